"""How likely drafts are to be accepted, and the draft length that pays best.

- a_i: the probability that draft i (0-based) is accepted when all drafts before it were,
  per draft position (PositionalAcceptance), or for a draft model from its own confidence in
  the token, calibrated against what the target accepted (ConfidenceCalibration);
- E(k) = 1 + a_0 + a_0 a_1 + ... + a_0...a_{k-1}: the tokens a pass with k drafts yields on
  average (the accepted drafts plus the target's own token);
- the best k maximises E(k) / C(k), tokens per second, C(k) being what the step costs.
"""

from __future__ import annotations

from typing import Callable, Sequence

from specli.decoding.policy.constants import CEILING_ACCEPT, COPY_BINS, DECAY, PRIOR_ACCEPT, PRIOR_WEIGHT


def expected_tokens(accept: Sequence[float]) -> list[float]:
    """E(k) for k = 0 .. len(accept): tokens a pass with k drafts yields on average."""
    out = [1.0]
    all_accepted = 1.0
    for a in accept:
        all_accepted *= a
        out.append(out[-1] + all_accepted)
    return out


def best_length(accept: Sequence[float], t_draft: float, pass_cost: Callable[[int], float],
                plain_cost: float | None = None, start_cost: float = 0.0, going_rate: float | None = None) -> int:
    """The k in 0 .. len(accept) with the highest E(k) / (start_cost + k t_draft + T(k+1)).

    `accept[i]` is a_i; `pass_cost(n)` is T(n); `plain_cost` is what a pass costs in plain
    decoding (default T(1)); `start_cost` what a step that drafts at all pays on top of its
    tokens. Ties go to the shorter draft (less work).

    With `going_rate` (tokens per second the generation makes in the long run), the k with the
    highest E(k) - going_rate * C(k) instead: the step's tokens less what its time would have
    made at that rate. Over many steps that is what maximises tokens per second (a step with a
    better chance than most should take more of it than its own best ratio would).
    """
    expected = expected_tokens(accept)
    plain = plain_cost if plain_cost is not None else pass_cost(1)
    if going_rate is not None:
        best_k, best = 0, expected[0] - going_rate * plain
        for k in range(1, len(accept) + 1):
            value = expected[k] - going_rate * (start_cost + k * t_draft + pass_cost(k + 1))
            if value > best + 1e-12:
                best_k, best = k, value
        return best_k
    best_k, best_rate = 0, expected[0] / plain
    for k in range(1, len(accept) + 1):
        rate = expected[k] / (start_cost + k * t_draft + pass_cost(k + 1))
        if rate > best_rate * (1 + 1e-12):
            best_k, best_rate = k, rate
    return best_k


class PositionalAcceptance:
    """a_i per draft position, from recent verdicts.

    A position with little evidence leans on the estimate of the position before it (the first
    on PRIOR_ACCEPT): a_i = (accepted_i + w a_{i-1}) / (judged_i + w). Every position's old
    verdicts fade by DECAY at each step, judged or not: a deep position that failed once, long
    ago, drifts back to its neighbour's estimate and gets tried again.
    """

    def __init__(self, max_positions: int, prior: float | None = None) -> None:
        self.judged = [0.0] * max_positions
        self.accepted = [0.0] * max_positions
        self.prior = PRIOR_ACCEPT if prior is None else prior
        self.refused = False  # whether a draft has been refused since this record was made

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        self.refused = self.refused or n_accepted < n_drafted
        # Positions 0 .. n_accepted were judged (the last of them rejected unless all passed);
        # later drafts were never looked at.
        n_judged = min(n_accepted + 1, n_drafted, len(self.judged))
        n_passed = min(n_judged, n_accepted)
        self.judged = [j * DECAY + 1 if i < n_judged else j * DECAY for i, j in enumerate(self.judged)]
        self.accepted = [a * DECAY + 1 if i < n_passed else a * DECAY for i, a in enumerate(self.accepted)]

    def fade(self) -> None:
        """Old verdicts shrink to a prior's weight (a probe's verdict was news: see `fade`)."""
        self.judged, self.accepted = fade(self.judged, self.accepted)

    def rates(self, n: int) -> list[float]:
        """a_0 .. a_{n-1}: a deeper position leans on the one before it, so refusals are not
        forgotten deeper."""
        out = []
        previous = self.prior
        for i in range(min(n, len(self.judged))):
            previous = (self.accepted[i] + PRIOR_WEIGHT * previous) / (self.judged[i] + PRIOR_WEIGHT)
            out.append(previous)
        return out


class CopyAcceptance:
    """a_i for drafts copied from the text (prompt lookup), given the evidence behind the copy:
    the match m (how many tokens at the end of the context repeat those before the copied
    place) and, when the copied text occurs twice before, how many tokens the two agree on.

    The match is evidence of its own: the text has followed the copied place for m tokens in a
    row, so by the rule of succession the next one follows with (m + 1) / (m + 2), and draft i
    (all before it accepted) with (m + i + 1) / (m + i + 2), counting as m + 2 verdicts (at
    most half of what a record holds, 1 / (2 (1 - DECAY)), about 16: a record that has seen
    more outweighs it). Against it weigh the run's own verdicts
    on drafts copied after matches of about that length: one record per bin of COPY_BINS,
    recent verdicts counting most. A model that does not follow short matches learns it within a few drafts, while a
    long match still drafts at once whatever short ones did.

    Two earlier places that agree on a token make it as likely as any draft is (CEILING_ACCEPT);
    where the evidence ends (they differ, or the drafter's own rules stop vouching) the text may
    fork, at even odds: each has a record of its own per bin too (docs/policy.md,
    `CopyAcceptance`).
    """

    def __init__(self, max_positions: int) -> None:
        self.records = [PositionalAcceptance(max_positions) for _ in COPY_BINS]
        self.agreed = [[0.0, 0.0] for _ in COPY_BINS]  # [judged, accepted] of agreed tokens
        self.forks = [[0.0, 0.0] for _ in COPY_BINS]  # ... of tokens where the evidence ends

    @staticmethod
    def bin(match: int) -> int:
        return max(i for i, edge in enumerate(COPY_BINS) if match >= edge)

    @property
    def refused(self) -> bool:
        return any(r.refused for r in self.records)

    def observe(self, match: int, n_drafted: int, n_accepted: int, agreed: int | None = None,
                fork: int | None = None) -> None:
        b = self.bin(match)
        self.records[b].observe(n_drafted, n_accepted)
        agreed = agreed or 0
        last = fork if fork is not None else agreed - 1  # the last token judged on its own record
        for counts in (self.agreed[b], self.forks[b]):
            counts[0] *= DECAY
            counts[1] *= DECAY
        for i in range(min(n_accepted + 1, n_drafted, last + 1)):
            counts = self.agreed[b] if i < agreed else self.forks[b] if i == fork else None
            if counts is not None:
                counts[0] += 1
                counts[1] += i < n_accepted

    def rates(self, n: int, match: int, agreed: int | None = None, fork: int | None = None) -> list[float]:
        """a_0 .. a_{n-1} for a copy after a match of `match` tokens, its first `agreed` tokens
        agreed on by a second earlier place, its evidence ending at token `fork`."""
        b = self.bin(match)
        record = self.records[b]
        weight = min(match + 2.0, 0.5 / (1 - DECAY))
        out = []
        for i in range(min(n, len(record.judged))):
            prior = (match + i + 1) / (match + i + 2)
            out.append((record.accepted[i] + weight * prior) / (record.judged[i] + weight))
        if agreed:
            judged, accepted = self.agreed[b]
            sure = (accepted + PRIOR_WEIGHT * CEILING_ACCEPT) / (judged + PRIOR_WEIGHT)
            for i in range(min(agreed, len(out))):
                out[i] = max(out[i], sure)
        if fork is not None and fork < len(out):
            judged, accepted = self.forks[b]
            out[fork] = min(out[fork], (accepted + PRIOR_WEIGHT * 0.5) / (judged + PRIOR_WEIGHT))
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

    def fade(self) -> None:
        """Old verdicts shrink to a prior's weight (see `fade`)."""
        self.judged, self.accepted = fade(self.judged, self.accepted)

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


def fade(judged: Sequence[float], accepted: Sequence[float]) -> tuple[list[float], list[float]]:
    """A record's verdicts scaled down as a full record (1 / (1 - DECAY) verdicts) would be to a
    prior's weight (PRIOR_WEIGHT): what is left when a probe's verdict says the text may have
    changed (docs/policy.md, "A probe against the odds")."""
    keep = PRIOR_WEIGHT * (1 - DECAY)
    return [j * keep for j in judged], [a * keep for a in accepted]


def gated_rate(first: ConfidenceCalibration, later: Sequence[float], t_draft: float, costs: Sequence[float],
               start_cost: float = 0.0) -> float | None:
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
