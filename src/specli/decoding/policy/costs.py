"""What a target pass costs: T(n), the seconds of a pass over n tokens, learnt from timed passes,
and what the context before a pass adds to it. Pure arithmetic on timings handed in.

The measurements behind each rule: docs/policy.md ("Pass costs").
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from specli.decoding.policy.constants import CONTEXT_PRIOR, FIRST_LOOK, NOISE, PRIOR_SLOPE, PRIOR_WEIGHT, RECENT


def recent_timings() -> deque:
    """A run's recent timings of one kind, whose median is saved: the last 1 / (1 - RECENT),
    about 20, as many as the cost line weighs."""
    return deque(maxlen=round(1 / (1 - RECENT)))


def contended(utilization: float | None, usual: float | None) -> bool:
    """Whether a pass that used `utilization` CPU seconds per second was slowed by other
    processes: it used less than 1 / NOISE of the usual (unknown either way: not contended)."""
    return utilization is not None and usual is not None and utilization * NOISE < usual


def running_time(mean: float | None, seconds: float, weight: float | None = None) -> float:
    """A running mean of a duration, the newest timing counting `weight` (1 / FIRST_LOOK: it
    follows the last few); a timing counts at most NOISE times the mean (a pass stalled by
    another process must not steer it for dozens). Symmetric: following faster timings faster
    than slower ones biased it low (docs/policy.md, `running_time`)."""
    if mean is None:
        return seconds
    return mean + (1 / FIRST_LOOK if weight is None else weight) * (min(seconds, NOISE * mean) - mean)


class ContextSlope:
    """B, what a target pass costs per token per token of context before it: T(n, L) = T(n, 0)
    + B n L. Attention reads the whole cache for every token of a pass, a large part of a
    small model's pass on a CPU; without B, costs learnt at one context length priced passes
    at another wrongly (docs/policy.md, `ContextSlope`).

    Estimated from the passes themselves: within each pass size, timing against n L, pooled
    over sizes (least squares with one intercept per size), and leaning to the prior (0, or a
    saved slope) until the contexts seen differ enough to tell. Every pass of the run counts
    alike: B is the machine's and the model's, not the text's, and a pass stalled by another
    process is clipped to NOISE times its prediction.
    """

    def __init__(self) -> None:
        self._sizes: dict[int, list[float]] = {}  # per size: [passes, mean x, mean t] (x = n L)
        self._num = 0.0  # sum over sizes of the centred x t (updated as Welford's, exact where x does not vary)
        self._den = 0.0  # sum over sizes of the centred x^2
        self.prior = 0.0  # the slope it leans to until contexts differ enough (a saved one, or 0)

    def observe(self, n_tokens: int, seconds: float, context: int) -> None:
        """A pass over n_tokens after `context` tokens took `seconds`."""
        x = float(n_tokens * context)
        size = self._sizes.setdefault(n_tokens, [0, 0.0, 0.0])
        count, mean_x, mean_t = size
        if count >= 3:  # one stalled pass must not tilt the slope for hundreds
            seconds = min(seconds, NOISE * (mean_t + self.slope * (x - mean_x)))
        count += 1
        dx = x - mean_x
        mean_x += dx / count
        mean_t += (seconds - mean_t) / count
        self._num += dx * (seconds - mean_t)
        self._den += dx * (x - mean_x)
        size[:] = [count, mean_x, mean_t]

    @property
    def slope(self) -> float:
        """B in seconds per token per token of context (never negative)."""
        return max((self._num + CONTEXT_PRIOR * self.prior) / (max(self._den, 0.0) + CONTEXT_PRIOR), 0.0)

    @property
    def learnt(self) -> bool:
        """Whether the run's own passes have told the slope more than the prior has."""
        return self._den > CONTEXT_PRIOR


class PassCost:
    """T(n), the seconds of a target pass over n tokens, learnt from timed passes.

    A one-token pass (plain decoding, or a draft model's look that kept nothing) keeps a running
    mean of its own. Wider passes follow a straight line, T(n) = a + b n, fitted by least
    squares to recent passes, each older pass counting RECENT as much as the next: on a
    CPU a pass costs about a fixed part plus a part per token, on a GPU nearly the fixed part
    alone. (One mean per size left a size measured in a slow moment expensive for good: it was
    never chosen again, so never re-measured; docs/policy.md, `PassCost`.)
    Beyond the widest pass measured lately, the cost rises optimistically (the smaller of the
    fitted and the prior slope), so that a longer draft gets tried and then judged on its real
    cost; a pessimistic guess would never be put to the test.
    """

    def __init__(self) -> None:
        # Timings are kept as at no context (less B n L, see ContextSlope), the table adds it back.
        self._mean: dict[int, float] = {}  # per size: running mean (T(1) is read from it)
        self._fit = [0.0] * 5  # wide passes, forgetting-weighted: sum w, w n, w n^2, w t, w n t
        self._widest = 0.0  # the widest pass measured lately (fades back like the fit)
        # One-token passes grow faster with the context than wide ones do per token: a slope each.
        self.context_one, self.context_wide = ContextSlope(), ContextSlope()
        # The run's own recent timings per size, as at no context, with the CPU use per second
        # of each (None where not measured): what is saved, as medians of the uncontended ones.
        self.samples: dict[int, deque[tuple[float, float | None]]] = {}

    def observe(self, n_tokens: int, seconds: float, cold: bool = False, context: int = 0,
                utilization: float | None = None) -> None:
        """A pass over n_tokens after `context` tokens took `seconds` (using `utilization` CPU
        seconds per second). `cold`: it ran in another regime than the one its size is priced
        for (a wide pass after a step that ran no draft model, a one-token pass other than plain
        after plain): it counts at most as the line's estimate, and not towards the context slope
        (such passes come late in a reply, where drafting stops paying, and would pass their
        slowness off as the context's), nor is it saved."""
        assert n_tokens >= 1 and seconds >= 0 and math.isfinite(seconds)
        if 1 in self._mean and n_tokens > 1:
            # A wide pass is never charged more than NOISE one-token passes per token: what
            # is above that is a stall, not the pass.
            seconds = min(seconds, NOISE * n_tokens * (self._mean[1] + self.context_cost(1, context)))
        if not cold:
            self._context_slope(n_tokens).observe(n_tokens, seconds, context)
        seconds = self.at_no_context(n_tokens, seconds, context)
        if not cold:
            self.samples.setdefault(n_tokens, recent_timings()).append((seconds, utilization))
        self._mean[n_tokens] = running_time(self._mean.get(n_tokens), seconds)
        if n_tokens >= 2:
            if self._fit[0] >= 3:
                # One pass stalled by another process must not steer the line for dozens.
                at_0, slope = self._line()
                seconds = min(seconds, (1.0 if cold else NOISE) * (at_0 + slope * n_tokens))
            w, wn, wnn, wt, wnt = (x * RECENT for x in self._fit)
            self._fit = [w + 1, wn + n_tokens, wnn + n_tokens**2, wt + seconds, wnt + n_tokens * seconds]
            self._widest = max(self._widest * RECENT, n_tokens)

    def _context_slope(self, n_tokens: int) -> ContextSlope:
        return self.context_one if n_tokens == 1 else self.context_wide

    def context_cost(self, n_tokens: int, context: int) -> float:
        """What `context` tokens before it add to a pass over n_tokens."""
        return self._context_slope(n_tokens).slope * n_tokens * context

    def at_no_context(self, n_tokens: int, seconds: float, context: int) -> float:
        """A timing taken after `context` tokens, as it would be with none (at least a tenth of it)."""
        return max(seconds - self.context_cost(n_tokens, context), 0.1 * seconds)

    def seed(self, n_tokens: int, seconds: float, weight: float | None = None) -> None:
        """Start from a saved cost: a pass over n_tokens at no context takes `seconds`, counted as
        `weight` passes (PRIOR_WEIGHT: the run's own passes soon outweigh it). Not a sample of this run."""
        weight = PRIOR_WEIGHT if weight is None else weight
        self._mean[n_tokens] = seconds if n_tokens not in self._mean else self._mean[n_tokens]
        if n_tokens >= 2:
            w, wn, wnn, wt, wnt = self._fit
            self._fit = [w + weight, wn + weight * n_tokens, wnn + weight * n_tokens**2, wt + weight * seconds,
                         wnt + weight * n_tokens * seconds]
            self._widest = max(self._widest, n_tokens)

    def medians(self, usual_utilization: float | None) -> dict[int, tuple[float, int]]:
        """Per size: the median of the recent timings not slowed by other processes (CPU use
        per second at least 1 / NOISE times `usual_utilization`), and how many there were."""
        out = {}
        for n, kept in self.samples.items():
            good = [s for s, u in kept if not contended(u, usual_utilization)]
            if good:  # (one is enough: the next run checks what it is told)
                out[n] = (statistics.median(good), len(good))
        return out

    def __call__(self, n_tokens: int) -> float:
        return self.table(n_tokens)[n_tokens]

    def _slope(self) -> float:
        """Seconds per extra token of a wide pass: the fitted slope when the recent passes differ
        in size; else from T(1) to their mean; else the prior. Never negative."""
        w, wn, wnn, wt, wnt = self._fit
        mean_n, mean_t = wn / w, wt / w
        spread = wnn / w - mean_n**2
        if spread >= 0.25:
            return max((wnt / w - mean_n * mean_t) / spread, 0.0)
        if 1 in self._mean and mean_n > 1:
            return max((mean_t - self._mean[1]) / (mean_n - 1), 0.0)
        return self._prior_slope()

    def _line(self) -> tuple[float, float]:
        """(T(0), slope) of the wide passes' line: T(n) = T(0) + slope n."""
        w, wn, _, wt, _ = self._fit
        slope = self._slope()
        return wt / w - slope * wn / w, slope

    def table(self, n_top: int, context: int = 0) -> list[float]:
        """[T(0) = 0, T(1), ..., T(n_top)] for passes after `context` tokens: every size a step may
        ask about, in one go; never decreasing in n."""
        if not self._mean:
            return [0.0] + [1.0 + PRIOR_SLOPE * (n - 1) for n in range(1, n_top + 1)]  # relative units
        prior = self._prior_slope()
        per_token = self.context_wide.slope * context  # what the context adds per token of a wide pass
        one = self.context_cost(1, context)
        if self._fit[0] < 1e-9:  # one-token passes only: T(1) and the prior slope
            t1 = self._mean.get(1, min(self._mean.values()))
            return [0.0, t1 + one] + [t1 + prior * (n - 1) + per_token * n for n in range(2, n_top + 1)]
        at_0, slope = self._line()
        widest = max(2, round(self._widest))
        up = min(slope, prior)
        previous = self._mean[1] if 1 in self._mean else max(at_0 + slope, 1e-9)
        out = [0.0, previous + one]
        for n in range(2, n_top + 1):  # (a hot loop: --draft-max auto plans with it every step)
            t = at_0 + slope * n if n <= widest else at_0 + slope * widest + up * (n - widest)
            previous = t if t > previous else previous
            out.append(previous + per_token * n)
        return out

    def _prior_slope(self) -> float:
        """PRIOR_SLOPE of a one-token pass, scaled from the shortest pass measured."""
        shortest = min(self._mean)
        return PRIOR_SLOPE * self._mean[shortest] / (1 + PRIOR_SLOPE * (shortest - 1))


class SharedPassCost:
    """How a pass shared by several sequences is split among them, for their -n auto policies.

    A pass over T tokens costs about a + b*T: a (reading the weights) whatever T, b per token.
    Split in proportion to tokens, every sequence would see a linear cost, b + a/T a token,
    and conclude that drafting never pays, although the passes get fewer and the throughput
    higher when they draft: each one's drafts are paid by b each, while a is paid once a pass
    however many tokens are in it. So each sequence is charged an equal part of the pass as
    it would be with every sequence decoding plain, (a + b*N)/N for N sequences, plus b for
    each token it adds beyond its own one: what its drafts add to the pass. The charges add up
    to the pass. a and b are fitted to the passes seen (least squares, recent passes weighing
    more); until the passes' sizes vary enough, the split is by tokens.
    """

    DECAY = 0.98  # per pass: a pass's weight halves after about 35 more
    MIN_SPREAD = 0.5  # tokens: the standard deviation of pass sizes a fit needs

    def __init__(self):
        self._w = self._t = self._s = self._tt = self._ts = 0.0

    def add(self, n_tokens: int, pass_s: float) -> None:
        d = self.DECAY
        self._w, self._t, self._s = self._w * d + 1, self._t * d + n_tokens, self._s * d + pass_s
        self._tt, self._ts = self._tt * d + n_tokens * n_tokens, self._ts * d + n_tokens * pass_s

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of the recent passes, or None while their sizes hardly vary (a spread of
        under half a token: one odd pass must not set the slope). A pass that costs the same
        whatever its size (a GPU below its compute limit) gives b = 0: drafts then cost nothing
        extra, and each sequence pays 1/N."""
        w, t, s, tt, ts = self._w, self._t, self._s, self._tt, self._ts
        var = tt * w - t * t
        if w < 2 or var < self.MIN_SPREAD**2 * w * w:
            return None
        b = (ts * w - t * s) / var
        a = (s - b * t) / w
        if b < 0:
            a, b = s / w, 0.0
        elif a < 0:
            a, b = 0.0, ts / tt
        return (a, b) if a + b > 0 else None

    def shares(self, n_tokens: dict[int, int]) -> dict[int, float]:
        """Each sequence's part of a pass over n_tokens[s] tokens of each (adding up to 1)."""
        total = sum(n_tokens.values())
        fit = self.fit()
        if fit is None:
            return {s: n / total for s, n in n_tokens.items()}
        a, b = fit
        base = (a + b * len(n_tokens)) / len(n_tokens)
        return {s: (base + b * (n - 1)) / (a + b * total) for s, n in n_tokens.items()}
