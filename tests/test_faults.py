"""Faults and hostile input through the command line (issue 19, items 3-5 and 10): unbounded
inputs, writes that fail, values that used to crash the sampler or the batch size, Ctrl-C while
the models load or specli's modules import, and a resume with other settings. Every case runs a
real `specli` process; the ones that read a device have a timeout, so a regression fails
instead of filling the memory."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest

from fixtures.cli import assert_one_line_error, default_signals, popen, specli

ONE = ["--threads", "1"]
REPEATING = "1 2 3 1 2 3 1 2 3 1 2 3"  # prompt lookup drafts long copies of it
DEVICE_TIMEOUT = 60  # the limit is 64 MiB: reading it takes well under a second


def specli_with(args: list[str], *, stdin=None, stdout=subprocess.PIPE, env: dict | None = None, code: str | None = None):
    """specli with a file as stdin or stdout; `code` runs before main() in the same process
    (to make a fault happen where no input can)."""
    prelude = (code or "") + "\nimport sys\nfrom specli.cli.app import main\nmain(sys.argv[1:])\n"
    return subprocess.run(
        [sys.executable, "-c", prelude, *args], stdin=stdin, stdout=stdout, stderr=subprocess.PIPE,
        timeout=DEVICE_TIMEOUT, env={**os.environ, **(env or {})},
    )


def one_line(stderr: bytes, *fragments: str) -> str:
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    assert len(lines) == 1, stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def write_jsonl(path: Path, objects) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects), encoding="utf-8")
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- item 3: unbounded reads, failing writes -------------------------------------------------
def test_a_prompt_or_input_from_dev_zero_stops_at_the_stated_limit(pair_perturbed):
    target = str(pair_perturbed[0])
    with open("/dev/zero", "rb") as zero:
        result = specli_with(["run", "-", "-m", target, *ONE], stdin=zero)
    assert result.returncode == 2 and result.stdout == b""
    one_line(result.stderr, "the prompt on stdin", "64 MiB", "SPECLI_MAX_INPUT_BYTES")
    for args, stdin in ((["batch", "/dev/zero"], None), (["batch", "-"], "/dev/zero")):
        with open(stdin or os.devnull, "rb") as handle:
            result = specli_with([*args, "-m", target, *ONE], stdin=handle)
        assert result.returncode == 2 and result.stdout == b"", result.stderr
        one_line(result.stderr, "input limit", "SPECLI_MAX_INPUT_BYTES")


def test_the_input_limit_is_set_by_its_variable(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    small = {"SPECLI_MAX_INPUT_BYTES": "16"}
    refused = specli("run", "-", "-m", target, *ONE, stdin="seventeen bytes!!", env=small)
    assert_one_line_error(refused, 2, "16 bytes", "SPECLI_MAX_INPUT_BYTES")
    fits = specli("run", "-", "-m", target, *ONE, "--max-tokens", "2", "-q", stdin="sixteen bytes!!!", env=small)
    assert fits.returncode == 0, fits.stderr
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n" * 4)
    refused = specli("batch", str(prompts), "-m", target, *ONE, env=small)
    assert_one_line_error(refused, 2, f"input file {prompts}", "SPECLI_MAX_INPUT_BYTES")
    bad = specli("run", "-", "-m", target, *ONE, stdin="hi", env={"SPECLI_MAX_INPUT_BYTES": "lots"})
    assert_one_line_error(bad, 2, "SPECLI_MAX_INPUT_BYTES must be a whole number")


def test_a_registry_that_is_not_a_regular_file_is_refused_unread(pair_perturbed):
    target = str(pair_perturbed[0])
    result = specli_with(["run", "hi", "-m", target, *ONE], env={"SPECLI_MODELS": "/dev/zero"})
    assert result.returncode == 2 and result.stdout == b""
    one_line(result.stderr, "model registry /dev/zero is not a regular file")


def test_writes_that_fail_are_one_line(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\nworld\n")
    refused = specli("batch", str(prompts), "-m", target, *ONE, "-o", "/dev/full")
    assert_one_line_error(refused, 2, "-o /dev/full is not a regular file")
    for args in (["run", "hello", "-m", target], ["run", "hello", "-m", target, "--json"], ["batch", str(prompts), "-m", target]):
        with open("/dev/full", "w") as full:
            result = specli_with([*args, *ONE, "--max-tokens", "5", "-q"], stdout=full)
        assert result.returncode == 1, result.stderr
        one_line(result.stderr, "specli: error: No space left on device")


# --- item 4: valid values that used to crash ---------------------------------------------------
@pytest.mark.parametrize("ctx,n_draft", [("32", "64"), ("16", "auto"), ("20", "40")])
def test_drafts_longer_than_a_small_context_batch_are_cut_to_fit(pair_perturbed, ctx, n_draft):
    target = str(pair_perturbed[0])
    greedy = ["-m", target, "-c", ctx, "--temperature", "0", "--max-tokens", "60", "--json", "-q", *ONE]
    drafted = specli("run", REPEATING, "--lookup", "--draft-max", n_draft, *greedy)
    plain = specli("run", REPEATING, "--target-only", *greedy)
    assert drafted.returncode == 0 and plain.returncode == 0, drafted.stderr + plain.stderr
    assert json.loads(drafted.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


def test_tiny_temperature_and_repeat_penalty_sample(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    for option, value in (("--temperature", "1e-310"), ("--repeat-penalty", "1e-300"), ("--repeat-penalty", "1e300")):
        result = specli("run", "hello there hello there", "-m", target, option, value, "--seed", "1", "--max-tokens", "12", "--json", "-q", *ONE)
        assert result.returncode == 0, (option, value, result.stderr)
        assert result.stderr == "" and json.loads(result.stdout)["n_tokens"] > 0
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "penalty", "prompt": "hello there hello there", "repeat_penalty": 1e-300},
        {"id": "temperature", "prompt": "hello there", "temperature": 1e-310},
    ])
    out = tmp_path / "out.jsonl"
    result = specli("batch", str(src), "-o", str(out), "-m", target, "--max-tokens", "8", "-q", *ONE)
    assert result.returncode == 0, result.stderr
    assert [r.get("error") for r in records(out)] == [None, None]


# A bug that no input can reach any more, put back by hand: an item with top_k 7 fails in the
# middle of its generation.
FAIL_TOP_K_7 = textwrap.dedent("""
    from specli.decoding import step
    verify = step.verify
    def _failing(rows, draft, context, sampling, *args, **kwargs):
        if sampling.top_k == 7:
            raise ZeroDivisionError("planted fault")
        return verify(rows, draft, context, sampling, *args, **kwargs)
    step.verify = _failing
""")


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_an_item_that_fails_is_its_own_error_record_and_the_batch_goes_on(tmp_path, pair_perturbed, parallel):
    target = str(pair_perturbed[0])
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "Once upon a time"},
        {"id": "b", "prompt": "hello world hello", "top_k": 7},
        {"id": "c", "prompt": "def fibonacci(n):"},
    ])
    out = tmp_path / "out.jsonl"
    args = ["batch", str(src), "-o", str(out), "-m", target, "--temperature", "0", "--max-tokens", "6", "-P", parallel, "-q", *ONE]
    for _ in range(2):  # the resume retries the failed item, fails again, and still finishes
        result = specli_with(args, code=FAIL_TOP_K_7)
        assert result.returncode == 1, result.stderr
        assert result.stderr == b""
        by_id = {r["id"]: r for r in records(out)}
        assert set(by_id) == {"a", "b", "c"}
        assert "ZeroDivisionError: planted fault" in by_id["b"]["error"]
        assert by_id["a"]["n_tokens"] > 0 and by_id["c"]["n_tokens"] > 0


# --- item 5: Ctrl-C ------------------------------------------------------------------------------
F_SETPIPE_SZ = 1031  # Linux


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs F_SETPIPE_SZ")
def test_ctrl_c_while_the_model_loads_stops_it(pair_perturbed):
    """With --verbose llama.cpp's loader logs ~26 KB through specli's log callback. stderr is a
    4 KiB pipe that this test stops reading after the loader's first line: the load then stalls
    inside the callback, mid-load, whatever the machine's speed, and gets the SIGINT there."""
    target = str(pair_perturbed[0])
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, F_SETPIPE_SZ, 4096)
    proc = popen(
        [sys.executable, "-m", "specli", "run", "hello", "-m", target, "--verbose", *ONE, "--max-tokens", "200"],
        stdout=subprocess.PIPE, stderr=write_end,
    )
    os.close(write_end)
    seen = b""
    try:
        while b"llama_model_loader: loaded meta data" not in seen:
            chunk = os.read(read_end, 4096)
            assert chunk, seen
            seen += chunk
        proc.send_signal(signal.SIGINT)
        while chunk := os.read(read_end, 65536):
            seen += chunk
        stdout, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        os.close(read_end)
    text = seen.decode("utf-8", "replace")
    assert proc.returncode == 130, text[-2000:]
    assert stdout == b""  # stopped before generating
    assert "Traceback" not in text and "Exception ignored" not in text, text[-2000:]
    assert len([line for line in text.splitlines() if line.startswith("specli")]) <= 1


IMPORT_INTERRUPT = textwrap.dedent("""
    import os, runpy, signal, sys
    class Interrupt:
        def find_spec(self, name, path=None, target=None):
            if name == "llama_cpp":
                os.kill(os.getpid(), signal.SIGINT)
            return None
    sys.meta_path.insert(0, Interrupt())
    sys.argv = ["specli", "run", "hello"]
    runpy.run_module("specli", run_name="__main__", alter_sys=True)
""")


def test_ctrl_c_while_specli_imports_is_one_line_and_exit_130():
    result = subprocess.run([sys.executable, "-c", IMPORT_INTERRUPT], capture_output=True, text=True, timeout=60,
                            preexec_fn=default_signals)  # it sends itself the SIGINT
    assert result.returncode == 130, result.stderr
    assert result.stderr == "specli: interrupted\n" and result.stdout == ""


# --- item 10: BOM, -c, --threads, resume with other settings --------------------------------
def test_a_byte_order_mark_does_not_make_jsonl_text(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    lines = "\ufeff" + json.dumps({"id": "x", "prompt": "hello"}) + "\n" + json.dumps({"id": "y", "prompt": "world"}) + "\n"
    result = specli("batch", "-", "-m", target, "--max-tokens", "3", "-q", *ONE, stdin=lines)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == ["x", "y"]
    text_file = tmp_path / "prompts.txt"
    text_file.write_bytes(b"\xef\xbb\xbfhello\n")
    result = specli("batch", str(text_file), "-m", target, "--max-tokens", "3", "-q", "--temperature", "0", *ONE)
    plain = specli("run", "hello", "-m", target, "--max-tokens", "3", "-q", "--temperature", "0", "--json", *ONE)
    assert json.loads(result.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


def test_ctx_and_threads_beyond_their_maximum_are_refused(pair_perturbed):
    target = str(pair_perturbed[0])
    result = specli("run", "hi", "-m", target, "-c", str(2**32 + 16), *ONE)
    assert_one_line_error(result, 2, "-c", "16777216")
    cpus = os.cpu_count()
    result = specli("run", "hi", "-m", target, "--threads", str(4 * cpus + 1))
    assert_one_line_error(result, 2, "--threads", f"at most {4 * cpus}", f"{cpus} CPUs")
    result = specli("batch", "-", "-m", target, "--threads", "999", stdin="hi\n")
    assert_one_line_error(result, 2, "--threads")


def test_a_resume_with_other_settings_is_refused_without_force(tmp_path, pair_perturbed, pair_identical):
    target, other = str(pair_perturbed[0]), str(pair_identical[0])
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(["hello", "world", "again"])])
    out = tmp_path / "out.jsonl"
    first = ["batch", str(src), "-o", str(out), "--max-tokens", "3", "-q", *ONE]
    result = specli(*first, "-m", target, "--temperature", "0", "--lookup")
    assert result.returncode == 0, result.stderr
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")  # as if the run had stopped after two items
    before = out.read_bytes()

    refused = specli(*first, "-m", other, "--temperature", "0.5", "--target-only")
    assert_one_line_error(refused, 2, str(out), "--force", "temperature 0.0 (this run: 0.5)", "target", "draft \"lookup\" (this run: none)")
    assert out.read_bytes() == before
    same = specli(*first, "-m", target, "--temperature", "0", "--lookup")  # the same settings resume
    assert same.returncode == 0 and len(records(out)) == 3, same.stderr

    out.write_text("\n".join(lines[:2]) + "\n")
    forced = specli(*first, "-m", target, "--temperature", "0.5", "--lookup", "--force")
    assert forced.returncode == 0, forced.stderr
    assert [r["sampling"]["temperature"] for r in records(out)] == [0.0, 0.0, 0.5]


# --- issue 19, leftovers: outputs checked before loading, chat's endless line, 32-bit options ---
@contextmanager
def unwritable(path: Path):
    """`path` (a file or a folder) that cannot be written while the block runs: its permission
    bits, or, for root (whom they do not bind), the immutable attribute."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode & 0o7777
        path.chmod(0o555 if path.is_dir() else 0o444)
        undo = lambda: path.chmod(mode)  # noqa: E731
    else:
        try:
            made = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
        except FileNotFoundError:
            made = False
        if not made:
            pytest.skip("running as root, and chattr +i does not work here")
        undo = lambda: subprocess.run(["chattr", "-i", str(path)], check=True)  # noqa: E731
    try:
        yield path
    finally:
        undo()


def test_outputs_that_cannot_be_written_are_refused_before_the_models_load(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    missing_model = str(tmp_path / "not-there.gguf")  # the outputs are checked even before -m is looked at
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\nworld\n")
    folder = tmp_path / "ro"
    folder.mkdir()
    kept = tmp_path / "kept.jsonl"
    kept.write_text(json.dumps({"id": 1, "prompt": "hello", "text": " there"}) + "\n")
    before = (kept.read_bytes(), kept.stat().st_mtime_ns)
    fresh = tmp_path / "out.jsonl"
    batch = ["batch", str(prompts), *ONE, "--max-tokens", "3", "-q"]
    with unwritable(folder), unwritable(kept):
        result = specli(*batch, "-m", missing_model, "-o", str(folder / "out.jsonl"))
        assert_one_line_error(result, 2, "cannot write -o", str(folder), "nothing can be created")
        result = specli(*batch, "-m", target, "-o", str(kept))
        assert_one_line_error(result, 2, f"cannot write -o {kept}")
        result = specli(*batch, "-m", missing_model, "-o", str(fresh), "--summary", str(folder / "summary.json"))
        assert_one_line_error(result, 2, "cannot write the --summary file", str(folder))
        result = specli("bench", "-m", missing_model, *ONE, "--json", str(folder / "bench.json"))
        assert_one_line_error(result, 2, "cannot write the --json file", str(folder))
        result = specli("bench", "-m", missing_model, *ONE, "--csv", str(kept))
        assert_one_line_error(result, 2, f"cannot write the --csv file {kept}")
    result = specli(*batch, "-m", missing_model, "-o", str(fresh), "--summary", str(tmp_path))
    assert_one_line_error(result, 2, "--summary", "is a directory")
    assert (kept.read_bytes(), kept.stat().st_mtime_ns) == before
    assert not fresh.exists() and list(folder.iterdir()) == []
    # Writable: the same run goes through.
    result = specli(*batch, "-m", target, "-o", str(fresh), "--summary", str(tmp_path / "summary.json"))
    assert result.returncode == 0, result.stderr
    assert len(records(fresh)) == 2 and json.loads((tmp_path / "summary.json").read_text())["done"] == 2


def test_chat_stops_reading_an_endless_line_at_the_stated_limit(pair_perturbed):
    target = str(pair_perturbed[0])
    with open("/dev/zero", "rb") as zero:
        result = specli_with(["chat", "-m", target, *ONE, "-q"], stdin=zero)
    assert result.returncode == 2 and result.stdout == b"", result.stderr
    one_line(result.stderr, "a chat message on stdin", "64 MiB", "SPECLI_MAX_INPUT_BYTES")
    # A smaller limit: the message before the long one is answered, then the session ends, also
    # for a message continued over many lines (each ending in a backslash).
    small = {"SPECLI_MAX_INPUT_BYTES": "16"}
    chat = ["chat", "-m", target, *ONE, "-q", "--max-tokens", "3", "--temperature", "0"]
    for long_message in ("x" * 17 + "\n", "abcd\\\n" * 5 + "end\n"):
        result = specli(*chat, stdin="hello\n" + long_message + "never read\n", env=small)
        assert result.returncode == 2, result.stderr
        assert result.stdout != ""  # the reply to "hello"
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "a chat message on stdin" in lines[0] and "16 bytes" in lines[0], result.stderr
    result = specli(*chat, stdin="x" * 16 + "\r\n", env=small)  # exactly the limit is accepted
    assert result.returncode == 0, result.stderr


def test_chat_refuses_binary_input_instead_of_answering_it_line_by_line(pair_perturbed, tmp_path):
    target = str(pair_perturbed[0])
    chat = ["chat", "-m", target, *ONE, "-q", "--max-tokens", "3", "--temperature", "0"]
    # 1 MiB of every byte value in turn, so a newline every 256 bytes: line 2 is bytes 0-9 (text),
    # line 3 runs from byte 11, and byte 0x80 is the first that is not UTF-8.
    (tmp_path / "noise").write_bytes(b"hello\n" + bytes(range(256)) * 4096)
    with open(tmp_path / "noise", "rb") as noise:
        result = specli_with(chat, stdin=noise)
    assert result.returncode == 2 and result.stdout != b"", result.stderr  # the text lines were answered
    one_line(result.stderr, "line 3 of stdin is not UTF-8 text (bad byte at column 118)")


def test_parallel_and_gpu_layers_beyond_their_maximum_are_refused(pair_perturbed):
    target = str(pair_perturbed[0])
    for value in (str(2**32 + 2), "257", "0"):
        result = specli("batch", "-", "-m", target, *ONE, "--parallel", value, stdin="hi\n")
        assert_one_line_error(result, 2, "--parallel must be from 1 to 256", value)
    result = specli("batch", "-", "-m", target, *ONE, "-P", "2", "-c", "9000000", stdin="hi\n")
    assert_one_line_error(result, 2, "--parallel 2 with -c 9000000", "16,777,216")
    for command, option, value in (("run", "--ngl", str(2**32)), ("run", "--draft-ngl", "-2"), ("chat", "--ngl", "10001"),
                                   ("batch", "--draft-ngl", str(2**31)), ("bench", "--ngl", "-3")):
        args = [command, "hi"] if command == "run" else [command, "-"] if command == "batch" else [command]
        result = specli(*args, "-m", target, *ONE, option, value, stdin="hi\n")
        assert_one_line_error(result, 2, option, "-1 (all layers)", "0 to 10,000", value)
    result = specli("fit", "-m", target, "--ngl", str(2**32))
    assert_one_line_error(result, 2, "--ngl", "0 to 10,000")


# --- issue 40: paths that are no files, outputs that cannot be reached ----------------------------
@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_a_model_path_that_is_no_regular_file_is_refused_at_once(tmp_path, pair_perturbed, kind):
    # Opening a FIFO to read it waits for a writer for ever (it hung `run` and `fit`; Ctrl-C ended
    # it without a line); a socket cannot be opened; a device would be read as a model. Every
    # option taking a model path, in every command, refuses it unopened: one line, exit 2.
    import socket

    target = str(pair_perturbed[0])
    if kind == "device":
        path = "/dev/zero"
    else:
        path = str(tmp_path / "m.gguf")
        if kind == "fifo":
            os.mkfifo(path)
        else:
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(path)
    words = {"fifo": "is a FIFO (named pipe), not a regular file", "socket": "is a socket, not a regular file",
             "device": "is a character device, not a regular file"}[kind]
    cases = [["run", "hi", "-m", path, *ONE], ["run", "hi", "-m", target, "-md", path, *ONE], ["chat", "-m", path, *ONE],
             ["batch", "-", "-m", path, *ONE], ["batch", "-", "-m", target, "--draft", path, *ONE], ["bench", "-m", path, *ONE],
             ["serve", "-m", path, "--port", "0", *ONE], ["fit", "-m", path], ["fit", "-m", target, "-md", path]]
    for args in cases:
        result = specli(*args, stdin="hi\n", timeout=30)
        assert_one_line_error(result, 2, path, words)


def closed_stdout() -> None:
    os.close(1)  # as the shell's `>&-` leaves it (preexec_fn: in the child, before specli starts)


def test_a_closed_stdout_is_one_line_before_any_work(tmp_path, pair_perturbed):
    # Was: the whole generation, then AttributeError: 'NoneType' object has no attribute 'write'.
    # The model named does not exist: the closed stdout is found first, before any model is looked at.
    missing = str(tmp_path / "not-there.gguf")
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\nworld\n")
    cases = [["run", "hi", "-m", missing], ["run", "hi", "-m", missing, "--json"], ["chat", "-m", missing],
             ["batch", str(prompts), "-m", missing], ["bench", "-m", missing], ["fit", "-m", missing],
             ["models"], ["models", "--json"], ["cache"], ["cache", "--json"]]
    env = {**os.environ, "SPECLI_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    for args in cases:
        result = subprocess.run([sys.executable, "-m", "specli", *args], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                preexec_fn=closed_stdout, timeout=60, env=env)
        assert result.returncode == 1, (args, result.stderr)
        one_line(result.stderr, "specli: error: stdout is closed")
    # What needs no stdout still runs: batch to a file (and nothing lands in the file opened first).
    out = tmp_path / "out.jsonl"
    result = subprocess.run([sys.executable, "-m", "specli", "batch", str(prompts), "-m", str(pair_perturbed[0]), "-o", str(out),
                             *ONE, "--max-tokens", "2", "-q"], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=closed_stdout, timeout=120, env=env)
    assert result.returncode == 0 and result.stderr == b"", result.stderr
    assert [r["id"] for r in records(out)] == [1, 2]


def test_an_output_fifo_with_no_reader_is_refused_before_the_models_load(tmp_path):
    # A FIFO with no reader blocked `batch --summary` for good, after the whole batch. Checked
    # with the other outputs, before -m is looked at (the model here does not exist).
    missing = str(tmp_path / "not-there.gguf")
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    for args, option in ((["batch", "-", "-o", str(tmp_path / "o.jsonl"), "--summary", str(fifo)], "the --summary file"),
                         (["bench", "--json", str(fifo)], "the --json file"), (["bench", "--csv", str(fifo)], "the --csv file")):
        result = specli(*args, "-m", missing, *ONE, stdin="hi\n", timeout=30)
        assert_one_line_error(result, 2, f"cannot write {option} {fifo}: it is a FIFO (named pipe) with no reader", "start what reads it first")


def test_an_output_fifo_with_a_reader_gets_the_summary_and_a_reader_that_left_is_one_line(tmp_path, pair_perturbed):
    import threading

    target = str(pair_perturbed[0])
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\nworld\n")
    fifo = tmp_path / "summary.fifo"
    os.mkfifo(fifo)
    batch = ["batch", str(prompts), "-m", target, *ONE, "--max-tokens", "2", "-q", "--summary", str(fifo)]
    # A reader such as `cat FIFO`: the up-front check must not end it (it reads until the last writer closes).
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    result = specli(*batch, "-o", str(tmp_path / "a.jsonl"), timeout=120)
    reader.join(30)
    assert result.returncode == 0, result.stderr
    assert got and json.loads(got[0])["done"] == 2
    # A reader that leaves before the summary is written: one line saying where the records are.
    def leave() -> None:
        os.close(os.open(fifo, os.O_RDONLY))  # (returns once specli has opened it to check it)

    threading.Thread(target=leave, daemon=True).start()
    result = specli(*batch, "-o", str(tmp_path / "b.jsonl"), timeout=120)
    assert_one_line_error(result, 1, f"cannot write the --summary file {fifo}", f"the records themselves are written in {tmp_path / 'b.jsonl'}")
    assert len(records(tmp_path / "b.jsonl")) == 2
