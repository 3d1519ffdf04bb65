#!/usr/bin/env python3
"""Speculative *sampling* at temperature 0.8: specli's rejection sampling vs native llama.cpp.

Same machine, same pair (Gemma 3 270M F16 as the target, its Q4_K_M as the draft), same
prompts, draft length, temperature and top-k/top-p/min-p (llama.cpp's defaults), in one run.
native = `llama-speculative-simple --spec-type draft-simple`, whose verification samples the
target at each position and keeps a draft token only if the sample equals it (exact match),
which accepts less than rejection sampling's min(1, p/q). Each side's speedup is over its own
plain sampling (specli --target-only; native with an ngram key that never matches).

Needs the native build of benchmarks/build_native.sh.
Usage: python benchmarks/bench_sampling_native.py [--n 4] [--max-tokens 128] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench_lookup import (
    DEFAULT_NATIVE_DIR, NO_DRAFT_KEY, PROMPTS, BenchError, default_model, find_specli, native_bins,
    run_process, run_spec_simple, write_prompt_files,
)  # fmt: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures package
from fixtures.helpers import convert  # noqa: E402


def specli_run(args, target: Path, draft: Path | None, prompt: str, seed: int) -> dict:
    mode = ["--target-only"] if draft is None else ["-d", str(draft), "--draft-max", str(args.n)]
    cmd = [
        *find_specli(), "run", "-m", str(target), *mode, "--temperature", str(args.temperature),
        "--seed", str(seed), "--json", "--quiet", "--max-tokens", str(args.max_tokens),
        "--threads", str(args.threads), "-c", "4096", prompt,
    ]  # fmt: skip
    out = json.loads(run_process(cmd).stdout)
    stats = out["stats"]
    return {"tps": stats["tokens_per_s"], "drafted": stats["drafted"], "accepted": stats["accepted"]}


def native_run(args, bins, target: Path, draft: Path | None, prompt_name, prompt_file, seed: int) -> dict:
    spec = (
        ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_DRAFT_KEY)]
        if draft is None
        else ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.n)]
    )
    cmd = [
        str(bins["llama-speculative-simple"]), "-m", str(target), *spec, "-f", str(prompt_file),
        "-n", str(args.max_tokens + 1), "--temp", str(args.temperature), "-s", str(seed),
        "-t", str(args.threads), "-c", "4096", "-lv", "5",
    ]  # fmt: skip
    run = run_spec_simple("native", prompt_name, 0, cmd, PROMPTS[prompt_name], args.max_tokens)
    return {"tps": run.tokens_per_s, "drafted": run.drafted or 0, "accepted": run.accepted or 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4, help="draft tokens per step (both sides)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2, help="seeds per configuration, interleaved")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--native-dir", type=Path, default=DEFAULT_NATIVE_DIR)
    args = parser.parse_args()
    bins = native_bins(args.native_dir)
    draft = default_model().resolve()
    prompt_files = write_prompt_files(args.native_dir / "prompts", list(PROMPTS))

    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target = convert(draft, Path(tmp) / "gemma-3-270m-f16.gguf", "f16")
        for seed in range(args.repeat):
            for name in PROMPTS:
                for label, fn in (
                    ("specli plain", lambda: specli_run(args, target, None, PROMPTS[name], seed)),
                    ("specli spec", lambda: specli_run(args, target, draft, PROMPTS[name], seed)),
                    ("native plain", lambda: native_run(args, bins, target, None, name, prompt_files[name], seed)),
                    ("native spec", lambda: native_run(args, bins, target, draft, name, prompt_files[name], seed)),
                ):
                    try:
                        results.setdefault((name, label), []).append(fn())
                    except (BenchError, json.JSONDecodeError) as err:
                        print(f"{name} {label} seed {seed} failed: {err}", file=sys.stderr)
                    print(f"seed {seed} {name:8} {label:13} {results.get((name, label), [{}])[-1].get('tps')}", file=sys.stderr)

    def med(name, label):
        runs = results.get((name, label), [])
        tps = statistics.median(r["tps"] for r in runs) if runs else float("nan")
        drafted = sum(r["drafted"] for r in runs)
        return tps, (sum(r["accepted"] for r in runs) / drafted if drafted else float("nan"))

    print(f"Gemma 3 270M F16 target + Q4_K_M draft, N={args.n}, temperature {args.temperature}, "
          f"top-k 40, top-p 0.95, min-p 0.05, {args.max_tokens} tokens, median of {args.repeat} seeds, tok/s\n")
    print("| prompt | specli plain | specli speculative | speedup | acceptance | native plain | native speculative | speedup | acceptance |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in PROMPTS:
        (sp, _), (ss, sa) = med(name, "specli plain"), med(name, "specli spec")
        (np_, _), (ns, na) = med(name, "native plain"), med(name, "native spec")
        print(f"| {name} | {sp:.1f} | {ss:.1f} | {ss / sp:.2f}x | {sa:.0%} | {np_:.1f} | {ns:.1f} | {ns / np_:.2f}x | {na:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
