#!/usr/bin/env python3
"""Build cost-realistic synthetic (target, draft) pairs for `specli bench`, at three agreement levels.

Each pair comes from tests/fixtures/synthetic.py's make_cost_pair: the target is the draft's blocks plus 8
more (about 8-10x the draft's cost per token), and a calibrated scale on the extra blocks sets
how often the two agree. The levels aim at a greedy acceptance near 0.5, 0.7 and 0.9.
Random weights: these pairs measure the speculative loop's mechanics and cost, not language
quality.

For each pair it prints the two paths and the measured greedy agreement: along the target's
own greedy continuation of a fixed prompt (numpy reference forward pass), the fraction of
positions where the draft's argmax equals the target's.

Usage: python benchmarks/make_cost_pairs.py [--out /tmp/specli-cost-pairs] [--tokens 48]
Then e.g.: specli bench -m TARGET -d DRAFT --draft-max 1,2,3,5,8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures package
from fixtures import synthetic  # noqa: E402
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend

# make_cost_pair's agreement knob is teacher-forced on random tokens; along a greedy path the
# agreement differs, and the calibration is a bisection, so greedy agreement moves in steps as
# the knob does. These knob values were picked (seed 0) by measuring greedy agreement:
# knob 0.50 -> 0.42, 0.51 -> 0.54; 0.75 -> 0.71; 0.89 -> 0.77, 0.90 -> 0.96 (no step in between).
LEVELS = {"a50": 0.51, "a70": 0.75, "a90": 0.90}
PROMPT = "Once upon a time, in a small village,"


def greedy_agreement(target: Path, draft: Path, prompt_ids: list[int], n_new: int) -> float:
    """Fraction of the target's next n_new greedy tokens that the draft's argmax also picks,
    each position conditioned on the target's own continuation (teacher-forced)."""
    path = synthetic.greedy_path(target, prompt_ids, n_new)
    tokens = list(prompt_ids) + path
    # Logits at position i predict token i+1: compare the positions that predict the continuation.
    rows = slice(len(prompt_ids) - 1, len(tokens) - 1)
    t = synthetic.reference_logits(target, tokens)[rows].argmax(axis=1)
    d = synthetic.reference_logits(draft, tokens)[rows].argmax(axis=1)
    return float(np.mean(t == d))


def prompt_ids(model_path: Path) -> list[int]:
    """The fixed prompt in the pair's vocabulary (BOS as the model wants it)."""
    init_backend()
    model = LlamaModel(model_path, n_ctx=256, n_threads=1)
    try:
        return model.tokenize(PROMPT, add_bos=model.vocab_info().add_bos)
    finally:
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/specli-cost-pairs"), help="directory for the GGUF files")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens over which agreement is measured")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ids = None
    for label, knob in LEVELS.items():
        directory = args.out / label  # one folder per level: make_cost_pair names the draft by seed only
        directory.mkdir(parents=True, exist_ok=True)
        target, draft = synthetic.make_cost_pair(directory, seed=args.seed, agreement=knob)
        ids = ids or prompt_ids(target)
        agreement = greedy_agreement(target, draft, ids, args.tokens)
        print(f"{label}: target {target}")
        print(f"{' ' * len(label)}  draft  {draft}")
        print(f"{' ' * len(label)}  greedy agreement {agreement:.2f} over {args.tokens} tokens (knob {knob})")


if __name__ == "__main__":
    main()
