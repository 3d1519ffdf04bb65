"""Make the synthetic cost pairs a50, a70, a90 (a draft honestly cheaper than its target) and print their paths.

tests/fixtures/synthetic.py's make_cost_pair: a target of 9 blocks over a 1-block draft (about
8-10x its cost per token), random weights, a calibrated scale on the extra blocks setting how
often the two agree. a50, a70 and a90 aim at greedy agreement 0.5, 0.7 and 0.9 (seed 0 measured
0.54, 0.71, 0.96 along the target's greedy text). They measure the loop's mechanics and cost,
not language quality. Made on first use under $SPECLI_COST_PAIRS (default /tmp/specli-cost-pairs).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.common import ROOT
from harness.models import Pair

PAIRS_DIR = Path(os.environ.get("SPECLI_COST_PAIRS", "/tmp/specli-cost-pairs"))
# make_cost_pair's knob is teacher-forced on random tokens; along a greedy path agreement moves in
# steps (seed 0: knob 0.50 -> 0.42, 0.51 -> 0.54; 0.75 -> 0.71; 0.89 -> 0.77, 0.90 -> 0.96).
LEVELS = {"a50": 0.51, "a70": 0.75, "a90": 0.90}


def cost_pair(label: str, folder: Path = PAIRS_DIR) -> Pair:
    """The pair `label` (a50, a70, a90), made there if missing (a few seconds of numpy)."""
    where = Path(folder) / label  # one folder per level: make_cost_pair names its files by seed only
    targets, drafts = sorted(where.glob("*-target-*.gguf")), sorted(where.glob("*-draft-*.gguf"))
    if not (targets and drafts):
        sys.path.insert(0, str(ROOT / "tests"))  # the fixtures package
        from fixtures import synthetic

        where.mkdir(parents=True, exist_ok=True)
        target, draft = synthetic.make_cost_pair(where, seed=0, agreement=LEVELS[label])
        targets, drafts = [target], [draft]
    return Pair(label, targets[0], drafts[0], chat=False)


def add_arguments(ap) -> None:
    ap.add_argument("--out", type=Path, default=PAIRS_DIR)


def main(args) -> int:
    for label in LEVELS:
        pair = cost_pair(label, args.out)
        print(f"{label}: -m {pair.target} -d {pair.draft}")
    return 0
