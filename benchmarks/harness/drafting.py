"""Drafting on Spec-Bench and unseen text: does drafting pay, per category, against plain
decoding, native llama.cpp's drafters and the oracle?

Stages, each reading what the one before saved under --out/MODEL/:
  texts    the target's greedy texts (through its chat template for an instruct model).
  costs    this machine's cost table: the target's pass by width (1-65 tokens) and the draft
           model's time per token.
  traces   the draft model's greedy choices along each text (one batch pass per text): what
           it would draft at every position, so that it is replayed without a model.
  replay   clock-free figures for every drafter and policy: tokens per target pass, drafted
           and refused tokens, modelled speedup over plain decoding under this machine's table
           and a GPU-like one, and the oracle.
  sweep    every policy constant at half and at double its value: which figures it moves
           (a constant that moves none by more than --sweep-noise is not a rule).
  wall     real processes, rounds interleaved: specli run against llama-speculative-simple.
"""

from __future__ import annotations

from pathlib import Path

from harness import models, prompts, texts, traces
from harness.common import DEFAULT_OUT, log, read_jsonl, write_json


def add_arguments(ap) -> None:
    ap.add_argument("stage", choices=["texts", "costs", "traces", "replay", "sweep", "wall"])
    ap.add_argument("--model", default="qwen", help="qwen (the real instruct pair) or gemma (a base model that loops)")
    ap.add_argument("--prompts", help="a folder of .txt prompts instead of Spec-Bench, or 'code-edits' (edits of real "
                    "functions from installed packages, as user turns)")
    ap.add_argument("--set", help="the prompt set's name in the results (default: spec_bench or the folder's)")
    ap.add_argument("--per-category", type=int, default=12, help="Spec-Bench questions per category (two-turn ones: half)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--split", choices=["all", "dev", "check"], default="all", help="dev: tune on it; check: held out")
    ap.add_argument("--configs", help="replay: only these configurations (comma list, e.g. 'lookup auto,draft auto')")
    ap.add_argument("--wall-per-category", type=int, default=2, help="wall: prompts per category")
    ap.add_argument("--rounds", type=int, default=2, help="wall: rounds, interleaved")
    ap.add_argument("--n", type=int, default=4, help="wall: the fixed draft length compared with native's at the same N")
    ap.add_argument("--sweep-noise", type=float, default=0.005, help="sweep: a relative change in a figure that counts")
    ap.add_argument("--noise", metavar="SIGMA,STALLS[,SEED]",
                    help="replay, sweep: what the policy is told is noisy, as on a shared machine: each pass's timing "
                         "times a log-normal factor of this spread, and this share of passes stalled 3x by another "
                         "process (its CPU use halved), SEED choosing the machine's luck; the figures still charge the table's "
                         "costs. E.g. 0.15,0.03")
    ap.add_argument("--constant", action="append", default=[], metavar="NAME=VALUE",
                    help="replay: set a policy constant for this run (repeatable), e.g. REACH_MIN=4")


def items_of(args, pair) -> list[prompts.Item]:
    if args.prompts == "code-edits":
        return prompts.code_edits(args.per_category * 3, chat=pair.chat)
    if args.prompts:
        return prompts.folder(Path(args.prompts), chat=pair.chat)
    return prompts.spec_bench(args.per_category, chat=pair.chat)


def set_name(args) -> str:
    return args.set or (Path(args.prompts).name if args.prompts else "spec_bench")


def texts_path(args) -> Path:
    return Path(args.out) / args.model / f"texts-{set_name(args)}.jsonl"


def main(args) -> int:
    pair = models.by_name(args.model)
    if args.stage == "texts":
        rows = texts.generate(items_of(args, pair), pair.target, texts_path(args), chat=pair.chat,
                              max_tokens=args.max_tokens, threads=args.threads)
        log(f"{len(rows)} texts in {texts_path(args)}")
        return 0
    if args.stage == "costs":
        from harness import costs

        costs.measure(pair.target, pair.draft, Path(args.out) / args.model / "costs.json", threads=args.threads)
        return 0
    rows = read_jsonl(texts_path(args))
    if args.split != "all":
        rows = [r for r in rows if r["split"] == args.split]
    if args.stage == "traces":
        traces.compute(rows, pair.draft, traces_path(args), threads=args.threads)
        return 0
    if args.stage == "sweep":
        return sweep(args, pair, rows)
    if args.stage == "replay":
        from harness import replaying, report

        found = traces.load(traces_path(args)) if pair.draft is not None and traces_path(args).exists() else {}
        tables = cost_tables(args, pair)
        conf = replaying.configs(bool(found))
        if args.configs:
            conf = {name: conf[name] for name in args.configs.split(",")}
        for setting in args.constant:
            replaying.set_constant(*setting.split("=", 1))
        results = replaying.run_all(rows, found, tables, conf, noise=replaying.noise_of(args.noise))
        if not args.configs and not args.constant and not args.noise:
            write_json(Path(args.out) / args.model / f"replay-{set_name(args)}-{args.split}.json", results)
        title = f"{args.model} {set_name(args)} ({args.split}{''.join(', ' + c for c in args.constant)}"
        title += f", told noise {args.noise})" if args.noise else ")"
        (report.compact if args.configs else report.replay_tables)(results, tables, title)
        return 0
    return wall(args, pair, rows)


def traces_path(args) -> Path:
    return Path(args.out) / args.model / f"traces-{set_name(args)}.jsonl"


def cost_tables(args, pair) -> list:
    from harness import costs

    path = Path(args.out) / args.model / "costs.json"
    if pair.name == "qwen":
        cpu = costs.load(path, costs.QWEN_NOTES, costs.QWEN_NOTES_DRAFT, "this CPU")
    else:
        cpu = costs.load(path, costs.GEMMA_NOTES, 0.0, "this CPU")
    if not path.exists():
        log(f"no {path}: the 2-core table of ../shared/NOTES.md stands in (run the costs stage for this machine's)")
    return [cpu, costs.flat_like(cpu)]


def wall_configs(pair, n: int) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (side, options). Native plain decoding is llama-speculative-simple with a key that
    never matches (the very loop and timer of its speculative runs)."""
    from harness import native

    out = {"specli plain": ("specli", ("--target-only",)), "specli lookup auto": ("specli", ("--lookup",))}
    if pair.draft is not None:
        d = str(pair.draft)
        out.update({"specli draft auto": ("specli", ("-md", d)), "specli hybrid auto": ("specli", ("-md", d, "--lookup")),
                    f"specli draft {n}": ("specli", ("-md", d, "--draft-max", str(n)))})
    else:
        out[f"specli lookup {n}"] = ("specli", ("--lookup", "--draft-max", str(n)))
    out["native plain"] = ("native", native.NATIVE_PLAIN)
    out.update({f"native {t}": ("native", ("--spec-type", t)) for t in ("ngram-simple", "ngram-map-k", "ngram-mod")})
    if pair.draft is not None:
        out[f"native draft-simple {n}"] = ("native", ("-md", str(pair.draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(n)))
    return out


def wall(args, pair, rows: list[dict]) -> int:
    """Real processes on the same prompt text (specli parses its special tokens as llama.cpp
    does), rounds interleaved; per prompt the best round (interference only slows a run)."""
    from harness import native
    from harness.common import category_order, gm_cell, gmean, table
    from harness.prompts import stratified

    chosen = stratified(rows, args.wall_per_category, "wall", "id")
    conf = wall_configs(pair, args.n)
    folder = Path(args.out) / args.model / "wall-prompts"
    jobs = []
    for row in chosen:
        for name, (side, opts) in conf.items():
            if side == "specli":
                cmd = native.specli_run_cmd(pair.target, *opts, prompt=row["prompt"], max_tokens=args.max_tokens, threads=args.threads)
                jobs.append(native.Job((row["id"], name), "specli", cmd))
            else:
                cmd = native.spec_simple_cmd(pair.target, *opts, prompt_file=native.prompt_file(folder, row["id"], row["prompt"]),
                                             max_tokens=args.max_tokens, threads=args.threads)
                jobs.append(native.Job((row["id"], name), "spec-simple", cmd, prompt=row["prompt"], max_tokens=args.max_tokens))
    log(f"{len(chosen)} prompts x {len(conf)} configurations x {args.rounds} rounds")
    results, failures = native.rounds(jobs, args.rounds)
    write_json(Path(args.out) / args.model / f"wall-{set_name(args)}.json", {"runs": results, "failures": failures})
    best: dict[tuple, dict] = {}
    for r in results:
        key = tuple(r["key"])
        if r["tps"] is not None and (key not in best or r["tps"] > best[key]["tps"]):
            best[key] = r
    cat_of = {r["id"]: r["category"] for r in chosen}

    def ratio(i: str, a: str, b: str) -> float | None:
        x, y = best.get((i, a)), best.get((i, b))
        return x["tps"] / y["tps"] if x and y else None

    names = [n for n in conf if "plain" not in n]
    natives = [n for n in names if n.startswith("native ngram")]
    rows_out = []
    for cat in category_order(cat_of.values()) + ["all"]:
        ids = [i for i in cat_of if cat in (cat_of[i], "all")]
        cells = [cat, len(ids)]
        for name in names:
            plain = "specli plain" if name.startswith("specli") else "native plain"
            sp = [v for v in (ratio(i, name, plain) for i in ids) if v]
            # (specli's decided tokens count the end-of-generation token its pass decided, as native's log does)
            tpp = [(best[(i, name)].get("decided") or best[(i, name)]["tokens"]) / best[(i, name)]["passes"]
                   for i in ids if (i, name) in best and best[(i, name)].get("passes")]
            cells.append(f"{gm_cell(sp, suffix='x')} / {gmean(tpp):.2f}" if sp else "-")
        vs = [ratio(i, "specli lookup auto", max(natives, key=lambda n: best.get((i, n), {}).get("tps") or 0)) for i in ids]
        cells.append(gm_cell([v for v in vs if v]))
        if pair.draft is not None:
            cells.append(gm_cell([v for v in (ratio(i, f"specli draft {args.n}", f"native draft-simple {args.n}") for i in ids) if v]))
            cells.append(gm_cell([v for v in (ratio(i, "specli plain", "native plain") for i in ids) if v]))
        rows_out.append(cells)
    head = ["category", "n", *names, "lookup auto / fastest native n-gram"]
    if pair.draft is not None:
        head += [f"draft {args.n} / native draft-simple {args.n}", "specli plain / native plain"]
    table(head, rows_out, f"## wall clock: {args.model} {set_name(args)}, {len(chosen)} prompts, {args.rounds} rounds, "
          f"{args.max_tokens} tokens, {args.threads} threads: speedup over the same side's plain decoding, geometric mean "
          "[min-max] / tokens per target pass; ratios per prompt")
    same = sum(1 for (i, n), r in best.items() if n.startswith("specli") and r.get("text") is not None
               and (i, "specli plain") in best and r["text"] == best[(i, "specli plain")]["text"])
    total = sum(1 for (i, n) in best if n.startswith("specli"))
    print(f"specli texts equal to its plain run's: {same} of {total}; failed runs: {len(failures)}")
    for f in failures:
        log(f)
    return 0


def sweep(args, pair, rows: list[dict]) -> int:
    """Each policy constant at half and double its value, replayed under both tables: the
    geometric-mean modelled speedup of every auto configuration, per category and overall,
    against the baseline's. Prints each constant's largest relative change."""

    from harness import replaying
    from harness.common import category_order, gmean, table

    found = traces.load(traces_path(args)) if pair.draft is not None and traces_path(args).exists() else {}
    tables = cost_tables(args, pair)
    conf = {n: c for n, c in replaying.configs(bool(found)).items() if n.endswith(("auto", "auto warm")) and not n.startswith("memory")}
    if args.configs:
        conf = {name: conf[name] for name in args.configs.split(",")}
    cats = category_order(r["category"] for r in rows)
    noise = replaying.noise_of(args.noise)

    def figures() -> dict[tuple, float]:
        res = replaying.run_all(rows, found, tables, conf, progress=lambda _m: None, noise=noise)
        out = {}
        for costs in tables:
            for name in conf:
                for cat in cats + ["all"]:
                    vals = [r["tables"][costs.label][name]["speedup"] for r in res if cat in (r["category"], "all") and name in r["tables"][costs.label]]
                    if vals:
                        out[(costs.label, name, cat)] = gmean(vals)
        return out

    base = figures()
    results = []
    for name, value in replaying.policy_constants().items():
        moves = {}
        for factor in (0.5, 2.0):
            # (a weight or probability near 1 varies by its distance from 1: DECAY 0.97 -> 0.94, 0.985;
            # a factor a little over 1 by its excess: REACH_COST 1.25 -> 1.125, 1.5)
            if isinstance(value, float) and 0.5 < value < 1:
                new = 1 - (1 - value) * factor
            elif isinstance(value, float) and 1 < value < 2:
                new = 1 + (value - 1) * factor
            else:
                new = value * factor
            if isinstance(value, int):
                new = max(1, round(new)) if value >= 1 else round(new)
                if new == value:
                    continue
            replaying.set_constant(name, repr(new))
            got = figures()
            replaying.set_constant(name, repr(value))
            worst = max(base, key=lambda k: abs(got[k] / base[k] - 1))
            # (and over all categories: one text that flips between two paths moves a category's
            # cell, seldom the whole set's)
            overall = max((k for k in base if k[2] == "all"), key=lambda k: abs(got[k] / base[k] - 1))
            moves[factor] = (got[worst] / base[worst] - 1, worst, got[overall] / base[overall] - 1, overall)
        big = max((abs(m[0]) for m in moves.values()), default=0.0)
        results.append({"name": name, "value": value, "moves": {str(f): [m[0], list(m[1]), m[2], list(m[3])] for f, m in moves.items()},
                        "largest": big, "largest_overall": max((abs(m[2]) for m in moves.values()), default=0.0)})
        log(f"{name} = {value}: " + ", ".join(f"x{f}: {m[0]:+.3%} ({' / '.join(m[1])}), all {m[2]:+.3%}" for f, m in moves.items()))
    if not args.noise:
        write_json(Path(args.out) / args.model / f"sweep-{set_name(args)}-{args.split}.json", results)

    def cell(r, f, i):
        m = r["moves"].get(f)
        return f"{m[i]:+.2%} ({' / '.join(m[i + 1][:2] if i else m[i + 1])})" if m else "-"

    rows_out = [[r["name"], r["value"], cell(r, "0.5", 0), cell(r, "2.0", 0), cell(r, "0.5", 2), cell(r, "2.0", 2),
                 "rule" if r["largest"] > args.sweep_noise else "no effect"]
                for r in sorted(results, key=lambda r: -r["largest"])]
    title = f"## sweep: {args.model} {set_name(args)} ({args.split}), {len(rows)} texts" + (f", told noise {args.noise}" if args.noise else "")
    table(["constant", "value", "x0.5: largest change (table / config / category)", "x2", "x0.5: largest overall (table / config)",
           "x2 overall", f"over {args.sweep_noise:.1%}?"], rows_out, title)
    return 0
