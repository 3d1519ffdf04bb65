"""`specli chat` through a real subprocess (piped stdin, and a pty for Ctrl-C), plus its pure parts."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from fixtures.cli import popen
from specli.session.chat import MessageTooLong, fit_conversation, read_message, render_plain

GREEDY = ("--temperature", "0")
TURN = re.compile(r"prompt (\d+) tokens \((\d+) new, (\d+) reused\)")


def chat(*args: str, stdin: str = "", timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "specli", "chat", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout,
    )


def turns(stderr: str) -> list[tuple[int, int, int]]:
    """(prompt tokens, evaluated, reused) of each reply, from the per-turn summary lines."""
    return [tuple(map(int, m.groups())) for m in TURN.finditer(stderr)]


def saved(tmp_path, name="chat.json") -> dict:
    return json.loads((tmp_path / name).read_text(encoding="utf-8"))


# --- several turns, one process --------------------------------------------------------------------
def test_turns_reuse_the_cache_and_stdout_is_only_the_replies(pair_perturbed, tmp_path):
    target, draft = map(str, pair_perturbed)
    script = f"Hello there\nHow are you today?\nTell me more.\n/save {tmp_path / 'chat.json'}\n/exit\n"
    result = chat("-m", target, "-d", draft, "--max-tokens", "20", *GREEDY, stdin=script)
    assert result.returncode == 0, result.stderr
    (p1, e1, r1), (p2, e2, r2), (p3, e3, r3) = turns(result.stderr)
    assert r1 == 0 and e1 == p1
    assert r2 >= p1  # turn 1's whole prompt came from the cache
    assert r3 >= p2 and r3 > r2
    assert e2 + r2 == p2 and e2 < p2
    conv = saved(tmp_path)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"] * 3
    replies = [m["content"] for m in conv["messages"] if m["role"] == "assistant"]
    assert all(replies)
    assert result.stdout == "".join(r + "\n" for r in replies)  # no prompts, no notices
    assert "no chat template" in result.stderr  # the fixture has none: plain turns, said once
    assert conv["settings"]["template"] == "plain" and conv["settings"]["draft"] == draft

    # Greedy speculative chat gives the target's own replies.
    plain = chat("-m", target, "--target-only", "--max-tokens", "20", *GREEDY, stdin=script.replace("chat.json", "plain.json"))
    assert plain.returncode == 0, plain.stderr
    assert [m["content"] for m in saved(tmp_path, "plain.json")["messages"]] == [m["content"] for m in conv["messages"]]


def test_commands_reset_n_system_save(pair_perturbed, tmp_path):
    target, draft = map(str, pair_perturbed)
    script = "\n".join([
        "First message", "Second message", "/reset", "Third message",
        "/n 2", "/n 0", "/n lots", "/system Be terse.", "/system", "/bogus", "/help",
        "line one\\", "line two", f"/save {tmp_path / 'chat.json'}", "/stats", "/exit", "never sent",
    ]) + "\n"
    result = chat("-m", target, "-d", draft, "--max-tokens", "8", *GREEDY, "--system", "You are a test.", stdin=script)
    assert result.returncode == 0, result.stderr
    counts = turns(result.stderr)
    assert len(counts) == 4  # /exit ends the session before "never sent"
    assert counts[1][2] >= counts[0][0] and counts[2][2] == 0  # /reset emptied the cache
    err = result.stderr
    assert "draft length: 2 tokens per step" in err
    assert err.count("/n needs 'auto' or a number of draft tokens from 1 to 64") == 2
    assert "unknown command /bogus; /help lists the commands" in err
    assert "A line ending with a backslash continues" in err
    assert "system prompt: 'Be terse.'" in err
    assert "turns: 4" in err and "speedup estimate" in err and "ignores the draft's cost" in err
    conv = saved(tmp_path)
    assert conv["system"] == "Be terse."
    assert [m["content"] for m in conv["messages"] if m["role"] == "user"] == ["Third message", "line one\nline two"]
    assert conv["settings"]["n_draft"] == 2 and conv["settings"]["sampling"]["greedy"] is True


def test_end_of_input_exits_cleanly(pair_perturbed):
    target = str(pair_perturbed[0])
    result = chat("-m", target, "--max-tokens", "5", stdin="hi\n")  # no /exit: EOF ends it
    assert result.returncode == 0, result.stderr
    assert len(turns(result.stderr)) == 1 and result.stdout.endswith("\n")
    empty = chat("-m", target, "--quiet", stdin="")
    assert empty.returncode == 0 and empty.stdout == "" and empty.stderr == ""


def test_unknown_template_is_one_line_usage_error(pair_perturbed):
    result = chat("-m", str(pair_perturbed[0]), "--template", "no-such-template", stdin="hi\n")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specli: error: unknown chat template 'no-such-template'")
    assert "chatml" in lines[0]


def test_builtin_template_by_name(pair_perturbed, tmp_path):
    result = chat("-m", str(pair_perturbed[0]), "--template", "chatml", "--max-tokens", "4",
                  stdin=f"hi\nagain\n/save {tmp_path / 'c.json'}\n")
    assert result.returncode == 0, result.stderr
    assert "no chat template" not in result.stderr
    assert saved(tmp_path, "c.json")["settings"]["template"] == "chatml"
    (p1, _, _), (_, _, r2) = turns(result.stderr)
    assert r2 >= p1


def test_context_overflow_drops_old_turns_and_refuses_huge_messages(pair_perturbed, tmp_path):
    target = str(pair_perturbed[0])
    medium = "the cat sat on the mat " * 4
    huge = "the cat sat on the mat " * 200
    script = "\n".join([medium] * 5 + [huge, "still here?", f"/save {tmp_path / 'c.json'}"]) + "\n"
    result = chat("-m", target, "-c", "256", "--max-tokens", "16", *GREEDY, "--system", "SYS", stdin=script)
    assert result.returncode == 0, result.stderr
    assert "context full: dropped the oldest" in result.stderr
    refused = [line for line in result.stderr.splitlines() if "message refused" in line]
    assert len(refused) == 1 and "raise -c" in refused[0]
    assert len(turns(result.stderr)) == 6  # the huge message got no reply; the next one did
    conv = saved(tmp_path, "c.json")
    assert conv["system"] == "SYS"  # never dropped
    assert conv["messages"][-2]["content"] == "still here?"
    assert huge.strip() not in [m["content"].strip() for m in conv["messages"]]
    assert len(conv["messages"]) >= 4  # refusing the huge message kept the history
    assert all(p + 16 <= 256 for p, _, _ in turns(result.stderr))


def test_memory_stays_flat_over_200_turns(pair_perturbed):
    """200 short turns (with /reset every 20): RSS may grow by less than 10 MB after turn 20
    (measured: about 0.2 MB over 350 turns)."""
    target, draft = map(str, pair_perturbed)
    proc = subprocess.Popen(
        [sys.executable, "-m", "specli", "chat", "-m", target, "-d", draft, "--max-tokens", "4", "-c", "4096", *GREEDY],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines = []
    for turn in range(200):
        if turn and turn % 20 == 0:
            lines.append("/reset")
        lines.append(f"message number {turn}")
    proc.stdin.write("\n".join(lines) + "\n")
    proc.stdin.flush()

    def wait_for_turns(n: int) -> None:
        seen = 0
        while seen < n:
            line = proc.stderr.readline()
            assert line, "chat ended early"
            seen += "stop:" in line

    def rss_kb(field: str) -> int:
        with open(f"/proc/{proc.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

    try:
        wait_for_turns(20)
        after_20 = rss_kb("VmRSS")
        wait_for_turns(180)
        peak, now = rss_kb("VmHWM"), rss_kb("VmRSS")
        proc.stdin.write("/exit\n")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert now - after_20 < 10_000, (after_20, now)
    assert peak - after_20 < 10_000, (after_20, peak)


# --- the real model --------------------------------------------------------------------------------
@pytest.mark.gemma
def test_gemma_chat_with_lookup(gemma_path, tmp_path):
    script = f"Write a Python function that adds two numbers.\nNow make it multiply instead.\n/stats\n/save {tmp_path / 'g.json'}\n"
    result = chat("-m", str(gemma_path), "--lookup", "--max-tokens", "40", *GREEDY, stdin=script)
    assert result.returncode == 0, result.stderr
    (p1, _, _), (_, e2, r2) = turns(result.stderr)
    assert r2 >= p1 and e2 < r2
    conv = saved(tmp_path, "g.json")
    assert conv["settings"]["draft"] == "lookup"
    assert all(m["content"].strip() for m in conv["messages"])
    assert "drafted:" in result.stderr


class Pty:
    """The parent's side of a pty: reads into `buf`; `expect` consumes up to a needle."""

    def __init__(self, fd: int):
        self.fd, self.buf, self.pos = fd, bytearray(), 0

    @classmethod
    def chat(cls, *args: str) -> tuple[subprocess.Popen, "Pty"]:
        """`specli chat ARGS` with a new pseudo-terminal as its stdin, stdout and stderr."""
        import pty

        master, slave = pty.openpty()
        proc = popen(
            [sys.executable, "-m", "specli", "chat", *args],
            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
        )
        os.close(slave)
        return proc, cls(master)

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self, proc: subprocess.Popen) -> None:
        """Kill `proc` if it still runs, and close the terminal."""
        if proc.poll() is None:
            proc.kill()
        os.close(self.fd)

    def expect(self, needle: bytes, timeout: float = 60) -> None:
        """Wait until `needle` appears after the previous match; continue after it."""
        deadline = time.monotonic() + timeout
        while (found := self.buf.find(needle, self.pos)) < 0:
            assert time.monotonic() < deadline, (needle, bytes(self.buf[-400:]))
            ready, _, _ = select.select([self.fd], [], [], 0.5)
            if ready:
                try:
                    self.buf += os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    raise AssertionError((needle, bytes(self.buf[-400:]))) from None
        self.pos = found + len(needle)


@pytest.mark.gemma
def test_ctrl_c_stops_the_reply_not_the_session(gemma_path):
    proc, term = Pty.chat("-m", str(gemma_path), "--target-only", "--max-tokens", "2000", "-c", "256", *GREEDY)
    try:
        term.expect(b">>> ")
        # (a reply that goes on: the plain format's reply ends at the model's next "User:" turn)
        term.send(b"Count with me: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,\n")
        term.expect(b"tok/s")  # the live line: the reply is streaming
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        term.expect(b"stop: interrupted")
        term.expect(b">>> ")
        term.send(b"Say hello.\n")
        term.expect(b"stop: ")  # answered (up to -c: the context is small)
        term.expect(b">>> ")
        term.send(b"/exit\n")
        assert proc.wait(timeout=30) == 0
    finally:
        term.close(proc)
    assert b"Traceback" not in term.buf


# --- pure parts ------------------------------------------------------------------------------------
def test_read_message_joins_backslash_lines():
    lines = iter(["one\\", "two\\", "three", "next"])
    read = lambda prompt: next(lines, None)  # noqa: E731
    assert read_message(read) == "one\ntwo\nthree"
    assert read_message(read) == "next"
    assert read_message(read) is None
    pending = iter(["dangling\\"])
    assert read_message(lambda p: next(pending, None)) == "dangling"


def test_fit_conversation_drops_oldest_pairs_only():
    tokens_of = lambda system, msgs: [0] * (len(system or "") + sum(len(m["content"]) for m in msgs))  # noqa: E731
    history = [{"role": r, "content": c} for r, c in [("user", "a" * 10), ("assistant", "b" * 10), ("user", "c" * 10), ("assistant", "d" * 10)]]
    ids, dropped = fit_conversation("S" * 5, history, {"role": "user", "content": "e" * 10}, tokens_of, n_ctx=50, max_tokens=10)
    assert dropped == 1 and len(ids) == 35 and [m["content"][0] for m in history] == ["c", "d"]
    with pytest.raises(MessageTooLong):
        fit_conversation("S" * 5, history, {"role": "user", "content": "x" * 60}, tokens_of, n_ctx=50, max_tokens=10)
    assert len(history) == 2  # a refused message drops nothing
    ids, dropped = fit_conversation("", history, {"role": "user", "content": "y" * 45}, tokens_of, n_ctx=50, max_tokens=10)
    assert dropped == 1 and history == [] and len(ids) == 45  # no history left: the reply gets what room remains


def test_plain_format_keeps_each_turn_a_prefix_of_the_next():
    first = render_plain([("system", "S"), ("user", "hi")], add_assistant=True)
    second = render_plain([("system", "S"), ("user", "hi"), ("assistant", " hello"), ("user", "more")], add_assistant=True)
    assert second.startswith(first) and first.endswith("Assistant:")


@pytest.mark.parametrize("leave", ["sigint", "ctrl-d"])
def test_leaving_at_the_prompt_of_a_terminal_exits_0(pair_perturbed, leave):
    proc, term = Pty.chat("-m", str(pair_perturbed[0]), "--max-tokens", "4")
    try:
        term.expect(b">>> ")
        term.send(b"hello\n")
        term.expect(b"stop: ")
        term.expect(b">>> ")
        if leave == "sigint":
            # CPython's readline waits in select() without a wake-up fd: a SIGINT that lands
            # after the prompt is drawn but before that wait is only acted on at the next event
            # (a busy machine made it 3 runs in 8). Ctrl-C again, as a user would.
            for _ in range(5):
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=2)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            term.send(b"\x04")
        assert proc.wait(timeout=30) == 0
    finally:
        term.close(proc)
    assert b"Traceback" not in term.buf


# --- a full context: drop half at once, then reuse the cache again -------------------------------
def test_fit_conversation_drops_half_of_the_pairs_at_once():
    tokens_of = lambda system, msgs: [0] * sum(len(m["content"]) for m in msgs)  # noqa: E731
    history = [{"role": r, "content": f"{i}" * 10} for i in range(4) for r in ("user", "assistant")]
    # 80 tokens of history + 10 new: one pair too many for 90 - 10; half of the 4 pairs go.
    ids, dropped = fit_conversation(None, history, {"role": "user", "content": "n" * 10}, tokens_of, n_ctx=90, max_tokens=10)
    assert dropped == 2 and len(ids) == 50 and [m["content"][0] for m in history] == ["2", "2", "3", "3"]
    # Still too long after half: more go, one pair at a time.
    history = [{"role": r, "content": f"{i}" * 10} for i in range(4) for r in ("user", "assistant")]
    ids, dropped = fit_conversation(None, history, {"role": "user", "content": "n" * 10}, tokens_of, n_ctx=40, max_tokens=10)
    assert dropped == 3 and len(ids) == 30


DROP = "context full: dropped the oldest"


@pytest.mark.slow
def test_full_context_drops_half_and_later_turns_reuse_the_cache(pair_perturbed):
    """Once the context is full, a drop is followed by turns that reuse the cache (the old
    one-pair-per-turn drop re-evaluated nearly the whole prompt every turn from then on)."""
    target = str(pair_perturbed[0])
    messages = [f"tell me about the cat number {i} that sat on the mat" for i in range(14)]
    result = chat("-m", target, "-c", "256", "--max-tokens", "12", *GREEDY, "--system", "SYS",
                  stdin="\n".join(messages) + "\n")
    assert result.returncode == 0, result.stderr
    # Per turn: (dropped before it?, prompt, evaluated, reused), in stderr's order.
    rows, pending_drop = [], False
    for line in result.stderr.splitlines():
        if line.startswith(DROP):
            pending_drop = True
        elif (m := TURN.search(line)):
            rows.append((pending_drop, *map(int, m.groups())))
            pending_drop = False
    assert len(rows) == 14
    first = next(i for i, row in enumerate(rows) if row[0])
    after = rows[first + 1 :]
    assert len(after) >= 6, rows
    drops = [i for i, row in enumerate(after) if row[0]]
    # Never two drops in a row: each one frees room for the turns after it.
    assert all(b - a > 1 for a, b in zip(drops, drops[1:])), rows
    assert len(drops) <= len(after) // 2, rows
    for dropped, prompt, evaluated, reused in after:
        if not dropped:  # only what is new since the previous turn is evaluated
            assert evaluated + reused == prompt and evaluated < prompt // 2, rows


# --- /save: atomic ---------------------------------------------------------------------------------
@pytest.fixture
def session(monkeypatch):
    import io

    from specli.session.chat import ChatOptions, ChatSession, Formatter

    s = ChatSession(loaded=None, formatter=Formatter(None, "plain"), options=ChatOptions(), err=io.StringIO())
    s.messages = [{"role": "user", "content": "hi " * 3000}, {"role": "assistant", "content": "hello"}]
    monkeypatch.setattr(s, "to_json", lambda: {"system": s.system, "messages": s.messages})
    return s


def test_save_on_a_full_disk_keeps_the_earlier_save(session, tmp_path, monkeypatch):
    import errno

    import specli.files as files

    path = tmp_path / "chat.json"
    session._save(str(path))
    before = path.read_bytes()
    assert json.loads(before)["messages"][1]["content"] == "hello"

    real_fdopen = os.fdopen

    from fixtures.helpers import FullDisk

    # a file that takes 4096 bytes, then fails as a full disk does
    monkeypatch.setattr(files.os, "fdopen", lambda fd, *a, **k: FullDisk(real_fdopen(fd, *a, **k), room=4096))
    session.messages.append({"role": "user", "content": "more " * 2000})
    session._save(str(path))
    assert "No space left on device" in session.err.getvalue() and "kept as it was" in session.err.getvalue()
    assert path.read_bytes() == before  # the earlier save, whole
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]  # no temporary file left

    # A folder where no temporary file can be made: the same.
    monkeypatch.setattr(files.os, "fdopen", real_fdopen)
    monkeypatch.setattr(files.tempfile, "mkstemp", lambda **k: (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied")))
    session._save(str(path))
    assert "Permission denied" in session.err.getvalue() and path.read_bytes() == before


def test_save_keeps_a_symlink_and_the_mode(session, tmp_path):
    real = tmp_path / "real.json"
    real.write_text("{}")
    os.chmod(real, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    session._save(str(link))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["messages"][1]["content"] == "hello"
    assert os.stat(real).st_mode & 0o777 == 0o640
    fresh = tmp_path / "new.json"
    session._save(str(fresh))
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(fresh).st_mode & 0o777 == 0o666 & ~umask


def test_save_to_a_fifo_with_no_reader_is_a_notice_at_once(session, tmp_path):
    # A plain open for writing waits for a reader for ever (issue 40, item 9): a notice instead,
    # and the session goes on; with a reader there, the save is written through the FIFO.
    import threading

    fifo = tmp_path / "chat.fifo"
    os.mkfifo(fifo)
    done = threading.Event()
    threading.Thread(target=lambda: (session._save(str(fifo)), done.set()), daemon=True).start()
    assert done.wait(10), "/save to a FIFO with no reader blocked"
    notice = session.err.getvalue()
    assert f"/save: cannot write {fifo}: it is a FIFO (named pipe) with no reader" in notice and "kept as it was" not in notice
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        session._save(str(fifo))
        chunks = []
        while chunk := os.read(reader, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(reader)
    assert json.loads(b"".join(chunks))["messages"][1]["content"] == "hello"
