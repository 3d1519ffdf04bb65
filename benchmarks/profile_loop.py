#!/usr/bin/env python3
"""Where a generation's time goes: llama.cpp's decode vs specli's Python, per configuration.

Profiles (cProfile, standard library) one warm generation per configuration on the embedded
Gemma 3 270M Q4_K_M, greedy, in one process, and prints the share of generation time spent in
`llama_decode` (native compute), in the Python loop around it, and the top Python functions by
own time. A loop that matches native speed spends nearly all its time in decode.

Usage: python benchmarks/profile_loop.py [--max-tokens 128] [--top 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

from bench_lookup import PROMPTS, default_model

from specli.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specli.decoding.engine import SpeculativeDecoder
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend


def profile(decoder: SpeculativeDecoder, prompt_ids: list[int], max_tokens: int, top: int) -> None:
    decoder.generate(prompt_ids, max_tokens=8).run()  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    gen = decoder.generate(prompt_ids, max_tokens=max_tokens).run()
    profiler.disable()
    stats = pstats.Stats(profiler)
    decode_s = sum(tt for (file, _, name), (_, _, tt, _, _) in stats.stats.items() if name == "_decode_chunk")
    total = gen.stats.generation_s + gen.stats.prompt_s
    print(f"  {gen.stats.tokens_per_s:.1f} tok/s, {gen.stats.target_passes} target passes; decode {decode_s / total:.1%} "
          f"of the time, everything else {1 - decode_s / total:.1%}")  # fmt: skip
    rows = sorted(((tt, f"{file.split('/')[-1]}:{name}") for (file, _, name), (_, _, tt, _, _) in stats.stats.items()
                   if name != "_decode_chunk"), reverse=True)[:top]  # fmt: skip
    for tt, where in rows:
        print(f"    {tt * 1000:7.1f} ms  {where}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    init_backend()
    path = default_model()
    target = LlamaModel(path, n_ctx=4096, n_threads=args.threads)
    draft = LlamaModel(path, n_ctx=4096, n_threads=args.threads)  # the same file: full acceptance
    ids = target.tokenize(PROMPTS["code"], add_bos=True)
    for label, decoder in (
        ("target-only", SpeculativeDecoder(target, None, 0)),
        ("lookup -n 16", SpeculativeDecoder(target, PromptLookupDrafter(), 16)),
        ("lookup -n auto", SpeculativeDecoder(target, PromptLookupDrafter(), "auto")),
        ("draft model (itself) -n 4", SpeculativeDecoder(target, DraftModelDrafter(draft), 4)),
        ("draft model (itself) -n auto", SpeculativeDecoder(target, DraftModelDrafter(draft), "auto")),
    ):
        print(f"{label}:")
        profile(decoder, ids, args.max_tokens, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
