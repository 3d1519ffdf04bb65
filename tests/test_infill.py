"""llama-server's own endpoints in `specli serve` (server/llama_api.py): /infill's prompt layout
(server/fim.py) and limits (decoding/limits.py), --cache-reuse (plan_chunk_reuse and the caches'
reuse_chunks), /tokenize, /detokenize, /apply-template, /props, /metrics, /slots.

The fast checks run without a server; the HTTP ones on `specli serve` processes over loopback
(127.0.0.1, port 0, always stopped) on synthetic models with Qwen's FIM tokens. One layer, so a
chunk's keys and values depend on its tokens and positions alone: a chunk moved by --cache-reuse
must then give exactly what evaluating the prompt afresh gives (with more layers it also carries
what the text before it was, as in llama-server). The real Qwen pair and llama-server itself:
tests/test_infill_real.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    import httpx2 as httpx  # the HTTP library of openai 3.x
except ImportError:
    import httpx

from conftest import load
from fixtures import synthetic
from fixtures.cli import popen, stop
from specli.decoding.generation import Generation, Request
from specli.decoding.loop import generate
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.decoding.stats import Stats
from specli.decoding.stopping import STOP_INDENT, STOP_STRING, STOP_TIME_LIMIT, LineLimits
from specli.decoding.text import TextStream
from specli.llama.model import plan_chunk_reuse
from specli.server import fim
from specli.server.llama_api import LlamaRoutes, nested_fields, parse_infill, prometheus_text
from specli.server.protocol import ApiError, timings
from specli.server.scheduler import released_tokens

CTX = 2304  # over llama-server's batch of 2048: the FIM layout then keeps 258 tokens of extra context
START_DEADLINE = 120
LISTENING = re.compile(r"specli serve: listening on http://(\S+):(\d+) ")
LINES = [f"def step_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(40)]


# --- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fim_path(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fim")
    return synthetic.make_model(directory / "fim-1layer.gguf", vocab=synthetic.fim_vocab(), seed=11, n_layer=1)


@pytest.fixture(scope="module")
def fim_model(fim_path):
    model = load(fim_path, n_ctx=CTX)
    yield model
    model.close()


@pytest.fixture(scope="module")
def fim2_model(tmp_path_factory):
    """Two layers: a chunk moved by --cache-reuse keeps in its second layer what the text before
    it was, so its entries differ from those computed afresh (and so, here, the completion)."""
    path = synthetic.make_model(tmp_path_factory.mktemp("fim2") / "fim-2layer.gguf", vocab=synthetic.fim_vocab(), seed=11, n_layer=2)
    model = load(path, n_ctx=CTX)
    yield model
    model.close()


class Server:
    """One `specli serve` process on 127.0.0.1, port 0; stopped (SIGTERM, then kill) by `serving`."""

    def __init__(self, model: Path, log: Path, args: tuple[str, ...]):
        self.log = log
        cmd = [sys.executable, "-m", "specli", "serve", "-m", str(model), "-c", str(CTX), "--threads", "1", "--port", "0", *args]
        with open(log, "w") as err:
            self.proc = popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + START_DEADLINE
        while not (found := LISTENING.search(log.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"specli serve did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.1)
        self.url = f"http://{found.group(1)}:{found.group(2)}"
        self.http = httpx.Client(base_url=self.url, timeout=300)

    def stop(self) -> None:
        stop(self.proc)

    def post(self, path: str, body, **kw):
        return self.http.post(path, json=body, **kw)

    def infill(self, body: dict) -> dict:
        response = self.post("/infill", body)
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, path: str, body: dict) -> list:
        with self.http.stream("POST", path, json=body) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines), lines
        return [line[len("data: ") :] for line in lines]

    def metrics(self) -> dict:
        response = self.http.get("/metrics")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        values = {}
        for line in response.text.splitlines():
            if not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values


@contextlib.contextmanager
def serving(model: Path, log: Path, *args: str):
    server = Server(model, log, args)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(fim_path, tmp_path_factory):
    """Lookup drafting (a fixed length: the same verified batches every time), greedy by
    default, --cache-reuse 8, /metrics and /slots on."""
    log = tmp_path_factory.mktemp("serve") / "serve.stderr"
    with serving(fim_path, log, "--lookup", "--draft-max", "4", "--temperature", "0", "--cache-reuse", "8", "--metrics", "--slots") as srv:
        yield srv


def editor_request(first: int, last: int, cursor_text: str = "    return", **kw) -> dict:
    """What llama.vscode sends: the lines before the cursor, the text after it, one extra chunk."""
    body = {
        "input_prefix": "".join(LINES[first:last]), "input_suffix": "\n" + "".join(LINES[last : last + 4]), "prompt": cursor_text,
        "input_extra": [{"filename": "util.py", "text": "def helper(y):\n    return y - 1\n", "time": 1}],
        "n_predict": 16, "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
        "t_max_prompt_ms": 500, "stream": False,
    }
    body.update(kw)
    return body


def layout(model, body: dict, n_ctx: int = CTX) -> list[int]:
    """The prompt /infill builds for `body` (the server's -n is unset: n_predict -1)."""
    extra = [(chunk.get("filename", "tmp"), chunk["text"]) for chunk in body.get("input_extra", [])]
    return fim.infill_prompt(model, model.fim_tokens(), prefix=body["input_prefix"], suffix=body["input_suffix"], extra=extra,
                             prompt=body.get("prompt", ""), n_ctx=n_ctx)


# --- the FIM layout ---------------------------------------------------------------------------------
def test_the_repo_level_layout_puts_each_piece_where_llama_server_does(fim_model):
    m, f = fim_model, fim_model.fim_tokens()
    text = lambda s: m.tokenize(s, add_bos=False)  # noqa: E731
    ids = fim.infill_prompt(m, f, prefix="def f(x):\n", suffix="\nprint(f(2))\n", extra=[("a.py", "A = 1\n"), ("b.py", "B = 2\n")],
                            prompt="    return", n_ctx=CTX)
    extra = [f["rep"], *text("myproject\n"), f["sep"], *text("a.py\n"), *text("A = 1\n"), f["sep"], *text("b.py\n"), *text("B = 2\n"),
             f["sep"], *text("filename\n")]
    # BOS (this vocabulary adds one) after the extra context; `prompt` right after the prefix, tokenized on its own
    assert ids == [*extra, m.vocab_info().bos, f["pre"], *text("def f(x):\n"), *text("    return"), f["suf"], *text("\nprint(f(2))\n"), f["mid"]]


def test_without_repo_tokens_the_chunks_follow_a_snippet_separator(tmp_path):
    model = load(synthetic.make_model(tmp_path / "plain-fim.gguf", vocab=synthetic.fim_vocab(repo_level=False), seed=3, n_layer=1), n_ctx=CTX)
    try:
        f = model.fim_tokens()
        assert f["rep"] is None and f["sep"] is None and f["pre"] is not None
        text = lambda s: model.tokenize(s, add_bos=False)  # noqa: E731
        ids = fim.infill_prompt(model, f, prefix="x = 1\n", suffix="", extra=[("a.py", "A = 1\n")], n_ctx=CTX)
        assert ids == [*text("\n\n--- snippet ---\n\n"), *text("A = 1\n"), model.vocab_info().bos, f["pre"], *text("x = 1\n"), f["suf"], f["mid"]]
    finally:
        model.close()


def test_the_layout_keeps_llama_servers_shares_of_prefix_suffix_and_extra(fim_model):
    """With a batch of 16: the prefix keeps its last 12 tokens, the suffix its first 4 - 2 -
    len(prompt), the extra context its last n_ctx - 16 - 2*n_predict tokens."""
    m, f = fim_model, fim_model.fim_tokens()
    prefix, suffix = "".join(LINES[:3]), "".join(LINES[3:6])
    p, s = m.tokenize(prefix, add_bos=False), m.tokenize(suffix, add_bos=False)
    extra = [f["rep"], *m.tokenize("myproject\n", add_bos=False), f["sep"], *m.tokenize("a.py\n", add_bos=False),
             *m.tokenize("".join(LINES[6:9]), add_bos=False), f["sep"], *m.tokenize("filename\n", add_bos=False)]
    ids = fim.infill_prompt(m, f, prefix=prefix, suffix=suffix, extra=[("a.py", "".join(LINES[6:9]))], n_ctx=16 + 30 + 2 * 5, n_predict=5, n_batch=16)
    bos = m.vocab_info().bos
    assert ids == [*extra[-30:], bos, f["pre"], *p[-12:], f["suf"], *s[:2], f["mid"]]
    one = m.tokenize("y", add_bos=False, parse_special=True)
    ids = fim.infill_prompt(m, f, prefix=prefix, suffix=suffix, extra=[], prompt="y", n_ctx=16, n_predict=1, n_batch=16)
    assert ids == [bos, f["pre"], *p[-12:], *one, f["suf"], *s[: 2 - len(one)], f["mid"]]  # (no room for extra context at all)


def test_prefix_and_suffix_may_mix_text_and_token_ids(fim_model):
    m, f = fim_model, fim_model.fim_tokens()
    word = m.tokenize(" hello", add_bos=False)
    ids = fim.infill_prompt(m, f, prefix=["a", 7, " hello"], suffix=[9], extra=[], n_ctx=CTX)
    assert ids[-(len(word) + 6) :] == [f["pre"], *m.tokenize("a", add_bos=False), 7, *word, f["suf"], 9, f["mid"]][-(len(word) + 6) :]


def big_editor_request(**kw) -> dict:
    """A file far larger than llama-server's shares: the prefix over its 1,536 tokens, the suffix
    over its 510, the extra context over any share."""
    many = [f"def step_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)]
    body = {"input_prefix": "".join(many[:150]), "input_suffix": "\n" + "".join(many[150:250]),
            "input_extra": [{"filename": "other.py", "text": "".join(many[250:])}], "prompt": "    return", "n_predict": 16}
    body.update(kw)
    return body


@pytest.mark.parametrize("n_ctx", [4096, CTX])
def test_the_extra_context_gives_way_where_llama_servers_shares_overfill_the_context(fim_model, n_ctx):
    """-c 4096 without -n (the documented setup): llama-server gives the extra context 2,050
    tokens beside up to 2,050 of prefix, suffix and FIM tokens, 4,100 in all, and refuses the
    request; specli drops the oldest extra tokens instead, keeping n_room for the completion."""
    m, f, body = fim_model, fim_model.fim_tokens(), big_editor_request()
    args = dict(prefix=body["input_prefix"], suffix=body["input_suffix"], prompt=body["prompt"],
                extra=[(c["filename"], c["text"]) for c in body["input_extra"]])
    whole = fim.infill_prompt(m, f, **args, n_ctx=10**6)  # (room for all of the extra context)
    n_fim = fim.PREFIX_TAKE + fim.SUFFIX_TAKE + 4  # (BOS, the three FIM tokens; the prompt within the suffix's share)
    extra, shares = whole[:-n_fim], whole[-n_fim:]
    assert shares[:2] == [m.vocab_info().bos, f["pre"]] and len(extra) > n_ctx - fim.LLAMA_SERVER_BATCH + 2  # (llama-server's prompt: n_ctx + 4)
    for n_room in (1, 16):
        ids = fim.infill_prompt(m, f, **args, n_ctx=n_ctx, n_room=n_room)
        assert len(ids) == n_ctx - n_room and ids[-n_fim:] == shares and ids[:-n_fim] == extra[-(len(ids) - n_fim) :]  # (the newest extra tokens)


@pytest.mark.parametrize("region", ["suffix", "extra"])
def test_prompt_lookup_drafts_from_the_suffix_and_the_extra_context(fim_model, region):
    """Prompt lookup indexes the whole FIM prompt: a completion typing what the suffix or another
    file holds is drafted from there."""
    from specli.decoding.drafters import PromptLookupDrafter

    m, f = fim_model, fim_model.fim_tokens()
    suffix = "\n    total = compute the unique total of alpha beta and gamma for the report\n"
    chunk = "def helper(argument one, argument two):\n    return the second argument times three hundred\n"
    ids = fim.infill_prompt(m, f, prefix="x = 1\n", suffix=suffix, extra=[("other.py", chunk)], n_ctx=CTX)
    span = m.tokenize(suffix if region == "suffix" else chunk, add_bos=False)
    at = next(i for i in range(len(ids)) if ids[i : i + len(span)] == span)  # where the region's tokens lie in the prompt
    drafter = PromptLookupDrafter()
    drafter.begin(ids)
    typed = span[:10]  # (the completion so far: the region's first tokens)
    proposal = drafter.propose([*ids, *typed], 8)
    assert proposal.tokens and proposal.tokens == ids[at + 10 : at + 10 + len(proposal.tokens)]


# --- the limits -------------------------------------------------------------------------------------
def feed(limits: LineLimits, pieces: list[str]):
    """The pieces as tokens' texts, one after_token call each: the first verdict (or None) and
    how many pieces it took."""
    text = ""
    for i, piece in enumerate(pieces):
        start, text = len(text), text + piece
        hit = limits.after_token(text, start)
        if hit is not None:
            return hit, i + 1, text
    return None, len(pieces), text


def test_n_indent_cuts_before_the_first_less_indented_line():
    hit, n, text = feed(LineLimits(n_indent=4), ["x = 1", "\n", "    y", " = 2\n", "  ", "z", " = 3\n"])
    assert hit == (STOP_INDENT, len("x = 1\n    y = 2\n  ")) and n == 6  # (the cursor's own line is never checked)
    hit, _, text = feed(LineLimits(n_indent=1), ["a\n", "\tb\n", "  \tc\n", "\n", "d"])  # (a tab counts one)
    assert hit == (STOP_INDENT, len("a\n\tb\n  \tc\n")) and text[: hit[1]].endswith("c\n")  # a blank line ends it, as in llama-server
    assert feed(LineLimits(n_indent=2), ["a\n  b\n  c\n   "])[0] is None  # (indentation only: not yet known)


def test_t_max_predict_ms_ends_at_a_newline_once_the_time_is_up():
    now = [0.0]
    limits = LineLimits(t_max_predict_ms=100, clock=lambda: now[0])
    assert limits.after_token("a\n", 0) is None  # (a newline in time)
    now[0] = 0.5
    assert limits.after_token("a\nb", 2) is None  # (late, but no newline)
    assert limits.after_token("a\nb\nc", 3) == (STOP_TIME_LIMIT, 5)  # the token with the newline is kept
    assert not LineLimits(t_max_predict_ms=-1).active and not LineLimits(n_indent=0).active


PIECES = {1: b"a", 2: b"\n", 3: b"    b", 4: b" c\n", 5: b"d", 6: b"e", 7: b"STOP", 8: b" c\nd"}


def generation(**kw) -> Generation:
    return Generation(prompt_ids=[0], _stream=TextStream(lambda t: PIECES[t]), **kw)


def test_a_limit_cuts_the_generation_inside_a_pass_and_drops_later_tokens():
    gen = generation(limits=LineLimits(n_indent=2))
    gen.record([1, 2, 3], n_accepted=2, n_drafted=3, is_eog=lambda t: False)
    step = gen.record([4, 5, 6, 1], n_accepted=3, n_drafted=3, is_eog=lambda t: False)
    assert gen.stop_reason == STOP_INDENT and gen.text == "a\n    b c\n" and gen.token_ids == [1, 2, 3, 4]
    assert step.tokens == [4] and gen.stats.n_tokens == 4
    gen = generation(limits=LineLimits(n_indent=2))
    gen.record([1, 2, 3, 8, 6], n_accepted=0, n_drafted=0, is_eog=lambda t: False)
    assert gen.text == "a\n    b c\n" and gen.token_ids == [1, 2, 3, 8]  # (the cut inside a token keeps it, as a stop string's)


def test_a_stop_string_names_itself():
    gen = generation(stop=("TOP", "ST"))
    gen.record([1, 7, 6], n_accepted=0, n_drafted=0, is_eog=lambda t: False)
    assert (gen.stop_reason, gen.stop_word, gen.text) == (STOP_STRING, "ST", "a")


# --- --cache-reuse's plan -----------------------------------------------------------------------------
def test_chunk_reuse_keeps_the_prefix_then_moves_runs_of_at_least_n():
    cached = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert plan_chunk_reuse(cached, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 2) == (10, [])  # (a plain prefix)
    # tokens 3..4 dropped from the cache (an editor's window moved on): 5..10 move left by two
    assert plan_chunk_reuse(cached, [1, 2, 5, 6, 7, 8, 9, 10, 11], 3) == (8, [(4, 2, 6)])
    assert plan_chunk_reuse(cached, [1, 2, 5, 6, 7, 8, 9, 10, 11], 7) == (2, [])  # (a run under N is not kept)
    # two runs, the cache's text between them skipped
    assert plan_chunk_reuse(cached, [1, 4, 5, 6, 9, 10], 2) == (6, [(3, 1, 3), (8, 4, 2)])
    # an insertion into the new prompt: llama-server's walk skips only cached tokens, so what
    # follows the new text is evaluated again
    assert plan_chunk_reuse(cached, [1, 2, 99, 3, 4, 5, 6, 7, 8, 9, 10], 2) == (2, [])
    assert plan_chunk_reuse(cached, [1, 2, 9, 10], 0) == (2, [])  # (off)


# --- request checks -----------------------------------------------------------------------------------
BASE = {"input_prefix": "a", "input_suffix": "b"}


@pytest.mark.parametrize("extra, param", [
    ({"input_prefix": None}, "input_prefix"), ({"input_suffix": 3}, "input_suffix"), ({"input_prefix": ["a", 10**9]}, "input_prefix"),
    ({"input_extra": {"text": "x"}}, "input_extra"), ({"input_extra": [{"filename": "a.py"}]}, "input_extra"),
    ({"input_extra": [{"text": "x", "filename": 3}]}, "input_extra"), ({"prompt": 5}, "prompt"), ({"n_predict": -2}, "n_predict"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"n_indent": -1}, "n_indent"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"stop": [1]}, "stop"), ({"stream": "yes"}, "stream"), ({"cache_prompt": 1}, "cache_prompt"), ({"samplers": 5}, "samplers"),
    ({"response_fields": "content"}, "response_fields"), ({"lora": [{"id": 0, "scale": 0.5}]}, "lora"), ({"n_probs": 101}, "n_probs"),
    ({"ignore_eos": True}, "ignore_eos"), ({"t_max_predict_ms": "1s"}, "t_max_predict_ms"), ({"id_slot": "0"}, "id_slot"),
    ({"seed": -5}, "seed"), ({"n_cache_reuse": -1}, "n_cache_reuse"), ({"typical_p": True}, "typical_p"),
])
def test_a_bad_infill_field_is_a_400_naming_it(extra, param):
    body = {**BASE, **extra}
    if extra.get(param, 0) is None:
        del body[param]
    with pytest.raises(ApiError) as info:
        parse_infill(body, SamplingParams(), n_vocab=1000)
    assert info.value.status == 400 and info.value.param == param and info.value.message


def test_infill_fields_read_as_llama_server_reads_them():
    req = parse_infill({**BASE, "stop": ["", "\n\n"], "t_max_prompt_ms": 500, "some_vendor_field": [1], "samplers": [], "n_predict": 0,
                        "typical_p": 1.0, "logit_bias": [], "lora": [], "n_keep": 64, "seed": -1, "n_indent": 4}, GREEDY, n_vocab=1000)
    assert req.stop == ("\n\n",) and req.n_predict == 0 and req.seed is None and req.n_indent == 4 and req.cache_prompt
    assert parse_infill({**BASE, "max_tokens": 7}, GREEDY, 1000).n_predict == 7
    assert parse_infill({**BASE, "t_max_predict_ms": 0}, GREEDY, 1000).t_max_predict_ms is None


def infill_ids(model, body: dict, n_ctx: int, server_n=None) -> list[int]:
    """LlamaRoutes._infill_ids for `body` on a server whose requests hold n_ctx tokens."""
    from types import SimpleNamespace

    routes = LlamaRoutes(SimpleNamespace(n_ctx=n_ctx), model, SimpleNamespace(default_max_tokens=server_n))
    return routes._infill_ids(parse_infill(body, GREEDY, model.n_vocab))


def test_an_infill_prompt_too_long_names_the_cause_and_the_fix(fim_model):
    body = big_editor_request()
    assert len(infill_ids(fim_model, body, 4096)) == 4096 - 16  # (n_predict's room; without it, one token's)
    assert len(infill_ids(fim_model, {**body, "n_predict": -1}, 4096)) == 4095
    # -n 100: llama-server's own share of the extra context (n_ctx - 2048 - 2 * 100) leaves room already: its prompt as it is
    assert len(infill_ids(fim_model, {**body, "n_predict": -1}, 4096, server_n=100)) == 4096 - 2048 - 200 + fim.PREFIX_TAKE + fim.SUFFIX_TAKE + 4
    with pytest.raises(ApiError) as info:  # the prefix and suffix alone do not fit: -c is the fix
        infill_ids(fim_model, body, 2048)
    err = info.value
    assert err.status == 400 and err.code == "context_length_exceeded" and err.param == "input_prefix"
    assert "prefix, 'prompt' and suffix take 2050 tokens" in err.message and "larger -c (4096" in err.message
    with pytest.raises(ApiError) as info:  # a 'prompt' past its share
        infill_ids(fim_model, {**body, "prompt": "x " * 3000}, 4096)
    assert info.value.param == "prompt" and "shorter 'prompt'" in info.value.message


def test_response_fields_pick_nested_values():
    body = {"content": "x", "timings": {"prompt_n": 3}, "stop": True}
    assert nested_fields(["content", "timings/prompt_n", "timings/nope", "missing"], body) == {"content": "x", "timings/prompt_n": 3}


def test_metrics_text_has_llama_servers_names_and_specli_drafting():
    stats = Stats()
    stats.record_step(4, 3, 4, source="lookup")
    stats.prompt_tokens, stats.prompt_reused, stats.prompt_s, stats.generation_s = 10, 4, 0.5, 1.0
    text = prometheus_text({"totals": stats, "counts": {"completed": 1, "cancelled": 2, "failed": 0, "passes": 1}, "pass_sequences": 1,
                            "most_tokens": 14, "processing": 0, "queued": 3}, queue_limit=64)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines["llamacpp:prompt_tokens_total"] == "6" and lines["llamacpp:prompt_tokens_cached_total"] == "4"
    assert lines["llamacpp:spec_decode_num_draft_tokens_total"] == "4" and lines["llamacpp:spec_decode_num_accepted_tokens_total"] == "3"
    assert lines["llamacpp:requests_deferred"] == "3" and lines['specli:requests_total{outcome="cancelled"}'] == "2"
    assert lines['specli:drafted_tokens_total{source="lookup"}'] == "4" and lines["specli:tokens_per_pass"] == "4.0"
    assert "# TYPE llamacpp:tokens_predicted_total counter" in text and text.endswith("\n")


def test_the_generation_speed_is_stats_tokens_per_s_everywhere():
    """timings.predicted_per_second and /metrics' predicted_tokens_seconds are the speed
    `speculative.tokens_per_s` gives: the tokens decided after the prompt's pass, over the
    generation time (not every token over it); 0 where there is none."""
    stats = Stats()
    stats.record_step(4, 3, 4, source="lookup")
    stats.record_step(4, 1, 2, source="lookup")
    stats.prompt_pass_decided, stats.generation_s = 4, 0.5  # (the first pass ended the prompt: its 4 tokens are the prompt's)
    assert stats.tokens_per_s == 4.0 and timings(stats)["predicted_per_second"] == 4.0
    text = prometheus_text({"totals": stats, "counts": {"completed": 1, "cancelled": 0, "failed": 0, "passes": 2}, "pass_sequences": 2,
                            "most_tokens": 14, "processing": 0, "queued": 0}, queue_limit=64)
    assert "llamacpp:predicted_tokens_seconds 4.0\n" in text
    one = Stats()
    one.record_step(0, 0, 1)
    one.prompt_pass_decided, one.generation_s = 1, 0.1
    assert one.tokens_per_s is None and timings(one)["predicted_per_second"] == 0.0


def test_streamed_token_ids_are_those_of_released_text():
    """A token whose text is held back (it may begin a stop string) is not sent until its text
    is: a stop string may cut it, and then its id must never have gone out."""
    gen = generation(stop=("de",))
    gen.record([1, 5], n_accepted=0, n_drafted=0, is_eog=lambda t: False)  # "a", then "d": held
    assert gen.text == "a" and gen.token_ids == [1, 5] and released_tokens(gen) == 1
    gen.record([6], n_accepted=0, n_drafted=0, is_eog=lambda t: False)  # "e": the stop string, cut before "d"
    assert gen.text == "a" and gen.token_ids == [1] and released_tokens(gen) == 1
    gen = generation(stop=("de",))
    gen.record([1, 5, 1], n_accepted=0, n_drafted=0, is_eog=lambda t: False)  # "d" released by the "a" after it
    assert gen.text == "ada" and released_tokens(gen) == 3
    plain = generation()
    plain.record([1, 2], n_accepted=0, n_drafted=0, is_eog=lambda t: False)
    assert released_tokens(plain) == 2


# --- /infill over HTTP --------------------------------------------------------------------------------
LLAMA_SERVER_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated", "generation_settings",
                     "prompt", "has_new_line", "truncated", "stop_type", "stopping_word", "tokens_cached", "timings"}


def test_infill_gives_what_completions_give_for_its_prompt(server, fim_model):
    body = editor_request(0, 12, temperature=0, cache_prompt=False)
    ids = layout(fim_model, body)
    done = server.infill(body)
    assert set(done) == LLAMA_SERVER_KEYS | {"speculative"}
    assert done["tokens_evaluated"] == len(ids) and done["stop"] is True and done["tokens_predicted"] == 16
    assert done["prompt"] == b"".join(fim_model.special_piece(t) for t in ids).decode()
    timings = done["timings"]
    assert {"prompt_n", "cache_n", "predicted_n", "predicted_per_token_ms", "draft_n", "draft_n_accepted"} <= set(timings)
    assert timings["draft_n"] == done["speculative"]["drafted"] and timings["predicted_n"] == 16
    plain = server.post("/v1/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0}).json()
    assert plain["choices"][0]["text"] == done["content"]


def test_a_streamed_infill_sends_llama_servers_events(server):
    body = editor_request(0, 12, temperature=0)
    whole = server.infill(body)["content"]
    events = [json.loads(data) for data in server.stream("/infill", {**body, "stream": True})]
    *parts, last = events
    assert parts and all(e["stop"] is False and set(e) == {"index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"} for e in parts)
    assert "".join(e["content"] for e in parts) == whole and sum(len(e["tokens"]) for e in parts) == last["tokens_predicted"]
    assert last["stop"] is True and last["content"] == "" and "timings" in last and "speculative" in last  # (no [DONE] after it)


def test_response_fields_and_return_tokens(server, fim_model):
    done = server.infill(editor_request(0, 8, temperature=0, n_predict=5, return_tokens=True, response_fields=["content", "tokens", "timings/predicted_n"]))
    assert set(done) == {"content", "tokens", "timings/predicted_n"} and done["timings/predicted_n"] == 5 and len(done["tokens"]) == 5
    assert all(0 <= t < fim_model.n_vocab for t in done["tokens"])


def test_unknown_and_unused_fields_are_ignored_and_bad_ones_refused(server):
    ok = server.post("/infill", editor_request(0, 4, n_predict=2, some_vendor_field={"x": 1}, id_slot=-1, n_keep=64, t_max_predict_ms=1000))
    assert ok.status_code == 200, ok.text
    bad = server.post("/infill", editor_request(0, 4, n_indent="four"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n_indent"
    assert server.post("/infill", [1, 2]).status_code == 400
    long = server.post("/infill", editor_request(0, 4, prompt="x " * 3000))
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"


def test_a_large_file_is_completed_where_llama_servers_shares_overfill_the_context(server, fim_model):
    """CTX is over llama-server's batch by 256: its shares give the extra context 258 tokens
    beside 2,050 of prefix, suffix and FIM tokens, over the context; the extra context gives way."""
    body = big_editor_request(temperature=0)
    done = server.infill(body)
    assert done["tokens_evaluated"] == CTX - 16 and done["tokens_predicted"] == 16


def test_n_predict_zero_puts_the_prompt_in_the_cache(server, fim_model):
    """llama.vscode's warm-up request (n_predict 0): the next request finds the prompt cached."""
    body = editor_request(20, 30, temperature=0, n_predict=0, cache_prompt=False)
    warm = server.infill(body)
    assert warm["tokens_predicted"] == 1 and warm["timings"]["cache_n"] == 0  # (one token, as llama-server gives)
    again = server.infill({**body, "n_predict": 4, "cache_prompt": True})
    assert again["timings"]["cache_n"] == len(layout(fim_model, body)) - 1


def test_cache_reuse_moves_the_rest_of_the_file_and_gives_the_fresh_completion(server, fim_model):
    """The editor's window moved down three lines: the lines still in it are kept (moved to
    their new positions), and the completion equals the one computed afresh."""
    first = editor_request(2, 26, temperature=0, n_predict=12, return_tokens=True)
    done = server.infill(first)
    assert done["stop_type"] == "limit"  # (n_predict reached: the cache holds the prompt and all but the last token)
    moved = editor_request(5, 29, temperature=0, n_predict=12)
    old, new = layout(fim_model, first), layout(fim_model, moved)
    common = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    n_keep, moves = plan_chunk_reuse([*old, *done["tokens"][:-1]], new[:-1], 8)
    assert moves and n_keep > common + 100
    reused = server.infill(moved)
    assert reused["timings"]["cache_n"] == n_keep
    fresh = server.infill({**moved, "cache_prompt": False})
    assert fresh["timings"]["cache_n"] == 0 and fresh["content"] == reused["content"]
    # the request's own n_cache_reuse: 0 keeps the common prefix alone
    server.infill(first)
    prefix_only = server.infill({**moved, "n_cache_reuse": 0})
    assert prefix_only["timings"]["cache_n"] == common


# --- the other endpoints ----------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(server, fim_model):
    pre = fim_model.fim_tokens()["pre"]
    tokens = server.post("/tokenize", {"content": "hello <|fim_prefix|>"}).json()["tokens"]
    assert pre in tokens and tokens == fim_model.tokenize("hello <|fim_prefix|>", add_bos=False, parse_special=True)
    assert pre not in server.post("/tokenize", {"content": "hello <|fim_prefix|>", "parse_special": False}).json()["tokens"]
    with_bos = server.post("/tokenize", {"content": "hello", "add_special": True}).json()["tokens"]
    assert with_bos[0] == fim_model.vocab_info().bos
    pieces = server.post("/tokenize", {"content": "hello <|fim_prefix|>", "with_pieces": True}).json()["tokens"]
    text = "".join(p["piece"] for p in pieces)
    assert [p["id"] for p in pieces] == tokens and text.lstrip() == "hello <|fim_prefix|>"  # (SPM's leading space kept, as llama-server keeps it)
    assert server.post("/detokenize", {"tokens": tokens}).json() == {"content": text}
    assert server.post("/tokenize", {}).json() == {"tokens": []}
    for path, body, param in (("/detokenize", {"tokens": [10**7]}, "tokens"), ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/tokenize", {"content": 5}, "content"), ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces")):
        response = server.post(path, body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_apply_template_is_the_text_chat_completions_evaluates(server, fim_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = server.post("/apply-template", {"messages": messages}).json()["prompt"]
    assert prompt == "Be brief.\n\nUser: hi\nAssistant:"  # (this model has no template: plain turns)
    chat = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(fim_model.tokenize(prompt, add_bos=True, parse_special=True))
    assert server.post("/apply-template", {"messages": [{"role": "robot", "content": "x"}]}).json()["error"]["param"] == "messages"


def test_props_says_what_clients_read(server, fim_path):
    props = server.http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == CTX and props["total_slots"] == 1
    assert props["default_generation_settings"]["params"]["temperature"] == 0
    assert props["model_path"] == str(fim_path) and props["endpoint_metrics"] is True and props["endpoint_slots"] is True
    assert props["chat_template"] == "" and props["bos_token"] == "<s>" and "specli" in props["build_info"]
    assert props["specli"]["infill"] is True and props["specli"]["cache_reuse"] == 8 and props["specli"]["drafting"] == "lookup"


def test_metrics_count_what_the_requests_did(server):
    before = server.metrics()
    done = server.infill(editor_request(10, 20, temperature=0, n_predict=9, cache_prompt=False))
    after = server.metrics()
    grew = lambda name: after[name] - before.get(name, 0)  # noqa: E731
    assert grew("llamacpp:tokens_predicted_total") == done["tokens_predicted"] == 9
    assert grew("llamacpp:prompt_tokens_total") == done["timings"]["prompt_n"]
    assert grew("llamacpp:spec_decode_num_draft_tokens_total") == done["timings"]["draft_n"]
    assert grew('specli:requests_total{outcome="completed"}') == 1 and after["llamacpp:requests_processing"] == 0


def test_slots_lists_each_slot(server):
    slots = server.http.get("/slots").json()
    assert [s["id"] for s in slots] == [0] and slots[0]["n_ctx"] == CTX and slots[0]["is_processing"] is False


def test_memory_drafts_a_completion_from_an_earlier_one(fim_path, tmp_path):
    """--memory process: the same completion asked again is drafted from the first one."""
    with serving(fim_path, tmp_path / "memory.stderr", "--lookup", "--memory", "process", "--draft-max", "8", "--temperature", "0", "--metrics") as srv:
        body = editor_request(0, 10, n_predict=24, cache_prompt=False)
        first = srv.infill(body)
        second = srv.infill(body)
        metrics = srv.metrics()
    assert second["content"] == first["content"]
    assert metrics.get('specli:accepted_tokens_total{source="memory"}', 0) > 0
    assert second["speculative"]["accepted"] > first["speculative"]["accepted"]


def test_the_key_guards_every_endpoint_but_health_and_off_endpoints_are_501(pair_perturbed, tmp_path):
    """A model without FIM tokens; --api-key; no --metrics or --slots."""
    with serving(pair_perturbed[0], tmp_path / "key.stderr", "--api-key", "sesame") as srv:
        for method, path in (("POST", "/infill"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/apply-template"),
                             ("GET", "/props"), ("GET", "/metrics"), ("GET", "/slots")):
            response = srv.http.request(method, path, json={} if method == "POST" else None)
            assert response.status_code == 401, (path, response.text)
        assert srv.http.get("/health").status_code == 200 and srv.http.get("/v1/health").status_code == 200
        key = {"Authorization": "Bearer sesame"}
        for path in ("/metrics", "/slots"):
            off = srv.http.get(path, headers=key)
            assert off.status_code == 501 and f"--{path[1:]}" in off.json()["error"]["message"]
        no_fim = srv.http.post("/infill", json=BASE, headers=key)
        message = no_fim.json()["error"]["message"]
        assert no_fim.status_code == 400 and all(word in message for word in ("prefix", "suffix", "middle", "/v1/completions"))
        assert srv.http.post("/tokenize", json={"content": "hi"}, headers=key).status_code == 200


@pytest.mark.gemma
def test_cache_reuse_moves_entries_of_a_sliding_window_model(gemma_path, tmp_path):
    """Gemma 3 attends to a sliding window in most layers; specli's contexts keep every position
    in that cache too (llama.cpp's default), so its entries move like any others (llama-server,
    whose window cache is smaller, turns --cache-reuse off for it). It has no FIM tokens."""
    with serving(gemma_path, tmp_path / "gemma.stderr", "--cache-reuse", "16", "--temperature", "0") as srv:
        assert "--cache-reuse 16 is off" not in srv.log.read_text()
        assert srv.http.get("/props").json()["specli"]["cache_reuse"] == 16
        words = " ".join(f"word{i}" for i in range(40))
        srv.post("/v1/completions", {"prompt": words, "max_tokens": 2})
        again = srv.post("/v1/completions", {"prompt": words[len("word0 word1 ") :], "max_tokens": 2})
        assert again.status_code == 200 and again.json()["timings"]["cache_n"] > 16  # (BOS, then the moved words)
        refused = srv.post("/infill", BASE)
        assert refused.status_code == 400 and "fill-in-the-middle" in refused.json()["error"]["message"]


def run_jobs(model, jobs: list, *, cache_reuse: int = 8, max_tokens: int = 3, **kw):
    """The jobs ((prompt, its n_cache_reuse or None) each) one after another through a scheduler
    with --cache-reuse `cache_reuse` (lookup drafting, greedy): each one's Done, and the
    scheduler (closed)."""
    from specli.decoding.drafters import make_drafter
    from specli.decoding.step import SpeculativeDecoder
    from specli.server.scheduler import Done, Job, Scheduler
    from specli.session.loading import Loaded, Plan

    decoder = SpeculativeDecoder(model, make_drafter("lookup"), 4, GREEDY)
    loaded = Loaded(Plan(model.path, None, "lookup", decoder.draft_length, GREEDY), model, None, decoder)
    scheduler = Scheduler(loaded, queue_limit=4, cache_reuse=cache_reuse, **kw)
    done = []
    scheduler.start()
    try:
        for ids, reuse in jobs:
            events = []
            scheduler.submit(Job(Request(ids, max_tokens, GREEDY, cache_reuse=reuse), emit=events.append))
            deadline = time.monotonic() + 60
            while not any(isinstance(e, Done) for e in events) and time.monotonic() < deadline:
                time.sleep(0.01)
            done.append(next(e for e in events if isinstance(e, Done)))
    finally:
        scheduler.stop()
        scheduler.join(30)
        scheduler.close()
    return done, scheduler


def reused_by_second(model, prompts: list[list[int]], **kw) -> tuple[int, list[str], bool]:
    """The prompts one after another through a scheduler with --cache-reuse 8 (3 tokens each,
    greedy): the tokens the last one found in its slot's cache, the texts, and whether the
    scheduler could move entries."""
    done, scheduler = run_jobs(model, [(ids, None) for ids in prompts], **kw)
    return done[-1].generation.stats.prompt_reused, [d.generation.text for d in done], scheduler.can_reuse


def test_a_cache_that_cannot_move_entries_keeps_the_common_prefix_alone(fim_model, monkeypatch):
    """(M-RoPE models: no model of that kind is at hand, so the cache says it cannot.) The
    scheduler then reuses the common prefix only, as without --cache-reuse."""
    from specli.llama.model import LlamaModel

    old, new = layout(fim_model, editor_request(2, 26)), layout(fim_model, editor_request(5, 29))
    common = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    assert reused_by_second(fim_model, [old, new], n_seq=1)[0] > common + 100
    monkeypatch.setattr(LlamaModel, "can_shift", property(lambda self: False))
    reused, _, can_reuse = reused_by_second(fim_model, [old, new], n_seq=1)
    assert not can_reuse and reused == common


def test_cache_reuse_in_a_slot_of_several(fim_model):
    """With --parallel the slot's cache is one sequence of a shared context: its entries move
    the same way, and the text is the fresh one."""
    old, new = layout(fim_model, editor_request(2, 26)), layout(fim_model, editor_request(5, 29))
    common = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    reused, texts, _ = reused_by_second(fim_model, [old, new], n_seq=2, n_threads=1)
    assert reused > common + 100
    assert texts[-1] == reused_by_second(fim_model, [new], n_seq=2, n_threads=1)[1][0]


@pytest.mark.parametrize("server_reuse, opt_in, opt_out", [(0, 8, None), (8, None, 0)], ids=["server-off", "request-off"])
@pytest.mark.parametrize("n_seq", [1, 2])
def test_a_request_without_cache_reuse_never_keeps_moved_entries(fim2_model, server_reuse, opt_in, opt_out, n_seq):
    """Moved chunks are approximate (two layers: they differ from fresh ones, and so does the
    completion after them). A request that reuses none (the server's --cache-reuse 0, or its own
    n_cache_reuse 0) after one that moved chunks in its slot must still give what `run` gives:
    it keeps the exact entries only (the common prefix before the first move)."""
    from specli.decoding.step import SpeculativeDecoder

    model = fim2_model
    old, new = layout(model, editor_request(2, 26)), layout(model, editor_request(5, 29))
    common = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    model.reset()
    run_text = generate(SpeculativeDecoder(model, None, 0, GREEDY), Request(new, max_tokens=16)).run().text  # (`specli run`, target only)
    jobs = [(old, None), (new, opt_in), (new, opt_out), (new, opt_out)]
    numerics = dict(kv_type="f32", flash_attn="off")  # (load()'s, for the slots' own context with n_seq 2)
    done, _ = run_jobs(model, jobs, cache_reuse=server_reuse, max_tokens=16, n_seq=n_seq, n_threads=1, **numerics)
    moved, exact, again = (d.generation for d in done[1:])
    assert moved.stats.prompt_reused > common + 100 and moved.text != run_text  # (the moved chunks changed the completion)
    assert exact.text == run_text and exact.stats.prompt_reused == common  # (re-evaluated from the first move on)
    assert again.text == run_text and again.stats.prompt_reused == len(new) - 1  # (what it computed exactly is kept whole)
