"""Structured output: schema-constrained extraction and tool calls on the real pair, clock-free.

Each workload (workloads/structured.jsonl: a prompt and a JSON schema, or a prompt and tools with
a tool_choice; split dev/check, a third held out) is generated greedily under its constraint with plain constrained decoding (target-only)
and with each drafter, through the chat template. Printed side by side: tokens per target pass,
the schema's forced tokens drafted and accepted, all drafted and refused tokens, whether the
texts equal plain constrained decoding's, (tools: every call's arguments valid), the constraint's time per emitted token against a
one-token target pass (the run's own), and a modelled speedup over plain constrained decoding
on this CPU's table and a GPU-like one (each pass charged by its width, a draft-model token at
the table's price). Every output is checked against its schema.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from harness import costs as cost_tables
from harness import models
from harness.common import DEFAULT_OUT, HERE, gmean, log, table, write_json

CONFIGS = ("target-only", "lookup 8", "lookup auto", "draft 4", "hybrid 4")


def add_arguments(ap) -> None:
    ap.add_argument("--workloads", type=Path, default=HERE.parent / "workloads" / "structured.jsonl")
    ap.add_argument("--split", choices=("all", "dev", "check"), default="all")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compact", action="store_true", help="compact JSON (no spaces after ':' and ',')")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)


def _drafter(config: str, draft_model):
    from specli.decoding.drafters import DraftModelDrafter, HybridDrafter, PromptLookupDrafter

    kind, length = config.split()[0], (config.split() + ["1"])[1]
    made = {"target-only": None, "lookup": PromptLookupDrafter(), "draft": DraftModelDrafter(draft_model) if kind == "draft" else None,
            "hybrid": HybridDrafter(PromptLookupDrafter(), DraftModelDrafter(draft_model)) if kind == "hybrid" else None}[kind]
    return made, (length if length == "auto" else int(length))


def modelled_s(stats, table_, t_draft: float) -> float:
    """The run's passes charged by width (draft_lengths: passes by draft length), and its draft-model tokens."""
    passes = sum(n * table_(k + 1) for k, n in enumerate(stats.draft_lengths))
    model_tokens = sum(d for source, (d, _) in stats.by_source.items() if source == "draft-model")
    return passes + model_tokens * t_draft


def _check(w: dict, text: str, fmt) -> None:
    """The output validates: against the schema, or (tools) as one call at least, each call's
    arguments against its tool's parameters."""
    import jsonschema

    from specli.constraints.tools import parse_calls

    if "tools" not in w:
        jsonschema.validate(json.loads(text), w["schema"])
        return
    calls = parse_calls(fmt, text).calls
    if not calls:
        raise AssertionError(f"{w['id']}: no tool call in {text!r}")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in w["tools"]}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def main(args) -> int:
    from specli.constraints import Constraint, Grammar
    from specli.constraints.tools import Tool, ToolConstraint
    from specli.decoding.generation import Request
    from specli.decoding.loop import generate
    from specli.decoding.step import GRAMMAR, SpeculativeDecoder
    from specli.llama.conversation import encode_conversation
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend
    from specli.session.chat import choose_formatter

    pair = models.qwen()
    init_backend()
    target = LlamaModel(pair.target, n_ctx=2048, n_threads=args.threads)
    draft = LlamaModel(pair.draft, n_ctx=2048, n_threads=args.threads)
    formatter, _ = choose_formatter(target, None)
    cpu = cost_tables.load(None, cost_tables.QWEN_NOTES, cost_tables.QWEN_NOTES_DRAFT, "this CPU (NOTES)")
    tables = [cpu, cost_tables.flat_like(cpu)]
    work = [json.loads(line) for line in args.workloads.read_text(encoding="utf-8").splitlines() if line.strip()]
    work = [w for w in work if args.split == "all" or w["split"] == args.split]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    rows, results = [], []
    for w in work:
        if "tools" in w:  # a tool call (the template's format, tool_choice as given), its arguments checked against the tool's schema
            ids = encode_conversation(target, formatter, None, [{"role": "user", "content": w["prompt"]}], tools=w["tools"])
            tools = [Tool(t["function"]["name"], t["function"]["parameters"]) for t in w["tools"]]
            constraint = ToolConstraint(formatter.tool_format, tools, target, choice=w.get("tool_choice", "required"))
        else:
            ids = encode_conversation(target, formatter, None, [{"role": "user", "content": w["prompt"]}])
            grammar = Grammar("json_schema", json.dumps(w["schema"]), json_style="compact" if args.compact else "spaced")
            constraint = Constraint(grammar, target)
        plain = None
        for config in configs:
            drafter, length = _drafter(config, draft)
            gen = generate(SpeculativeDecoder(target, drafter, length), Request(ids, max_tokens=args.max_tokens, constraint=constraint)).run()
            _check(w, gen.text, formatter.tool_format)
            st = gen.stats
            one_pass = st.verify_s / max(1, st.target_passes) if config == "target-only" else None
            forced = st.by_source.get(GRAMMAR, [0, 0])
            rec = {"id": w["id"], "split": w["split"], "config": config, "tokens": len(gen.token_ids), "passes": st.target_passes,
                   "tokens_per_pass": st.mean_tokens_per_pass, "forced_drafted": forced[0], "forced_accepted": forced[1],
                   "drafted": st.drafted, "refused": st.drafted - st.accepted, "constraint_s": st.constraint_s,
                   "one_pass_s": one_pass, "same_text": None if plain is None else gen.token_ids == plain["ids"],
                   "modelled": {t.label: modelled_s(st, t.table, t.t_draft) for t in tables}, "ids": gen.token_ids}
            if plain is None:
                plain = rec
            results.append(rec)
            log(f"{w['id']} {config}: {rec['tokens']} tokens, {rec['passes']} passes, forced {forced[0]}/{forced[1]}")
    for config in configs:
        recs = [r for r in results if r["config"] == config]
        base = {r["id"]: r for r in results if r["config"] == configs[0]}
        def ratio(label: str, recs=recs, base=base) -> float:
            return gmean(base[r["id"]]["modelled"][label] / r["modelled"][label] for r in recs)

        tpp = sum(r["tokens"] for r in recs) / sum(r["passes"] for r in recs)
        per_token = statistics.median(r["constraint_s"] / r["tokens"] for r in recs)
        rows.append([config, f"{tpp:.2f}", f"{sum(r['forced_accepted'] for r in recs)}/{sum(r['forced_drafted'] for r in recs)}",
                     f"{sum(r['refused'] for r in recs)}/{sum(r['drafted'] for r in recs)}",
                     "-" if config == configs[0] else f"{sum(bool(r['same_text']) for r in recs)}/{len(recs)}",
                     f"{per_token * 1e3:.3f} ms", *(f"{ratio(t.label):.2f}x" for t in tables)])
    one = statistics.median(r["one_pass_s"] for r in results if r["one_pass_s"])
    table(["config", "tokens/pass", "forced accepted/drafted", "refused/drafted", "texts = plain", "constraint per token",
           *(f"modelled vs plain, {t.label}" for t in tables)], rows,
          title=f"structured output, {len(work)} workloads ({args.split}), greedy; a one-token target pass here: {one * 1e3:.1f} ms")
    write_json(Path(args.out) / "structured.json", results)
    return 0
