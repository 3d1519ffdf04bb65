"""Cost tables: seconds of a target pass by its width, and a draft model's seconds per token,
measured once per machine; and the GPU-like table (a pass over 16 tokens costs 1.1 one-token
passes, a draft token 0.1 of one), for a target about 10x its draft where wide passes are
nearly free."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from harness.common import log
from specli.decoding.replay import CostTable

FLAT_AT_16 = 1.1
FLAT_DRAFT = 0.1

# Measured on this kind of machine (2-core AMD EPYC, `llama-bench -p K -n 0 -t 2`,
# ../shared/NOTES.md 2026-12-03): the Qwen2.5-Coder 1.5B Q4_K_M target and its 0.5B draft.
QWEN_NOTES = {1: 0.0348, 2: 0.0348 * 1.52, 4: 0.0348 * 2.34, 8: 0.0348 * 4.93, 16: 0.0348 * 5.80, 32: 0.0348 * 10.1}
QWEN_NOTES_DRAFT = 0.0201
# Gemma 3 270M Q4_K_M (NOTES, 2026-12-02), no draft model of its family pays.
GEMMA_NOTES = {1: 0.0225, 4: 0.066, 16: 0.127, 32: 0.312, 65: 0.762}


@dataclass(frozen=True)
class Costs:
    """One machine's prices: the target's pass by width, a draft token."""

    table: CostTable
    t_draft: float  # seconds per draft-model token (0: no draft model)

    @property
    def label(self) -> str:
        return self.table.label


def flat_like(costs: Costs) -> Costs:
    one = costs.table(1)
    return Costs(CostTable.flat(one, FLAT_AT_16, "GPU-like"), FLAT_DRAFT * one)


def measure(target: Path, draft: Path | None, out: Path, *, threads: int, samples: int = 9, depth: int = 256) -> dict:
    """Median time of a target pass by width (1-65, logits for every position) after `depth`
    tokens of context, and of the draft model's one-token pass: specli's own measurement
    (session/costs.measure: every width and the draft's pass timed once a round, in shuffled
    order, `samples` rounds)."""
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend
    from specli.session.costs import measure as measure_passes

    init_backend()
    models = [LlamaModel(Path(p), n_ctx=1024, n_threads=threads) for p in (target, draft) if p is not None]
    try:
        costs = measure_passes(models[0], models[1] if draft is not None else None, widths=tuple(range(1, 66)),
                               samples=samples, depth=depth)
    finally:
        for model in models:
            model.close()
    payload = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "threads": threads, "depth": costs.depth,
               "target": {str(n): s for n, s in costs.target_s.items()}}
    log("target: " + ", ".join(f"T({n}) {costs.target_s[n] * 1e3:.1f} ms" for n in (1, 2, 4, 8, 16, 32, 65) if n in costs.target_s))
    if costs.draft_s is not None:
        payload["draft"] = {"1": costs.draft_s}
        log(f"draft: T(1) {costs.draft_s * 1e3:.1f} ms")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(payload, indent=1), encoding="utf-8")
    return payload


def load(path: Path | None, notes: dict[int, float], notes_draft: float, label: str) -> Costs:
    """This machine's measured table (the `costs` stage), else the one in the notes."""
    if path is not None and Path(path).exists():
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        table = CostTable.from_medians({int(n): s for n, s in data["target"].items()}, label)
        return Costs(table, data.get("draft", {}).get("1", 0.0))
    return Costs(CostTable.from_points(notes, label), notes_draft)
