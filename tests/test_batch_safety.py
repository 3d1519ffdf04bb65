"""`specli batch -o FILE` never rewrites what is not its own output, and one output has one
writer: files that are not batch outputs (and non-regular paths) are refused untouched, a valid
output still resumes, and a lock keeps a second run off an output in use (and does not outlive
a killed one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.cli import GREEDY_ARGS, PROMPTS, assert_one_line_error, popen, read_records, specli, write_jsonl
from specli.decoding.sampling import GREEDY
from specli.session import batch

COMMON = ["--target-only", "--max-tokens", "6", *GREEDY_ARGS]
RECORD = {"id": 1, "line": 1, "text": "a", "token_ids": [5], "n_tokens": 1, "stop_reason": "length", "stats": {}}


def lock_file(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def snapshot(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


# --- refused: files that are not batch outputs, untouched -------------------------------------
NOT_OUTPUTS = {
    "text-lines": b"my precious notes\nsecond line\n",
    "one-text-line": b"a single line of notes",
    "one-text-line-newline": b"a single line of notes\n",
    "one-json-line": b'{"name": "settings", "value": 3}',
    "one-json-line-newline": b'{"name": "settings", "value": 3}\n',
    "jsonl-rows-with-id": b'{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"}\n',
    "id-and-line-only": b'{"id": 1, "line": 1, "text": "only some result fields"}\n',
    "start-of-a-record-alone": b'{"id": 1, "line": 1, "te',
    "record-then-a-note": (json.dumps(RECORD) + "\nmy note\n" + json.dumps({**RECORD, "id": 2, "line": 2}) + "\n").encode(),
    "record-then-json-without-newline": (json.dumps(RECORD) + '\n{"note": 1}').encode(),
    "not-utf8": b"\xff\xfe binary \x00 data\n",
}


@pytest.mark.parametrize("content", NOT_OUTPUTS.values(), ids=NOT_OUTPUTS.keys())
def test_a_file_that_is_not_a_batch_output_is_refused_untouched(tmp_path, pair_perturbed, content):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    out = tmp_path / "notes.jsonl"
    out.write_bytes(content)
    os.utime(out, ns=(1_000_000_000, 1_000_000_000))  # a past mtime: any write would move it
    before = snapshot(out)
    result = specli("batch", str(src), "-o", str(out), "-m", str(pair_perturbed[0]), *COMMON)
    assert_one_line_error(result, 2, str(out), "not a specli batch record", "--overwrite")
    assert snapshot(out) == before
    assert not lock_file(out).exists()


def test_non_regular_outputs_are_refused(tmp_path, pair_perturbed):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    target = str(pair_perturbed[0])
    folder = tmp_path / "folder"
    folder.mkdir()
    assert_one_line_error(specli("batch", str(src), "-o", str(folder), "-m", target, *COMMON), 2, "is a directory")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it to read would block: it must not be opened at all
    assert_one_line_error(specli("batch", str(src), "-o", str(fifo), "-m", target, *COMMON), 2, "not a regular file", "'-' for stdout")
    assert_one_line_error(specli("batch", str(src), "-o", os.devnull, "-m", target, *COMMON), 2, "not a regular file")
    assert_one_line_error(specli("batch", str(src), "-o", str(fifo), "--overwrite", "-m", target, *COMMON), 2, "not a regular file")
    assert not lock_file(fifo).exists()


def test_an_output_over_the_read_cap_is_refused_unread(tmp_path, pair_perturbed):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    out = tmp_path / "huge.jsonl"
    with out.open("wb") as handle:
        handle.truncate(batch.MAX_RESUME_BYTES + 1)  # sparse: costs no disk
    before = out.stat()
    result = specli("batch", str(src), "-o", str(out), "-m", str(pair_perturbed[0]), *COMMON)
    assert_one_line_error(result, 2, str(out), "1 GiB", "--overwrite")
    after = out.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


# --- accepted: a valid earlier output resumes ---------------------------------------------------
@pytest.fixture
def finished(tmp_path, pair_perturbed):
    """A three-item batch run to the end: (input, output, its bytes)."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS[:3])])
    out = tmp_path / "out.jsonl"
    result = specli("batch", str(src), "-o", str(out), "-m", str(pair_perturbed[0]), *COMMON)
    assert result.returncode == 0, result.stderr
    assert not lock_file(out).exists()
    return src, out, out.read_bytes()


def test_a_valid_output_resumes_and_an_empty_file_is_used(tmp_path, pair_perturbed, finished):
    src, out, complete = finished
    target = str(pair_perturbed[0])
    again = specli("batch", str(src), "-o", str(out), "-m", target, *COMMON)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr and "3 of 3 items already done" in again.stderr
    assert out.read_bytes() == complete

    # The last record without its newline (a kill between the two): kept, and the file is whole.
    out.write_bytes(complete.rstrip(b"\n"))
    again = specli("batch", str(src), "-o", str(out), "-m", target, *COMMON)
    assert again.returncode == 0, again.stderr
    assert "3 of 3 items already done" in again.stderr
    assert out.read_bytes() == complete

    empty = tmp_path / "empty.jsonl"
    empty.touch()
    fresh = specli("batch", str(src), "-o", str(empty), "-m", target, *COMMON)
    assert fresh.returncode == 0, fresh.stderr
    assert tokens(empty) == tokens(out)


def test_a_cut_short_last_line_is_dropped_and_its_item_runs_again(pair_perturbed, finished):
    src, out, complete = finished
    lines = complete.splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # killed mid-write
    again = specli("batch", str(src), "-o", str(out), "-m", str(pair_perturbed[0]), *COMMON)
    assert again.returncode == 0, again.stderr
    assert "2 of 3 items already done" in again.stderr and "an incomplete last line was dropped" in again.stderr
    assert out.read_bytes().startswith(b"".join(lines[:2]))  # kept as they were
    assert tokens(out) == [(json.loads(line)["id"], json.loads(line)["token_ids"]) for line in lines]


def tokens(path: Path) -> list:
    return [(r["id"], r["token_ids"]) for r in read_records(path)]


# --- one writer per output ----------------------------------------------------------------------
def start_on_stdin(out: Path, target: str) -> subprocess.Popen:
    """A batch reading its input from stdin: it takes the lock, then waits for the input."""
    args = [sys.executable, "-m", "specli", "batch", "-", "-o", str(out), "-m", target, *COMMON]
    return popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lock(out: Path, proc: subprocess.Popen) -> None:
    """Until `proc` holds the lock on `out` (it writes its PID into the lock file)."""
    deadline = time.monotonic() + 120  # a guard against a hang, not a timing check
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if lock_file(out).read_text().strip() == str(proc.pid):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    pytest.fail(f"the batch ended (rc {proc.returncode}) or never took the lock")


def test_a_second_run_on_an_output_in_use_is_refused_and_the_first_completes(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    out = tmp_path / "out.jsonl"
    first = start_on_stdin(out, target)
    try:
        wait_for_lock(out, first)  # it holds the lock, and waits for its input
        src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
        second = specli("batch", str(src), "-o", str(out), "-m", target, *COMMON)
        assert_one_line_error(second, 2, "another specli batch", f"PID {first.pid}", str(out), str(lock_file(out)))
        also = specli("batch", str(src), "-o", str(out), "--overwrite", "-m", target, *COMMON)
        assert_one_line_error(also, 2, "another specli batch")

        _, stderr = first.communicate("".join(p + "\n" for p in PROMPTS), timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr
    records = read_records(out)
    assert [r["id"] for r in records] == list(range(1, len(PROMPTS) + 1))
    assert all(batch.record_kind(r) == "result" for r in records)
    assert not lock_file(out).exists()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "ctrl-c"])
def test_a_killed_or_interrupted_run_does_not_block_the_next(tmp_path, pair_perturbed, sig):
    target = str(pair_perturbed[0])
    out = tmp_path / "out.jsonl"
    proc = start_on_stdin(out, target)
    try:
        wait_for_lock(out, proc)
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        assert lock_file(out).exists()  # left behind, but the OS dropped the lock with the process
    else:
        assert proc.returncode == 130
        assert not lock_file(out).exists()

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": PROMPTS[0]}])
    again = specli("batch", str(src), "-o", str(out), "-m", target, *COMMON)
    assert again.returncode == 0, again.stderr
    assert [r["id"] for r in read_records(out)] == [1]
    assert not lock_file(out).exists()


# --- the rule, without a model ------------------------------------------------------------------
def test_record_rule_and_cut_short_lines(tmp_path):
    assert batch.record_kind(RECORD) == "result"
    assert batch.record_kind({"id": "a", "line": 3, "error": "bad"}) == "error"
    assert batch.record_kind({**RECORD, "id": True}) is None
    assert batch.record_kind({**RECORD, "line": "1"}) is None
    assert batch.record_kind({k: v for k, v in RECORD.items() if k != "stats"}) is None
    assert batch.record_kind({"id": 1, "line": 1, "error": None}) is None

    good = json.dumps(RECORD, ensure_ascii=False)
    path = tmp_path / "out.jsonl"
    for tail in (good[:1], good[:4], good[:40]):  # cut anywhere: dropped
        path.write_text(good + "\n" + tail)
        prev = batch.read_previous(path)
        assert (prev.done, prev.n_partial, prev.needs_rewrite) == ({"1"}, 1, True)
    for tail in ("[1, 2", "note", '{"id" 1'):  # not the start of a record: refused
        path.write_text(good + "\n" + tail)
        with pytest.raises(batch.NotAnOutput):
            batch.read_previous(path)
    # Text with U+2028 (a line end to str.splitlines) stays one record through the final sort.
    odd = {**RECORD, "text": "a\u2028b\x85c"}
    path.write_text(json.dumps({**odd, "id": 2, "line": 2}, ensure_ascii=False) + "\n" + good + "\n", encoding="utf-8")
    entries = batch.parse_lines([b"x", b"y"], "text", GREEDY, 8)
    batch.sort_output(path, entries)
    assert read_records_bytes(path) == [RECORD, {**odd, "id": 2, "line": 2}]


def read_records_bytes(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().decode("utf-8").split("\n") if line]


def test_a_rewritten_output_stays_a_link_and_keeps_its_mode(tmp_path):
    # The in-order rewrite at the end of a run goes through write_atomically.
    from specli.files import write_atomically

    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    real.chmod(0o644)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    write_atomically(link, ["new"])
    assert link.is_symlink() and real.read_text() == "new\n"
    assert real.stat().st_mode & 0o777 == 0o644


def test_an_atomic_write_to_a_fifo_or_device_writes_through_it(tmp_path):
    # A temporary file renamed over the path would replace the FIFO (or a device node) with a
    # regular file, and the reader would get nothing. A FIFO of our own: this fails for any user.
    import os
    import stat
    import threading

    from specli.files import write_atomically

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    # The reader is open before the write: a FIFO with no reader is refused at once (below),
    # and a reader thread might not have reached its open() yet.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_atomically(fifo, ["first", "second"])
        while chunk := os.read(reader, 1 << 16):
            got.append(chunk)
    finally:
        os.close(reader)
    assert got == [b"first\nsecond\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    # No reader: ENXIO at once, naming it (a plain open would wait for a reader for ever).
    done: list[BaseException] = []

    def write() -> None:
        try:
            write_atomically(fifo, ["third"])
        except OSError as err:
            done.append(err)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(10)
    assert done and "FIFO (named pipe) with no reader" in str(done[0]), "a write to a FIFO with no reader blocked"
