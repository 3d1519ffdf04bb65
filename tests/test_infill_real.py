"""/infill and llama-server's other endpoints on the real Qwen2.5-Coder 1.5B, against llama-server
itself (the native build of the llama.cpp specli binds, benchmarks/build_native.sh; skipped
without it, or without the Qwen pair): a llama.vscode-shaped request gets the same prompt,
token for token, and at greedy the same completion (or a near tie where they part), and with
--cache-reuse on both the next request (the cursor moved down) reuses as many tokens.

Both servers run on 127.0.0.1 with one thread and are always stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

try:
    import httpx2 as httpx
except ImportError:
    import httpx

from fixtures.cli import popen, stop
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend
from specli.server import fim

pytestmark = pytest.mark.real_pair

NATIVE_BIN = Path(os.environ.get("LLAMA_CPP_BIN") or "/tmp/specli-native/src/vendor/llama.cpp/build/bin")
CTX = 4096
REUSE = 64
# The largest logit gap allowed between the two tokens where the completions part: a near tie
# (the two servers evaluate the prompt in other batches, which rounds otherwise on this Q4_K_M
# file), not a different prompt, which would part by several units.
MARGIN = 1.0
SOURCE = Path(__file__).resolve().parent.parent / "src" / "specli" / "decoding" / "drafters.py"


@pytest.fixture(scope="module")
def llama_server() -> Path:
    binary = NATIVE_BIN / "llama-server"
    if not binary.is_file():
        pytest.skip(f"no native llama-server in {NATIVE_BIN}: benchmarks/build_native.sh builds it (or set LLAMA_CPP_BIN)")
    return binary


@contextlib.contextmanager
def running(cmd: list[str], log: Path, pattern: str):
    with open(log, "w") as err:
        proc = popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while not (found := re.search(pattern, log.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{cmd[0]} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        yield httpx.Client(base_url=f"http://127.0.0.1:{found.group(1)}", timeout=900)
    finally:
        stop(proc, 60)


@contextlib.contextmanager
def both_servers(qwen_pair, llama_server: Path, tmp_path: Path):
    target = str(qwen_pair[0])
    specli_cmd = [sys.executable, "-m", "specli", "serve", "-m", target, "--lookup", "-c", str(CTX), "--threads", "1", "--port", "0",
                  "--cache-reuse", str(REUSE)]
    port = free_port()
    native_cmd = [str(llama_server), "-m", target, "-c", str(CTX), "-np", "1", "-t", "1", "-tb", "1", "--host", "127.0.0.1", "--port", str(port),
                  "--cache-reuse", str(REUSE), "--cache-ram", "0"]
    with running(specli_cmd, tmp_path / "specli.log", r"listening on http://127\.0\.0\.1:(\d+) ") as ours:
        with running(native_cmd, tmp_path / "native.log", rf"listening on http://127\.0\.0\.1:({port})") as theirs:
            yield ours, theirs


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def editor_request(lines: list[str], cursor: int) -> dict:
    """llama.vscode's request (its defaults, a shorter window to keep the test short), greedy:
    top_k 1 is greedy in its sampler chain, temperature 0 in specli's; t_max_predict_ms long
    enough that time never ends it."""
    line = lines[cursor]
    col = len(line) - len(line.lstrip())
    return {
        "input_prefix": "".join(lines[max(0, cursor - 40) : cursor]), "input_suffix": line[col:] + "".join(lines[cursor + 1 : cursor + 12]),
        "prompt": line[:col], "input_extra": [{"filename": "engine.py", "text": "".join(lines[:20]), "time": 0}],
        "n_predict": 48, "n_indent": col, "top_k": 1, "temperature": 0, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 600000, "stream": False, "return_tokens": True,
    }


def parting_gap(target: Path, body: dict, ours: list[int], theirs: list[int]) -> float:
    """Where two greedy completions part: the target's logit gap between the two tokens there."""
    init_backend()
    model = LlamaModel(target, n_ctx=CTX, n_threads=1)
    try:
        extra = [(c["filename"], c["text"]) for c in body["input_extra"]]
        prompt = fim.infill_prompt(model, model.fim_tokens(), prefix=body["input_prefix"], suffix=body["input_suffix"], extra=extra,
                                   prompt=body["prompt"], n_ctx=CTX)
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        assert i is not None, f"the same tokens, another text: {ours} vs {theirs}"
        logits = np.array(model.eval([*prompt, *ours[:i]], logits="last")[0])
        return abs(float(logits[ours[i]] - logits[theirs[i]]))
    finally:
        model.close()


def test_a_llama_vscode_request_gets_llama_servers_prompt_and_completion(qwen_pair, llama_server, tmp_path):
    lines = SOURCE.read_text().splitlines(keepends=True)
    cursor = next(i for i in range(60, len(lines)) if lines[i].startswith("        ") and lines[i].strip())
    with both_servers(qwen_pair, llama_server, tmp_path) as (ours, theirs):
        for step, body in enumerate((editor_request(lines, cursor), editor_request(lines, cursor + 3))):
            mine = ours.post("/infill", json=body)
            native = theirs.post("/infill", json=body)
            assert mine.status_code == native.status_code == 200, (mine.text[:500], native.text[:500])
            a, b = mine.json(), native.json()
            assert a["prompt"] == b["prompt"] and a["tokens_evaluated"] == b["tokens_evaluated"]  # the same FIM prompt
            assert set(b) <= set(a)  # llama-server's fields, and specli's `speculative`
            if a["content"] != b["content"]:
                gap = parting_gap(qwen_pair[0], body, a["tokens"], b["tokens"])
                assert gap < MARGIN, (gap, a["content"], b["content"])
            else:
                assert a["stop_type"] == b["stop_type"]
                # (llama-server checks n_indent a token or two after the line starts: it may have made more)
                assert b["tokens"][: len(a["tokens"])] == a["tokens"]
                if step == 1:  # the cursor moved: both kept the same tokens (--cache-reuse on both)
                    assert a["timings"]["cache_n"] == b["timings"]["cache_n"] > 0


def test_tokenize_detokenize_and_apply_template_answer_as_llama_server(qwen_pair, llama_server, tmp_path):
    requests = [
        ("/tokenize", {"content": "def f(x):\n    return x <|fim_prefix|> é ✓"}),
        ("/tokenize", {"content": "<|im_start|>user", "parse_special": False}),
        ("/tokenize", {"content": "hello", "add_special": True, "with_pieces": True}),
        ("/tokenize", {"content": ["a", 151659, " b"], "with_pieces": True}),
        ("/detokenize", {"tokens": [750, 282, 2075, 151659, 220, 18503]}),
        ("/apply-template", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}),
    ]
    with both_servers(qwen_pair, llama_server, tmp_path) as (ours, theirs):
        for path, body in requests:
            mine, native = ours.post(path, json=body), theirs.post(path, json=body)
            assert mine.status_code == native.status_code == 200
            assert mine.json() == native.json(), (path, body)
        props, native_props = ours.get("/props").json(), theirs.get("/props").json()
        for key in ("total_slots", "chat_template", "bos_token", "eos_token"):
            assert props[key] == native_props[key], key
        assert props["default_generation_settings"]["n_ctx"] == native_props["default_generation_settings"]["n_ctx"]
