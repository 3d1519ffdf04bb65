"""How many tokens to draft, chosen every step from what the run has measured (`-n auto`).

The model, in plain words:
- cost: a target pass over n tokens takes T(n) seconds (on a CPU it grows with n: 13.8 ms for
  1 token, 92 ms for 17 on Gemma 270M; on a GPU it is nearly flat); drafting one token costs
  t_draft (a draft model's forward pass; almost nothing for prompt lookup).
- acceptance: a_i = probability that draft i (0-based) is accepted when all drafts before it
  were. For a draft model, a_i can also be read from the draft's own confidence in token i
  (calibrated against what the target actually accepted).
- a pass with k drafts yields E(k) = 1 + a_0 + a_0 a_1 + ... + a_0...a_{k-1} tokens on average
  (the accepted drafts plus the target's own token) and costs C(k) = k t_draft + T(k+1).
- the policy picks k to maximise E(k) / C(k), tokens per second. k = 0 is plain decoding: when
  drafting does not pay, the loop falls back to it and re-probes now and then with a short
  draft, so that a change in the text (a code block starting) is noticed.

Everything here is pure bookkeeping and arithmetic on numbers handed in by the engine: no
timing is taken here, so the policy is tested on simulated costs and acceptances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

# Before anything is measured: an optimistic acceptance (so the first steps draft and learn),
# a target pass cost growing by 10% per extra token, and a draft token at 10% of a pass.
PRIOR_ACCEPT = 0.7
PRIOR_WEIGHT = 2.0  # pseudo-observations behind a prior or a neighbour's estimate
PRIOR_SLOPE = 0.1  # T(n) = T(1) * (1 + PRIOR_SLOPE * (n - 1)) until two pass sizes are measured
PRIOR_DRAFT_COST = 0.1  # t_draft / T(1) until a draft is measured
DECAY = 0.97  # weight of older observations per new one: recent text counts most
COST_EMA = 0.2  # weight of the newest timing in a pass-size's running mean
PROBE_LENGTH = 2
PROBE_EVERY_MIN = 8  # plain steps before the first re-probe
PROBE_EVERY_MAX = 128  # the interval doubles after each probe that did not pay, up to this
PROBE_FADE = 0.1  # evidence kept when a probe starts


def expected_tokens(accept: Sequence[float]) -> list[float]:
    """E(k) for k = 0 .. len(accept): tokens a pass with k drafts yields on average."""
    out = [1.0]
    all_accepted = 1.0
    for a in accept:
        all_accepted *= a
        out.append(out[-1] + all_accepted)
    return out


def best_length(accept: Sequence[float], t_draft: float, pass_cost: Callable[[int], float]) -> int:
    """The k in 0 .. len(accept) with the highest E(k) / (k t_draft + T(k+1)).

    `accept[i]` is a_i; `pass_cost(n)` is T(n). Ties go to the shorter draft (less work).
    """
    expected = expected_tokens(accept)
    best_k, best_rate = 0, expected[0] / pass_cost(1)
    for k in range(1, len(accept) + 1):
        rate = expected[k] / (k * t_draft + pass_cost(k + 1))
        if rate > best_rate * (1 + 1e-12):
            best_k, best_rate = k, rate
    return best_k


class PassCost:
    """T(n), the seconds of a target pass over n tokens, learnt from timed passes.

    Each pass size keeps a running mean; between measured sizes T is interpolated, beyond them
    extrapolated with the least-squares slope (or the prior slope while one size is known).
    """

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}

    def observe(self, n_tokens: int, seconds: float) -> None:
        assert n_tokens >= 1 and seconds >= 0
        if n_tokens in self._mean:
            self._mean[n_tokens] += COST_EMA * (seconds - self._mean[n_tokens])
        else:
            self._mean[n_tokens] = seconds
        self._count[n_tokens] = self._count.get(n_tokens, 0) + 1

    @property
    def measured(self) -> bool:
        return bool(self._mean)

    def __call__(self, n_tokens: int) -> float:
        if not self._mean:
            return 1.0 + PRIOR_SLOPE * (n_tokens - 1)  # relative units until a pass is timed
        sizes = sorted(self._mean)
        if n_tokens in self._mean:
            return self._mean[n_tokens]
        lo = [s for s in sizes if s < n_tokens]
        hi = [s for s in sizes if s > n_tokens]
        if lo and hi:
            a, b = lo[-1], hi[0]
            w = (n_tokens - a) / (b - a)
            return (1 - w) * self._mean[a] + w * self._mean[b]
        if lo:
            # Beyond the longest pass measured: optimistic (the smaller of the fitted and the
            # prior slope), so that a longer draft gets tried, measured, and then judged on
            # its real cost. A pessimistic guess would never be put to the test.
            edge = lo[-1]
            slope = min(self._fitted_slope(), self._prior_slope())
        else:
            edge, slope = hi[0], self._fitted_slope()
        return max(self._mean[edge] + slope * (n_tokens - edge), 1e-9)

    def _prior_slope(self) -> float:
        """PRIOR_SLOPE of a one-token pass, scaled from the shortest pass measured."""
        shortest = min(self._mean)
        return PRIOR_SLOPE * self._mean[shortest] / (1 + PRIOR_SLOPE * (shortest - 1))

    def _fitted_slope(self) -> float:
        """Seconds per extra token: the count-weighted least-squares slope, never negative."""
        sizes = list(self._mean)
        if len(sizes) < 2:
            return self._prior_slope()
        weights = [min(self._count[s], 10) for s in sizes]
        total = sum(weights)
        mx = sum(w * s for w, s in zip(weights, sizes)) / total
        my = sum(w * self._mean[s] for w, s in zip(weights, sizes)) / total
        sxx = sum(w * (s - mx) ** 2 for w, s in zip(weights, sizes))
        sxy = sum(w * (s - mx) * (self._mean[s] - my) for w, s in zip(weights, sizes))
        return max(sxy / sxx, 0.0)


class PositionalAcceptance:
    """a_i per draft position, from recent verdicts.

    A position with little evidence leans on the estimate of the position before it (the first
    on PRIOR_ACCEPT): a_i = (accepted_i + w a_{i-1}) / (judged_i + w). Every position's old
    verdicts fade by DECAY at each step, judged or not: a deep position that failed once, long
    ago, drifts back to its neighbour's estimate and gets tried again.
    """

    def __init__(self, max_positions: int) -> None:
        self.judged = [0.0] * max_positions
        self.accepted = [0.0] * max_positions

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        # Positions 0 .. n_accepted were judged (the last of them rejected unless all passed);
        # later drafts were never looked at.
        n_judged = min(n_accepted + 1, n_drafted, len(self.judged))
        for i in range(len(self.judged)):
            self.judged[i] = self.judged[i] * DECAY + (1 if i < n_judged else 0)
            self.accepted[i] = self.accepted[i] * DECAY + (1 if i < min(n_judged, n_accepted) else 0)

    def fade(self, keep: float) -> None:
        """Keep only this fraction of the evidence (before a probe: its verdict is news)."""
        self.judged = [j * keep for j in self.judged]
        self.accepted = [a * keep for a in self.accepted]

    def rates(self, n: int) -> list[float]:
        out, previous = [], PRIOR_ACCEPT
        for i in range(min(n, len(self.judged))):
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

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.BINS), self.BINS - 1)

    def observe(self, confidences: Sequence[float], n_accepted: int) -> None:
        for i, confidence in enumerate(confidences[: n_accepted + 1]):
            b = self._bin(confidence)
            self.judged[b] = self.judged[b] * DECAY + 1
            self.accepted[b] = self.accepted[b] * DECAY + (1 if i < n_accepted else 0)

    def rate(self, confidence: float) -> float:
        b = self._bin(confidence)
        centre = (b + 0.5) / self.BINS
        return (self.accepted[b] + PRIOR_WEIGHT * centre) / (self.judged[b] + PRIOR_WEIGHT)


@dataclass
class SourceState:
    """What the policy knows about one kind of draft (prompt lookup, or the draft model)."""

    acceptance: PositionalAcceptance
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    t_draft: float | None = None  # seconds per drafted token, running mean
    plain_streak: int = 0  # steps in a row this source was not worth drafting
    probe_every: int = PROBE_EVERY_MIN


class DraftJudge:
    """What a drafter asks while proposing. This one drafts exactly as asked (fixed -n)."""

    wants_confidence = False  # whether `keep` is to be asked (it needs the draft's probabilities)

    def limit(self, source: str, n_max: int) -> int:
        """How many tokens of `source` are worth proposing now (0 = none), at most n_max."""
        return n_max

    def keep(self, source: str, position: int, confidence: float) -> bool:
        """Whether the draft token at `position`, which the drafter gives this probability,
        is worth sending to the target (False ends the proposal before it)."""
        return True


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
        # The proposal being built: expected tokens, P(all so far accepted), drafts so far.
        self._expected = 1.0
        self._all_accepted = 1.0
        self._probing = False

    def source(self, name: str) -> SourceState:
        if name not in self._sources:
            self._sources[name] = SourceState(PositionalAcceptance(self.max_draft))
        return self._sources[name]

    def _t_draft(self, state: SourceState) -> float:
        if state.t_draft is not None:
            return state.t_draft
        return PRIOR_DRAFT_COST * self.pass_cost(1)

    def limit(self, source: str, n_max: int) -> int:
        state = self.source(source)
        self._expected, self._all_accepted, self._probing = 1.0, 1.0, False
        n_max = min(n_max, self.max_draft)
        k = best_length(state.acceptance.rates(n_max), self._t_draft(state), self.pass_cost)
        if k > 0:
            state.plain_streak, state.probe_every = 0, PROBE_EVERY_MIN
            return n_max if state.t_draft is not None and self._has_confidence(state) else k
        state.plain_streak += 1
        if state.plain_streak >= state.probe_every and n_max > 0:
            # Drafting has not paid lately: try a short draft to see if the text has changed.
            state.plain_streak = 0
            state.probe_every = min(state.probe_every * 2, PROBE_EVERY_MAX)
            self._probing = True
            # The old verdicts are what made drafting stop; the probe's says if that still holds.
            state.acceptance.fade(PROBE_FADE)
            return min(PROBE_LENGTH, n_max)
        return 0

    @staticmethod
    def _has_confidence(state: SourceState) -> bool:
        return sum(state.calibration.judged) > 0

    def keep(self, source: str, position: int, confidence: float) -> bool:
        """Keep draft `position` if a pass including it (and the drafts expected after it) is
        expected to yield more tokens per second than a pass that stops before it."""
        if self._probing:
            return True
        state = self.source(source)
        t_draft = self._t_draft(state)
        spent = (position + 1) * t_draft  # drafting cost already paid, whatever we decide
        rate_without = self._expected / (spent + self.pass_cost(position + 1))
        a_here = state.calibration.rate(confidence)
        later = state.acceptance.rates(self.max_draft)[position + 1 :]
        expected, all_accepted = self._expected, self._all_accepted * a_here
        best_with = 0.0
        for extra, a in enumerate([a_here, *later]):
            if extra:
                all_accepted *= a
            expected += all_accepted
            n = position + 1 + extra  # drafts in the pass
            best_with = max(best_with, expected / (spent + extra * t_draft + self.pass_cost(n + 1)))
        if best_with <= rate_without:
            return False
        self._all_accepted *= a_here
        self._expected += self._all_accepted
        return True

    def observe(self, source: str | None, n_drafted: int, n_accepted: int, confidences: Sequence[float] | None,
                draft_s: float, pass_tokens: int, pass_s: float) -> None:  # fmt: skip
        """One step's facts: what was drafted and accepted, and what drafting and the pass cost."""
        self.pass_cost.observe(pass_tokens, pass_s)
        if source is None or n_drafted == 0:
            return
        state = self.source(source)
        state.acceptance.observe(n_drafted, n_accepted)
        if confidences:
            state.calibration.observe(confidences, n_accepted)
        per_token = draft_s / n_drafted
        state.t_draft = per_token if state.t_draft is None else state.t_draft + COST_EMA * (per_token - state.t_draft)
