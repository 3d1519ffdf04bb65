"""`--draft-max auto`: how many tokens to draft, chosen every step from what the run has measured.

In plain words: a step that drafts k tokens is expected to make E(k) tokens (acceptance.py)
and to cost C(k) = start + gap + k t_draft + T(k+1): the drafter's start and its time per
token, the loop's own time between passes, and the target's pass over k+1 tokens after the
step's context (costs.py). A plain step makes one token for what plain decoding costs,
measured on its own. The policy drafts the k that makes the most tokens per second, k = 0
being plain decoding; a draft model's tokens are then kept one by one while the wider pass is
expected to pay (`keep`). When drafting does not pay the policy decodes plain and re-probes
with a short draft from a small budget of the time; while drafting pays it times plain
decoding again now and then. Saved costs from earlier runs (store.py) are trusted only as far
as the run's own first passes confirm them.

docs/policy.md gives the design and the measurements behind each rule, by constant name.
Everything here is bookkeeping and arithmetic on numbers handed in by the engine: no timing
is taken here, so the policy is tested on simulated costs and acceptances.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from specli.decoding.policy.acceptance import ConfidenceCalibration, CopyAcceptance, PositionalAcceptance, best_length, expected_tokens, gated_rate
from specli.decoding.policy.constants import CEILING_ACCEPT, COPY_REACH, FIRST_LOOK, NOISE, PRIOR_DRAFT_COST, PRIOR_SLOPE, PRIOR_WEIGHT, PROBE_BUDGET, REACH_COST, REACH_MIN, RECENT, RECHECK_EVERY
from specli.decoding.policy.costs import PassCost, contended, recent_timings, running_time
from specli.decoding.policy.judge import DraftJudge
from specli.decoding.policy.store import Cost, Saved, SourceRecord


@dataclass
class SourceState:
    """What the policy knows about one kind of draft (prompt lookup, or the draft model)."""

    acceptance: PositionalAcceptance
    copy: CopyAcceptance
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    t_draft: float | None = None  # seconds per drafted token, running mean
    start_s: float | None = None  # what a step that drafts pays on top of its tokens, running mean
    plain_streak: int = 0  # steps in a row this source was not worth drafting
    drafting_steps: int = 0  # steps that ran the drafter (counted up to FIRST_LOOK)
    probe_s: float | None = None  # what a re-probe step costs beyond a plain step, running mean
    judged_at: int = 0  # the context length at the last decision on drafting
    runs_model: bool = False  # it times its drafts (a draft model, whose passes evict the target's weights)
    reach: int = field(default_factory=lambda: 2 * REACH_MIN)  # drafts reach at most this far (see REACH_MIN)
    recheck_in: int | None = None  # plain steps until a drafter that cannot pay is probed again (None: it can)
    recheck_every: int = field(default_factory=lambda: RECHECK_EVERY)  # (read at run time: a sweep sets it)
    # This run's own timings of t_draft and start_s, from steps whose pass was not contended:
    # their medians are what is saved.
    t_draft_samples: deque = field(default_factory=recent_timings)
    start_samples: deque = field(default_factory=recent_timings)
    # ... and of t_draft on caches the target had filled (after plain steps): saved only when
    # there is no other (a draft model that never pays drafts only after plain steps, and the
    # next run must know it costs too much without drafting to find out).
    t_draft_cold: deque = field(default_factory=recent_timings)


@dataclass
class ProposalPlan:
    """One proposal, from its drafter's `limit` to the step's `observe`: what `limit` decided,
    the step's figures it computed once, and what `keep` has kept so far."""

    source: str  # the drafter that asked
    record: str  # the SourceState its drafts are judged on: the drafter's, or its long-match one
    probe: bool = False  # a re-probe: every token is kept; observe() weighs its verdict
    costs: list[float] = field(default_factory=list)  # T(0) .. T(n_max + 1) at the step's context
    rates: list[float] = field(default_factory=list)  # a_0 .. a_{n_max - 1}
    t_draft: float = 0.0  # seconds per drafted token
    expected: float = 1.0  # E of a pass with the drafts kept so far
    all_accepted: float = 1.0  # P(every draft kept so far is accepted)
    ends: bool = False  # the token just kept ends the proposal (`last`)
    match: int = 0  # a copying drafter's match (0: none): the CopyAcceptance record to update
    agreed: int | None = None  # ... how many of its tokens a second earlier place agrees on
    fork: int | None = None  # ... and the first token its evidence does not vouch for

    def keep(self, position: int, a_here: float) -> bool:
        """Keep draft `position`, accepted with a_here when all before it are, if a pass
        including it (and the drafts expected after it) is expected to yield more tokens per
        second than a pass that stops before it; `ends` then says whether the best plan ends
        with it."""
        self.ends = False
        if self.probe:
            return True
        if position + 2 >= len(self.costs):
            return False  # beyond what limit() allowed
        costs, t_draft = self.costs, self.t_draft
        spent = (position + 1) * t_draft  # draft passes already paid, whatever we decide
        rate_without = self.expected / (spent + costs[position + 1])
        later = self.rates[position + 1 :]
        expected, all_accepted = self.expected, self.all_accepted * a_here
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
        self.all_accepted *= a_here
        self.expected += self.all_accepted
        # Ending here saves the draft pass that would only show the next token: worth it when
        # the plan is to stop after this one (the next token's confidence is not seen).
        self.ends = best_extra == 0
        return True


@dataclass(frozen=True)
class StepReport:
    """One step's facts, as the engine reports them to `AdaptivePolicy.observe`."""

    source: str | None  # the drafter whose proposal was verified (None: a plain step)
    n_drafted: int
    n_accepted: int
    confidences: Sequence[float] | None  # the draft model's confidence per token ([]: it only looked)
    draft_s: float  # drafting, in all
    pass_tokens: int  # tokens in the target pass
    pass_s: float  # the target pass (and this sequence's verification)
    token_s: float | None = None  # per drafted token, when the drafter timed its passes
    first_s: float | None = None  # until the drafter's first token, when timed
    context_len: int = 0  # the context the pass ran after
    gap_s: float | None = None  # from the end of the previous step's pass to this step's start (None: first step)
    cpu_s: float | None = None  # the CPU seconds the process used during the pass, when measured
    prompt_tokens: int = 0  # prompt tokens the pass also evaluated (a generation's first): its times are no step's cost


class AdaptivePolicy(DraftJudge):
    """`--draft-max auto`: each step's draft length from the measured costs and acceptance.

    The engine reports every pass with `observe`; drafters ask `limit` before proposing and,
    when they know their confidence, `keep` for each token and `last` after each kept one.
    `limit` makes the step's `plan`, which `keep` and `last` go on with and `observe` reads
    back (whether the step was a probe, which record it was judged on) and clears.
    """

    wants_confidence = True

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.pass_cost = PassCost()
        self._sources: dict[str, SourceState] = {}
        self.plan: ProposalPlan | None = None  # the proposal of the current step (None: no limit() since observe())
        # Plain decoding's cost is measured on its own, a plain pass after a plain pass: right
        # after drafting, a target pass is slower (a draft model's pass evicts its weights).
        self.plain_s: float | None = None
        # The loop's time between two passes beyond drafting and the pass (recording the step,
        # this policy, the caller's rendering), after a plain step and after one that drafted:
        # every step pays it once, so a step that makes more tokens pays less of it per token.
        self.plain_gap_s: float | None = None
        self.draft_gap_s: float | None = None
        self._plain_run = 0  # plain steps in a row, up to the latest (0: the latest drafted)
        # While drafting pays, plain decoding is not timed, and its estimate can go stale: every
        # RECHECK_EVERY drafting steps FIRST_LOOK plain steps time it again (the counterpart of
        # re-probing a drafter while decoding plain; docs/policy.md, "Plain checks").
        self._since_plain = 0  # drafting steps since plain decoding was last timed
        self._plain_check_left = 0  # plain steps still to make for a check
        self._previous_draft_s = 0.0  # the drafter's time at the last step (a plain one: limit())
        self._previous_drafter: str | None = None  # the source whose drafter ran at the last step
        # Probing is paid from one budget: PROBE_BUDGET of every step's time, spent by each probe
        # that did not pay (its time beyond the plain steps that would have made its tokens),
        # saved up to one plain step's worth, about one probe (None: full).
        self._credit: float | None = None
        self._credit_cap = 0.0
        self._utilizations: deque[float] = deque(maxlen=64)  # CPU use per second of recent passes
        # Saved costs (seed) and how far this run has confirmed them: the ratios of its own
        # passes to what they predicted, per kind; the run's own passes, to start over from
        # them if the saved costs are dropped.
        self._seed: Saved | None = None
        self._seed_model: PassCost | None = None
        self._seed_status: str | None = None
        self._seed_ratios: dict[str, list[float]] = {"one": [], "wide": []}
        self._own_passes: list[tuple[int, float, bool, int, float | None, bool]] = []
        self._steps = 0
        self._made = 0.0  # tokens made lately, each step's counting RECENT as much per newer step
        self._made_s = 0.0  # ... and the seconds they took

    def seed(self, saved: Saved) -> None:
        """Start from what earlier runs measured (store.parse has checked it). Saved costs
        count as a few passes; until the run's own passes confirm them (`_check_seed`) they can
        be dropped whole."""
        model = PassCost()
        wide = [n for n in saved.passes if n > 1]
        for cost in (self.pass_cost, model):
            for n in sorted(saved.passes):
                # The wide sizes share one prior's weight between them: the run's own passes
                # outweigh them within a few steps.
                cost.seed(n, saved.passes[n].seconds, PRIOR_WEIGHT if n == 1 else PRIOR_WEIGHT / len(wide))
            cost.context_one.prior, cost.context_wide.prior = saved.context_one, saved.context_wide
        if 1 in saved.passes:
            self.plain_s = saved.passes[1].seconds
        self.plain_gap_s, self.draft_gap_s = saved.plain_gap_s, saved.draft_gap_s
        for name, record in saved.sources.items():
            st = self.source(name)
            st.t_draft = None if record.t_draft is None else record.t_draft.seconds
            st.start_s = None if record.start_s is None else record.start_s.seconds
            st.runs_model = record.runs_model
            # Lookup's acceptance belongs to the text, not the pair: only a draft model's is
            # taken as a prior (docs/policy.md, "Between runs").
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
        return contended(utilization, self.usual_utilization())

    def _wide_seed_unchecked(self) -> bool:
        """Whether saved costs still wait for the run's own wide passes to confirm them."""
        return self._seed_status == "pending" and len(self._seed_ratios["wide"]) < FIRST_LOOK

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
            passes = {n: c for n, c in passes.items() if c.seconds <= NOISE * n * one.seconds}
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
                t_draft=_median_cost(st.t_draft_samples or st.t_draft_cold, now, before.t_draft if before else None),
                start_s=_median_cost(st.start_samples, now, before.start_s if before else None),
                acceptance=_capped(st.acceptance.judged, st.acceptance.accepted),
                calibration=_capped(st.calibration.judged, st.calibration.accepted),
                first_seen=_scaled(st.calibration.first_seen, 10.0),
            )
            if record.t_draft or record.start_s or any(j for j, _ in record.acceptance):
                out.sources[name] = record
        return None if out.empty else out

    def source(self, name: str) -> SourceState:
        if name not in self._sources:
            self._sources[name] = SourceState(PositionalAcceptance(self.max_draft), CopyAcceptance(self.max_draft))
        return self._sources[name]

    def resting(self, source: str) -> bool:
        """Whether `source` waits for its re-timing (it could not pay even at CEILING_ACCEPT):
        until then it drafts nothing, so a draft model need not read new prompts (a server's or
        a chat's next request: the policy outlives a generation)."""
        state = self._sources.get(source)
        return state is not None and state.recheck_in is not None and state.recheck_in > 0

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

    def _plan_rate(self, gated: float | None, k: int, state: SourceState, plan: ProposalPlan) -> float:
        """Tokens per second expected of this step's plan: the gated rate of a draft model, or
        k drafts at the per-position acceptance (the plan's figures)."""
        if gated is not None:
            return gated
        return expected_tokens(plan.rates[:k])[k] / (self._start_cost(state) + k * plan.t_draft + plan.costs[k + 1])

    def limit(self, source: str, n_max: int, context_len: int = 0, match: int = 0, agreed: int | None = None,
              cap: int | None = None) -> int:
        plan = self.plan = ProposalPlan(source, source)
        state = self.source(source)
        if match > 0 and not state.runs_model:
            return self._limit_copy(plan, state, n_max, context_len, match, agreed, cap)
        if cap is not None:
            n_max = min(n_max, cap)
        if self.plain_s is None:
            return 0  # the first two steps of a policy's life measure plain decoding
        if self._plain_check_left > 0:
            self._plain_check_left -= 1
            return 0
        if state.plain_streak and context_len < state.judged_at:
            # A new reply, on a shorter context than the one drafting was judged on: passes cost
            # less there, wide ones most (ContextSlope). Judge afresh (free: no probe).
            state.plain_streak = 0
        if state.plain_streak and (state.plain_streak < FIRST_LOOK - 1 or not self._probe_affordable(state, context_len)):
            # Drafting did not pay at the last decision, and acceptance estimates only change
            # when something is drafted: stay plain, at no cost, until a probe is due.
            state.plain_streak += 1
            return 0
        n_max = min(n_max, self.max_draft)
        state.judged_at = context_len
        plan.costs = self.pass_cost.table(n_max + 1, context_len)
        if n_max > state.reach:
            within = REACH_COST * plan.costs[state.reach + 1]
            n_max = max(n for n in range(state.reach, n_max + 1) if plan.costs[n + 1] <= within)
        plan.rates = state.acceptance.rates(n_max)
        plan.t_draft = self._t_draft(state)
        plain = self._plain_at(context_len)
        if state.t_draft is not None and self._cannot_pay(plan, state, plain):
            # Not even drafts accepted as often as a draft model ever is would beat plain decoding
            # at these costs (one nearly as slow as its target, on a CPU): acceptance hardly
            # matters, so nothing is probed but a rare re-timing.
            if state.recheck_in is None or state.recheck_in > 0:
                state.recheck_in = (state.recheck_every if state.recheck_in is None else state.recheck_in) - 1
                return 0
            state.recheck_in, state.recheck_every = None, 2 * state.recheck_every
            plan.probe = True
            return min(REACH_MIN, n_max)
        state.recheck_in, state.recheck_every = None, RECHECK_EVERY  # (it can pay again: rechecks start over)
        gated = None
        if state.t_draft is not None and self._has_confidence(state):
            gated = gated_rate(state.calibration, plan.rates[1:], plan.t_draft, plan.costs, self._start_cost(state))
        if gated is not None:
            # A draft model: whether to look at its first token at all; `keep` gates the rest.
            k = n_max if gated > 1 / plain or state.drafting_steps < FIRST_LOOK else 0
        else:
            k = self._best_length(plan, state, plain)
        if k > 0:
            state.plain_streak = 0  # (the probe interval shrinks back when a draft pays: observe)
            return 0 if self._plain_check_due(gated, k, state, plan, plain) else k
        state.plain_streak += 1
        if state.plain_streak >= FIRST_LOOK and n_max > 0 and self._probe_affordable(state, context_len):
            # Drafting has not paid lately: try a short draft to see if the text has changed.
            state.plain_streak = 0
            plan.probe = True  # (what its verdict does to the record: observe)
            return min(REACH_MIN, n_max)
        return 0

    def _cannot_pay(self, plan: ProposalPlan, state: SourceState, plain: float) -> bool:
        """Whether no draft length would beat plain decoding even at CEILING_ACCEPT per token."""
        start = self._start_cost(state)
        expected = expected_tokens([CEILING_ACCEPT] * (len(plan.costs) - 2))
        best = max((expected[k] / (start + k * plan.t_draft + plan.costs[k + 1]) for k in range(1, len(plan.costs) - 1)), default=0.0)
        return best * plain <= 1.0

    def _best_length(self, plan: ProposalPlan, state: SourceState, plain: float) -> int:
        """The draft length that maximises expected tokens per second on the plan's rates and
        costs; until the run sees a draft refused (a copying drafter: or has checked saved
        costs against its own wide passes), a model-free drafter's drafts are also priced as a fresh
        run prices wide passes, and the longer choice is taken: a warm run that knew their cost
        decoded plain where a fresh one drafted, and lost on text that copies (docs/policy.md,
        PRIOR_SLOPE for a fresh run's prices)."""
        going = self.going_rate(plain) if plan.match else None
        k = best_length(plan.rates, plan.t_draft, plan.costs.__getitem__, plain, self._start_cost(state), going)
        unchecked = self._wide_seed_unchecked()
        if (not state.acceptance.refused or plan.match and unchecked) and not state.runs_model:
            t1 = plan.costs[1]
            fresh = [0.0] + [t1 * (1 + PRIOR_SLOPE * (n - 1)) for n in range(1, len(plan.rates) + 2)]
            k = max(k, best_length(plan.rates, plan.t_draft, fresh.__getitem__, plain, self._start_cost(state), going))
        return k

    def going_rate(self, plain: float) -> float:
        """Tokens per second the generation has made lately (the last ~20 steps count), and
        at least plain decoding's: what a step's time is worth (acceptance.best_length)."""
        return max(self._made / self._made_s, 1 / plain) if self._made_s > 0 else 1 / plain

    def _plain_check_due(self, gated: float | None, k: int, state: SourceState, plan: ProposalPlan, plain: float) -> bool:
        """Whether plain decoding is to be timed again before drafting on (see __init__); if
        so, the check starts with this step."""
        if self._since_plain < RECHECK_EVERY or self._plan_rate(gated, k, state, plan) * plain >= NOISE:
            return False
        self._since_plain = 0
        self._plain_check_left = FIRST_LOOK - 1
        return True

    def _limit_copy(self, plan: ProposalPlan, state: SourceState, n_max: int, context_len: int, match: int,
                    agreed: int | None, cap: int | None) -> int:
        """limit() for a drafter that copies the text and says how long its match is (prompt
        lookup). Its acceptance is judged on that evidence every step (CopyAcceptance), so
        nothing here waits for a probe: a match long enough to pay drafts at once, whatever
        earlier refusals or saved costs said. Copying costs no model pass, so drafting may
        start before plain decoding is timed (its cost is then the passes' T(1))."""
        # Where the evidence ends: the first token two earlier places disagree on, or the
        # drafter's own cap (the text left this copy there last time, a short match): a fork.
        fork = min((x for x in (agreed, cap) if x is not None), default=None)
        plan.match, plan.agreed, plan.fork = match, agreed, fork
        if self._plain_check_left > 0:
            self._plain_check_left -= 1
            return 0
        n_max = min(n_max, self.max_draft)
        plan.costs = self.pass_cost.table(n_max + 1, context_len)
        # A copy's own match is evidence of how far it goes (COPY_REACH): refused short copies
        # do not hold back a long one.
        reach = max(state.reach, int(COPY_REACH * match))
        if n_max > reach:
            within = REACH_COST * plan.costs[reach + 1]
            n_max = max(n for n in range(reach, n_max + 1) if plan.costs[n + 1] <= within)
        plan.rates = state.copy.rates(n_max, match, agreed, fork)
        plan.t_draft = self._t_draft(state)
        plain = self._plain_at(context_len) if self.plain_s is not None else plan.costs[1] + (self.plain_gap_s or 0.0)
        k = self._best_length(plan, state, plain)
        return 0 if k > 0 and self._plain_check_due(None, k, state, plan, plain) else k

    def _probe_affordable(self, state: SourceState, context_len: int) -> bool:
        """Whether the probing budget holds what a probe is expected to cost beyond a plain step
        (as the last probes did; before any, as the cost model prices it), or a full budget.
        Saved costs that are still to be confirmed by wide passes get them from probes, at most
        FIRST_LOOK: costs that the run never checks would otherwise hold it plain for good."""
        if self._credit is None or self._wide_seed_unchecked():
            return True
        expected = state.probe_s
        if expected is None:
            costs = self.pass_cost.table(REACH_MIN + 1, context_len)
            expected = self._start_cost(state) + REACH_MIN * self._t_draft(state) + costs[REACH_MIN + 1] - costs[1]
        return self._credit >= min(expected, self._credit_cap)

    @staticmethod
    def _against_the_odds(chances: Iterable[float]) -> bool:
        """Whether a probe accepted in full had worse than even odds per token, its drafts
        accepted with these chances: a pair whose drafts are taken 70% of the time passes a
        2-token probe half the time, and that is no news; one whose drafts were all refused
        passing it is. The chances come from the acceptance record, or from the calibration of
        the probe's confidences."""
        chances = list(chances)
        return math.prod(chances) < 0.5 ** len(chances)

    @staticmethod
    def _has_confidence(state: SourceState) -> bool:
        return sum(state.calibration.judged) > 0

    def keep(self, source: str, position: int, confidence: float) -> bool:
        """Keep draft `position` if a pass including it (and the drafts expected after it) is
        expected to yield more tokens per second than a pass that stops before it (`ProposalPlan.keep`);
        `last()` then says whether the best plan ends with it."""
        plan = self.plan
        assert plan is not None and plan.source == source, "keep() is asked after the drafter's limit()"
        calibration = self.source(plan.record).calibration
        if position == 0:
            calibration.saw_first(confidence)
        return plan.keep(position, calibration.rate(confidence))

    def last(self) -> bool:
        return self.plan is not None and self.plan.ends

    def observe(self, step: StepReport) -> None:
        """One step's facts (StepReport), as the engine measured them. Ends the step's plan."""
        if step.prompt_tokens:
            self._observe_verdict(step)
            return
        source, n_drafted, n_accepted, confidences = step.source, step.n_drafted, step.n_accepted, step.confidences
        draft_s, pass_tokens, pass_s, token_s, first_s = step.draft_s, step.pass_tokens, step.pass_s, step.token_s, step.first_s
        context_len, gap_s, cpu_s = step.context_len, step.gap_s, step.cpu_s
        plan, self.plan = self.plan, None
        probe = plan is not None and plan.probe
        self._steps += 1
        if gap_s is not None:  # (the previous step's: plain steps also pay their limit() call)
            if self._plain_run:
                self.plain_gap_s = running_time(self.plain_gap_s, gap_s + self._previous_draft_s)
            else:
                self.draft_gap_s = running_time(self.draft_gap_s, gap_s)
        # (a drafter that asked no limit() this step proposed nothing: its record is its own name)
        record = plan.record if plan is not None and plan.source == source else source
        state = None if record is None else self.source(record)
        self._pay_for_probes(probe, draft_s + pass_s + (gap_s or 0.0), n_accepted + 1, context_len)
        self._made = self._made * RECENT + n_accepted + 1
        self._made_s = self._made_s * RECENT + draft_s + pass_s + (gap_s or 0.0)
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
            # The second plain step after drafting still runs a little slow (its caches hold the
            # drafter's work): it counts only where faster than the record; later ones as they come.
            seconds = self.pass_cost.at_no_context(1, pass_s, context_len)
            if self._plain_run > 2 or self.plain_s is None or seconds < self.plain_s:
                self.plain_s = running_time(self.plain_s, seconds)
            self._since_plain = 0
        elif not plain:
            self._since_plain += 1
        self._previous_draft_s = draft_s
        if state is None:
            return
        if ran:
            state.drafting_steps = min(state.drafting_steps + 1, FIRST_LOOK)

        # A drafter that did not run at the last step runs on caches the target's plain passes
        # have filled, slower than step after step, which is what is weighed against plain
        # decoding: such timings count only where faster than the record (the machine sped up,
        # or the record holds a stall). A probe always follows plain steps. (docs/policy.md,
        # "Cold draft timings")
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
            # A probe that goes as the record expects joins it as one more verdict; one taken in
            # full against the odds says the text may have changed: the old verdicts make way.
            # The calibration (a property of the pair) fades only against its own odds.
            # (docs/policy.md, "A probe against the odds")
            if self._against_the_odds(state.acceptance.rates(n_drafted)):
                state.acceptance.fade()
            if self._against_the_odds(map(state.calibration.rate, confidences or ())):
                state.calibration.fade()
        elif not probe and self.plain_s is not None and (n_accepted + 1) * self._plain_at(context_len) > draft_s + pass_s + (self.draft_gap_s or 0.0):
            # This draft beat plain decoding: when drafting stops paying, probe again soon.
            self._credit = None
        self._learn_verdict(state, plan, source, n_drafted, n_accepted, confidences)
        if confidences is not None and token_s is None and state.t_draft is not None:
            return  # a draft model's one-token proposal: no draft pass of its own was timed
        per_token = token_s if token_s is not None else draft_s / n_drafted
        state.t_draft = timed(state.t_draft, per_token)
        if not contended:
            (state.t_draft_samples if warm or not state.runs_model else state.t_draft_cold).append(per_token)

    def _observe_verdict(self, step: StepReport) -> None:
        """A step whose pass also put the prompt's end into the cache (a generation's first):
        what the target accepted counts, its times would price the prompt as drafting."""
        plan, self.plan = self.plan, None
        record = plan.record if plan is not None and plan.source == step.source else step.source
        if record is not None and step.n_drafted > 0:
            self._learn_verdict(self.source(record), plan, step.source, step.n_drafted, step.n_accepted, step.confidences)

    def _learn_verdict(self, state, plan, source, n_drafted: int, n_accepted: int, confidences) -> None:
        """What a drafter's source learns from the target's verdict on its proposal."""
        state.acceptance.observe(n_drafted, n_accepted)
        if plan is not None and plan.source == source and plan.match:
            state.copy.observe(plan.match, n_drafted, n_accepted, plan.agreed, plan.fork)
        if n_accepted == n_drafted:
            state.reach = max(state.reach, 2 * n_drafted)
        else:
            state.reach = max(2 * (n_accepted + 1), REACH_MIN)
        if confidences:
            state.calibration.observe(confidences, n_accepted)

    def _pay_for_probes(self, probe: bool, step_s: float, tokens: int, context_len: int) -> None:
        """The probing budget: every step adds PROBE_BUDGET of its time (up to one plain step's
        worth); a probe spends what it cost beyond the plain steps that would have made its tokens."""
        if self.plain_s is None:
            return
        plain = self._plain_at(context_len)
        cap = self._credit_cap = plain  # (a full budget compares with the cap it was cut to)
        credit = cap if self._credit is None else self._credit
        if probe:
            credit -= max(step_s - tokens * plain, 0.0)
        self._credit = min(credit + PROBE_BUDGET * step_s, cap)

    def _check_seed(self, n_tokens: int, seconds: float, cold: bool, context_len: int, utilization: float | None,
                    steady_plain: bool, contended: bool) -> None:
        """Compare the run's own passes with what the saved costs predict: the median of the
        first FIRST_LOOK ratios of each kind outside 1/NOISE .. NOISE drops them (a machine
        that changed, or saved costs measured under another load)."""
        self._own_passes.append((n_tokens, seconds, cold, context_len, utilization, steady_plain))
        # (The first pass of a size in a process is slower, llama.cpp sizing its buffers for it:
        # the median leaves one such pass out.)
        if not cold and not contended:
            ratios = self._seed_ratios["one" if n_tokens == 1 else "wide"]
            predicted = max(self._seed_model.table(n_tokens, context_len)[n_tokens], 1e-12)
            if len(ratios) < FIRST_LOOK:
                ratios.append(seconds / predicted)
                if len(ratios) == FIRST_LOOK and not 1 / NOISE <= statistics.median(ratios) <= NOISE:
                    self._drop_seed()
                    return
        if all(len(r) >= FIRST_LOOK for r in self._seed_ratios.values()) or self._steps >= RECHECK_EVERY:
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
    """The median of a run's own timings as a saved Cost (one is enough: the next run checks
    it), else what was saved before."""
    if samples:
        return Cost(statistics.median(samples), len(samples), now)
    return before


def _capped(judged: Sequence[float], accepted: Sequence[float]) -> list[tuple[float, float]]:
    """[judged, accepted] per position or bin, scaled down to at most PRIOR_WEIGHT verdicts
    each: a weak prior for the next run, not a record."""
    out = []
    for j, a in zip(judged, accepted):
        scale = min(1.0, PRIOR_WEIGHT / j) if j > 0 else 0.0
        out.append((j * scale, a * scale))
    while out and out[-1][0] == 0:
        out.pop()
    return out


def _scaled(values: Sequence[float], total: float) -> list[float]:
    """`values` scaled down so that they add up to at most `total`."""
    whole = sum(values)
    return [v * min(1.0, total / whole) for v in values] if whole > 0 else []
