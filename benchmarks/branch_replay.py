#!/usr/bin/env python3
"""Several candidates in one pass, replayed: does a tree of drafts pay where a chain does not?

Clock-free, on memory_replay.py's workloads (tools, code, extract, prose; or --texts): text i is
replayed on its known output with a MemoryDrafter whose memory holds texts 0 .. i-1, as in
memory_replay.py. Each step, at a fixed draft length n:

  chain      the drafter's proposal (lookup in the context, else the memory's best when most
             earlier places agree on it): one branch of up to n tokens, width = drafts + 1;
  tree B     that chain plus the memory's other candidates (TokenMemory.lookup, best first:
             most places, longest match, latest), up to B distinct branches of up to n tokens
             each; width = distinct tree nodes + 1 (branches share their common prefixes);
  judged B   what --draft-max auto does (branches.plan_branches, told the table the pass is
             charged from): a node outside the chain kept only where the memory's odds for it
             (times BRANCH_ODDS) times a one-token pass exceed what it adds to the pass, and no
             other branch beside a copy from the context ("after lookup too": with them).

Accepted = the longest branch's agreement with the text; each pass emits it + 1 tokens. Each
pass is charged on memory_replay.CPU (2-core CPU, NOTES) and memory_replay.GPU (flat: 16 tokens
cost 1.1 one-token passes); speedup = plain decoding's modelled time / the run's.

Seen (Gemma's tokenizer; the first 160 Spec-Bench texts, 20 per category): on the CPU table a
tree at a fixed B costs 2-54% of the chain's speed everywhere (5-50% on Spec-Bench), and the
judged tree almost never branches (within 0.1% of the chain); on the flat table trees gain
1-2% on Spec-Bench (1-5% per category), 2-10% on tools, 1-4% on extract, -1..+2% on code,
nothing on prose; the judged tree gets most of that (-1..+8%).

Usage:
  python benchmarks/branch_replay.py [--workloads tools,code,extract,prose] [--n 2,4,8,16] [--b 2,3,4]
  python benchmarks/branch_replay.py --workloads '' --texts /tmp/specli-spec-bench/texts-spec_bench.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import memory_replay as mr  # noqa: E402
from memory_replay import CPU, GPU  # noqa: E402

from specli.decoding.branches import TokenTree, choose_branches, plan_branches  # noqa: E402
from specli.decoding.memory import TokenMemory  # noqa: E402
from specli.decoding.memory_drafter import MemoryDrafter  # noqa: E402
from specli.decoding.policy import FIXED  # noqa: E402
from specli.decoding.replay import agreeing  # noqa: E402

try:  # (a MemoryDrafter's record of how its kinds of draft fared, where it keeps one)
    from specli.decoding.memory_drafter import MemoryRecord  # noqa: E402
except ImportError:
    MemoryRecord = None


def replay_tree(text: list[int], p: int, drafter: MemoryDrafter, n: int, branches: int, judged_on=None,
                after_lookup: bool = False) -> list[tuple[int, int]]:  # fmt: skip
    """(width, tokens emitted) of each pass replaying text[p:]; branches 1 = the chain alone.
    Judged (judged_on a table): the engine's choice (branches.plan_branches), or with
    after_lookup other branches beside a copy from the context too."""
    drafter.begin(text[:p])
    out = []
    pos = p
    while pos < len(text):
        context = text[:pos]
        k = min(n, len(text) - pos - 1)
        proposal = drafter.propose(context, k, FIXED) if k > 0 else None
        chain = list(proposal.tokens) if proposal is not None else []
        if branches > 1 and k > 0 and (judged_on is None or after_lookup):
            found = [(c.tokens, c.count) for c in drafter.memory.lookup(context, k)]
            tree_branches = choose_branches(chain, found, k, branches, judged_on) if found else ([chain] if chain else [])
        elif branches > 1 and k > 0:
            tree_branches = plan_branches(drafter, context, chain, k, branches, judged_on, proposal.source)
        else:
            tree_branches = [chain] if chain else []
        tree = TokenTree.of(tree_branches)
        n_acc = max((agreeing(b, text, pos) for b in tree_branches), default=0)
        if chain:
            drafter.update(len(chain), agreeing(chain, text, pos))
        out.append((tree.width, n_acc + 1))
        pos += n_acc + 1
    return out


def variants(bs: list[int]) -> list[tuple[str, int, object]]:
    """(label, branches, judged on which table: None, "CPU" or "GPU")."""
    return ([("chain", 1, None)] + [(f"tree {b}", b, None) for b in bs]
            + [(f"judged {b}, CPU", b, "CPU") for b in bs] + [(f"judged {b}, GPU", b, "GPU") for b in bs]
            + [(f"judged {b}, CPU, after lookup too", b, "CPU") for b in bs]
            + [(f"judged {b}, GPU, after lookup too", b, "GPU") for b in bs])  # fmt: skip


def replay_workload(texts: list[dict], ns: list[int], bs: list[int]) -> dict:
    """Per (n, variant): [passes, tokens, CPU seconds, GPU seconds, width sum] over the texts.
    Each (n, variant) drafts as one process would: its own record of how memory drafts fared."""
    memory = TokenMemory("bench")
    tot: dict = {}
    records: dict = {}
    for row in texts:
        text = list(row["prompt_ids"]) + list(row["output_ids"])
        p = len(row["prompt_ids"])
        if len(text) <= p + 1 or p == 0:
            continue
        for n in ns:
            for label, b, told in variants(bs):
                table = {"CPU": CPU, "GPU": GPU}.get(told)
                kw = {} if MemoryRecord is None else {"record": records.setdefault((n, label), MemoryRecord())}
                passes = replay_tree(text, p, MemoryDrafter(memory, **kw), n, b, table, after_lookup="after lookup too" in label)
                t = tot.setdefault((n, label), [0, 0, 0.0, 0.0, 0])
                t[0] += len(passes)
                t[1] += sum(e for _, e in passes)
                t[2] += sum(CPU(w) for w, _ in passes)
                t[3] += sum(GPU(w) for w, _ in passes)
                t[4] += sum(w for w, _ in passes)
        memory.add(text)
    return tot


def print_table(title: str, tot: dict, ns: list[int], bs: list[int], n_texts: int) -> None:
    tokens = next(iter(tot.values()))[1] if tot else 0
    print(f"\n### {title}: {n_texts} texts, {tokens} tokens generated")
    print("| n | variant | tokens/pass | mean width | speedup CPU | speedup GPU | vs chain CPU | vs chain GPU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in ns:
        chain = tot[(n, "chain")]
        for label, _, told in variants(bs):
            passes, toks, cpu, gpu, widths = tot[(n, label)]
            s_cpu, s_gpu = toks * CPU(1) / cpu, toks * GPU(1) / gpu
            cells = [str(n), label, f"{toks / passes:.2f}", f"{widths / passes:.1f}",
                     "" if told == "GPU" else f"{s_cpu:.2f}x", "" if told == "CPU" else f"{s_gpu:.2f}x",
                     "" if told == "GPU" else f"{chain[2] / cpu:.3f}", "" if told == "CPU" else f"{chain[3] / gpu:.3f}"]  # fmt: skip
            print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="tools,code,extract,prose")
    ap.add_argument("--texts", action="append", default=[])
    ap.add_argument("--tokenizer", choices=["auto", "gemma", "words"], default="auto")
    ap.add_argument("--n", type=lambda s: [int(x) for x in s.split(",") if x], default=[2, 4, 8, 16])
    ap.add_argument("--b", type=lambda s: [int(x) for x in s.split(",") if x], default=[2, 3, 4])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    if names:
        tok = mr.tokenizer(args.tokenizer)
        print(f"tokenizer: {tok.name}")
        makers = {"tools": mr.tools_workload, "code": mr.code_workload, "extract": mr.extract_workload}
        for name in names:
            pairs = mr.prose_workload() if name == "prose" else makers[name](random.Random(f"{args.seed}-{name}"))
            texts = mr.tokenized(pairs, tok, name)
            print_table(name, replay_workload(texts, args.n, args.b), args.n, args.b, len(texts))
    for path in args.texts:
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = mr.spec_bench_order(rows)
        print_table(Path(path).name, replay_workload(rows, args.n, args.b), args.n, args.b, len(rows))
        by_cat: dict[str, list[dict]] = {}
        for r in rows:
            by_cat.setdefault(r.get("category", ""), []).append(r)
        # (per category: the memory holds only that category's earlier texts)
        for cat, group in sorted(by_cat.items()):
            print_table(f"{Path(path).name} [{cat}, its own memory]", replay_workload(group, args.n, args.b), args.n, args.b, len(group))


if __name__ == "__main__":
    main()
