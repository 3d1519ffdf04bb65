"""Stop strings (--stop, a batch item's `stop`, chat's plain turns): the generation ends at the
first one in its text, cut exactly there, wherever it falls (inside a token, across tokens,
inside an accepted draft), and no part of it is ever streamed."""

from __future__ import annotations

import io
import json
from bisect import bisect_left
from pathlib import Path

import pytest

from conftest import load
from fixtures.cli import assert_one_line_error, specli
from specli.decoding.drafters import make_drafter
from specli.decoding.generation import Request
from specli.decoding.loop import DecoderPool, generate
from specli.decoding.parallel import ItemDone, ParallelRunner, run_sequential
from specli.decoding.sampling import GREEDY
from specli.decoding.step import SpeculativeDecoder
from specli.decoding.text import TextStream
from specli.errors import UsageError
from specli.llama.model import LlamaModel
from specli.session import batch

# Drafts of several tokens, all accepted: a draft model identical to the target. (Prompt lookup on
# a repetitive prompt drafts next to nothing here: the random fixture model does not continue it.)
REPETITIVE = "one two three four five six seven eight nine ten. " * 6
N_DRAFT = 8
MAX_TOKENS = 60
CLI_GREEDY = ("--temperature", "0", "--threads", "1")
NEVER = "§never in this text§"


@pytest.fixture(scope="module")
def target(pair_perturbed):
    model = load(pair_perturbed[0])
    yield model
    model.close()


@pytest.fixture(scope="module")
def identical(pair_identical):
    model_tgt, model_dft = load(pair_identical[0]), load(pair_identical[1])
    yield model_tgt, model_dft
    model_tgt.close(), model_dft.close()


def token_starts(model, token_ids) -> tuple[list[int], str]:
    """Each token's offset in the text of `token_ids` (a split character counts at its start),
    and that text."""
    stream, text, starts = TextStream(model.piece), "", []
    for token in token_ids:
        starts.append(len(text))
        text += stream.feed([token])
    return starts, text + stream.flush()


def drafted_run(models, prompt: str, stop=(), max_tokens: int = MAX_TOKENS):
    """A greedy run with the identical draft model and a fixed draft length: the generation and its steps."""
    model_tgt, model_dft = models
    decoder = SpeculativeDecoder(model_tgt, make_drafter("draft-model", model_dft), N_DRAFT)
    gen = generate(decoder, Request(model_tgt.tokenize(prompt), max_tokens=max_tokens, stop=stop))
    return gen, list(gen)


def first_occurring(text: str, begin: int, lengths=range(3, 12), end_before: int | None = None) -> str | None:
    """A substring of `text` beginning at `begin` whose first occurrence is there (or None)."""
    for length in lengths:
        end = begin + length
        if end > (len(text) if end_before is None else end_before):
            return None
        candidate = text[begin:end]
        if candidate.strip() and text.find(candidate) == begin:
            return candidate
    return None


def stop_inside_a_draft(model, gen, steps) -> tuple[str, int, int]:
    """(stop string, its offset, the step) for a substring of the output that first occurs
    inside an accepted draft of several tokens: it begins after the draft's first token and
    ends before the draft's last token begins, so accepted drafts follow it in that step."""
    starts, text = token_starts(model, gen.token_ids)
    assert text == gen.text
    first = 0
    for number, step in enumerate(steps):
        drafted = list(range(first, first + step.n_accepted))
        first += len(step.tokens)
        if len(drafted) < 3:
            continue
        for j in drafted[1:-1]:
            for begin in (starts[j] + 1, starts[j]):  # mid-token first: the cut falls inside a token
                candidate = first_occurring(text, begin, end_before=starts[drafted[-1]])
                if candidate:
                    return candidate, begin, number
    pytest.fail("the unstopped run accepted no draft of several tokens where a stop string could go")


# --- the engine ------------------------------------------------------------------------------------
def test_a_stop_string_inside_an_accepted_draft_ends_the_generation_there(identical):
    target = identical[0]
    unstopped, steps = drafted_run(identical, REPETITIVE)
    assert unstopped.stop_reason == "max_tokens"
    stop, begin, number = stop_inside_a_draft(target, unstopped, steps)
    starts, text = token_starts(target, unstopped.token_ids)

    gen, stopped_steps = drafted_run(identical, REPETITIVE, stop=[NEVER, stop])
    assert gen.stop_reason == "stop"
    assert gen.text == text[:begin]  # exactly the unstopped text, cut right before the stop string
    n_kept = bisect_left(starts, begin)  # the tokens that begin before it
    assert gen.token_ids == unstopped.token_ids[:n_kept] and gen.stats.n_tokens == n_kept
    # The same steps up to the one whose draft held the stop string; no pass after it.
    assert len(stopped_steps) == number + 1 == gen.stats.target_passes < unstopped.stats.target_passes
    assert [s.tokens for s in stopped_steps[:-1]] == [s.tokens for s in steps[:number]]
    last, same = stopped_steps[-1], steps[number]
    assert last.n_drafted == same.n_drafted and last.n_accepted < same.n_accepted  # drafts past the cut dropped
    assert last.tokens == same.tokens[: len(last.tokens)]
    assert "".join(s.text for s in stopped_steps) == gen.text  # streamed: the output, no part of the stop string


def test_a_stop_string_spanning_two_tokens_is_held_back_then_cut(target):
    """Target-only, one token per step: the stop string's first part arrives a step before the
    rest, and must not be streamed meanwhile."""
    ids = target.tokenize("Once upon a time, in a small village, there lived")
    unstopped = generate(SpeculativeDecoder(target, None, 0), Request(ids, max_tokens=MAX_TOKENS)).run()
    starts, text = token_starts(target, unstopped.token_ids)
    for i in range(len(starts) - 2):
        if starts[i + 1] - starts[i] >= 2 and starts[i + 2] > starts[i + 1]:
            begin = starts[i + 1] - 1  # the last character of token i, then token i + 1
            stop = first_occurring(text, begin, lengths=[2, 3, 4], end_before=starts[i + 2])
            if stop:
                break
    else:
        pytest.fail("no two tokens to span")

    gen = generate(SpeculativeDecoder(target, None, 0), Request(ids, max_tokens=MAX_TOKENS, stop=[stop]))
    streamed = []
    for step in gen:
        streamed.append(step.text)
        assert len("".join(streamed)) <= begin  # nothing at or past the cut is ever shown
    assert gen.stop_reason == "stop"
    assert gen.text == "".join(streamed) == text[:begin]
    assert gen.token_ids == unstopped.token_ids[: i + 1]  # token i holds the stop string's start: kept
    assert len(streamed) == i + 2  # the pass that completed the stop string was the last one


def test_a_stop_string_that_never_completes_changes_nothing(identical):
    """Its starts are held back, then released: the output is the unstopped run's, all streamed."""
    unstopped, _ = drafted_run(identical, REPETITIVE)
    # Starts of the text here and there, and its last character: held back at the last step.
    prefixes = {unstopped.text[k : k + 2] for k in range(0, len(unstopped.text) - 2, 5)} | {unstopped.text[-1]}
    gen, steps = drafted_run(identical, REPETITIVE, stop=[p + NEVER for p in prefixes])
    assert gen.stop_reason == "max_tokens"
    assert gen.token_ids == unstopped.token_ids and gen.text == unstopped.text
    assert gen.stats.n_tokens == unstopped.stats.n_tokens
    assert "".join(s.text for s in steps) != gen.text  # something was held back at the end...
    assert gen.text.startswith("".join(s.text for s in steps))  # ...and comes with the finish


def test_an_empty_stop_string_is_refused(target):
    with pytest.raises(UsageError, match="stop needs non-empty text"):
        generate(SpeculativeDecoder(target, None, 0), Request(target.tokenize("hi"), max_tokens=4, stop=["x", ""]))


def test_parallel_equals_sequential_with_stop_strings(pair_perturbed):
    """Both loops take the one step per sequence, stop strings included (F32 numerics, as in
    test_batch's exactness tests)."""
    model = LlamaModel(pair_perturbed[0], n_ctx=256, n_threads=1, kv_type="f32", flash_attn="off")
    try:
        prompts = [REPETITIVE, "Once upon a time", "def fibonacci(n):", "hello world hello world hello"]
        plain = [batch.Item(k + 1, k, p, 40, GREEDY) for k, p in enumerate(prompts)]
        unstopped = _generate(run_sequential(DecoderPool(model, make_drafter("lookup"), 4), plain))
        items = []
        for item in plain:
            _, text = token_starts(model, unstopped[item.id][0])
            stop = first_occurring(text, len(text) // 2) or NEVER
            items.append(batch.Item(item.line, item.id, item.prompt, item.max_tokens, GREEDY, stop=(stop,)))
        reference = _generate(run_sequential(DecoderPool(model, make_drafter("lookup"), 4), items))
        assert sum(reason == "stop" for _, reason, _ in reference.values()) >= 3
        runner = ParallelRunner(model, "lookup", 4, 2, n_threads=1, kv_type="f32", flash_attn="off")
        try:
            assert _generate(runner.run(items)) == reference
        finally:
            runner.close()
    finally:
        model.close()


def _generate(events) -> dict:
    return {
        e.item.id: (e.generation.token_ids, e.generation.stop_reason, e.generation.text) if e.error is None else e.error
        for e in events if isinstance(e, ItemDone)
    }


# --- the command line ------------------------------------------------------------------------------
def test_run_stop_inside_a_draft_json_and_streamed(pair_identical, identical):
    target = identical[0]
    path, draft = map(str, pair_identical)
    args = ("run", REPETITIVE, "-m", path, "-d", draft, "--num-speculative-tokens", str(N_DRAFT), "--max-tokens", str(MAX_TOKENS), *CLI_GREEDY)
    unstopped = specli(*args, "--json")
    assert unstopped.returncode == 0, unstopped.stderr
    unstopped = json.loads(unstopped.stdout)
    gen, steps = drafted_run(identical, REPETITIVE)
    assert gen.token_ids == unstopped["token_ids"]  # the same run here: its steps say where the drafts were
    stop, begin, _ = stop_inside_a_draft(target, gen, steps)

    as_json = specli(*args, "--json", "--stop", NEVER, "--stop", stop)
    plain = specli(*args, "--stop", stop)
    assert as_json.returncode == 0 and plain.returncode == 0, as_json.stderr + plain.stderr
    out = json.loads(as_json.stdout)
    assert out["stop_reason"] == "stop"
    assert out["text"] == unstopped["text"][:begin]
    starts, _ = token_starts(target, unstopped["token_ids"])
    assert out["token_ids"] == unstopped["token_ids"][: bisect_left(starts, begin)]
    assert out["n_tokens"] == len(out["token_ids"])
    assert plain.stdout == out["text"]  # all that was streamed: not a character of the stop string


def test_an_empty_stop_is_a_usage_error(pair_perturbed):
    result = specli("run", "hi", "-m", str(pair_perturbed[0]), "--stop", "")
    assert_one_line_error(result, 2, "--stop needs non-empty text")


def write_jsonl(path: Path, objects) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects), encoding="utf-8")
    return path


CONTENT = ("text", "token_ids", "n_tokens", "stop_reason")


def test_batch_stop_per_item_and_from_the_command_line(tmp_path, pair_perturbed):
    path = str(pair_perturbed[0])
    prompts = ["Once upon a time", "def fibonacci(n):", REPETITIVE]
    common = ("-m", path, "--lookup", "--num-speculative-tokens", "4", "--max-tokens", "30", "-c", "512", "-q", *CLI_GREEDY)
    src = write_jsonl(tmp_path / "plain.jsonl", [{"id": k, "prompt": p} for k, p in enumerate(prompts)])
    result = specli("batch", str(src), *common)
    assert result.returncode == 0, result.stderr
    unstopped = {r["id"]: r for r in map(json.loads, result.stdout.splitlines())}
    cut = {k: len(r["text"]) // 2 for k, r in unstopped.items()}
    stops = {k: first_occurring(r["text"], cut[k]) for k, r in unstopped.items()}
    assert all(stops.values()), stops

    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "cli", "prompt": prompts[0]},  # the command line's --stop
        {"id": "own", "prompt": prompts[1], "stop": stops[1]},
        {"id": "list", "prompt": prompts[2], "stop": [NEVER, stops[2]]},
        {"id": "none", "prompt": prompts[0], "stop": []},  # [] overrides --stop: no stop strings
        {"id": "number", "prompt": prompts[0], "stop": 5},
        {"id": "mixed", "prompt": prompts[0], "stop": ["a", 3]},
        {"id": "empty", "prompt": prompts[0], "stop": ""},
    ])
    records = {}
    for parallel in ("1", "2"):
        result = specli("batch", str(src), *common, "--stop", stops[0], "--parallel", parallel)
        assert result.returncode == 1, result.stderr  # the bad lines failed
        records[parallel] = [json.loads(line) for line in result.stdout.splitlines()]
    seq = {r["id"]: r for r in records["1"]}
    for key, k in (("cli", 0), ("own", 1), ("list", 2)):
        assert seq[key]["stop_reason"] == "stop", key
        assert seq[key]["text"] == unstopped[k]["text"][: cut[k]], key
        assert seq[key]["token_ids"] == unstopped[k]["token_ids"][: seq[key]["n_tokens"]]
    assert {name: seq["none"][name] for name in CONTENT} == {name: unstopped[0][name] for name in CONTENT}
    assert seq["number"]["error"] == "stop must be a string or a list of strings, got 5"
    assert seq["mixed"]["error"] == 'stop must be a string or a list of strings, got ["a", 3]'
    assert "stop needs non-empty text" in seq["empty"]["error"]
    # --parallel 2: the same records (but the timings)
    strip = lambda r: {name: r.get(name) for name in ("id", "line", "error", *CONTENT)}  # noqa: E731
    assert [strip(r) for r in records["2"]] == [strip(r) for r in records["1"]]


def test_chat_stop_cuts_a_reply(pair_perturbed):
    path = str(pair_perturbed[0])
    args = ("chat", "-m", path, "--target-only", "--max-tokens", "24", *CLI_GREEDY)
    unstopped = specli(*args, stdin="Hello there\n")
    assert unstopped.returncode == 0, unstopped.stderr
    reply = unstopped.stdout[:-1]  # each reply ends with a newline on a pipe
    cut = len(reply) // 2
    stop = first_occurring(reply, cut)
    assert stop, reply
    stopped = specli(*args, "--stop", stop, stdin="Hello there\n")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == reply[:cut] + "\n"


def test_plain_chat_replies_stop_at_the_next_user_turn(pair_perturbed, monkeypatch):
    """Without a chat template a reply ends where the model starts the next `User:` line (and at
    --stop's strings); a template ends a turn with its own end-of-generation token."""
    from specli.cli.render import stream_generation, summary_line
    from specli.session.chat import PLAIN, ChatOptions, ChatSession, Formatter
    from specli.session.loading import ModelChoice, plan
    from specli.session.loading import load as load_pair

    assert Formatter(None, PLAIN).stop == ("\nUser:",)
    assert Formatter("chatml", "chatml").stop == ()
    choice = ModelChoice(model=str(pair_perturbed[0]), target_only=True, n_ctx=256, threads=1)
    loaded = load_pair(plan(choice), choice)
    try:
        asked = []
        from specli.session import chat

        real = chat.generate
        monkeypatch.setattr(chat, "generate", lambda decoder, request: asked.append(tuple(request.stop)) or real(decoder, request))
        out = io.StringIO()
        options = ChatOptions(max_tokens=8, quiet=True, stop=("END",))
        session = ChatSession(loaded, Formatter(None, PLAIN), options, out=out, err=io.StringIO(),
                              stream_generation=stream_generation, summary_line=summary_line)
        session.turn("hi")
        assert asked == [("\nUser:", "END")]
        assert out.getvalue().endswith("\n") and session.messages[-1]["role"] == "assistant"
    finally:
        loaded.close()
