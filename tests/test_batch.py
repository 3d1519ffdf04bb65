"""`specli batch`: input lines to records, order, exactness against `run`, resume after a kill or
Ctrl-C, exit codes; and the lockstep `--parallel` loop token-for-token against sequential runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURE_CTX
from fixtures.cli import GREEDY_ARGS, ONE, PROMPTS, assert_one_line_error, popen, read_records, specli, write_jsonl
from specli.decoding.drafters import make_drafter
from specli.decoding.loop import DecoderPool
from specli.decoding.parallel import ItemDone, ParallelRunner, run_sequential
from specli.decoding.policy.costs import SharedPassCost
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.llama.model import LlamaModel
from specli.session import batch


def run_json(target: str, prompt: str, *args: str) -> dict:
    result = specli("run", prompt, "-m", target, "--json", "--quiet", *ONE, *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# --- good and bad lines, order, content -------------------------------------------------------
def test_good_and_bad_lines_in_order_with_run_equal_content(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    long_prompt = "word " * 300  # more tokens than -c 256 holds
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "first", "prompt": PROMPTS[0], "metadata": {"source": "test"}},
        {"prompt": PROMPTS[1], "max_tokens": 7},
        "this is not JSON",
        {"id": "no-prompt"},
        {"id": "wrong-type", "prompt": ["a list"]},
        "",
        {"id": "first", "prompt": "the same id again"},
        {"id": "typo", "prompt": "x", "temprature": 0.5},
        {"id": "too-long", "prompt": long_prompt},
        {"id": 99, "prompt": PROMPTS[2], "top_k": "many"},
        {"id": "last", "prompt": PROMPTS[3]},
    ])
    out = tmp_path / "out.jsonl"
    # A fixed draft length: with auto the drafting decisions follow timings, so passes could differ.
    result = specli("batch", str(src), "-o", str(out), "-m", target, "--lookup", "--draft-max", "4", "--max-tokens", "24", *GREEDY_ARGS)
    assert result.returncode == 1, result.stderr  # some lines failed
    assert result.stdout == ""
    records = read_records(out)
    assert [r["id"] for r in records] == ["first", 2, 3, "no-prompt", "wrong-type", "first", "typo", "too-long", 99, "last"]
    assert [r["line"] for r in records] == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]
    errors = {r["line"]: r["error"] for r in records if "error" in r}
    assert set(errors) == {3, 4, 5, 7, 8, 9, 10}
    assert "invalid JSON" in errors[3]
    assert "prompt" in errors[4]
    assert "prompt must be a string" in errors[5]
    assert "already used on line 1" in errors[7]
    assert "temprature" in errors[8]
    assert "raise -c" in errors[9] and "context holds 256" in errors[9]
    assert "top_k must be an integer" in errors[10]
    assert "batch: 10 items: 3 done, 7 failed" in result.stderr

    good = {r["id"]: r for r in records if "error" not in r}
    assert good["first"]["metadata"] == {"source": "test"}
    for item_id, prompt, max_tokens in (("first", PROMPTS[0], "24"), (2, PROMPTS[1], "7"), ("last", PROMPTS[3], "24")):
        expected = run_json(target, prompt, "--lookup", "--draft-max", "4", "--max-tokens", max_tokens, *GREEDY_ARGS)
        got = good[item_id]
        for key in ("text", "token_ids", "n_tokens", "stop_reason", "draft", "n_draft", "sampling", "seed"):
            assert got[key] == expected[key], key
        assert got["stats"].keys() == expected["stats"].keys()
        assert got["stats"]["target_passes"] == expected["stats"]["target_passes"]
        assert got["stats"]["drafted"] == expected["stats"]["drafted"]

    # Again on the same output: the good items are skipped, the bad lines fail again, once each.
    again = specli("batch", str(src), "-o", str(out), "-m", target, "--lookup", "--draft-max", "4", "--max-tokens", "24", *GREEDY_ARGS)
    assert again.returncode == 1, again.stderr
    assert "7 error record(s) from the earlier run are retried" in again.stderr
    assert "3 done" not in again.stderr and "0 done, 7 failed, 3 skipped" in again.stderr
    assert read_records(out) == records


def test_text_from_stdin_to_stdout_with_summary_file(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    summary = tmp_path / "summary.json"
    stdin = "".join(p + "\n" for p in PROMPTS[:3])
    result = specli("batch", "-", "-o", "-", "-m", target, "--target-only", "--max-tokens", "12", "--summary", str(summary), *GREEDY_ARGS, stdin=stdin)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]  # stdout: records only
    assert [r["id"] for r in records] == [1, 2, 3]
    for record, prompt in zip(records, PROMPTS):
        assert record["token_ids"] == run_json(target, prompt, "--target-only", "--max-tokens", "12", *GREEDY_ARGS)["token_ids"]
    totals = json.loads(summary.read_text())
    assert totals["items"] == totals["done"] == 3 and totals["failed"] == totals["skipped"] == 0
    assert totals["tokens"] == sum(r["n_tokens"] for r in records)
    assert totals["target_passes"] == sum(r["stats"]["target_passes"] for r in records)
    assert totals["parallel"] == 1 and totals["draft"] is None
    assert "\x1b" not in result.stderr  # not a terminal: no progress bar
    assert result.stderr.strip().splitlines()[-1].startswith("batch: 3 items: 3 done")


def test_item_sampling_fields_override_the_command_line(tmp_path, pair_perturbed):
    target, draft = map(str, pair_perturbed)
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "hot", "prompt": PROMPTS[0], "temperature": 1.3, "seed": 7, "top_k": 0},
        {"id": "cli", "prompt": PROMPTS[0]},
    ])
    # A fixed draft length: with auto a seed replays the distribution, not the text (README).
    result = specli("batch", str(src), "-m", target, "-d", draft, "--draft-max", "4", "--max-tokens", "20", "--temperature", "0.9", "--seed", "3", "-q", *ONE)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    hot, cli = map(json.loads, result.stdout.splitlines())
    expected_hot = run_json(target, PROMPTS[0], "-d", draft, "--draft-max", "4", "--max-tokens", "20", "--temperature", "1.3", "--seed", "7", "--top-k", "0")
    expected_cli = run_json(target, PROMPTS[0], "-d", draft, "--draft-max", "4", "--max-tokens", "20", "--temperature", "0.9", "--seed", "3")
    assert hot["token_ids"] == expected_hot["token_ids"] and hot["sampling"] == expected_hot["sampling"] and hot["seed"] == 7
    assert cli["token_ids"] == expected_cli["token_ids"] and cli["seed"] == 3


def test_parallel_with_a_draft_model_through_the_command(tmp_path, pair_perturbed):
    target, draft = map(str, pair_perturbed)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    result = specli("batch", str(src), "-m", target, "-d", draft, "--parallel", "2", "--max-tokens", "12", "--temperature", "0", "-q", *ONE)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["id"] for r in records] == list(range(len(PROMPTS)))
    assert all(r["n_tokens"] == 12 or r["stop_reason"] == "eos" for r in records)
    assert sum(r["stats"]["drafted"] for r in records) > 0 and records[0]["draft"] == draft


# --- usage errors: one line, exit 2, nothing generated ----------------------------------------
def test_usage_errors(tmp_path, pair_perturbed):
    target, draft = map(str, pair_perturbed)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    assert_one_line_error(specli("batch", str(tmp_path / "none.jsonl"), "-m", target), 2, "input file not found")
    assert_one_line_error(specli("batch", str(src), "-m", target, "--resume"), 2, "--resume needs an output file")
    assert_one_line_error(specli("batch", str(src), "-o", str(tmp_path / "o.jsonl"), "--resume", "--overwrite", "-m", target), 2, "pick one")
    assert_one_line_error(specli("batch", str(src), "-m", target, "--parallel", "0"), 2, "--parallel")
    assert_one_line_error(specli("batch", str(src), "-o", str(src), "-m", target), 2, "the output file is the input file")
    notes = tmp_path / "notes.txt"
    notes.write_text("my precious notes\nsecond line\n")
    assert_one_line_error(specli("batch", str(src), "-o", str(notes), "-m", target), 2, "not a specli batch record", "--overwrite")
    assert notes.read_text() == "my precious notes\nsecond line\n"  # never rewritten


# --- nothing lost: resume after a kill or Ctrl-C -----------------------------------------------
def many_items(tmp_path: Path, n: int) -> Path:
    return write_jsonl(tmp_path / "many.jsonl", [{"id": f"item-{i}", "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}"} for i in range(n)])


def start_batch(src: Path, out: Path, target: str, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "specli", "batch", str(src), "-o", str(out), "-m", target, "--lookup", "--max-tokens", "48", *GREEDY_ARGS, *extra]
    return popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lines(out: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.002)
    pytest.fail(f"the batch ended (rc {proc.returncode}) or stalled before writing {n} lines")


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, pair_perturbed):
    """The reference: the many-items batch run once, uninterrupted."""
    tmp = tmp_path_factory.mktemp("clean")
    src, out = many_items(tmp, 80), tmp / "clean.jsonl"
    proc = start_batch(src, out, str(pair_perturbed[0]))
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    return {r["id"]: r["token_ids"] for r in read_records(out)}


@pytest.mark.parametrize("parallel", ["1", "3"])
def test_resume_after_kill_does_every_id_exactly_once(tmp_path, pair_perturbed, clean_run, parallel):
    target = str(pair_perturbed[0])
    src, out = many_items(tmp_path, 80), tmp_path / "out.jsonl"
    proc = start_batch(src, out, target, "--parallel", parallel)
    wait_for_lines(out, proc, 3)
    proc.kill()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    first = out.read_bytes().count(b"\n")
    assert 3 <= first < 80  # killed mid-batch

    again = start_batch(src, out, target, "--parallel", parallel)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert "resuming" in stderr and "already done" in stderr
    records = read_records(out)
    ids = [r["id"] for r in records]
    assert ids == [f"item-{i}" for i in range(80)]  # each id once, in input order
    if parallel == "1":  # P > 1 on llama.cpp's default F16 cache: see the engine-level tests
        assert {r["id"]: r["token_ids"] for r in records} == clean_run
    summary_line = stderr.strip().splitlines()[-1]
    assert "skipped (already done)" in summary_line and " 0 failed" in summary_line


def test_ctrl_c_flushes_exits_130_and_a_rerun_completes(tmp_path, pair_perturbed, clean_run):
    target = str(pair_perturbed[0])
    src, out = many_items(tmp_path, 80), tmp_path / "out.jsonl"
    proc = start_batch(src, out, target)
    wait_for_lines(out, proc, 3)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted: run again to finish" in stderr and "Traceback" not in stderr
    records = read_records(out)  # every line complete JSON
    assert 3 <= len(records) < 80
    assert [r["id"] for r in records] == [f"item-{i}" for i in range(len(records))]

    again = specli("batch", str(src), "-o", str(out), "-m", target, "--lookup", "--max-tokens", "48", *GREEDY_ARGS)
    assert again.returncode == 0, again.stderr
    assert {r["id"]: r["token_ids"] for r in read_records(out)} == clean_run


def test_error_records_are_retried_on_resume_and_overwrite_starts_over(tmp_path, pair_perturbed):
    target = str(pair_perturbed[0])
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 300}, {"id": "end", "prompt": "bye"}])
    out = tmp_path / "out.jsonl"
    common = ["-m", target, "--target-only", "--max-tokens", "5", "--temperature", "0", *ONE]
    first = specli("batch", str(src), "-o", str(out), "-c", "256", *common)
    assert first.returncode == 1
    assert ["error" in r for r in read_records(out)] == [False, True, False]
    done_before = read_records(out)[0]

    second = specli("batch", str(src), "-o", str(out), "-c", "512", *common)
    assert second.returncode == 0, second.stderr
    assert "1 error record(s) from the earlier run are retried" in second.stderr
    records = read_records(out)
    assert [r["id"] for r in records] == ["short", "long", "end"] and not any("error" in r for r in records)
    assert records[0] == done_before  # skipped, not generated again

    third = specli("batch", str(src), "-o", str(out), "--overwrite", "-c", "256", *common)
    assert third.returncode == 1 and "resuming" not in third.stderr
    assert ["error" in r for r in read_records(out)] == [False, True, False]


# --- pure parts ---------------------------------------------------------------------------------
def test_format_detection_and_ids():
    assert batch.detect_format("x.txt", [b'{"prompt": 1}'], "auto") == "text"
    assert batch.detect_format("x.jsonl", [b"not json"], "auto") == "jsonl"
    assert batch.detect_format("-", [b"", b' {"prompt": "a"}'], "auto") == "jsonl"
    assert batch.detect_format("-", [b"plain prompt"], "auto") == "text"
    entries = batch.parse_lines([b'{"id": 1, "prompt": "a"}', b'{"prompt": "b"}', b'{"id": "1", "prompt": "c"}'], "jsonl", GREEDY, 8)
    # The second line's id is its line number, 2; "1" (a string) differs from 1.
    assert [(type(e).__name__, e.id) for e in entries] == [("Item", 1), ("Item", 2), ("Item", "1")]
    clash = batch.parse_lines([b'{"id": 2, "prompt": "a"}', b'{"prompt": "b"}'], "jsonl", GREEDY, 8)
    assert isinstance(clash[1], batch.LineError) and "already used on line 1" in clash[1].error
    bad_utf8 = batch.parse_lines([b"caf\xe9"], "text", GREEDY, 8)
    assert isinstance(bad_utf8[0], batch.LineError) and "not UTF-8" in bad_utf8[0].error


def test_writer_in_order_holds_back_until_earlier_records_are_out(tmp_path):
    import io

    entries = batch.parse_lines([b"a", b"b", b"c"], "text", GREEDY, 8)
    stream = io.StringIO()
    writer = batch.RecordWriter(stream, entries, in_order=True, skip=set())
    writer.write({"id": 2, "line": 2})
    assert stream.getvalue() == ""
    writer.write({"id": 1, "line": 1})
    assert [json.loads(x)["id"] for x in stream.getvalue().splitlines()] == [1, 2]
    writer.write({"id": 3, "line": 3})
    assert [json.loads(x)["id"] for x in stream.getvalue().splitlines()] == [1, 2, 3]


# --- --parallel: lockstep sequences, token-for-token equal to one at a time -------------------------
def load(path, n_ctx: int = FIXTURE_CTX) -> LlamaModel:
    """conftest's numerics (F32 cache, flash attention off) on one thread (see ONE)."""
    return LlamaModel(path, n_ctx=n_ctx, n_threads=1, kv_type="f32", flash_attn="off")


def engine_items(prompts, sampling=GREEDY, max_tokens=(40, 9, 57, 23, 31, 48)):
    return [batch.Item(i + 1, f"p{i}", p, max_tokens[i % len(max_tokens)], sampling) for i, p in enumerate(prompts)]


def generate(events) -> dict:
    out = {}
    for event in events:
        if isinstance(event, ItemDone):
            assert event.item.id not in out
            out[event.item.id] = (event.generation.token_ids, event.generation.stop_reason, event.generation.stats.n_tokens) if event.error is None else event.error
    return out


@pytest.mark.parametrize("drafting", ["lookup", "target-only"])
@pytest.mark.parametrize("sampling, n_draft", [
    (GREEDY, 5), (GREEDY, "auto"),
    # Sampled runs with a fixed N only: with auto the draft lengths follow timings, and the
    # random draws follow the draft lengths (README).
    (SamplingParams(temperature=0.9, seed=11), 5),
], ids=["greedy", "greedy-auto", "sampled"])
def test_parallel_equals_sequential_token_for_token(pair_perturbed, drafting, sampling, n_draft):
    """F32 weights, F32 cache, flash attention off: the numerics under which a multi-sequence
    pass gives the logits of a single-sequence one (~1e-5), so every item must match exactly."""
    model = load(pair_perturbed[0], n_ctx=256)
    try:
        prompts = [*PROMPTS, "word " * 300, *PROMPTS[::-1]]  # one prompt too long for n_ctx 256
        items = engine_items(prompts, sampling)
        reference = generate(run_sequential(DecoderPool(model, make_drafter(drafting), n_draft), items))
        assert "raise n_ctx" in reference["p6"]  # (the core names its field; the CLI says -c)
        for n_seq in (2, 3):
            runner = ParallelRunner(model, drafting, n_draft, n_seq, n_threads=1, kv_type="f32", flash_attn="off")
            try:
                assert generate(runner.run(items)) == reference, n_seq
            finally:
                runner.close()
    finally:
        model.close()


@pytest.mark.parametrize("n_draft", [4, "auto"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["draft-model", "hybrid"])
def test_parallel_with_a_draft_model_equals_sequential(pair_perturbed, n_draft, hybrid):
    """One draft cache per sequence (a second multi-sequence context on the draft's weights).
    The models' own contexts are freed first, as the commands do: nothing needs them."""
    model, model_dft = load(pair_perturbed[0], n_ctx=256), load(pair_perturbed[1], n_ctx=256)
    try:
        items = engine_items(PROMPTS)
        mode = "hybrid" if hybrid else "draft-model"
        reference = generate(run_sequential(DecoderPool(model, make_drafter(mode, model_dft), n_draft), items))
        runner = ParallelRunner(model, mode, n_draft, 2, n_threads=1, kv_type="f32", flash_attn="off", model_dft=model_dft,
                                release_models=True)
        assert model._ctx is None and model_dft._ctx is None
        drafted = 0
        try:
            events = list(runner.run(items))
        finally:
            runner.close()
        drafted = sum(e.generation.stats.drafted for e in events if isinstance(e, ItemDone) and e.error is None)
        assert generate(events) == reference
        assert drafted > 0
    finally:
        model_dft.close()
        model.close()


def test_a_shared_pass_charges_each_sequence_a_plain_part_and_its_drafts_at_the_margin():
    costs = SharedPassCost()
    assert costs.shares({0: 1, 1: 3}) == {0: 0.25, 1: 0.75}  # nothing seen yet: by tokens
    a, b = 0.008, 0.001
    for n in [4, 24, 9, 14, 4, 19] * 3:  # passes of a + b*T seconds
        costs.add(n, a + b * n)
    assert costs.fit() == pytest.approx((a, b))
    tokens = {0: 1, 1: 6, 2: 6, 3: 1}  # two plain sequences, two drafting 5 tokens each
    shares = costs.shares(tokens)
    pass_s = a + b * sum(tokens.values())
    assert sum(shares.values()) == pytest.approx(1.0)
    charged = {s: share * pass_s for s, share in shares.items()}
    # a plain sequence pays what it would if all were plain, a/N + b; drafts b a token more
    assert charged[0] == pytest.approx(a / 4 + b) and charged[1] == pytest.approx(a / 4 + b + 5 * b)
    steady = SharedPassCost()  # one odd pass among many of one size must not set the slope
    for _ in range(200):
        steady.add(8, 0.02)
    steady.add(9, 0.05)
    assert steady.fit() is None
    flat = SharedPassCost()  # a pass that costs the same whatever its size: drafts are free
    for n in [4, 24, 9, 14]:
        flat.add(n, 0.01)
    assert flat.shares(tokens) == pytest.approx({0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25})


def test_parallel_runs_several_sequences_per_pass_and_fills_free_slots(pair_perturbed):
    model = load(pair_perturbed[0])
    runner = ParallelRunner(model, "lookup", 4, 3, n_threads=1, kv_type="f32", flash_attn="off")
    try:
        order, width = [], []
        original_eval = runner.loop.passes.eval

        def spy(requests, **kwargs):
            width.append(len(requests))
            return original_eval(requests, **kwargs)

        runner.loop.passes.eval = spy
        for event in runner.run(engine_items(PROMPTS, max_tokens=(30, 5, 12))):
            if isinstance(event, ItemDone):
                order.append(event.item.id)
        assert sorted(order) == [f"p{i}" for i in range(len(PROMPTS))]
        assert max(width) == 3  # three sequences verified in one pass
        assert order.index("p1") < order.index("p0")  # short items finish first; their slots are refilled
    finally:
        runner.close()
        model.close()


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_both_loops_tell_the_policy_the_same_facts(pair_perturbed, monkeypatch, parallel):
    """Both loops take step.py's one step per sequence: with -n auto the policy hears of
    every step with the CPU time of its pass and, from a generation's third step on, the gap
    since the previous one (the lockstep loop once left both out)."""
    from specli.decoding import step

    calls = []
    observe = step.AdaptivePolicy.observe

    def spy(self, step):
        calls.append(step)
        return observe(self, step)

    monkeypatch.setattr(step.AdaptivePolicy, "observe", spy)
    model = load(pair_perturbed[0])
    items = engine_items(PROMPTS[:3], max_tokens=(12,))
    try:
        if parallel:
            runner = ParallelRunner(model, "lookup", "auto", 2, n_threads=1, kv_type="f32", flash_attn="off")
            try:
                done = generate(runner.run(items))
            finally:
                runner.close()
        else:
            done = generate(run_sequential(DecoderPool(model, make_drafter("lookup"), "auto"), items))
    finally:
        model.close()
    assert len(done) == len(items) and all(isinstance(result, tuple) for result in done.values())
    assert calls and all(call.cpu_s is not None for call in calls)
    assert any(call.gap_s is not None for call in calls)
    assert sum(call.gap_s is None for call in calls) <= 2 * len(items)  # each item's first two steps


def test_items_with_their_own_seeds_share_one_decoder_and_keep_their_seeds(pair_perturbed):
    """DecoderPool keys decoders by sampling setting without the seed (a batch of per-item
    seeds used to make a decoder, and an -n auto policy, per item), bounded by LIMIT."""
    model = load(pair_perturbed[0])
    try:
        sampling = [SamplingParams(temperature=0.9, seed=s) for s in (1, 2, 1)]
        items = [batch.Item(i + 1, f"s{i}", PROMPTS[0], 12, sp) for i, sp in enumerate(sampling)]
        pool = DecoderPool(model, make_drafter("lookup"), 3)
        seeds = [e.generation.seed for e in run_sequential(pool, items) if isinstance(e, ItemDone)]
        texts = [e.generation.text for e in run_sequential(pool, items) if isinstance(e, ItemDone)]
        assert seeds == [1, 2, 1] and len(pool._decoders) == 1
        assert texts[0] == texts[2]  # the same seed (and a fixed N) replays
        for t in range(DecoderPool.LIMIT + 3):
            pool.get(SamplingParams(temperature=0.5 + t / 100))
        assert len(pool._decoders) == DecoderPool.LIMIT
    finally:
        model.close()
