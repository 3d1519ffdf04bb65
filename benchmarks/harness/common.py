"""Printing and arithmetic every entry point shares: logs on stderr, Markdown tables on
stdout, geometric means with their spread, results as JSON."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the checkout
SHARED = ROOT.parent / "shared"
DEFAULT_OUT = Path(os.environ.get("SPECLI_BENCH_OUT", "/tmp/specli-bench"))

# Spec-Bench's categories in its leaderboard's order.
ORDER = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
         "translation", "summarization", "qa", "math_reasoning", "rag"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def gmean(values: Iterable[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    return f"[{min(values):.2f}-{max(values):.2f}]" if values else ""


def gm_cell(values: Sequence[float], fmt: str = ".2f", suffix: str = "") -> str:
    """'1.23x [0.98-1.40]': the geometric mean and the spread."""
    return f"{gmean(values):{fmt}}{suffix} {spread(values)}" if values else "-"


def category_order(categories: Iterable[str]) -> list[str]:
    return sorted(set(categories), key=lambda c: (c not in ORDER, ORDER.index(c) if c in ORDER else 0, c))


def table(head: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None) -> None:
    """A Markdown table on stdout."""
    if title:
        print(f"\n{title}")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def write_json(path: Path, payload: object) -> Path:
    """Results for BENCHMARKS.md, with when and where they were taken; written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": os.uname().nodename, "load_avg": os.getloadavg()[0]}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": payload}), encoding="utf-8")
    tmp.replace(path)
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
