#!/usr/bin/env python3
"""Every yardstick against native llama.cpp, side by side, in one run (BENCHMARKS.md).

Same machine, models, prompts, token budget, thread count and greedy decoding on both sides;
every configuration runs `--repeat` times, interleaved (the order rotates per round) and the
best round counts (interference only slows runs down). Each side's speedup is over its own
plain decoding; the ratio of the two speedups is the figure that travels across machines.

1. Plain decoding: specli --target-only vs `llama-bench` tg at the same context depth (the
   prompt's token count, `-d`: attention over a longer context costs more) (goal: ratio >=
   0.97), and vs
   native plain decoding of the same prompt (llama-speculative-simple with a lookup key that
   never matches: the same loop and clock as the native speculative runs).
2. Prompt lookup on Gemma 3 270M Q4_K_M: specli --lookup, -n 16 and -n auto, vs
   llama-speculative-simple --spec-type ngram-simple (defaults: key 12, draft 48).
3. Draft models: specli -d (-n N and -n auto) vs llama-speculative-simple --spec-type
   draft-simple (--spec-draft-n-max N, and with --spec-draft-p-min 0.75 gating, n-max 16),
   on the three synthetic cost pairs of make_cost_pairs.py (greedy agreement 0.54/0.71/0.96;
   target ~8-10x the draft's cost: loop mechanics and cost, not language quality) and on Gemma
   3 270M F16 with its Q4_K_M as the draft (a draft as costly as the target on a CPU: the 262k-token output head, shared, dominates).
   Acceptance is shown for both sides: identical outputs are not guaranteed (batch numerics).

Needs: the native build (benchmarks/build_native.sh) and the cost pairs
(python benchmarks/make_cost_pairs.py, default /tmp/specli-cost-pairs).
Usage: python benchmarks/yardstick.py [--repeat 2] [--max-tokens 128] [--json FILE] [--only lookup,draft,plain]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench_lookup import (
    DEFAULT_NATIVE_DIR, NO_DRAFT_KEY, PROMPTS, BenchError, Job, Run, best, default_model, find_specli,
    llama_bench_cmd, native_bins, run_all, run_llama_bench, run_spec_simple, run_specli, write_prompt_files,
)  # fmt: skip

DEFAULT_PAIRS = Path("/tmp/specli-cost-pairs")
SYNTHETIC = ("a50", "a70", "a90")
P_MIN = 0.75  # llama.cpp's greedy-probability gate for draft-simple (default 0 = off)


def specli_cmd(args, target: Path, prompt: str, mode: list[str]) -> list[str]:
    return [
        *args.specli, "run", "-m", str(target), *mode, "--temperature", "0", "--json", "--quiet",
        "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "-c", str(args.ctx), prompt,
    ]  # fmt: skip


def native_cmd(args, target: Path, prompt_file: Path, spec: list[str]) -> list[str]:
    """llama-speculative-simple, greedy, debug log on (bench_lookup.cut_at_max_tokens reads it)."""
    return [
        str(args.bins["llama-speculative-simple"]), "-m", str(target), *spec, "-f", str(prompt_file),
        "-n", str(args.max_tokens + 1), "--temp", "0", "-t", str(args.threads), "-c", str(args.ctx), "-lv", "5",
    ]  # fmt: skip


NATIVE_PLAIN = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_DRAFT_KEY),
                "--spec-ngram-simple-size-m", "1"]  # fmt: skip


def plan(args, gemma_q4: Path, gemma_f16: Path | None, pairs: dict[str, tuple[Path, Path]]) -> list[Job]:
    """Every process of one round. Job.prompt is "<model>/<prompt>" so sections can share names."""
    jobs: list[Job] = []
    files = args.prompt_files
    if "plain" in args.only or "lookup" in args.only:
        for name, text in PROMPTS.items():
            at = f"gemma-q4/{name}"
            depth = ["-d", str(args.prompt_tokens[name])]
            jobs.append(Job("llama-bench tg", at, [*llama_bench_cmd(args.bins["llama-bench"], args), *depth], "llama-bench"))
            jobs.append(Job("specli plain", at, specli_cmd(args, gemma_q4, text, ["--target-only"]), "specli"))
            jobs.append(Job("native plain", at, native_cmd(args, gemma_q4, files[name], NATIVE_PLAIN), "spec-simple"))
            if "lookup" in args.only:
                for n in ("16", "auto"):
                    jobs.append(Job(f"specli lookup n={n}", at, specli_cmd(args, gemma_q4, text, ["--lookup", "--draft-max", n]), "specli"))
                jobs.append(Job("native ngram default", at, native_cmd(args, gemma_q4, files[name], ["--spec-type", "ngram-simple"]), "spec-simple"))
    if "draft" in args.only:
        pair_list = [(label, t, d, ["story"], args.n_synthetic) for label, (t, d) in pairs.items()]
        if gemma_f16 is not None:
            pair_list.append(("gemma-f16+q4", gemma_f16, gemma_q4, list(PROMPTS), args.n_gemma))
        for label, target, draft, prompt_names, n in pair_list:
            for name in prompt_names:
                at, text = f"{label}/{name}", PROMPTS[name]
                jobs.append(Job("specli plain", at, specli_cmd(args, target, text, ["--target-only"]), "specli"))
                for n_opt in (str(n), "auto"):
                    mode = ["-d", str(draft), "--draft-max", n_opt]
                    jobs.append(Job(f"specli draft n={n_opt}", at, specli_cmd(args, target, text, mode), "specli"))
                jobs.append(Job("native plain", at, native_cmd(args, target, files[name], NATIVE_PLAIN), "spec-simple"))
                draft_simple = ["-md", str(draft), "--spec-type", "draft-simple"]
                jobs.append(Job(f"native draft n={n}", at, native_cmd(args, target, files[name], [*draft_simple, "--spec-draft-n-max", str(n)]), "spec-simple"))
                gated = [*draft_simple, "--spec-draft-n-max", "16", "--spec-draft-p-min", str(P_MIN)]
                jobs.append(Job(f"native draft p-min {P_MIN}", at, native_cmd(args, target, files[name], gated), "spec-simple"))
    return jobs


def execute(job: Job, rnd: int, max_tokens: int) -> Run:
    prompt_name = job.prompt.split("/")[1]
    if job.kind == "specli":
        return run_specli(job.config, job.prompt, rnd, job.cmd)
    if job.kind == "spec-simple":
        return run_spec_simple(job.config, job.prompt, rnd, job.cmd, PROMPTS.get(prompt_name, ""), max_tokens)
    run = run_llama_bench(rnd, job.cmd, max_tokens)
    run.prompt = job.prompt  # one llama-bench per prompt depth
    return run


def summarize(runs: list[Run]) -> dict[tuple[str, str], dict]:
    out: dict[tuple[str, str], dict] = {}
    for run in runs:
        entry = out.setdefault((run.prompt, run.config), {"tps": [], "drafted": 0, "accepted": 0, "passes": 0, "tokens": 0})
        if run.tokens_per_s is not None:
            entry["tps"].append(run.tokens_per_s)
        entry["drafted"] += run.drafted or 0
        entry["accepted"] += run.accepted or 0
        entry["tokens"] += run.n_tokens or 0
        entry["passes"] += run.extra.get("passes") or (
            round(run.n_tokens / run.extra["mean_tokens_per_pass"]) if run.extra.get("mean_tokens_per_pass") else 0)
    for entry in out.values():
        entry["best"] = best(entry["tps"])
        entry["acceptance"] = entry["accepted"] / entry["drafted"] if entry["drafted"] else None
        entry["drafts_per_pass"] = entry["drafted"] / entry["passes"] if entry["passes"] else None
    return out


def fmt(x, spec=".1f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def ratio(a, b):
    return a / b if a is not None and b else None


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def report(summary: dict, args) -> None:
    get = lambda at, config: summary.get((at, config), {})  # noqa: E731
    tps = lambda at, config: get(at, config).get("best")  # noqa: E731
    acc = lambda at, config: get(at, config).get("acceptance")  # noqa: E731
    if any(config == "llama-bench tg" for _, config in summary):
        rows = []
        for name in PROMPTS:
            at = f"gemma-q4/{name}"
            bench = tps(at, "llama-bench tg")
            rows.append([f"{name} ({args.prompt_tokens[name]} tokens)", fmt(tps(at, "specli plain")),
                         fmt(tps(at, "native plain")), fmt(bench),
                         fmt(ratio(tps(at, "specli plain"), bench), ".2f"),
                         fmt(ratio(tps(at, "specli plain"), tps(at, "native plain")), ".2f")])  # fmt: skip
        table(f"Plain decoding, Gemma 3 270M Q4_K_M, {args.max_tokens} tokens (tok/s)",
              ["prompt", "specli --target-only", "native plain (same prompt)", f"llama-bench tg{args.max_tokens} -d PROMPT",
               "specli / llama-bench", "specli / native plain"], rows)  # fmt: skip
    if "lookup" in args.only:
        rows = []
        for name in PROMPTS:
            at = f"gemma-q4/{name}"
            s_plain, n_plain = tps(at, "specli plain"), tps(at, "native plain")
            n_speed = ratio(tps(at, "native ngram default"), n_plain)
            row = [name]
            for n in ("16", "auto"):
                s_speed = ratio(tps(at, f"specli lookup n={n}"), s_plain)
                row += [fmt(s_speed, ".2f", "x"), fmt(acc(at, f"specli lookup n={n}"), ".0%")]
            row += [fmt(n_speed, ".2f", "x"), fmt(acc(at, "native ngram default"), ".0%"),
                    fmt(ratio(ratio(tps(at, "specli lookup n=16"), s_plain), n_speed), ".2f"),
                    fmt(ratio(ratio(tps(at, "specli lookup n=auto"), s_plain), n_speed), ".2f")]  # fmt: skip
            rows.append(row)
        table("Prompt lookup, Gemma 3 270M Q4_K_M: speedup over each side's own plain decoding",
              ["prompt", "specli -n 16", "acc", "specli -n auto", "acc", "native ngram-simple (12/48)", "acc",
               "ratio n16", "ratio auto"], rows)  # fmt: skip
    if "draft" in args.only:
        rows = []
        labels = sorted({at for at, config in summary if config.startswith("native draft")}, key=_pair_order)
        for at in labels:
            s_plain, n_plain = tps(at, "specli plain"), tps(at, "native plain")
            n = args.n_gemma if at.startswith("gemma") else args.n_synthetic
            row = [at, fmt(s_plain), fmt(n_plain)]
            speeds = {}
            for config, plain in ((f"specli draft n={n}", s_plain), ("specli draft n=auto", s_plain),
                                  (f"native draft n={n}", n_plain), (f"native draft p-min {P_MIN}", n_plain)):  # fmt: skip
                speeds[config] = ratio(tps(at, config), plain)
                row += [fmt(speeds[config], ".2f", "x"), fmt(acc(at, config), ".0%")]
            row += [fmt(get(at, "specli draft n=auto").get("drafts_per_pass"), ".1f"),
                    fmt(ratio(speeds[f"specli draft n={n}"], speeds[f"native draft n={n}"]), ".2f"),
                    fmt(ratio(speeds["specli draft n=auto"], max(filter(None, [speeds[f"native draft n={n}"],
                                                                               speeds[f"native draft p-min {P_MIN}"]]), default=None)), ".2f")]  # fmt: skip
            rows.append(row)
        table(f"Draft models, greedy: speedup over each side's own plain decoding (N = {args.n_synthetic} "
              f"synthetic, {args.n_gemma} Gemma; plain in tok/s)",
              ["pair/prompt", "specli plain", "native plain", "specli -n N", "acc", "specli auto", "acc",
               "native n-max N", "acc", f"native p-min {P_MIN}", "acc", "auto drafts/pass", "ratio N",
               "ratio auto / best native"], rows)  # fmt: skip


def prompt_token_counts(model_path: Path) -> dict[str, int]:
    """Gemma tokens of each prompt, BOS included, as `specli run` evaluates them."""
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend

    init_backend()
    model = LlamaModel(model_path, n_ctx=512)
    try:
        return {name: len(model.tokenize(text, add_bos=model.vocab_info().add_bos)) for name, text in PROMPTS.items()}
    finally:
        model.close()


def _pair_order(at: str) -> tuple[int, str]:
    label = at.split("/")[0]
    return (SYNTHETIC.index(label) if label in SYNTHETIC else len(SYNTHETIC), at)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--n-synthetic", type=int, default=5, help="fixed N on the synthetic pairs (both sides)")
    parser.add_argument("--n-gemma", type=int, default=4, help="fixed N on Gemma F16 + Q4_K_M (both sides)")
    parser.add_argument("--bench-reps", type=int, default=3, help="llama-bench repetitions per round")
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="make_cost_pairs.py's output folder")
    parser.add_argument("--native-dir", type=Path, default=DEFAULT_NATIVE_DIR)
    parser.add_argument("--only", default="plain,lookup,draft", help="sections to run, comma-separated")
    parser.add_argument("--no-gemma-f16", action="store_true", help="skip the Gemma F16 + Q4_K_M pair")
    parser.add_argument("--json", type=Path, help="write every run's numbers here")
    args = parser.parse_args()
    args.only = set(args.only.split(","))
    args.bins = native_bins(args.native_dir)
    args.specli = find_specli()
    args.model = gemma_q4 = default_model().resolve()
    args.prompt_files = write_prompt_files(args.native_dir / "prompts", list(PROMPTS))
    args.prompt_tokens = prompt_token_counts(gemma_q4)
    pairs = {}
    if "draft" in args.only:
        for label in SYNTHETIC:
            targets = sorted((args.pairs / label).glob("*-target-*.gguf"))
            drafts = sorted((args.pairs / label).glob("*-draft-*.gguf"))
            if not targets or not drafts:
                sys.exit(f"error: no cost pair in {args.pairs / label}; run: python benchmarks/make_cost_pairs.py --out {args.pairs}")
            pairs[label] = (targets[0], drafts[0])
    print(f"machine: {machine()}; {args.threads} threads, greedy, {args.max_tokens} tokens, best of {args.repeat} "
          f"interleaved rounds", file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        gemma_f16 = None
        if "draft" in args.only and not args.no_gemma_f16:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures package
            from fixtures.helpers import convert

            gemma_f16 = convert(gemma_q4, Path(tmp) / "gemma-3-270m-f16.gguf", "f16")
        jobs = plan(args, gemma_q4, gemma_f16, pairs)
        import bench_lookup

        bench_lookup.execute = execute  # run_all calls execute(); ours knows "<model>/<prompt>"
        runs, failures = run_all(jobs, args.repeat, args.max_tokens, lambda line: print(line, file=sys.stderr))
    summary = summarize(runs)
    print(f"machine: {machine()}; {args.threads} threads; greedy; {args.max_tokens} tokens; best of {args.repeat} rounds")
    report(summary, args)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if args.json:
        doc = {"runs": [asdict(r) for r in runs], "summary": {f"{k[0]}|{k[1]}": v for k, v in summary.items()}}
        args.json.write_text(json.dumps(doc, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as err:
        sys.exit(f"error: {err}")
