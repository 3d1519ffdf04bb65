#!/usr/bin/env python3
"""What llama.cpp's graph reuse is worth to target-only, fixed-N and `-n auto` decoding, in one run.

llama.cpp skips rebuilding its compute graph when a pass has the same shape (number of tokens,
outputs, KV window) as the context's previous pass. Plain decoding repeats one shape forever; a
fixed N repeats the target's (N+1)-token pass; `-n auto` changes the pass size from step to step.
This script loads the pair twice in one process: once as usual, once with graph reuse off
(LLAMA_GRAPH_REUSE_DISABLE=1, read by llama.cpp when a context is created), and runs every
configuration on both, interleaved, on the seven `specli bench` prompts.

Printed: each configuration's geometric-mean speedup over target-only in each world, and how much
faster each configuration runs with reuse than without (same process, same prompts).

Usage: python benchmarks/graph_reuse.py --pair /tmp/specli-cost-pairs/a70 [--ns 5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from specli.session.bench import BUILTIN_PROMPTS, token_budget
from specli.decoding.drafters import DraftModelDrafter
from specli.decoding.engine import SpeculativeDecoder
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend
from specli.decoding.sampling import GREEDY
from specli.modes import DraftLength

WORLDS = ("reuse", "no reuse")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, required=True, help="a folder from make_cost_pairs.py")
    parser.add_argument("--ns", default="5", help="fixed N to run beside auto (comma-separated)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    init_backend()
    models = {}
    for world in WORLDS:
        if world == "no reuse":
            os.environ["LLAMA_GRAPH_REUSE_DISABLE"] = "1"
        models[world] = tuple(
            LlamaModel(next(args.pair.glob(f"*{role}*.gguf")), n_ctx=4096, n_threads=args.threads)
            for role in ("target", "draft")
        )
    names = ["plain", *(f"N={n}" for n in args.ns.split(",")), "auto"]
    configs = {}
    for world, (target, draft) in models.items():
        for name in names:
            n_draft = DraftLength.off() if name == "plain" else DraftLength.auto() if name == "auto" else DraftLength.fixed_at(int(name[2:]))
            drafter = None if name == "plain" else DraftModelDrafter(draft)
            configs[(world, name)] = SpeculativeDecoder(target, drafter, n_draft, GREEDY)
    # Both worlds load the same target file: one tokenization serves both.
    prompt_ids = {p.name: models["reuse"][0].tokenize(p.text, add_bos=True) for p in BUILTIN_PROMPTS}
    rates: dict[tuple[str, str, str], list[float]] = {}
    for round_ in range(args.repeat + 1):  # round 0 warms every configuration up, unrecorded
        for prompt in BUILTIN_PROMPTS:
            ids = prompt_ids[prompt.name]
            for (world, name), decoder in configs.items():
                budget = token_budget(prompt, args.max_tokens) if round_ else 16
                gen = decoder.generate(ids, max_tokens=budget).run()
                if round_:
                    rates.setdefault((prompt.name, world, name), []).append(gen.stats.tokens_per_s)

    def rate(prompt: str, world: str, name: str) -> float:
        return statistics.median(rates[(prompt, world, name)])

    prompts = [p.name for p in BUILTIN_PROMPTS]
    print(f"{'geometric mean over target-only':34}" + "".join(f"{n:>9}" for n in names))
    for world in WORLDS:
        speedups = [statistics.geometric_mean([rate(p, world, n) / rate(p, world, "plain") for p in prompts])
                    for n in names]
        print(f"{'  graph ' + world:34}" + "".join(f"{s:8.3f}x" for s in speedups))
    gains = [statistics.geometric_mean([rate(p, "reuse", n) / rate(p, "no reuse", n) for p in prompts]) for n in names]
    print(f"{'with reuse / without (same config)':34}" + "".join(f"{g:8.3f}x" for g in gains))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
