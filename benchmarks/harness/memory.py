"""Drafting from memory on repeated work: does a memory of earlier texts pay, replayed and served?

Stages:
  replay  clock-free (harness.replaying): text i of a workload replayed on its known output with
          lookup alone and with a memory of texts 0..i-1 (MemoryDrafter, one MemoryRecord per cost
          table across the texts, as a server process keeps), at --draft-max auto and fixed N;
          tokens per target pass and the modelled speedup over plain decoding on the Gemma cost
          table and a flat GPU-like one. Workloads: benchmarks/workloads/replay_{tools,code,
          extract}.jsonl (20 requests each of one shape, outputs as an instruction-tuned model
          writes them, taken as the greedy text), prose (benchmarks/prompts, each file's first 60%
          the prompt: nothing to recall), all tokenized by Gemma 3 270M; or --texts FILE (greedy
          texts the `drafting texts` stage saved; Spec-Bench in question order), per category.
  serve   benchmarks/workloads/serve_*.jsonl (tools, tests, edit, conversation, batch: ordered
          raw completions written for a base model; a conversation's turn is the previous prompt,
          this side's own previous completion cut at its first "\\nUser:", and the next line)
          through `specli serve` and `llama-server` on Gemma, greedy, one slot, one client, each
          server started fresh per workload (memory and ngram-mod's pool start empty), one at a
          time, the side order reversed every other workload. Per workload and part (the last
          ~20% of each, "check", is held out): tokens per target pass (completion tokens -
          accepted), tok/s (completion tokens / request wall time), texts equal to llama-server
          plain's; the best specli lookup side against the best llama-server n-gram side and
          plain (goals: >= 1.5x and >= 2x, in both). --swa-full lets llama-server reuse a shared
          prefix on Gemma's sliding-window cache as specli does.
"""

from __future__ import annotations

from pathlib import Path

from harness import models, native
from harness.common import DEFAULT_OUT, HERE, log, read_jsonl, table, write_json

WORKLOADS = HERE.parent / "workloads"
SERVE_WORKLOADS = ("tools", "tests", "edit", "conversation", "batch")
SIDES = {
    "specli-plain": ("specli", ["--target-only"]),
    "specli-lookup": ("specli", ["--lookup"]),
    "specli-memory": ("specli", ["--lookup", "--memory", "process"]),
    "specli-lookup-d8": ("specli", ["--lookup", "--draft-max", "8"]),
    "specli-memory-d8": ("specli", ["--lookup", "--memory", "process", "--draft-max", "8"]),
    "native-plain": ("llama-server", []),
    **{f"native-{t}": ("llama-server", ["--spec-type", t]) for t in ("ngram-simple", "ngram-map-k", "ngram-mod")},
}
DEFAULT_SIDES = "specli-plain,specli-lookup,specli-memory,native-plain,native-ngram-simple,native-ngram-map-k,native-ngram-mod"


# --- replay ------------------------------------------------------------------------------------
def written_rows(tokenize) -> dict[str, list[dict]]:
    """The written workloads and prose, as replays want them: BOS and the prompt's tokens, then
    the output's (tokenized on its own: the target's tokens continue the prompt's)."""
    pairs = {name: [(r["prompt"], r["output"]) for r in read_jsonl(WORKLOADS / f"replay_{name}.jsonl")] for name in ("tools", "code", "extract")}
    pairs["prose"] = []
    for path in sorted((HERE.parent / "prompts").glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        cut = int(len(text) * 0.6)
        cut = text.rfind(" ", 0, cut) if " " in text[:cut] else cut
        pairs["prose"].append((text[:cut], text[cut:]))
    return {name: [{"id": f"{name}{i}", "category": name, "split": "dev", "prompt_ids": tokenize(p, add_bos=True),
                    "output_ids": tokenize(o, add_bos=False)} for i, (p, o) in enumerate(ps)] for name, ps in pairs.items()}


def question_order(rows: list[dict]) -> list[dict]:
    """Spec-Bench texts in the order they were asked (q12 before q12t2 before q13); others as saved."""
    def key(item):
        i, row = item
        qid = str(row["id"]).removeprefix("q").removesuffix("t2")
        return (0, int(qid), str(row["id"]).endswith("t2")) if qid.isdigit() else (1, i, False)

    return [row for _, row in sorted(enumerate(rows), key=key)]


def replay(args) -> None:
    from harness import costs, replaying, report

    cpu = costs.load(None, costs.GEMMA_NOTES, 0.0, "Gemma CPU (NOTES)")
    tables = [cpu, costs.flat_like(cpu)]
    ns = [int(n) for n in args.n.split(",") if n]
    conf = {f"{kind} {n}": (kind, replaying.AUTO if n == "auto" else int(n)) for kind in ("lookup", "memory") for n in ["auto", *ns]}
    if args.texts:
        sets = {Path(path).name: question_order(read_jsonl(Path(path))) for path in args.texts}
    else:
        from specli.llama.model import LlamaModel
        from specli.llama.native import init_backend

        init_backend()
        model = LlamaModel(models.gemma().target, n_ctx=512)
        sets = written_rows(model.tokenize)
        model.close()
    results = {name: replaying.run_all([r for r in rows if len(r["output_ids"]) > 1], {}, tables, conf) for name, rows in sets.items()}
    for name, res in results.items():
        report.compact(res, tables, f"{name}: {len(res)} texts, memory of the texts before each")
    write_json(Path(args.out) / "memory" / f"replay-{'texts' if args.texts else 'written'}.json", results)


# --- serve -------------------------------------------------------------------------------------
def serve_side(args, model: Path, workload: str, requests: list[dict], side: str) -> list[dict]:
    kind, extra = SIDES[side]
    if kind == "specli":
        cmd = native.specli_serve_cmd(model, *extra, threads=args.threads, ctx=args.ctx)
    else:
        cmd = native.llama_server_cmd(model, *extra, *(["--swa-full"] if args.swa_full else []), threads=args.threads, ctx=args.ctx)
    rows, prompt = [], ""
    with native.serving(cmd, f"{workload}-{side}", Path(args.out) / "memory" / "logs") as srv:
        srv.complete("Hello", 2)  # warm-up, not measured (it enters memory and ngram-mod's pool too)
        for req in requests:
            if "prompt" in req:
                prompt = req["prompt"]
            else:  # conversation: the previous prompt, this side's previous completion (cut), the next line
                prev = rows[-1]["text"]
                prompt += (prev[: prev.find("\nUser:")] if "\nUser:" in prev else prev) + req["append"]
            rows.append({"workload": workload, "side": side, "id": req["id"], "part": req["part"], **srv.complete(prompt, args.max_tokens)})
    return rows


def best(aggs: dict, pick, key: str):
    found = [(a[key], s) for s, a in aggs.items() if pick(s) and a[key]]
    return max(found) if found else None


def serve_report(rows: list[dict], workloads: list[str], sides: list[str]) -> None:
    ratios = []
    for part in ("main", "check"):
        lines = []
        for w in workloads:
            ref = {r["id"]: r["text"] for r in rows if r["workload"] == w and r["side"] == "native-plain"}
            aggs = {}
            for side in sides:
                rs = [r for r in rows if r["workload"] == w and r["side"] == side and r["part"] == part]
                if rs:
                    n, passes, wall = sum(r["tokens"] for r in rs), sum(r["passes"] for r in rs), sum(r["wall_s"] for r in rs)
                    aggs[side] = {"tpp": n / passes if passes else None, "tps": n / wall}
                    lines.append([w, side, len(rs), n, f"{sum(r['accepted'] for r in rs)}/{sum(r['drafted'] for r in rs)}",
                                  f"{aggs[side]['tpp']:.2f}", f"{aggs[side]['tps']:.1f}",
                                  f"{sum(ref.get(r['id']) == r['text'] for r in rs)}/{len(rs)}" if ref else "-"])
            cells = [w, part]
            for key in ("tpp", "tps"):
                mine = best(aggs, lambda s: s.startswith("specli-") and s != "specli-plain", key)
                theirs = best(aggs, lambda s: s.startswith("native-ngram"), key)
                plain = best(aggs, lambda s: s.endswith("-plain"), key)
                for b in (mine, theirs):
                    cells.append(f"{b[0]:.2f} ({b[1]})" if b else "-")
                for other, goal in ((theirs, 1.5), (plain, 2.0)):
                    cells.append(f"{mine[0] / other[0]:.2f} ({'met' if mine[0] / other[0] >= goal else 'missed'})" if mine and other else "-")
            ratios.append(cells)
        table(["workload", "side", "requests", "tokens", "accepted/drafted", "tokens/pass", "tok/s", "= llama-server plain"], lines,
              title=f"{part} part:")
    table(["workload", "part", "specli tokens/pass", "native n-gram", "ratio (>= 1.5)", "vs plain (>= 2)", "specli tok/s",
           "native n-gram", "ratio (>= 1.5)", "vs plain (>= 2)"], ratios, title="best specli lookup side against the best "
          "llama-server n-gram side and plain:")
    checked = [r for r in rows if (r["speculative"] or {}).get("target_passes") is not None]
    bad = [r["id"] for r in checked if r["speculative"]["target_passes"] != r["passes"]]
    print(f"specli's target passes = tokens - accepted: {len(checked) - len(bad)}/{len(checked)} requests" + (f"; not: {bad[:12]}" if bad else ""))


def serve(args) -> None:
    model = models.gemma().target if args.model is None else Path(args.model)
    sides, rows = args.sides.split(","), []
    workloads = args.workloads.split(",")
    for i, w in enumerate(workloads):
        requests = read_jsonl(WORKLOADS / f"serve_{w}.jsonl")
        if args.quick:  # the first two requests, the second standing in for the check part
            requests = [dict(requests[0], part="main"), dict(requests[1], part="check")]
        for side in sides if i % 2 == 0 else sides[::-1]:
            log(f"[{w}] {side}")
            rows += serve_side(args, model, w, requests, side)
            write_json(Path(args.out) / "memory" / "serve.json", {"settings": vars(args), "rows": rows})  # a run cut short keeps these
    serve_report(rows, workloads, sides)


def add_arguments(ap) -> None:
    ap.add_argument("stage", choices=["replay", "serve"])
    ap.add_argument("--texts", action="append", default=[], help="replay: a texts-*.jsonl of `drafting texts` (repeatable) "
                    "instead of the written workloads")
    ap.add_argument("--n", default="8,16", help="replay: fixed draft lengths beside auto")
    ap.add_argument("--workloads", default=",".join(SERVE_WORKLOADS), help="serve: comma list")
    ap.add_argument("--sides", default=DEFAULT_SIDES, help=f"serve: comma list of {', '.join(SIDES)}")
    ap.add_argument("--model", help="serve: a GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--swa-full", action="store_true", help="serve: llama-server --swa-full")
    ap.add_argument("--quick", action="store_true", help="serve: the first two requests of each workload")
    ap.add_argument("--out", default=str(DEFAULT_OUT))


def main(args) -> int:
    (replay if args.stage == "replay" else serve)(args)
    return 0
