"""How many tokens to draft, chosen every step from what the run has measured (`-n auto`).

The model, in plain words:
- cost: a target pass over n tokens takes T(n) seconds (on a CPU it grows with n: 13.8 ms for
  1 token, 92 ms for 17 on Gemma 270M; on a GPU it is nearly flat), plus what attention over
  the context adds, B n L after L tokens (a large part of a small model's pass on a CPU, so
  costs are learnt as at no context and priced at the step's own); drafting one token costs
  t_draft (a draft model's forward pass and the loop's work on the token; almost nothing for
  prompt lookup), and a step that drafts pays `start` before its first token (the draft
  model's first pass runs on caches the target's pass has just used).
- every step also pays the loop's own time between passes (recording the step, the policy,
  the caller's rendering: 0.1-0.2 ms a step, more on a terminal), measured by the engine: a
  plain step pays it for one token, a step that drafts for all it makes.
- acceptance: a_i = probability that draft i (0-based) is accepted when all drafts before it
  were. For a draft model, a_i can also be read from the draft's own confidence in token i
  (calibrated against what the target actually accepted).
- a pass with k drafts yields E(k) = 1 + a_0 + a_0 a_1 + ... + a_0...a_{k-1} tokens on average
  (the accepted drafts plus the target's own token) and costs C(k) = start + gap + k t_draft +
  T(k+1), against plain + gap' for a plain step.
- the policy picks k to maximise E(k) / C(k), tokens per second. k = 0 is plain decoding, whose
  cost is measured on its own (a plain pass after a plain pass: right after a draft model's
  pass the target runs slower, its weights evicted from the CPU caches), so a policy's first two
  steps are plain. When drafting does not pay, the loop falls back to plain decoding and
  re-probes with a short draft, so that a change in the text (a code block starting) is
  noticed within tens of tokens: probes are paid from a budget that grows by PROBE_BUDGET of
  the time spent (a probe that did not pay costs its loss against a plain step), so where
  drafting never pays they take at most that share of the time; a new reply, on a shorter
  context, is judged afresh. Prompt lookup tells how long its match is: drafts from long
  matches (LONG_MATCH tokens or more) keep a record of their own, so text that copies is
  recognised at once even where short matches fail. The other way
  round, while drafting goes on plain decoding is not timed, so after PLAIN_CHECK_EVERY_MIN
  drafting steps (the interval doubling while drafting stays ahead) a few plain steps time it
  again, unless drafting is expected to win by more than PLAIN_CHECK_MARGIN.
- likewise a draft model's first step after plain decoding runs on caches the plain passes
  filled: its draft and target timings count only where faster than a run of drafting steps
  measured.
- a draft model's tokens come with its confidence: whether to look at the first draft token at
  all is judged over the recent mix of confidences (`gated_rate`), and each token is kept only
  while the pass it widens is expected to pay (`AdaptivePolicy.keep`); when the best plan ends
  with the token just kept, the proposal ends there (`last`) instead of paying a draft pass to
  see a next token that would be dropped.
- a re-probe's verdict joins the record; only a probe accepted in full against the record's
  odds (under PROBE_SURPRISE: the text may have changed) fades the old verdicts, and the
  confidence calibration (how far the draft model can be trusted, a property of the pair) only
  when it was against the calibration's odds.

Between runs (policy_store.py) only what belongs to the machine and the pair is kept, and
a run trusts it only as far as its own passes confirm it: the first SEED_CHECKS passes of each
kind (one-token, wide) are compared with what the saved costs predict, and when their median
is off by more than SEED_TRUST the saved state is dropped and the run goes on as from a fresh
start. Passes slowed by other processes (their CPU use per second under CONTENDED times the
usual) are not saved; a pass is never charged more than PLAUSIBLE one-token passes per token.

Everything here is pure bookkeeping and arithmetic on numbers handed in by the engine: no
timing is taken here, so the policy is tested on simulated costs and acceptances.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from specli.decoding.policy.store import PLAUSIBLE, SAVED_ACCEPT_WEIGHT, SAVED_CALIBRATION_WEIGHT, Cost, Saved, SourceRecord

# Before anything is measured: an optimistic acceptance (so the first steps draft and learn),
# a target pass cost growing by 10% per extra token, and a draft token at 10% of a pass.
PRIOR_ACCEPT = 0.7
PRIOR_WEIGHT = 3.0  # pseudo-observations behind a prior or a neighbour's estimate
PRIOR_SLOPE = 0.1  # T(n) = T(1) * (1 + PRIOR_SLOPE * (n - 1)) until two pass sizes are measured
PRIOR_DRAFT_COST = 0.1  # t_draft / T(1) until a draft is measured
DECAY = 0.97  # weight of older observations per new one: recent text counts most
COST_EMA = 0.2  # weight of the newest timing in a running mean of a duration
COST_FORGET = 0.95  # weight of a wide pass in the cost line per newer pass (about 20 passes)
COST_CLIP = 1.5  # a wide pass counts at most this times the line's estimate
CONTEXT_FORGET = 0.995  # weight of a pass in the context slope per newer pass (about 200 passes)
CONTEXT_PRIOR = 4 * 100.0**2  # the slope leans to 0 until passes' n * context differ this much
CONTEXT_CLIP = 2.0  # a pass counts at most this times its estimate (looser: the slope is being learnt)
PROBE_LENGTH = 2
PROBE_EVERY_MIN = 4  # plain steps before a re-probe, at least
PROBE_BUDGET = 0.02  # probes that do not pay take at most this share of the time,
PROBE_CREDIT = 1.0  # plus at most this many plain steps' worth saved up while none was due (about one probe:
# more, and every short reply after a long plain stretch paid for a burst of probes)
LONG_MATCH = 12  # a lookup draft copied after a match this long (native ngram-simple's key) has a record of its own
LONG_SUFFIX = ":long"  # (named like its drafter, with this suffix)
SEED_TRUST = 1.5  # saved costs are dropped when a run's own passes differ by more than this factor
SEED_CHECKS = 3  # own passes of each kind (one-token, wide) that confirm or refute them
SEED_WEIGHT = 2.0  # pseudo-passes a saved pass cost counts as
SEED_WATCH = 256  # steps after which saved costs that were never refuted are taken as confirmed
CONTENDED = 0.8  # a pass using less CPU per second than this share of the usual was slowed down
SAMPLES_KEPT = 31  # recent uncontended timings per pass size, whose median is saved
MIN_SAMPLES_SAVED = 1  # timings a pass size needs before its median is saved (the next run checks it)
LONG_MATCH_ACCEPT = 0.9  # the prior acceptance of drafts copied after a long match
REACH_START = 16  # a source's drafts reach at most this far at first, then twice its latest
REACH_MIN = 8  # accepted run (at least this) ...
REACH_COST = 1.25  # ... unless going further costs at most this times the pass at that reach
# (on a CPU a 64-token pass refused early costs a dozen plain ones, and deep positions are
# estimated from shallow ones; on a GPU wide passes cost nearly nothing more, so no limit)
PROBE_FADE = 0.1  # evidence kept when a probe's verdict is news
PROBE_SURPRISE = 0.25  # a fully accepted probe is news only if the record gave it less than this
PLAIN_CHECK_EVERY_MIN = 128  # drafting steps before plain decoding is timed again
PLAIN_CHECK_EVERY_MAX = 1024  # the interval doubles after each check, back to the minimum
# whenever the policy chooses plain decoding
PLAIN_CHECK_STEPS = 4  # plain steps of a check: the first runs on caches the drafter filled
PLAIN_CHECK_MARGIN = 1.5  # no check where drafting is expected to beat plain by more than this
PLAIN_CHECK_WEIGHT = 0.5  # a check's timings replace a stale estimate faster than routine ones
LOOKAHEAD = 8  # drafts after the current one that `keep` weighs
WARM_UP_DRAFTS = 4  # a draft model's first steps draft (keep still judges each token): the
# first timings of a new pass shape are slow (0.6 ms per draft token where 0.3 is usual), and a
# gate closed on them would only reopen through re-probes


def running_time(mean: float | None, seconds: float, weight: float = COST_EMA) -> float:
    """A running mean of a duration; a timing counts at most COST_CLIP times the mean (a pass
    stalled by another process must not steer it for dozens).

    Symmetric, like the wide passes' line. Following faster timings faster than slower ones
    (weights 0.5 and 0.2, no clip) kept the mean of a70's plain passes 1.5-1.9% under their true
    mean (their spread: 5-15%), so plain decoding looked that much cheaper than drafting, whose
    wide passes are priced by an unbiased fit; and a 50 ms stall lifted a 1 ms mean to 10.8."""
    if mean is None:
        return seconds
    return mean + weight * (min(seconds, COST_CLIP * mean) - mean)


def expected_tokens(accept: Sequence[float]) -> list[float]:
    """E(k) for k = 0 .. len(accept): tokens a pass with k drafts yields on average."""
    out = [1.0]
    all_accepted = 1.0
    for a in accept:
        all_accepted *= a
        out.append(out[-1] + all_accepted)
    return out


def best_length(accept: Sequence[float], t_draft: float, pass_cost: Callable[[int], float],
                plain_cost: float | None = None, start_cost: float = 0.0) -> int:  # fmt: skip
    """The k in 0 .. len(accept) with the highest E(k) / (start_cost + k t_draft + T(k+1)).

    `accept[i]` is a_i; `pass_cost(n)` is T(n); `plain_cost` is what a pass costs in plain
    decoding (default T(1)); `start_cost` what a step that drafts at all pays on top of its
    tokens. Ties go to the shorter draft (less work).
    """
    expected = expected_tokens(accept)
    best_k, best_rate = 0, expected[0] / (plain_cost if plain_cost is not None else pass_cost(1))
    for k in range(1, len(accept) + 1):
        rate = expected[k] / (start_cost + k * t_draft + pass_cost(k + 1))
        if rate > best_rate * (1 + 1e-12):
            best_k, best_rate = k, rate
    return best_k


class ContextSlope:
    """B, what a target pass costs per token per token of context before it: T(n, L) = T(n, 0)
    + B n L. Attention reads the whole cache for every token of a pass; on a CPU that is a
    large part of a small model's pass (the a70 target: T(6) 4.5 ms at 30 tokens of context,
    6.2 ms at 400; T(1) 1.7 and 2.2 ms). Costs measured at one context length are otherwise
    carried to another: the line fitted at the end of a long reply priced the next prompt's
    short-context drafting 30% too high, next to plain passes timed at the short context, and
    held -n auto in plain decoding where a fixed N paid 1.1x.

    Estimated from the passes themselves: within each pass size, timing against n L, pooled
    over sizes (least squares with one intercept per size), recent passes counting most, and
    leaning to B = 0 until the contexts seen differ enough to tell.
    """

    def __init__(self) -> None:
        self._sizes: dict[int, list[float]] = {}  # per size: [w, w x, w x^2, w t, w x t, clock] (x = n L)
        self._num = 0.0  # sum over sizes of the centred w x t
        self._den = 0.0  # sum over sizes of the centred w x^2
        self._clock = 0  # passes seen
        self.prior = 0.0  # the slope it leans to until contexts differ enough (a saved one, or 0)

    @staticmethod
    def _centred(sums: list[float]) -> tuple[float, float]:
        w, wx, wxx, wt, wxt = sums[:5]
        return (wxt - wx * wt / w, wxx - wx * wx / w) if w > 0 else (0.0, 0.0)

    def observe(self, n_tokens: int, seconds: float, context: int) -> None:
        """A pass over n_tokens after `context` tokens took `seconds`."""
        x = float(n_tokens * context)
        self._clock += 1
        self._num *= CONTEXT_FORGET
        self._den *= CONTEXT_FORGET
        sums = self._sizes.get(n_tokens)
        if sums is None:
            sums = self._sizes[n_tokens] = [0.0] * 5 + [self._clock]
        else:
            fade = CONTEXT_FORGET ** (self._clock - sums[5])
            sums[:5] = [v * fade for v in sums[:5]]
            sums[5] = self._clock
            num, den = self._centred(sums)
            self._num -= num
            self._den -= den
            if sums[0] >= 3:  # one stalled pass must not tilt the slope for hundreds
                predicted = sums[3] / sums[0] + self.slope * (x - sums[1] / sums[0])
                seconds = min(seconds, CONTEXT_CLIP * predicted)
        w, wx, wxx, wt, wxt = sums[:5]
        sums[:5] = [w + 1, wx + x, wxx + x * x, wt + seconds, wxt + x * seconds]
        num, den = self._centred(sums)
        self._num += num
        self._den += den

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
    squares to recent passes, each older pass counting COST_FORGET as much as the next: on a
    CPU a pass costs about a fixed part plus a part per token (NOTES.md; the a90 pair in the
    loop: 5.4 / 6.4 / 8.7 / 10.4 ms for 4 / 6 / 9 / 13 tokens), on a GPU nearly the fixed part
    alone. One mean per size instead left sizes measured in a slow moment expensive for good:
    they were never chosen again, so never re-measured (a90 runs stuck at 4 or 8 drafts per
    pass, all accepted, and noise in the per-size means made steps that plans clustered at).
    Beyond the widest pass measured lately, the cost rises optimistically (the smaller of the
    fitted and the prior slope), so that a longer draft gets tried and then judged on its real
    cost; a pessimistic guess would never be put to the test.
    """

    def __init__(self) -> None:
        # Timings are kept as at no context (less B n L, see ContextSlope), the table adds it back.
        self._mean: dict[int, float] = {}  # per size: running mean (T(1) is read from it)
        self._fit = [0.0] * 5  # wide passes, forgetting-weighted: sum w, w n, w n^2, w t, w n t
        self._widest = 0.0  # the widest pass measured lately (fades back like the fit)
        # One-token passes grow faster with the context than wide ones do per token (the a70
        # target in the loop: 1.2-1.6 us against 0.7-0.8 us per token per token of context).
        self.context_one, self.context_wide = ContextSlope(), ContextSlope()
        # The run's own recent timings per size, as at no context, with the CPU use per second
        # of each (None where not measured): what is saved, as medians of the uncontended ones.
        self.samples: dict[int, deque[tuple[float, float | None]]] = {}

    def observe(self, n_tokens: int, seconds: float, cold: bool = False, context: int = 0,
                utilization: float | None = None) -> None:  # fmt: skip
        """A pass over n_tokens after `context` tokens took `seconds` (using `utilization` CPU
        seconds per second). `cold`: it ran in another regime than the one its size is priced
        for (a wide pass after a step that ran no draft model, a one-token pass other than plain
        after plain): it counts at most as the line's estimate, and not towards the context slope
        (such passes come late in a reply, where drafting stops paying, and would pass their
        slowness off as the context's), nor is it saved."""
        assert n_tokens >= 1 and seconds >= 0 and math.isfinite(seconds)
        if 1 in self._mean and n_tokens > 1:
            # A wide pass is never charged more than PLAUSIBLE one-token passes per token: what
            # is above that is a stall, not the pass.
            seconds = min(seconds, PLAUSIBLE * n_tokens * (self._mean[1] + self.context_cost(1, context)))
        if not cold:
            self._context_slope(n_tokens).observe(n_tokens, seconds, context)
        seconds = self.at_no_context(n_tokens, seconds, context)
        if not cold:
            self.samples.setdefault(n_tokens, deque(maxlen=SAMPLES_KEPT)).append((seconds, utilization))
        self._mean[n_tokens] = running_time(self._mean.get(n_tokens), seconds)
        if n_tokens >= 2:
            if self._fit[0] >= 3:
                # One pass stalled by another process must not steer the line for dozens.
                at_0, slope = self._line()
                seconds = min(seconds, (1.0 if cold else COST_CLIP) * (at_0 + slope * n_tokens))
            w, wn, wnn, wt, wnt = (x * COST_FORGET for x in self._fit)
            self._fit = [w + 1, wn + n_tokens, wnn + n_tokens**2, wt + seconds, wnt + n_tokens * seconds]
            self._widest = max(self._widest * COST_FORGET, n_tokens)

    def _context_slope(self, n_tokens: int) -> ContextSlope:
        return self.context_one if n_tokens == 1 else self.context_wide

    def context_cost(self, n_tokens: int, context: int) -> float:
        """What `context` tokens before it add to a pass over n_tokens."""
        return self._context_slope(n_tokens).slope * n_tokens * context

    def at_no_context(self, n_tokens: int, seconds: float, context: int) -> float:
        """A timing taken after `context` tokens, as it would be with none (at least a tenth of it)."""
        return max(seconds - self.context_cost(n_tokens, context), 0.1 * seconds)

    def seed(self, n_tokens: int, seconds: float, weight: float = SEED_WEIGHT) -> None:
        """Start from a saved cost: a pass over n_tokens at no context takes `seconds`, counted as
        `weight` passes (the run's own passes soon outweigh it). Not a sample of this run."""
        self._mean[n_tokens] = seconds if n_tokens not in self._mean else self._mean[n_tokens]
        if n_tokens >= 2:
            w, wn, wnn, wt, wnt = self._fit
            self._fit = [w + weight, wn + weight * n_tokens, wnn + weight * n_tokens**2, wt + weight * seconds,
                         wnt + weight * n_tokens * seconds]  # fmt: skip
            self._widest = max(self._widest, n_tokens)

    def medians(self, usual_utilization: float | None) -> dict[int, tuple[float, int]]:
        """Per size: the median of the recent timings not slowed by other processes (CPU use
        per second at least CONTENDED times `usual_utilization`), and how many there were."""
        out = {}
        for n, kept in self.samples.items():
            good = [s for s, u in kept if usual_utilization is None or u is None or u >= CONTENDED * usual_utilization]
            if len(good) >= MIN_SAMPLES_SAVED:
                out[n] = (statistics.median(good), len(good))
        return out

    @property
    def measured(self) -> bool:
        return bool(self._mean)

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
        for n in range(2, n_top + 1):  # (a hot loop: -n auto plans with it every step)
            t = at_0 + slope * n if n <= widest else at_0 + slope * widest + up * (n - widest)
            previous = t if t > previous else previous
            out.append(previous + per_token * n)
        return out

    def _prior_slope(self) -> float:
        """PRIOR_SLOPE of a one-token pass, scaled from the shortest pass measured."""
        shortest = min(self._mean)
        return PRIOR_SLOPE * self._mean[shortest] / (1 + PRIOR_SLOPE * (shortest - 1))


class PositionalAcceptance:
    """a_i per draft position, from recent verdicts.

    A position with little evidence leans on the estimate of the position before it (the first
    on PRIOR_ACCEPT): a_i = (accepted_i + w a_{i-1}) / (judged_i + w). Every position's old
    verdicts fade by DECAY at each step, judged or not: a deep position that failed once, long
    ago, drifts back to its neighbour's estimate and gets tried again.
    """

    def __init__(self, max_positions: int, prior: float = PRIOR_ACCEPT) -> None:
        self.judged = [0.0] * max_positions
        self.accepted = [0.0] * max_positions
        self.prior = prior
        self.refused = False  # whether a draft has been refused since this record was made

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        self.refused = self.refused or n_accepted < n_drafted
        # Positions 0 .. n_accepted were judged (the last of them rejected unless all passed);
        # later drafts were never looked at.
        n_judged = min(n_accepted + 1, n_drafted, len(self.judged))
        n_passed = min(n_judged, n_accepted)
        self.judged = [j * DECAY + 1 if i < n_judged else j * DECAY for i, j in enumerate(self.judged)]
        self.accepted = [a * DECAY + 1 if i < n_passed else a * DECAY for i, a in enumerate(self.accepted)]

    def fade(self, keep: float) -> None:
        """Keep only this fraction of the evidence (before a probe: its verdict is news)."""
        self.judged = [j * keep for j in self.judged]
        self.accepted = [a * keep for a in self.accepted]

    def rates(self, n: int, copied: int = 0) -> list[float]:
        """a_0 .. a_{n-1}. `copied`: tokens the text has just copied in a row (a lookup match);
        by the rule of succession the next one follows with (copied + 1) / (copied + 2), and a
        position with little evidence leans on that where it is higher than its neighbour."""
        out, previous = [], self.prior
        for i in range(min(n, len(self.judged))):
            if copied:
                previous = max(previous, (copied + i + 1) / (copied + i + 2))
            previous = (self.accepted[i] + PRIOR_WEIGHT * previous) / (self.judged[i] + PRIOR_WEIGHT)
            out.append(previous)
        return out


class ConfidenceCalibration:
    """P(accepted | the draft model's probability for its token), in ten bins.

    Each bin starts at its own centre (a calibrated draft) and moves with what the target
    accepted; old verdicts fade by DECAY.
    """

    BINS = 10

    def __init__(self) -> None:
        self.judged = [0.0] * self.BINS
        self.accepted = [0.0] * self.BINS
        self.first_seen = [0.0] * self.BINS  # how often the first draft token falls in each bin

    def fade(self, keep: float) -> None:
        """Keep only this fraction of the verdicts (see PositionalAcceptance.fade)."""
        self.judged = [j * keep for j in self.judged]
        self.accepted = [a * keep for a in self.accepted]

    def saw_first(self, confidence: float) -> None:
        """The drafter looked at a first token with this confidence (kept or not)."""
        self.first_seen = [n * DECAY for n in self.first_seen]
        self.first_seen[self._bin(confidence)] += 1

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.BINS), self.BINS - 1)

    def observe(self, confidences: Sequence[float], n_accepted: int) -> None:
        for i, confidence in enumerate(confidences[: n_accepted + 1]):
            b = self._bin(confidence)
            self.judged[b] = self.judged[b] * DECAY + 1
            self.accepted[b] = self.accepted[b] * DECAY + (1 if i < n_accepted else 0)

    def rate(self, confidence: float) -> float:
        return self.bin_rate(self._bin(confidence))

    def bin_rate(self, b: int) -> float:
        centre = (b + 0.5) / self.BINS
        return (self.accepted[b] + PRIOR_WEIGHT * centre) / (self.judged[b] + PRIOR_WEIGHT)


def gated_rate(first: ConfidenceCalibration, later: Sequence[float], t_draft: float, costs: Sequence[float],
               start_cost: float = 0.0) -> float | None:  # fmt: skip
    """Tokens per second of drafting with a confidence gate: pay start_cost + t_draft to see
    the first token's confidence, keep it (and continue with the best number of later drafts,
    accepted with the rates `later`) only in the bins where that pays, else make a plain pass.

    Long-run rate = expected tokens per step / expected seconds per step, over the recent mix
    of first-token confidences. None before any first token was seen. costs[n] = T(n).
    """
    total = sum(first.first_seen)
    if total == 0 or len(costs) < 3:
        return None
    # After a kept first token: j more drafts (j more draft passes), chosen for the best rate
    # of the continuation.
    cont = expected_tokens(later[: len(costs) - 3])
    j, best_cont = 0, 0.0
    for extra, expected in enumerate(cont):
        rate = expected / ((1 + extra) * t_draft + costs[extra + 2])
        if rate > best_cont:
            j, best_cont = extra, rate
    kept_extra = j * t_draft + costs[j + 2] - costs[1]  # over looking and a plain pass
    rates = [first.bin_rate(b) for b in range(first.BINS)]
    tokens, seconds, best = 1.0, start_cost + t_draft + costs[1], 0.0  # nothing kept: look, then a plain pass
    for b in sorted(range(first.BINS), key=rates.__getitem__, reverse=True):
        # (the most promising bins first; the best prefix is the gate)
        f = first.first_seen[b] / total
        tokens += f * rates[b] * cont[j]
        seconds += f * kept_extra
        best = max(best, tokens / seconds)
    return best


@dataclass
class SourceState:
    """What the policy knows about one kind of draft (prompt lookup, or the draft model)."""

    acceptance: PositionalAcceptance
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    t_draft: float | None = None  # seconds per drafted token, running mean
    start_s: float | None = None  # what a step that drafts pays on top of its tokens, running mean
    plain_streak: int = 0  # steps in a row this source was not worth drafting
    drafting_steps: int = 0  # steps that ran the drafter (counted up to WARM_UP_DRAFTS)
    probe_s: float | None = None  # what a re-probe step costs beyond a plain step, running mean
    judged_at: int = 0  # the context length at the last decision on drafting
    runs_model: bool = False  # it times its drafts (a draft model, whose passes evict the target's weights)
    # This run's own timings of t_draft and start_s, from steps whose pass was not contended:
    # their medians are what is saved.
    reach: int = REACH_START  # see REACH_START
    t_draft_samples: deque = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))
    start_samples: deque = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))


class DraftJudge:
    """What a drafter asks while proposing. This one drafts exactly as asked (fixed -n)."""

    wants_confidence = False  # whether `keep` is to be asked (it needs the draft's probabilities)

    def limit(self, source: str, n_max: int, context_len: int = 0, match: int = 0) -> int:
        """How many tokens of `source` are worth proposing now (0 = none), at most n_max, the
        context being context_len tokens long; `match`: how many tokens at the end of the
        context repeat the earlier text the drafts are copied from (prompt lookup; 0 = none)."""
        return n_max

    def keep(self, source: str, position: int, confidence: float) -> bool:
        """Whether the draft token at `position`, which the drafter gives this probability,
        is worth sending to the target (False ends the proposal before it)."""
        return True

    def last(self) -> bool:
        """Whether the token `keep` has just kept is to end the proposal: no draft pass to see
        the next one."""
        return False


FIXED = DraftJudge()


class AdaptivePolicy(DraftJudge):
    """`-n auto`: each step's draft length from the measured costs and acceptance.

    The engine reports every pass with `observe`; drafters ask `limit` before proposing and,
    when they know their confidence, `keep` for each token.
    """

    wants_confidence = True

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.pass_cost = PassCost()
        self._sources: dict[str, SourceState] = {}
        # The proposal being built: expected tokens, P(all so far accepted), whether it is a
        # probe, and this step's figures (T(n) table, a_i, t_draft), computed once in limit().
        self._expected = 1.0
        self._all_accepted = 1.0
        self._probing = False
        self._costs: list[float] = []
        self._rates: list[float] = []
        self._t_draft_now = 0.0
        self._last = False  # keep()'s plan: the token it kept ends the proposal
        # A plain pass right after drafting is slower than one in a run of plain passes (a
        # draft model's forward pass evicts the target's weights from the CPU caches), so the
        # cost of plain decoding is measured on its own: a plain pass after a plain pass.
        self.plain_s: float | None = None
        # What the loop spends between two passes beyond drafting and the pass (recording the
        # step, this policy's own work, the caller's rendering), after a plain step and after
        # one that drafted: every step pays it once, so a step that makes more tokens pays less
        # of it per token. Left out, plain decoding on the a70 pair (2 ms passes) looked 4%
        # cheaper than it is with stdout to a pipe (80 us a step), 8% on a terminal (160 us),
        # where a drafting step's 130-240 us is shared by its 3-4 tokens.
        self.plain_gap_s: float | None = None
        self.draft_gap_s: float | None = None
        self._plain_run = 0  # plain steps in a row, up to the latest (0: the latest drafted)
        # While drafting pays, plain decoding is not timed, and its estimate can rest on a few
        # passes of long ago: a70's at 500 tokens of context read 2.8-2.9 ms (the last steady
        # plain passes, one at 3.5 ms) where plain decoding took 2.4, and auto drafted on
        # where every fixed N lost 9%. So every so many drafting steps a few plain steps time it
        # again (the counterpart of re-probing a drafter while decoding plain).
        self._since_plain = 0  # drafting steps since plain decoding was last timed
        self._plain_check_every = PLAIN_CHECK_EVERY_MIN
        self._plain_check_left = 0  # plain steps still to make for a check
        self._plain_checking = False  # the latest plain steps are a check's
        self._previous_draft_s = 0.0  # the drafter's time at the last step (a plain one: limit())
        self._previous_drafter: str | None = None  # the source whose drafter ran at the last step
        # Probing is paid from one budget: PROBE_BUDGET of every step's time, spent by each probe
        # that did not pay (its time beyond the plain steps that would have made its tokens),
        # saved up to PROBE_CREDIT plain steps (None: full).
        self._credit: float | None = None
        self._credit_cap = 0.0
        self._bucket: dict[str, str] = {}  # per drafter: the record its latest limit() used
        self._utilizations: deque[float] = deque(maxlen=64)  # CPU use per second of recent passes
        # Saved costs (seed) and how far this run has confirmed them: the ratios of its own
        # passes to what they predicted, per kind; the run's own passes, to start over from
        # them if the saved costs are dropped.
        self._seed: Saved | None = None
        self._seed_model: PassCost | None = None
        self._seed_status: str | None = None
        self._seed_ratios: dict[str, list[float]] = {"one": [], "wide": []}
        self._own_passes: list[tuple[int, float, bool, int, float | None, bool]] = []
        self._sizes_seen: set[int] = set()  # pass sizes this run has made
        self._steps = 0

    def seed(self, saved: Saved) -> None:
        """Start from what earlier runs measured (policy_store.parse has checked it). Saved costs
        count as a few passes; until the run's own passes confirm them (`_check_seed`) they can
        be dropped whole."""
        model = PassCost()
        wide = [n for n in saved.passes if n > 1]
        for cost in (self.pass_cost, model):
            for n in sorted(saved.passes):
                # The wide sizes share a few passes' weight between them: the run's own passes
                # outweigh them within a few dozen steps.
                cost.seed(n, saved.passes[n].seconds, SEED_WEIGHT if n == 1 else 3 * SEED_WEIGHT / len(wide))
            cost.context_one.prior, cost.context_wide.prior = saved.context_one, saved.context_wide
        if 1 in saved.passes:
            self.plain_s = saved.passes[1].seconds
        self.plain_gap_s, self.draft_gap_s = saved.plain_gap_s, saved.draft_gap_s
        for name, record in saved.sources.items():
            st = self.source(name)
            st.t_draft = None if record.t_draft is None else record.t_draft.seconds
            st.start_s = None if record.start_s is None else record.start_s.seconds
            # Lookup's acceptance is the text's alone: a warm run that started from the last
            # text's record drafted less on copy-friendly text than a fresh one (0.95x).
            for i, (judged, accepted) in enumerate(record.acceptance[: self.max_draft] if record.runs_model else ()):
                st.acceptance.judged[i], st.acceptance.accepted[i] = judged, accepted
            for i, (judged, accepted) in enumerate(record.calibration[: ConfidenceCalibration.BINS]):
                st.calibration.judged[i], st.calibration.accepted[i] = judged, accepted
            for i, seen in enumerate(record.first_seen[: ConfidenceCalibration.BINS]):
                st.calibration.first_seen[i] = seen
        self._seed, self._seed_model = saved, model
        self._seed_status = "pending" if saved.passes else None

    @property
    def seed_status(self) -> str | None:
        """None (nothing saved was used), "pending", "confirmed" or "dropped"."""
        return self._seed_status

    def usual_utilization(self) -> float | None:
        """CPU seconds per second of a pass not slowed by other processes: the 90th percentile
        of the run's own (contention only ever lowers it), or the saved figure if higher."""
        own = sorted(self._utilizations)
        mine = own[int(0.9 * (len(own) - 1))] if len(own) >= 8 else None
        theirs = self._seed.utilization if self._seed is not None and self._seed_status != "dropped" else None
        figures = [u for u in (mine, theirs) if u is not None]
        return max(figures) if figures else None

    def _contended(self, utilization: float | None) -> bool:
        usual = self.usual_utilization()
        return utilization is not None and usual is not None and utilization < CONTENDED * usual

    def saved(self, now: float, key: dict | None = None) -> Saved | None:
        """What is worth keeping for the next run (None: nothing): medians of this run's own
        uncontended timings; the saved costs it did not measure again, unless it dropped them;
        acceptance only as a weak prior."""
        usual = self.usual_utilization()
        seed = self._seed if self._seed_status != "dropped" else None
        passes = {n: Cost(t, count, now) for n, (t, count) in self.pass_cost.medians(usual).items()}
        for n, cost in (seed.passes.items() if seed is not None else ()):
            passes.setdefault(n, cost)
        one = passes.get(1)
        if one is not None:
            passes = {n: c for n, c in passes.items() if c.seconds <= PLAUSIBLE * n * one.seconds}
        out = Saved(passes=passes, key=dict(key or {}), saved_at=now, utilization=usual)
        for name, slope in (("context_one", self.pass_cost.context_one), ("context_wide", self.pass_cost.context_wide)):
            value = slope.slope if slope.learnt else getattr(seed, name, 0.0) if seed is not None else 0.0
            setattr(out, name, value)
        out.plain_gap_s = self.plain_gap_s if self.plain_gap_s is not None else getattr(seed, "plain_gap_s", None)
        out.draft_gap_s = self.draft_gap_s if self.draft_gap_s is not None else getattr(seed, "draft_gap_s", None)
        for name, st in self._sources.items():
            before = seed.sources.get(name) if seed is not None else None
            record = SourceRecord(
                runs_model=st.runs_model or bool(before and before.runs_model),
                t_draft=_median_cost(st.t_draft_samples, now, before.t_draft if before else None),
                start_s=_median_cost(st.start_samples, now, before.start_s if before else None),
                acceptance=_capped(st.acceptance.judged, st.acceptance.accepted, SAVED_ACCEPT_WEIGHT),
                calibration=_capped(st.calibration.judged, st.calibration.accepted, SAVED_CALIBRATION_WEIGHT),
                first_seen=_scaled(st.calibration.first_seen, 10.0),
            )
            if record.t_draft or record.start_s or any(j for j, _ in record.acceptance):
                out.sources[name] = record
        return None if out.empty else out

    def source(self, name: str) -> SourceState:
        if name not in self._sources:
            prior = LONG_MATCH_ACCEPT if name.endswith(LONG_SUFFIX) else PRIOR_ACCEPT
            self._sources[name] = SourceState(PositionalAcceptance(self.max_draft, prior))
        return self._sources[name]

    def _t_draft(self, state: SourceState) -> float:
        if state.t_draft is not None:
            return state.t_draft
        return PRIOR_DRAFT_COST * self.pass_cost(1)

    def _plain_pass_at(self, context_len: int) -> float:
        """What a plain pass costs after context_len tokens (plain_s is kept as at no context)."""
        assert self.plain_s is not None
        return self.plain_s + self.pass_cost.context_cost(1, context_len)

    def _plain_at(self, context_len: int) -> float:
        """What a plain step costs after context_len tokens: its pass and the loop's time around it."""
        return self._plain_pass_at(context_len) + (self.plain_gap_s or 0.0)

    def _start_cost(self, state: SourceState) -> float:
        """What a step that drafts pays beyond its draft tokens and its pass: the drafter's start
        and the loop's time around the step."""
        return (state.start_s or 0.0) + (self.draft_gap_s or 0.0)

    def _plan_rate(self, gated: float | None, k: int, state: SourceState) -> float:
        """Tokens per second expected of this step's plan: the gated rate of a draft model, or
        k drafts at the per-position acceptance (limit()'s figures of this step)."""
        if gated is not None:
            return gated
        return expected_tokens(self._rates[:k])[k] / (self._start_cost(state) + k * self._t_draft_now + self._costs[k + 1])

    def limit(self, source: str, n_max: int, context_len: int = 0, match: int = 0) -> int:
        key = source + LONG_SUFFIX if match >= LONG_MATCH else source
        self._bucket[source] = key
        state = self.source(key)
        self._expected, self._all_accepted, self._probing = 1.0, 1.0, False
        if self.plain_s is None:
            return 0  # the first two steps of a policy's life measure plain decoding
        if self._plain_check_left > 0:
            self._plain_check_left -= 1
            return 0
        if state.plain_streak and context_len < state.judged_at:
            # A new reply, on a shorter context than the one drafting was judged on: passes cost
            # less there, wide ones most (ContextSlope). Judge afresh (free: no probe).
            state.plain_streak = 0
        if state.plain_streak and (state.plain_streak < PROBE_EVERY_MIN - 1 or not self._probe_affordable(state, context_len)):
            # Drafting did not pay at the last decision, and acceptance estimates only change
            # when something is drafted: stay plain, at no cost, until a probe is due.
            state.plain_streak += 1
            return 0
        n_max = min(n_max, self.max_draft)
        state.judged_at = context_len
        self._costs = self.pass_cost.table(n_max + 1, context_len)
        if n_max > state.reach:
            within = REACH_COST * self._costs[state.reach + 1]
            n_max = max(n for n in range(state.reach, n_max + 1) if self._costs[n + 1] <= within)
        self._rates = state.acceptance.rates(n_max, match if match >= LONG_MATCH else 0)
        self._t_draft_now = self._t_draft(state)
        plain = self._plain_at(context_len)
        gated = None
        if state.t_draft is not None and self._has_confidence(state):
            gated = gated_rate(state.calibration, self._rates[1:], self._t_draft_now, self._costs, self._start_cost(state))
        if gated is not None:
            # A draft model: whether to look at its first token at all; `keep` gates the rest.
            k = n_max if gated > 1 / plain or state.drafting_steps < WARM_UP_DRAFTS else 0
        else:
            k = best_length(self._rates, self._t_draft_now, self._costs.__getitem__, plain, self._start_cost(state))
            if not state.acceptance.refused and not state.runs_model:
                # Until this run sees a draft refused, price wide passes as a fresh run does:
                # a warm run that knew their cost decoded plain where a fresh one drafted, and
                # on text that copies it ran at 0.78x the fresh speed (BENCHMARKS.md).
                t1 = self._costs[1]
                fresh = [0.0] + [t1 * (1 + PRIOR_SLOPE * (n - 1)) for n in range(1, n_max + 2)]
                k = max(k, best_length(self._rates, self._t_draft_now, fresh.__getitem__, plain, self._start_cost(state)))
        if k > 0:
            state.plain_streak = 0  # (the probe interval shrinks back when a draft pays: observe)
            if self._since_plain >= self._plain_check_every and self._plan_rate(gated, k, state) * plain < PLAIN_CHECK_MARGIN:
                # Time plain decoding again before drafting on (see __init__).
                self._since_plain = 0
                self._plain_check_every = min(self._plain_check_every * 2, PLAIN_CHECK_EVERY_MAX)
                self._plain_check_left = PLAIN_CHECK_STEPS - 1
                self._plain_checking = True
                return 0
            return k
        self._plain_check_every = PLAIN_CHECK_EVERY_MIN
        state.plain_streak += 1
        if state.plain_streak >= PROBE_EVERY_MIN and n_max > 0 and self._probe_affordable(state, context_len):
            # Drafting has not paid lately: try a short draft to see if the text has changed.
            state.plain_streak = 0
            self._probing = True  # (what its verdict does to the record: observe)
            return min(PROBE_LENGTH, n_max)
        return 0

    def _probe_affordable(self, state: SourceState, context_len: int) -> bool:
        """Whether the probing budget holds what a probe is expected to cost beyond a plain step
        (as the last probes did; before any, as the cost model prices it), or a full budget.
        Saved costs that are still to be confirmed by wide passes get them from probes, at most
        SEED_CHECKS: costs that the run never checks would otherwise hold it plain for good."""
        if self._credit is None or self._seed_status == "pending" and len(self._seed_ratios["wide"]) < SEED_CHECKS:
            return True
        expected = state.probe_s
        if expected is None:
            costs = self.pass_cost.table(PROBE_LENGTH + 1, context_len)
            expected = self._start_cost(state) + PROBE_LENGTH * self._t_draft(state) + costs[PROBE_LENGTH + 1] - costs[1]
        return self._credit >= min(expected, self._credit_cap)

    @staticmethod
    def _against_the_odds(chances: Iterable[float]) -> bool:
        """Whether a probe accepted in full had less than PROBE_SURPRISE, its drafts accepted
        with these chances: a pair whose drafts are taken half the time passes a 2-token probe
        one time in four, and that is no news; one whose drafts were all refused passing it is.
        The chances come from the acceptance record, or from the calibration of the probe's
        confidences."""
        return math.prod(chances) < PROBE_SURPRISE

    @staticmethod
    def _has_confidence(state: SourceState) -> bool:
        return sum(state.calibration.judged) > 0

    def keep(self, source: str, position: int, confidence: float) -> bool:
        """Keep draft `position` if a pass including it (and the drafts expected after it) is
        expected to yield more tokens per second than a pass that stops before it; `last()`
        then says whether the best plan ends with it."""
        state = self.source(self._bucket.get(source, source))
        self._last = False
        if position == 0:
            state.calibration.saw_first(confidence)
        if self._probing:
            return True
        if position + 2 >= len(self._costs):
            return False  # beyond what limit() allowed
        costs, t_draft = self._costs, self._t_draft_now
        spent = (position + 1) * t_draft  # draft passes already paid, whatever we decide
        rate_without = self._expected / (spent + costs[position + 1])
        a_here = state.calibration.rate(confidence)
        later = self._rates[position + 1 : position + 1 + LOOKAHEAD]
        expected, all_accepted = self._expected, self._all_accepted * a_here
        best_with, best_extra = 0.0, 0
        for extra, a in enumerate([a_here, *later]):
            n = position + 1 + extra  # drafts in the pass
            if n + 1 >= len(costs):
                break
            if extra:
                all_accepted *= a
            expected += all_accepted
            # `extra` more drafts cost `extra` more draft passes (this token's, ...); the last
            # one kept ends the proposal without a pass of its own.
            rate = expected / (spent + extra * t_draft + costs[n + 1])
            if rate > best_with:
                best_with, best_extra = rate, extra
        if best_with <= rate_without:
            return False
        self._all_accepted *= a_here
        self._expected += self._all_accepted
        # Ending here saves the draft pass that would only show the next token: worth it when
        # the plan is to stop after this one (the next token's confidence is not seen).
        self._last = best_extra == 0
        return True

    def last(self) -> bool:
        return self._last

    def observe(self, source: str | None, n_drafted: int, n_accepted: int, confidences: Sequence[float] | None,
                draft_s: float, pass_tokens: int, pass_s: float, token_s: float | None = None,
                first_s: float | None = None, context_len: int = 0, gap_s: float | None = None,
                cpu_s: float | None = None) -> None:  # fmt: skip
        """One step's facts: what was drafted and accepted, what drafting cost (draft_s in all;
        when the drafter timed them, token_s per drafted token and first_s until its first
        token), what the pass cost (after context_len tokens; cpu_s: the CPU seconds the process
        used meanwhile, when measured), and gap_s, the time from the end of the previous step's
        pass to the start of this step (None at a generation's first)."""
        probe, self._probing = self._probing, False
        self._steps += 1
        if gap_s is not None:  # (the previous step's: plain steps also pay their limit() call)
            if self._plain_run:
                self.plain_gap_s = running_time(self.plain_gap_s, gap_s + self._previous_draft_s)
            else:
                self.draft_gap_s = running_time(self.draft_gap_s, gap_s)
        state = None if source is None else self.source(self._bucket.get(source, source))
        self._pay_for_probes(probe, draft_s + pass_s + (gap_s or 0.0), n_accepted + 1, context_len)
        if probe and state is not None and self.plain_s is not None:
            state.probe_s = running_time(state.probe_s, max(draft_s + pass_s - self._plain_pass_at(context_len), 0.0))
        ran = state is not None and (n_drafted > 0 or confidences is not None)  # (a draft model may only have looked)
        warm, self._previous_drafter = ran and self._previous_drafter == source, source if ran else None
        if state is not None and (token_s is not None or first_s is not None):
            state.runs_model = True
        # Plain: nothing drafted, nor a draft model run only to look (confidences == []).
        plain = n_drafted == 0 and pass_tokens == 1 and confidences is None
        steady_plain = plain and self._plain_run > 0
        self._plain_run = self._plain_run + 1 if plain else 0
        cold = not steady_plain if pass_tokens == 1 else (ran and not warm and state.runs_model)
        utilization = cpu_s / pass_s if cpu_s is not None and pass_s > 0 else None
        contended = self._contended(utilization)
        if utilization is not None and not cold:
            self._utilizations.append(utilization)
        self.pass_cost.observe(pass_tokens, pass_s, cold, context_len, utilization)
        if self._seed_status == "pending":
            self._check_seed(pass_tokens, pass_s, cold, context_len, utilization, steady_plain, contended)
        if steady_plain:
            # The second plain step after drafting still runs 3-5% slow on a70 (the first 17%):
            # it counts only where faster than the record; later ones count as they come.
            seconds = self.pass_cost.at_no_context(1, pass_s, context_len)
            if self._plain_run > 2 or self.plain_s is None or seconds < self.plain_s:
                self.plain_s = running_time(self.plain_s, seconds, PLAIN_CHECK_WEIGHT if self._plain_checking else COST_EMA)
            self._since_plain = 0
        elif not plain:
            self._since_plain += 1
        self._plain_checking = self._plain_checking and plain and self._plain_run < PLAIN_CHECK_STEPS
        self._previous_draft_s = draft_s
        if state is None:
            return
        if ran:
            state.drafting_steps = min(state.drafting_steps + 1, WARM_UP_DRAFTS)
        # A drafter that did not run at the last step runs on caches the target's plain passes
        # have filled: a70's draft passes took 360 us after plain steps against 280 us in a run
        # of drafting steps. Those timings made drafting look dearer than it is when done step
        # after step, which is what the policy weighs against plain decoding (itself measured
        # plain after plain), and held a70 in plain decoding. So timings of a step that
        # follows a step without this drafter count only where faster than the record (the
        # machine sped up, or the record holds a stall). A probe always follows plain steps.
        def timed(mean: float | None, seconds: float) -> float:
            return running_time(mean, seconds) if warm or mean is None or seconds < mean else mean

        if first_s is not None and state.t_draft is not None:
            # The first draft pass of a step runs on caches the target's pass has just used,
            # and the step asks the policy first: what that costs beyond a drafted token.
            state.start_s = timed(state.start_s, max(first_s - state.t_draft, 0.0))
            if warm and not contended:
                state.start_samples.append(max(first_s - state.t_draft, 0.0))
        if n_drafted == 0:
            return
        if probe and n_accepted == n_drafted:
            # A probe that goes as the record expects (refused where drafts were refused; taken
            # in full, two times in three, at 80% acceptance) joins it as one more verdict. One
            # taken in full against the odds says the text may have changed: the old verdicts
            # make way. (Fading the record at every probe left a few probes to speak for the
            # pair: a70's fell from 0.8 to 0.5 after two probes refused by chance late in a
            # reply, where drafting had stopped paying for its cost, and the next reply, where
            # it pays, was judged on that and decoded plain until the next probe, 128 steps.)
            # The calibration fades only against its own odds: starting it over from its prior
            # (a calibrated draft) sent a draft model that is sure and wrong back to drafting.
            if self._against_the_odds(state.acceptance.rates(n_drafted)):
                state.acceptance.fade(PROBE_FADE)
            if self._against_the_odds(map(state.calibration.rate, confidences or ())):
                state.calibration.fade(PROBE_FADE)
        elif not probe and self.plain_s is not None and (n_accepted + 1) * self._plain_at(context_len) > draft_s + pass_s + (self.draft_gap_s or 0.0):
            # This draft beat plain decoding: when drafting stops paying, probe again soon.
            self._credit = None
        state.acceptance.observe(n_drafted, n_accepted)
        if n_accepted == n_drafted:
            state.reach = max(state.reach, 2 * n_drafted)
        else:
            state.reach = max(2 * (n_accepted + 1), REACH_MIN)
        if confidences:
            state.calibration.observe(confidences, n_accepted)
        if confidences is not None and token_s is None and state.t_draft is not None:
            return  # a draft model's one-token proposal: no draft pass of its own was timed
        per_token = token_s if token_s is not None else draft_s / n_drafted
        state.t_draft = timed(state.t_draft, per_token)
        if (warm or not state.runs_model) and not contended:
            state.t_draft_samples.append(per_token)

    def _pay_for_probes(self, probe: bool, step_s: float, tokens: int, context_len: int) -> None:
        """The probing budget: every step adds PROBE_BUDGET of its time (up to PROBE_CREDIT plain
        steps); a probe spends what it cost beyond the plain steps that would have made its tokens."""
        if self.plain_s is None:
            return
        plain = self._plain_at(context_len)
        cap = self._credit_cap = PROBE_CREDIT * plain  # (a full budget compares with the cap it was cut to)
        credit = cap if self._credit is None else self._credit
        if probe:
            credit -= max(step_s - tokens * plain, 0.0)
        self._credit = min(credit + PROBE_BUDGET * step_s, cap)

    def _check_seed(self, n_tokens: int, seconds: float, cold: bool, context_len: int, utilization: float | None,
                    steady_plain: bool, contended: bool) -> None:  # fmt: skip
        """Compare the run's own passes with what the saved costs predict: the median of the
        first SEED_CHECKS ratios of each kind outside 1/SEED_TRUST .. SEED_TRUST drops them."""
        self._own_passes.append((n_tokens, seconds, cold, context_len, utilization, steady_plain))
        # The first pass of a size in a process is slow (llama.cpp sizes its buffers for it: a
        # 65-token pass took 228-241 ms the first time, 189-202 after): not a fair check.
        first_of_its_size = n_tokens not in self._sizes_seen
        self._sizes_seen.add(n_tokens)
        if not cold and not contended and not first_of_its_size:
            ratios = self._seed_ratios["one" if n_tokens == 1 else "wide"]
            if len(ratios) < SEED_CHECKS:
                ratios.append(seconds / max(self._seed_model.table(n_tokens, context_len)[n_tokens], 1e-12))
                if len(ratios) == SEED_CHECKS and not 1 / SEED_TRUST <= statistics.median(ratios) <= SEED_TRUST:
                    self._drop_seed()
                    return
        if all(len(r) >= SEED_CHECKS for r in self._seed_ratios.values()) or self._steps >= SEED_WATCH:
            self._seed_status, self._own_passes = "confirmed", []

    def _drop_seed(self) -> None:
        """Forget the saved costs: go on from the run's own passes alone, as a fresh start would."""
        own = PassCost()
        plain_s = None
        for n_tokens, seconds, cold, context_len, utilization, steady_plain in self._own_passes:
            own.observe(n_tokens, seconds, cold, context_len, utilization)
            if steady_plain:
                plain_s = running_time(plain_s, own.at_no_context(1, seconds, context_len))
        self.pass_cost, self.plain_s = own, plain_s
        self.plain_gap_s = self.draft_gap_s = None
        for st in self._sources.values():
            st.t_draft = st.start_s = None
            st.plain_streak = 0
        self._credit = None
        self._seed_status, self._own_passes = "dropped", []



def _median_cost(samples: Sequence[float], now: float, before: Cost | None) -> Cost | None:
    """The median of a run's own timings as a saved Cost (MIN_SAMPLES_SAVED at least), else
    what was saved before."""
    if len(samples) >= MIN_SAMPLES_SAVED:
        return Cost(statistics.median(samples), len(samples), now)
    return before


def _capped(judged: Sequence[float], accepted: Sequence[float], weight: float) -> list[tuple[float, float]]:
    """[judged, accepted] per position or bin, scaled down to at most `weight` verdicts each:
    a weak prior for the next run, not a record."""
    out = []
    for j, a in zip(judged, accepted):
        scale = min(1.0, weight / j) if j > 0 else 0.0
        out.append((j * scale, a * scale))
    while out and out[-1][0] == 0:
        out.pop()
    return out


def _scaled(values: Sequence[float], total: float) -> list[float]:
    """`values` scaled down so that they add up to at most `total`."""
    whole = sum(values)
    return [v * min(1.0, total / whole) for v in values] if whole > 0 else []
