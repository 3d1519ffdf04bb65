"""What drafting can gain at best on this machine, from measured prices: the target's pass by its
width and the draft model's token. `specli bench` measures them on the models it loaded
(measure, a few seconds) and prints them beside its verdicts.

Why: on a CPU a pass over k tokens costs far more than a one-token pass (Qwen2.5-Coder 1.5B on
2 cores: 2.3x at 4 tokens, 5.8x at 16), so a draft model that costs half a target token cannot
pay even if every draft is accepted; no acceptance rate or policy fixes that, and the bench
should say so rather than blame the drafts. The ceilings are pure arithmetic (tested without a
model); the timing goes through LlamaModel.eval/truncate (llama_cpp stays in specli/llama/).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from specli.llama.model import LlamaModel

WIDTHS = (1, 2, 4, 8, 16)  # target pass widths timed (N + 1 for N drafts per step)
SAMPLES = 5  # timings per width; the median counts
DRAFT_PER_ROUND = 2  # the draft model's one-token pass is cheap: more timings, steadier median
DEPTH = 128  # tokens of context before each timed pass (attention reads them all)
# A break-even acceptance this high is more than a draft model keeps up on open-ended text (the
# Qwen 0.5B drafting for its 1.5B measured α 0.72-0.92 on code and chat).
RARE_ALPHA = 0.95
NEARLY_FREE = 2.0  # the widest pass under this many one-token passes: "wide passes are nearly free"

# Text to fill the context with: any text does, the timing does not depend on the tokens.
_CONTEXT_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion of the library's opening hours, the members agreed to extend them on weekends "
    "and to fund two more staff positions from the savings on heating. "
)


@dataclass(frozen=True)
class Ceiling:
    """The best gain over target-only some draft length allows, if every draft is accepted."""

    speedup: float
    n: int  # drafts per step at the best
    width: int  # the target pass it verifies them in: n + 1 tokens

    def to_json(self) -> dict:
        return {"speedup": self.speedup, "n": self.n, "width": self.width}


def lookup_ceiling(target_s: Mapping[int, float]) -> Ceiling:
    """A free drafter's best (prompt lookup costs next to nothing): a pass of width w yields at
    most w tokens, so the gain is at most max_w w T(1) / T(w) over the measured widths (ties: the
    narrower). Needs T(1)."""
    one = target_s[1]
    gain = {w: w * one / t for w, t in target_s.items()}
    w = max(gain, key=lambda k: (gain[k], -k))
    return Ceiling(gain[w], w - 1, w)


def draft_ceiling(target_s: Mapping[int, float], draft_s: float) -> Ceiling:
    """A draft model's best: N drafts cost N draft tokens and one target pass of width N + 1,
    which yields at most N + 1 tokens, so the gain is at most
    max_N (N + 1) T(1) / (T(N + 1) + N t_d) over the measured widths N + 1 >= 2 (ties: the
    shorter N). Needs T(1) and one wider width."""
    one = target_s[1]
    gain = {w: w * one / (t + (w - 1) * draft_s) for w, t in target_s.items() if w >= 2}
    w = max(gain, key=lambda k: (gain[k], -k))
    return Ceiling(gain[w], w - 1, w)


def break_even_alpha(target_s: Mapping[int, float], draft_s: float) -> float | None:
    """The lowest per-token acceptance α at which some measured N breaks even with a draft
    model: (1 - α^(N+1)) / (1 - α) tokens per step (Leviathan et al.) against a step's cost
    (T(N + 1) + N t_d) / T(1). None when no N does, even at α = 1."""
    one, best = target_s[1], None
    for w, t in target_s.items():
        n, cost = w - 1, (t + (w - 1) * draft_s) / one
        if n < 1 or cost > w:  # (tokens per step reach at most N + 1 = w)
            continue
        lo, hi = 0.0, 1.0  # tokens per step rise with α: bisect for tokens == cost
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(mid**i for i in range(w)) < cost else (lo, mid)
        best = hi if best is None else min(best, hi)
    return best


def alpha_text(alpha: float) -> str:
    """An acceptance for a sentence: three decimals near 1, where 0.998 must not read 1.00."""
    return f"{alpha:.3f}" if alpha > 0.99 else f"{alpha:.2f}"


@dataclass(frozen=True)
class PassCosts:
    """Measured prices on this machine: the target's pass by width, the draft model's token."""

    target_s: dict[int, float]  # median seconds of a target pass over w tokens (logits for all), by w
    draft_s: float | None = None  # median seconds of the draft model's one-token pass; None: no draft model
    depth: int = DEPTH  # tokens of context before each pass
    samples: int = SAMPLES

    def relative(self) -> dict[int, float]:
        """T(w) / T(1) per width."""
        one = self.target_s[1]
        return {w: t / one for w, t in sorted(self.target_s.items())}

    @property
    def draft_relative(self) -> float | None:
        """t_d / T(1): the draft model's token in target one-token passes."""
        return None if self.draft_s is None else self.draft_s / self.target_s[1]

    @property
    def lookup(self) -> Ceiling:
        return lookup_ceiling(self.target_s)

    @property
    def draft(self) -> Ceiling | None:
        return None if self.draft_s is None or len(self.target_s) < 2 else draft_ceiling(self.target_s, self.draft_s)

    def to_json(self) -> dict:
        """bench's --json "costs" object."""
        draft = self.draft
        return {
            "depth": self.depth, "samples": self.samples,
            "target_s": {str(w): t for w, t in sorted(self.target_s.items())},
            "relative": {str(w): r for w, r in self.relative().items()},
            "draft_s": self.draft_s, "draft_relative": self.draft_relative,
            "lookup_ceiling": self.lookup.to_json(),
            "draft_ceiling": draft.to_json() if draft else None,
            "draft_break_even_alpha": break_even_alpha(self.target_s, self.draft_s) if draft else None,
        }


def conclusion(costs: PassCosts) -> str:
    """What the prices allow, in plain words (one sentence)."""
    lookup, draft = costs.lookup, costs.draft
    widest = max(costs.target_s)
    wide = costs.relative()[widest]
    parts = []
    if draft is not None and draft.speedup < 1.0:
        parts.append("with this draft model drafting cannot pay on this machine, even if every draft were accepted "
                     f"(at most {draft.speedup:.2f}x, at N={draft.n})")
    elif draft is not None:
        alpha = break_even_alpha(costs.target_s, costs.draft_s)
        rare = ", which a draft model rarely keeps up outside text copied from its input" if alpha >= RARE_ALPHA else ""
        parts.append(f"with this draft model drafting can gain at most {draft.speedup:.2f}x (N={draft.n}) if every "
                     f"draft is accepted, and breaks even from a per-token acceptance of {alpha_text(alpha)}{rare}")
    parts.append(f"prompt lookup can gain up to {lookup.speedup:.2f}x (N={lookup.n}) where the text repeats its input (--lookup)")
    text = "; ".join(parts)
    if wide < NEARLY_FREE:
        text = f"wide passes are nearly free here ({widest} tokens cost {wide:.2f}x one): " + text
    return text[0].upper() + text[1:] + "."


def measure(model_tgt: "LlamaModel", model_dft: "LlamaModel | None", *, widths: tuple[int, ...] = WIDTHS,
            samples: int = SAMPLES, depth: int = DEPTH) -> PassCosts:
    """Time the target's pass at each width (logits for every row, as a verification pass asks)
    and the draft model's one-token pass, each after `depth` tokens of context; medians. Every
    round times each once (the draft's pass DRAFT_PER_ROUND times) in shuffled order, so that a
    slow spell of a shared machine hits every width and both models alike: t_d / T(1) compares
    timings taken side by side. Each pass runs once untimed first (llama.cpp sizes its buffers
    for a new width). Leaves both caches empty.

    The widths kept are those the context and the batch hold (width 1 always)."""
    depth = max(0, min(depth, model_tgt.n_ctx - max(widths) - 1))
    kept = tuple(w for w in widths if w <= model_tgt.n_batch and depth + w < model_tgt.n_ctx) or (1,)
    passes = [(model_tgt, w) for w in kept]
    if model_dft is not None:
        passes += [(model_dft, 1)] * DRAFT_PER_ROUND
    models = [model_tgt] + ([model_dft] if model_dft is not None else [])
    contexts = {}
    times: dict[tuple[int, int], list[float]] = {(id(m), w): [] for m, w in passes}
    try:
        for model in models:
            d = max(0, min(depth, model.n_ctx - max(w for m, w in passes if m is model) - 1))
            contexts[id(model)] = (d, _context_ids(model, d + max(kept)))
            model.truncate(0)
            model.eval(contexts[id(model)][1][:d], logits="none")
        for model, w in dict.fromkeys(passes):  # untimed, once each
            _one_pass(model, w, *contexts[id(model)])
        rng = random.Random(0)
        for _ in range(samples):
            order = passes[:]
            rng.shuffle(order)
            for model, w in order:
                times[id(model), w].append(_one_pass(model, w, *contexts[id(model)]))
    finally:
        for model in models:
            model.truncate(0)
    target_s = {w: statistics.median(times[id(model_tgt), w]) for w in kept}
    draft_s = statistics.median(times[id(model_dft), 1]) if model_dft is not None else None
    return PassCosts(target_s, draft_s, depth, samples)


def _context_ids(model: "LlamaModel", n: int) -> list[int]:
    """n tokens of filler text in the model's own vocabulary."""
    ids = model.tokenize(_CONTEXT_TEXT, add_bos=False) or [0]
    return (ids * (n // len(ids) + 1))[:n]


def _one_pass(model: "LlamaModel", width: int, depth: int, ids: list[int]) -> float:
    """Seconds of one pass over `width` tokens after `depth` cached ones, forgotten after."""
    start = time.perf_counter()
    model.eval(ids[depth : depth + width], logits="all")  # (returns once the logits are there)
    seconds = time.perf_counter() - start
    model.truncate(depth)
    return seconds
