"""`--memory process` in the front ends: one TokenMemory for the process, every slot's lookup
drafter a MemoryDrafter over it, every finished generation (a batch item done, a serve job
completed) remembered as prompt + output, a failed one not. Drafting from memory changes the
speed only: the tokens are those without it (F32 numerics). `--memory off` changes nothing, and
`--memory process` without lookup drafting is a one-line usage error."""

from __future__ import annotations

import pytest

from conftest import load
from fixtures.cli import GREEDY_ARGS, PROMPTS, assert_one_line_error, read_records, specli, write_jsonl
from specli.decoding.drafters import PromptLookupDrafter, make_drafter
from specli.decoding.loop import DecoderPool
from specli.decoding.memory import TokenMemory
from specli.decoding.memory_drafter import MEMORY, MemoryDrafter, drafter_with_memory
from specli.decoding.parallel import ItemDone, ParallelRunner, run_sequential
from specli.decoding.sampling import GREEDY
from specli.decoding.step import SpeculativeDecoder
from specli.session import batch
from specli.session.loading import Loaded, Plan
from test_serve_core import Collector, job_for, running

# Each prompt twice: a later item repeats an earlier one's text (and max_tokens), so its whole
# output is in memory by the time it starts, also with two slots.
REPEATED = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[0], PROMPTS[1], PROMPTS[4]]
MAX_TOKENS = [24, 17, 30, 24, 17, 30]


@pytest.fixture(scope="module")
def model(pair_perturbed):
    m = load(pair_perturbed[0], n_ctx=256)
    yield m
    m.close()


def items():
    return [batch.Item(i + 1, f"p{i}", p, MAX_TOKENS[i], GREEDY) for i, p in enumerate(REPEATED)]


def outcomes(events) -> dict:
    """id -> (token_ids, stop_reason, by_source) of every item done."""
    out = {}
    for event in events:
        if isinstance(event, ItemDone):
            assert event.error is None, event.error
            gen = event.generation
            out[event.item.id] = (gen.token_ids, gen.stop_reason, {k: list(v) for k, v in gen.stats.by_source.items()})
    return out


def run_items(model, n_seq: int, memory: TokenMemory | None) -> dict:
    if n_seq == 1:
        return outcomes(run_sequential(DecoderPool(model, drafter_with_memory("lookup", memory=memory), 4), items()))
    runner = ParallelRunner(model, "lookup", 4, n_seq, n_threads=1, kv_type="f32", flash_attn="off", memory=memory)
    try:
        return outcomes(runner.run(items()))
    finally:
        runner.close()


# --- batch --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_seq", [1, 2])
def test_batch_items_repeating_earlier_ones_draft_from_memory_and_give_the_same_tokens(model, n_seq):
    reference = run_items(model, n_seq, None)
    memory = TokenMemory()
    got = run_items(model, n_seq, memory)
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in reference.items()}  # exact
    assert all(MEMORY not in v[2] for v in reference.values())
    for i in range(3):  # the first of each prompt: nothing of it in memory yet
        assert MEMORY not in got[f"p{i}"][2]
    for i in range(3, 6):  # its repeat copies the earlier output from memory
        drafted, accepted = got[f"p{i}"][2][MEMORY]
        assert accepted > 0, (i, got[f"p{i}"])
    # Every item done is remembered, prompt + output: one document each.
    assert memory.n_documents == len(REPEATED)


def test_a_failed_item_is_not_remembered(model):
    memory = TokenMemory()
    bad = [batch.Item(1, "long", "word " * 300, 8, GREEDY), batch.Item(2, "ok", PROMPTS[0], 8, GREEDY)]
    events = [e for e in run_sequential(DecoderPool(model, drafter_with_memory("lookup", memory=memory), 4), bad) if isinstance(e, ItemDone)]
    assert [e.error is None for e in events] == [False, True]
    assert memory.n_documents == 1


def test_memory_off_makes_the_plain_lookup_drafter():
    assert type(make_drafter("lookup")) is PromptLookupDrafter
    assert type(drafter_with_memory("lookup", memory=None)) is PromptLookupDrafter
    shared = TokenMemory()
    a, b = drafter_with_memory("lookup", memory=shared), drafter_with_memory("lookup", memory=shared)
    assert isinstance(a, MemoryDrafter) and a.memory is b.memory is shared and a is not b
    with pytest.raises(ValueError, match="lookup"):
        drafter_with_memory("target-only", memory=shared)


# --- serve's scheduler --------------------------------------------------------------------------
def loaded_with_memory(model, memory: TokenMemory | None) -> Loaded:
    decoder = SpeculativeDecoder(model, drafter_with_memory("lookup", memory=memory), 4, GREEDY)
    the_plan = Plan(model.path, None, "lookup", decoder.draft_length, GREEDY, memory="off" if memory is None else "process")
    return Loaded(the_plan, model, None, decoder, memory=memory)


def serve_twice(model, n_seq: int, memory: TokenMemory | None) -> list:
    """PROMPTS[1], then once it is answered, the same request again: their (text, Done)."""
    from specli.server.scheduler import Scheduler

    scheduler = Scheduler(loaded_with_memory(model, memory), n_seq=n_seq, queue_limit=4, n_threads=1, kv_type="f32", flash_attn="off")
    results = []
    with running(scheduler):
        for _ in range(2):
            collector = Collector()
            scheduler.submit(job_for(model, PROMPTS[1], 40, collector))
            results.append(collector.result())
    return results


@pytest.mark.parametrize("n_seq", [1, 2])
def test_a_request_repeating_an_earlier_one_drafts_from_memory_with_the_same_output(model, n_seq):
    plain = serve_twice(model, n_seq, None)
    memory = TokenMemory()
    remembered = serve_twice(model, n_seq, memory)
    assert [text for text, _ in remembered] == [text for text, _ in plain]
    assert [done.generation.token_ids for _, done in remembered] == [done.generation.token_ids for _, done in plain]
    first, second = (done.generation.stats.by_source for _, done in remembered)
    assert MEMORY not in first
    assert second[MEMORY][1] > 0, second
    assert memory.n_documents == 2


def test_an_idle_scheduler_calls_on_idle_again_when_asked(model):
    """serve --memory persist saves when idle; a save put off (at most one per 30 s) is retried
    while the server stays idle: on_idle's answer is when to call it again."""
    import threading
    import time

    from specli.server.scheduler import Scheduler

    calls, done = [], threading.Event()

    def on_idle():
        calls.append(time.monotonic())
        if len(calls) >= 3:
            done.set()
            return None  # (nothing more to do: wait for a request)
        return 0.01

    scheduler = Scheduler(loaded_with_memory(model, TokenMemory()), n_seq=1, queue_limit=4, n_threads=1, kv_type="f32",
                          flash_attn="off", on_idle=on_idle)
    with running(scheduler):
        assert done.wait(60)  # (a deadline, not a timing check)
        collector = Collector()
        scheduler.submit(job_for(model, PROMPTS[1], 8, collector))
        collector.result()
        deadline = time.monotonic() + 60
        while len(calls) < 4 and time.monotonic() < deadline:  # idle again after the request
            time.sleep(0.01)
    assert len(calls) == 4


# --- the command line ---------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["batch", "serve"])
@pytest.mark.parametrize("drafting", [["--target-only"], ["--lookup", "-d", "DRAFT"], ["-d", "DRAFT"]], ids=["target-only", "hybrid", "draft-model"])
def test_memory_process_without_lookup_drafting_is_a_one_line_usage_error(tmp_path, pair_perturbed, command, drafting):
    target, draft = (str(p) for p in pair_perturbed)
    drafting = [draft if arg == "DRAFT" else arg for arg in drafting]
    where = [str(write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}]))] if command == "batch" else ["--port", "0"]
    result = specli(command, *where, "-m", target, *drafting, "--memory", "process", *GREEDY_ARGS)
    assert_one_line_error(result, 2, "--memory process", "--lookup", "--memory off")
    assert "Traceback" not in result.stderr


def test_batch_memory_off_changes_nothing_and_process_keeps_the_tokens(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p, "max_tokens": n} for i, (p, n) in enumerate(zip(REPEATED, MAX_TOKENS))])
    records = {}
    for name, extra in (("default", []), ("off", ["--memory", "off"]), ("process", ["--memory", "process"])):
        out = tmp_path / f"{name}.jsonl"
        result = specli("batch", str(src), "-o", str(out), "-m", target, "--lookup", "--draft-max", "4", "--max-tokens", "40", "--quiet", *extra, *GREEDY_ARGS)
        assert result.returncode == 0, result.stderr
        records[name] = read_records(out)
    for a, b in zip(records["default"], records["off"]):
        for key in ("text", "token_ids", "stop_reason", "draft", "n_draft"):
            assert a[key] == b[key], key
        assert a["stats"]["target_passes"] == b["stats"]["target_passes"]
        assert a["stats"]["drafted"] == b["stats"]["drafted"]
        assert MEMORY not in a["stats"]["by_source"] and MEMORY not in b["stats"]["by_source"]
    for a, b in zip(records["default"], records["process"]):
        assert (a["text"], a["token_ids"]) == (b["text"], b["token_ids"])
    assert any(r["stats"]["by_source"].get(MEMORY, {}).get("accepted", 0) > 0 for r in records["process"][3:])


def test_memory_process_with_a_pairs_own_draft_model_is_refused_before_loading(monkeypatch, pair_perturbed):
    """-m PAIR without -d drafts with the pair's draft model: refused once plan() finds it."""
    from types import SimpleNamespace

    from specli.errors import UsageError
    from specli.session import loading

    target, draft = pair_perturbed
    monkeypatch.setattr(loading, "resolve_model_arg", lambda name, registry: (target, SimpleNamespace(draft="the pair's draft")))
    monkeypatch.setattr(loading, "resolve_source", lambda source: draft)
    with pytest.raises(UsageError, match="the model's pair drafts with one.*--lookup"):
        loading.plan(loading.ModelChoice(model="pair", memory="process"))
    the_plan = loading.plan(loading.ModelChoice(model="pair", lookup=True, memory="process"))  # --lookup: no draft model
    assert (the_plan.mode, the_plan.memory) == ("lookup", "process")
    assert loading.plan(loading.ModelChoice(model="pair")).memory == "off"
