"""A raw prompt is tokenized as llama.cpp's CLI and server tokenize it (issue 41): the text of a
template's control tokens (`<|im_start|>`, `<start_of_turn>`) written into a prompt becomes the
control token (llama_tokenize with parse_special), so a prompt that formats its own chat turns,
or a hand-built FIM prompt, gets the tokens the model was trained on. `--no-parse-special` (and a
request's `"parse_special": false`) gives the old all-text tokens. Chat messages stay text.

Compared with llama.cpp's own tokenizer through llama_cpp's low-level llama_tokenize on the same
model (add_special and parse_special, what common_tokenize(prompt, true, true) passes), and, where
the native llama-server is built, through its /tokenize and /v1/completions.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import llama_cpp
import pytest

from fixtures.cli import ONE, popen, specli, stop, write_jsonl
from specli.llama.conversation import encode_conversation
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend
from specli.session.chat import choose_formatter

# --- what llama.cpp makes of a text ----------------------------------------------------------------


def llama_cpp_ids(model: LlamaModel, text: str, *, parse_special: bool = True) -> list[int]:
    """llama.cpp's tokens of a raw prompt: llama_tokenize(add_special=True, parse_special), as its
    CLI (tools/completion) and server (tokenize_mixed) call it through common_tokenize."""
    data = text.encode("utf-8")
    buf = (llama_cpp.llama_token * (len(data) + 8))()
    vocab = llama_cpp.llama_model_get_vocab(model._model)
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), True, parse_special)
    assert n >= 0
    return list(buf[:n])


def controls(model: LlamaModel, ids: list[int]) -> list[int]:
    return [t for t in ids if model.is_control(t)]


def run_json(*args: str, stdin: str | None = None) -> dict:
    result = specli("run", *args, "--json", "-q", "-n", "1", "--temperature", "0", "-c", "512", *ONE, stdin=stdin)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def batch_records(tmp_path: Path, model: Path, items: list, *args: str) -> list[dict]:
    source = write_jsonl(tmp_path / "in.jsonl", items)
    result = specli("batch", str(source), "-m", str(model), "--target-only", "-q", "-n", "1", "--temperature", "0", "-c", "512", *ONE, *args)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


# --- Gemma (always present): its <start_of_turn>/<end_of_turn> are control tokens -----------------
GEMMA_TURNS = "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.gemma
def test_a_raw_prompts_control_text_becomes_control_tokens_as_in_llama_cpp(gemma):
    ids = gemma.tokenize_prompt(GEMMA_TURNS)
    assert ids == llama_cpp_ids(gemma, GEMMA_TURNS)
    assert ids[0] == gemma.vocab_info().bos and len(controls(gemma, ids[1:])) == 3  # (BOS is one too)
    # The off-switch: all of it text, the tokens specli made before.
    text_ids = gemma.tokenize_prompt(GEMMA_TURNS, parse_special=False)
    assert text_ids == gemma.tokenize(GEMMA_TURNS, add_bos=True) == llama_cpp_ids(gemma, GEMMA_TURNS, parse_special=False)
    assert controls(gemma, text_ids[1:]) == [] and len(text_ids) > len(ids)
    # A prompt without control text is tokenized as before.
    assert gemma.tokenize_prompt("def fibonacci(n):") == gemma.tokenize("def fibonacci(n):", add_bos=True)


@pytest.mark.gemma
def test_a_prompt_that_starts_with_the_bos_text_keeps_one_bos(gemma):
    bos = gemma.vocab_info().bos
    rendered = "<bos>" + GEMMA_TURNS  # what a pipeline rendering Gemma's template itself sends
    native = llama_cpp_ids(gemma, rendered)
    assert native[:2] == [bos, bos]  # llama.cpp sends two (and warns)
    assert gemma.tokenize_prompt(rendered) == native[1:] == gemma.tokenize_prompt(GEMMA_TURNS)


@pytest.mark.gemma
@pytest.mark.parametrize("how", ["argument", "-p", "stdin"])
def test_run_parses_the_prompts_control_text_and_no_parse_special_keeps_it_text(gemma, gemma_path, how):
    args = {"argument": [GEMMA_TURNS], "-p": ["-p", GEMMA_TURNS], "stdin": ["-"]}[how]
    stdin = GEMMA_TURNS if how == "stdin" else None
    out = run_json(*args, "-m", str(gemma_path), "--target-only", stdin=stdin)
    assert out["stats"]["prompt_tokens"] == len(llama_cpp_ids(gemma, GEMMA_TURNS))
    if how == "argument":
        old = run_json(*args, "-m", str(gemma_path), "--target-only", "--no-parse-special")
        assert old["stats"]["prompt_tokens"] == len(gemma.tokenize(GEMMA_TURNS, add_bos=True))
        # --chat: the message is text, whatever the switch says.
        chat = run_json(*args, "-m", str(gemma_path), "--target-only", "--chat")
        message = [{"role": "user", "content": GEMMA_TURNS}]
        formatter, _ = choose_formatter(gemma, None)
        expected = encode_conversation(gemma, formatter, None, message)
        assert chat["stats"]["prompt_tokens"] == len(expected)
        assert len(controls(gemma, expected)) == len(controls(gemma, encode_conversation(gemma, formatter, None, [{"role": "user", "content": "x"}])))


@pytest.mark.gemma
def test_batch_parses_prompts_and_text_lines_but_never_messages(gemma, gemma_path, tmp_path):
    line = "<start_of_turn>user Hi<end_of_turn><start_of_turn>model"  # a text-line item (one line)
    items = [{"id": "json", "prompt": GEMMA_TURNS}, {"id": "chat", "messages": [{"role": "user", "content": GEMMA_TURNS}]}]
    records = batch_records(tmp_path, gemma_path, items)
    formatter, _ = choose_formatter(gemma, None)
    chat_ids = encode_conversation(gemma, formatter, None, items[1]["messages"])
    assert [r["stats"]["prompt_tokens"] for r in records] == [len(llama_cpp_ids(gemma, GEMMA_TURNS)), len(chat_ids)]
    old = batch_records(tmp_path, gemma_path, items, "--no-parse-special")
    assert [r["stats"]["prompt_tokens"] for r in old] == [len(gemma.tokenize(GEMMA_TURNS, add_bos=True)), len(chat_ids)]
    source = tmp_path / "lines.txt"
    source.write_text(line + "\n", encoding="utf-8")
    for flag, expected in (((), llama_cpp_ids(gemma, line)), (("--no-parse-special",), gemma.tokenize(line, add_bos=True))):
        result = specli("batch", str(source), "-m", str(gemma_path), "--target-only", "-q", "-n", "1", "--temperature", "0", "-c", "512", *ONE, *flag)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["stats"]["prompt_tokens"] == len(expected)


@pytest.mark.gemma
def test_completions_parse_a_text_prompts_control_text_unless_the_request_says_not_to(gemma):
    pytest.importorskip("starlette")
    from specli.decoding.sampling import SamplingParams
    from specli.server import protocol
    from specli.server.app import Service, Settings

    class Scheduler:
        n_ctx = 1024

    formatter, _ = choose_formatter(gemma, None)
    service = Service(Scheduler(), gemma, Settings("gemma", set(), SamplingParams(), formatter=formatter))

    def ids(body: dict, kind=protocol.TEXT) -> list[int]:
        return service._prompt_ids(protocol.parse_request(body, kind, SamplingParams()))[0]

    assert ids({"prompt": GEMMA_TURNS}) == llama_cpp_ids(gemma, GEMMA_TURNS)
    assert ids({"prompt": [GEMMA_TURNS]}) == llama_cpp_ids(gemma, GEMMA_TURNS)
    assert ids({"prompt": GEMMA_TURNS, "parse_special": False}) == gemma.tokenize(GEMMA_TURNS, add_bos=True)
    given = gemma.tokenize(GEMMA_TURNS, add_bos=False)  # token ids stay as given (no BOS added, nothing parsed)
    assert ids({"prompt": given}) == given
    chat = ids({"messages": [{"role": "user", "content": GEMMA_TURNS}]}, protocol.CHAT)
    assert chat == encode_conversation(gemma, formatter, None, [{"role": "user", "content": GEMMA_TURNS}])
    with pytest.raises(protocol.ApiError, match="parse_special"):
        protocol.parse_request({"prompt": "x", "parse_special": "no"}, protocol.TEXT, SamplingParams())


# --- the real Qwen2.5-Coder pair: the ChatML example ----------------------------------------
QWEN_MESSAGE = (
    "Write a Python function `is_prime(n: int) -> bool` that checks whether a number is prime, with a short docstring, "
    "type hints and a few doctest examples. Keep it simple and readable, and do not use any third-party libraries at all."
)
# The Qwen template's rendering of that one user message, with its default system prompt.
CHATML = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    f"<|im_start|>user\n{QWEN_MESSAGE}<|im_end|>\n<|im_start|>assistant\n"
)
CHATML_TOKENS = 83  # parsed, as llama.cpp's CLI and server make them (104 as text)


@pytest.fixture(scope="module")
def qwen(qwen_pair):
    init_backend()
    model = LlamaModel(qwen_pair[0], n_ctx=512, n_threads=1)
    yield model
    model.close()


@pytest.mark.real_pair
def test_the_chatml_example_is_the_qwen_templates_rendering(qwen):
    formatter, _ = choose_formatter(qwen, None)
    assert formatter.render(None, [{"role": "user", "content": QWEN_MESSAGE}]) == CHATML
    native = llama_cpp_ids(qwen, CHATML)
    assert len(native) == CHATML_TOKENS and qwen.tokenize_prompt(CHATML) == native
    # ... which is the chat rendering's tokens: a raw prompt of it now gets what the chat gets.
    assert native == encode_conversation(qwen, formatter, None, [{"role": "user", "content": QWEN_MESSAGE}])
    assert len(qwen.tokenize_prompt(CHATML, parse_special=False)) == 104


@pytest.mark.real_pair
def test_run_gives_llama_cpps_tokens_for_the_chatml_example(qwen, qwen_pair):
    target = str(qwen_pair[0])
    assert run_json(CHATML, "-m", target, "--target-only")["stats"]["prompt_tokens"] == CHATML_TOKENS
    old = run_json(CHATML, "-m", target, "--target-only", "--no-parse-special")
    assert old["stats"]["prompt_tokens"] == len(qwen.tokenize(CHATML, add_bos=False)) == 104


@pytest.mark.real_pair
def test_batch_gives_llama_cpps_tokens_for_the_chatml_example(qwen_pair, tmp_path):
    items = [{"prompt": CHATML}, {"messages": [{"role": "user", "content": CHATML}]}]
    records = batch_records(tmp_path, qwen_pair[0], items)
    assert records[0]["stats"]["prompt_tokens"] == CHATML_TOKENS
    assert records[1]["stats"]["prompt_tokens"] > 104  # the message is text inside the template's own turn
    old = batch_records(tmp_path, qwen_pair[0], items[:1], "--no-parse-special")
    assert old[0]["stats"]["prompt_tokens"] == 104


LISTENING = re.compile(r"specli serve: listening on http://(\S+):(\d+) ")


@contextlib.contextmanager
def serving(cmd: list[str], log: Path, ready):
    """A server process (stopped whatever happens), once ready(log text) gives its URL."""
    with open(log, "w") as err:
        proc = popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 180
        while (url := ready(log.read_text(errors="replace"))) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


@pytest.mark.real_pair
def test_completions_give_llama_cpps_tokens_for_the_chatml_example(qwen, qwen_pair, tmp_path):
    pytest.importorskip("starlette")
    cmd = [sys.executable, "-m", "specli", "serve", "-m", str(qwen_pair[0]), "--target-only", "-c", "512", *ONE, "--port", "0"]

    def ready(text):
        found = LISTENING.search(text)
        return found and f"http://{found.group(1)}:{found.group(2)}"

    with serving(cmd, tmp_path / "serve.log", ready) as url:
        def prompt_tokens(body: dict, path="/v1/completions") -> int:
            return post(url, path, {"max_tokens": 1, "temperature": 0, **body})["usage"]["prompt_tokens"]

        assert prompt_tokens({"prompt": CHATML}) == CHATML_TOKENS
        assert prompt_tokens({"prompt": CHATML, "parse_special": False}) == 104
        assert prompt_tokens({"prompt": qwen.tokenize(CHATML, add_bos=False)}) == 104  # ids as given
        # The message alone, through the chat route: the same 83 tokens; the rendering as a message: text.
        assert prompt_tokens({"messages": [{"role": "user", "content": QWEN_MESSAGE}]}, "/v1/chat/completions") == CHATML_TOKENS
        assert prompt_tokens({"messages": [{"role": "user", "content": CHATML}]}, "/v1/chat/completions") > 104


NATIVE_BIN = Path(os.environ.get("LLAMA_CPP_BIN") or "/tmp/specli-native/src/vendor/llama.cpp/build/bin")


@pytest.mark.real_pair
def test_llama_server_tokenizes_the_chatml_example_as_specli_now_does(qwen, qwen_pair, tmp_path):
    binary = NATIVE_BIN / "llama-server"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"no native llama-server in {NATIVE_BIN}: benchmarks/build_native.sh builds it (or set LLAMA_CPP_BIN)")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(binary), "-m", str(qwen_pair[0]), "-c", "512", "-t", "1", "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    with serving(cmd, tmp_path / "llama-server.log", lambda text: f"http://127.0.0.1:{port}" if "listening on http" in text else None) as url:
        tokens = post(url, "/tokenize", {"content": CHATML, "add_special": True})["tokens"]
        assert tokens == qwen.tokenize_prompt(CHATML) and len(tokens) == CHATML_TOKENS
        done = post(url, "/v1/completions", {"prompt": CHATML, "max_tokens": 1, "temperature": 0})
        assert done["usage"]["prompt_tokens"] == CHATML_TOKENS
