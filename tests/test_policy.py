"""The `-n auto` policy on simulated costs and acceptance: no model, no timing."""

from __future__ import annotations

import numpy as np
import pytest

from specli.decoding.policy import adaptive as policy_module
from specli.decoding.policy.acceptance import ConfidenceCalibration, PositionalAcceptance, best_length, expected_tokens
from specli.decoding.policy.adaptive import FIRST_LOOK, NOISE, PROBE_BUDGET, REACH_COST, RECHECK_EVERY, AdaptivePolicy, StepReport
from specli.decoding.policy.costs import PRIOR_SLOPE, ContextSlope, PassCost, running_time

FLAT = lambda n: 1.0  # noqa: E731  a GPU-like target: a pass costs the same for 1 or 33 tokens
# Gemma 3 270M on 2 CPU threads (measured on a 2-core VM): ms per pass for n tokens, interpolated.
CPU_MS = {1: 13.8, 2: 24.0, 5: 50.0, 9: 64.0, 13: 77.0, 17: 92.0, 25: 134.0, 33: 154.0}


def cpu_cost(n: int) -> float:
    sizes = sorted(CPU_MS)
    if n in CPU_MS:
        return CPU_MS[n]
    lo = max(s for s in sizes if s < n)
    hi = min(s for s in sizes if s > n)
    return CPU_MS[lo] + (CPU_MS[hi] - CPU_MS[lo]) * (n - lo) / (hi - lo)


def test_expected_tokens_is_one_plus_the_chance_of_each_prefix():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])
    assert expected_tokens([1.0] * 3) == [1.0, 2.0, 3.0, 4.0]


def test_never_accepted_means_plain_decoding():
    assert best_length([0.0] * 16, 0.0, FLAT) == 0
    assert best_length([0.0] * 16, 0.0, cpu_cost) == 0


def test_always_accepted_means_the_longest_draft_when_drafting_is_cheap():
    assert best_length([1.0] * 16, 0.01, FLAT) == 16
    assert best_length([1.0] * 32, 0.0, cpu_cost) == 32


@pytest.mark.parametrize("alpha, t_draft, cost, expected_k", [
    # α 0.5, free drafts, T(n) = 1 + 0.25 (n - 1): rates 1, 1.5/1.25 = 1.2, 1.75/1.5 = 1.17 -> 1.
    (0.5, 0.0, lambda n: 1 + 0.25 * (n - 1), 1),
    # Leviathan's setting (flat T): α 0.8, c 0.05: (1 - 0.8^(k+1)) / (0.2 (0.05 k + 1)) is
    # 3.039 at k 6, 3.082 at 7, 3.092 at 8, 3.078 at 9 -> 8.
    (0.8, 0.05, FLAT, 8),
    # α 0.6, c 0.5 (an expensive draft): k 1: 1.6/1.5 = 1.067, k 2: 1.96/2 = 0.98 -> 1.
    (0.6, 0.5, FLAT, 1),
    # α 0.4, c 0.5: k 1: 1.4/1.5 < 1 -> plain decoding pays best.
    (0.4, 0.5, FLAT, 0),
    # Gemma on a CPU with lookup at 96% acceptance: 16 drafts give (1 - 0.96^17) / 0.04 =
    # 12.4 tokens for 92 ms = 0.135/ms, 24 give 16.0 for 134 ms = 0.119/ms, plain 0.072/ms:
    # 16, which is also what a sweep of real runs found (drafters.py).
    (0.96, 0.0, cpu_cost, 16),
    # ... and at 50%: one draft gives 1.5 tokens for 24 ms (0.063/ms) < plain's 0.072/ms: 0.
    (0.5, 0.0, cpu_cost, 0),
])
def test_best_length_matches_the_worked_optimum(alpha, t_draft, cost, expected_k):
    assert best_length([alpha] * 32, t_draft, cost) == expected_k


def test_worked_optimum_for_gemma_at_96_percent_is_the_brute_force_one():
    rates = {k: expected_tokens([0.96] * k)[k] / cpu_cost(k + 1) for k in range(33)}
    assert max(rates, key=rates.get) == 16 and rates[16] > rates[24] > rates[0]


def measured(cost: PassCost) -> bool:
    """Whether any pass has been timed (PassCost's per-size means; the product has no use for it)."""
    return bool(cost._mean)


def test_pass_cost_interpolates_and_extrapolates_measured_sizes():
    cost = PassCost()
    assert not measured(cost) and cost(1) == 1.0  # relative units before any measurement
    cost.observe(1, 10.0)
    assert cost(1) == 10.0 and cost(5) > cost(1)  # the prior slope until a wide pass is measured
    cost.observe(5, 70.0)
    assert cost(3) == pytest.approx(40.0)  # one wide size: the line from T(1) to it
    # Beyond the widest measured: optimistically the prior slope (PRIOR_SLOPE T(1) per token)
    # rather than the fitted 15, so that longer drafts get tried and measured.
    prior = PRIOR_SLOPE * 10.0
    assert prior < 15 and cost(9) == pytest.approx(70.0 + 4 * prior)
    cost.observe(9, 110.0)
    assert cost(7) == pytest.approx(90.0) and cost(13) == pytest.approx(110.0 + 4 * prior, rel=0.01)
    for _ in range(40):
        cost.observe(1, 20.0)
    assert cost(1) == pytest.approx(20.0, rel=1e-3)  # a running mean follows a slower machine


def test_wide_passes_follow_a_line_that_never_falls():
    # Timings of 8 and 9 tokens that read 9.3 and 7.1 ms (noise: two sizes measured 40 times
    # each on the a90 pair) would send every plan to 9 if each size stood for itself.
    cost = PassCost()
    for _ in range(10):
        for n, ms in ((1, 3.0), (5, 6.8), (8, 9.3), (9, 7.1), (10, 10.3)):
            cost.observe(n, ms)
    table = cost.table(16)
    assert all(a <= b for a, b in zip(table[1:], table[2:]))
    assert table[1] == pytest.approx(3.0)  # a one-token pass is its own mean
    assert table[9] > table[8] and table[10] - table[9] == pytest.approx(table[9] - table[8])
    assert table[5] == pytest.approx(6.5, abs=0.5) and table[10] == pytest.approx(9.7, abs=0.5)
    # A pass stalled by another process (50 ms) moves the line by at most half its estimate.
    before = cost(8)
    cost.observe(8, 50.0)
    assert cost(8) < before * 1.1


def test_a_size_measured_in_a_slow_moment_follows_the_machine_when_it_speeds_up():
    # 9 tokens were measured while the machine ran slowly; since then the passes are 4 to 7
    # tokens and 40% faster: 9 must be judged on the line they draw, not its old time.
    cost = PassCost()
    for _ in range(10):
        cost.observe(5, 10.0)
        cost.observe(9, 20.0)
    for i in range(60):
        n = 4 + i % 4
        cost.observe(n, 0.6 * (10.0 + 2.5 * (n - 5)))
    assert cost(5) == pytest.approx(6.0, rel=0.05)
    # The fresh line says 12 at 9 tokens; past the passes measured lately the estimate rises
    # optimistically, so 9 is tried again and judged on what it costs now.
    assert cost(7) <= cost(9) <= 12.0 * 1.05


def context_cost(n: int, context: int) -> float:
    """A CPU-like target whose attention makes up much of a pass: ms for n tokens after `context`
    (like the a70 target's: one-token passes grow faster with the context than wide ones do per
    token, T(6) doubles between 30 and 1000 tokens of context)."""
    if n == 1:
        return 1.0 + 0.0008 * context
    return 1.5 + 0.3 * n + 0.0005 * n * context


def replies(n_replies: int, length: int = 200, prompt: int = 30):
    """(pass size, context) of the passes of replies that each start on a short prompt and
    grow one to nine tokens a pass."""
    for r in range(n_replies):
        context = prompt
        for i in range(length):
            n = 1 + (i * 7 + r) % 9
            yield n, context
            context += n


def test_context_slope_recovers_what_a_token_of_context_adds_to_a_pass():
    wide, one = ContextSlope(), ContextSlope()
    noise = np.random.default_rng(0)
    for n, context in replies(4):
        seconds = context_cost(n, context) * (1 + 0.05 * noise.standard_normal())
        (one if n == 1 else wide).observe(n, seconds, context)
    assert wide.slope == pytest.approx(0.0005, rel=0.1)
    assert one.slope == pytest.approx(0.0008, rel=0.15)
    # Passes all after the same context say nothing about it: the slope stays at 0.
    flat = ContextSlope()
    for n in (2, 5, 9) * 50:
        flat.observe(n, 1.0 + 0.3 * n, 100)
    assert flat.slope == 0.0


def test_pass_costs_measured_late_in_a_reply_price_the_next_short_one():
    # Costs learnt over long replies (context up to ~1000 tokens) must price a pass at the start
    # of the next reply (30 tokens of context) as it costs there, not as at the end of the last.
    cost = PassCost()
    for n, context in replies(3):
        cost.observe(n, context_cost(n, context), context=context)
    for context in (30, 1000):
        table = cost.table(12, context)
        for n in (1, 2, 6, 9):  # (past the widest pass measured, 9, the estimate is optimistic)
            assert table[n] == pytest.approx(context_cost(n, context), rel=0.1), (n, context)
    # A cold pass (a draft model's first after plain steps) neither raises the line nor the slope.
    slope, before = cost.context_wide.slope, cost.table(12, 500)[6]
    cost.observe(6, 3 * context_cost(6, 500), cold=True, context=500)
    assert cost.table(12, 500)[6] <= before and cost.context_wide.slope == slope


def test_a_new_reply_is_judged_afresh_on_its_short_context():
    # Drafting pays early in a reply (short context) and not late (the wide passes' attention
    # grows with the context): each reply should start drafting at once, not wait plain for
    # the next re-probe as it did when the decision taken at the end of the last reply held,
    # or when re-probes refused by chance late in a reply had faded the record to their word.
    cost = lambda n, context: 1.0 + 0.3 * (n - 1) + 0.006 * n * context  # noqa: E731
    waits = []  # per new reply: plain steps before its first draft
    late_drafts = []  # replies that end drafting
    for seed in range(10):
        policy = AdaptivePolicy(32)
        rng = np.random.default_rng(seed)
        for reply in range(6):
            context, steps, first_draft = 30, 0, None
            while context < 700:
                k = policy.limit("sim", 32, context)
                n_accepted = 0
                while n_accepted < k and rng.random() < 0.8:
                    n_accepted += 1
                policy.observe(StepReport("sim" if k else None, k, n_accepted, None, 0.0, k + 1, cost(k + 1, context), None,
                               None, context))
                if k and first_draft is None:
                    first_draft = steps
                context += n_accepted + 1
                steps += 1
            k = policy.limit("sim", 32, context)
            if k and not policy.plan.probe:  # late in a reply: plain decoding
                late_drafts.append((seed, reply, k))
            policy.plan = None  # (that step is not made)
            if reply:
                waits.append(first_draft)
    assert max(waits) <= 1, waits
    # (at 700 tokens of context a one-token draft accepted 80% of the time makes 3% fewer tokens
    # per second than plain decoding: a near tie that a lucky run of verdicts may tip, once)
    assert len(late_drafts) <= 1 and all(k == 1 for _, _, k in late_drafts), late_drafts


def test_a_probe_that_goes_as_expected_leaves_the_record_whole():
    # Drafts accepted 80% of the time; drafting then stops paying (its cost, say), and the
    # re-probes are refused now and then by chance. They are no news: the record stays near 0.8.
    # One accepted in full where the record said nearly never is news: the old verdicts fade.
    policy = AdaptivePolicy(32)
    state = policy.source("sim")
    rng = np.random.default_rng(0)
    for _ in range(200):
        state.acceptance.observe(4, min(int(rng.geometric(0.2)) - 1, 4))
    before = state.acceptance.rates(1)[0]
    assert before == pytest.approx(0.8, abs=0.1)
    for _ in range(3):
        policy.observe(StepReport(None, 0, 0, None, 0.0, 1, 1.0))  # plain passes: 1 s
    for _ in range(5):
        for n in (3, 9, 17):
            # wide passes: too dear to draft at the record's 80%, not at CEILING_ACCEPT (a
            # drafter that could not pay even then would not be probed at all)
            policy.pass_cost.observe(n, 0.95 * n)

    def probe(n_accepted: int) -> None:
        state.plain_streak, policy._credit = 3, None  # the next step is a probe
        assert policy.limit("sim", 32) == 2
        policy.observe(StepReport("sim", 2, n_accepted, None, 0.0, 3, 0.95 * 3))

    probe(0)
    probe(0)  # two probes, both refused at once
    assert state.acceptance.rates(1)[0] > before - 0.06
    for _ in range(200):
        state.acceptance.observe(4, 0)
    probe(2)
    assert state.acceptance.rates(2)[1] > 0.5


def test_positional_acceptance_learns_each_position_and_borrows_for_unseen_ones():
    acc = PositionalAcceptance(8)
    for _ in range(200):
        acc.observe(4, 2)  # the first two always accepted, the third always rejected
    rates = acc.rates(8)
    # (The prior keeps a trace: 2 pseudo-observations against ~33 remembered verdicts.)
    assert rates[0] > 0.95 and rates[1] > 0.95 and rates[2] < 0.1
    # Position 3 was never judged (the verdict stopped at 2): it leans on position 2's estimate.
    assert rates[3] < 0.1 and rates[7] < 0.1


def test_calibration_moves_from_the_prior_to_what_the_target_accepted():
    cal = ConfidenceCalibration()
    assert cal.rate(0.95) == pytest.approx(0.95) and cal.rate(0.15) == pytest.approx(0.15)
    for _ in range(200):
        cal.observe([0.95], 0)  # confident drafts that the target rejects: badly calibrated
    assert cal.rate(0.95) < 0.1


def simulate(policy: AdaptivePolicy, accept_prob, steps: int, cost=FLAT, t_draft=0.0, seed=0,
             confidence=None, trust=lambda c: c, totals=None, gap=0.0, tell_gap=True) -> list[int]:
    """Run the policy against a simulated target: each draft is accepted with accept_prob(step)
    (a draft model: with trust(its confidence)) until the first rejection; costs are what `cost`
    and `t_draft` say, a plain pass cost(1), and every step `gap` more (the loop's own time;
    reported to the policy as the engine does when tell_gap). Returns the drafted lengths per
    step; `totals`, a dict, gets the tokens made and the simulated seconds they took."""
    rng = np.random.default_rng(seed)
    lengths = []
    tokens = seconds = 0.0
    for step in range(steps):
        p = accept_prob(step) if accept_prob is not None else None
        k = policy.limit("sim", 32)
        confidences = None
        looked = k  # draft passes: a drafter without confidences drafts k tokens for k of them
        if k and confidence is not None:
            confidences, looked = [], 0
            for i in range(k):
                c = confidence(rng)
                looked += 1  # a draft pass showed this token
                if not policy.keep("sim", i, c):
                    break
                confidences.append(c)
                if policy.last():
                    break
            k = len(confidences)
        n_accepted = 0
        while n_accepted < k and rng.random() < (p if confidences is None else trust(confidences[n_accepted])):
            n_accepted += 1
        source = "sim" if looked else None
        told = gap if tell_gap and step >= 2 else None
        policy.observe(StepReport(source, k, n_accepted, confidences, looked * t_draft, k + 1, cost(k + 1), gap_s=told))
        tokens += n_accepted + 1
        seconds += looked * t_draft + cost(k + 1) + gap
        lengths.append(k)
    if totals is not None:
        totals.update(tokens=tokens, seconds=seconds)
    return lengths


def qwen_cpu(n: int) -> float:
    """Qwen2.5-Coder 1.5B on 2 CPU cores (ms by pass width, llama-bench; ../shared/NOTES.md)."""
    return 34.8 * {1: 1.0, 2: 1.52, 3: 1.93, 4: 2.34}.get(n, 2.34 + 0.4 * (n - 4)) / 1000


def test_a_draft_model_that_cannot_pay_at_any_likely_acceptance_is_not_probed():
    """The 0.5B draft at 0.58 of the target's one-token pass, on this CPU: even drafts accepted
    95% of the time would not pay, so after the drafts that time it the policy decodes plain
    and only re-times it every RECHECK_EVERY steps (doubling), whatever the acceptance."""
    policy = AdaptivePolicy(32)
    lengths = simulate(policy, lambda s: 0.99, 600, cost=qwen_cpu, t_draft=0.58 * qwen_cpu(1))
    drafting = [i for i, k in enumerate(lengths) if k]
    assert drafting and drafting[0] < 10
    late = [i for i in drafting if i > 10]
    assert len(late) <= 2 and all(i > 200 for i in late), drafting
    # The same draft at a tenth of the target's cost pays: it drafts all along.
    cheap = simulate(AdaptivePolicy(32), lambda s: 0.99, 200, cost=qwen_cpu, t_draft=0.1 * qwen_cpu(1))
    assert sum(1 for k in cheap[20:] if k) > 150


def test_a_draft_models_cost_timed_only_after_plain_steps_is_saved_for_the_next_run():
    """A draft model that never pays is only ever timed cold (after plain steps): that timing
    is saved, so the next run knows it costs too much without drafting to find out."""
    policy = AdaptivePolicy(32)
    simulate(policy, lambda s: 0.99, 300, cost=qwen_cpu, t_draft=0.58 * qwen_cpu(1))
    saved = policy.saved(1_800_000_000.0)
    assert saved.sources["sim"].t_draft is not None
    assert saved.sources["sim"].t_draft.seconds == pytest.approx(0.58 * qwen_cpu(1))


def test_re_probes_take_at_most_their_budget_where_drafting_never_pays():
    # Drafts are never accepted. Each probe that fails costs its wide pass beyond a plain one;
    # the probes together take at most PROBE_BUDGET of the time (plus the credit saved up at
    # the start: one plain step's worth, 1.0 here), however dear a probe is, and as often as that allows: a cheap probe (a wide
    # pass 1.3x a plain one, lookup on a GPU) comes every few dozen steps, a dear one (4x:
    # a50's, with the draft model's catch-up) every ~150.
    for wide, most_apart in ((4.0, 200), (1.3, 40), (cpu_cost(3) / cpu_cost(1), 120)):
        totals: dict = {}
        cost = lambda n, wide=wide: 1.0 if n == 1 else wide  # noqa: E731
        lengths = simulate(AdaptivePolicy(32), lambda step: 0.0, 6000, cost=cost, totals=totals)
        probes = [i for i, k in enumerate(lengths) if k and i >= 100]  # (the first drafts are not probes)
        overhead = len(probes) * (wide - 1.0)
        assert overhead <= PROBE_BUDGET * totals["seconds"] + cost(1) + wide
        assert max(b - a for a, b in zip(probes, probes[1:])) <= most_apart, (wide, np.diff(probes)[-5:])
        assert max(lengths[100:]) <= 2  # only probes


def test_policy_falls_back_to_plain_decoding_when_drafts_are_never_accepted():
    totals: dict = {}
    lengths = simulate(AdaptivePolicy(32), lambda step: 0.0, 2000, cost=cpu_cost, totals=totals)
    late = lengths[500:]
    assert max(late) <= 2
    # Plain decoding makes a token per cpu_cost(1); probes cost at most their budget on top.
    assert totals["tokens"] * cpu_cost(1) / totals["seconds"] >= 1 - PROBE_BUDGET - 0.01


def test_policy_drafts_the_longest_when_drafts_are_always_accepted():
    lengths = simulate(AdaptivePolicy(32), lambda step: 1.0, 300)
    assert all(k == 32 for k in lengths[20:])


@pytest.mark.parametrize("alpha, cost", [(0.8, FLAT), (0.9, cpu_cost), (0.6, cpu_cost)])
def test_policy_settles_on_the_optimal_length_for_a_known_acceptance(alpha, cost):
    lengths = simulate(AdaptivePolicy(32), lambda step: alpha, 3000, cost=cost)
    optimum = best_length([alpha] * 32, 0.0, cost)
    late = lengths[1000:]
    # Estimates fluctuate with recent luck: most steps within a couple of tokens of the optimum.
    near = sum(1 for k in late if abs(k - optimum) <= max(2, optimum // 4))
    assert near / len(late) > 0.6, (optimum, np.bincount(late))
    assert abs(np.median(late) - optimum) <= max(2, optimum // 4)


def test_the_loops_time_per_step_counts_against_plain_decoding_too():
    # Drafts taken 25% of the time, a draft token at 0.3 of a pass, passes flat: one draft a
    # step makes 1.25 tokens for 1.3 passes' time, 4% slower than plain decoding. Add a pass's
    # worth of the loop's own time to every step (a slow terminal, say): the draft now makes 1.25
    # tokens for 2.3 where plain decoding makes 1 for 2, 8% faster, and the policy that is told
    # the loop's time drafts.
    plain, told, untold = {}, {}, {}
    late = simulate(AdaptivePolicy(32), lambda step: 0.25, 3000, t_draft=0.3, totals=plain)[1000:]
    assert sum(1 for k in late if k) < 0.15 * len(late)  # probes only (their cost: a quarter of a step)
    late = simulate(AdaptivePolicy(32), lambda step: 0.25, 3000, t_draft=0.3, gap=1.0, totals=told)[1000:]
    assert sum(1 for k in late if k) > 0.9 * len(late)
    simulate(AdaptivePolicy(32), lambda step: 0.25, 3000, t_draft=0.3, gap=1.0, tell_gap=False, totals=untold)
    assert told["tokens"] / told["seconds"] > 1.05 * untold["tokens"] / untold["seconds"]


def slow_start_cost(factor: float, slow_steps: int = 2):
    """CPU-like pass costs (1 + 0.3 per extra token) whose first steps run `factor` times slower
    (a process's first passes, or a stall): plain decoding gets priced from them."""
    calls = [0]

    def cost(n: int) -> float:
        calls[0] += 1  # (simulate asks twice a step: to report the pass, and to count it)
        return (factor if calls[0] <= 2 * slow_steps else 1.0) * (1.0 + 0.3 * (n - 1))

    return cost


def test_plain_decoding_is_timed_again_while_drafting_goes_on(monkeypatch):
    # Drafts taken 20% of the time: one a step makes 1.2 tokens for 1.3 passes' time, 8% slower
    # than plain decoding. But plain decoding was timed on the first two passes, which ran 1.5x
    # slow: drafting looks 38% faster. Plain steps now and then correct it.
    checked, unchecked = {}, {}
    late = simulate(AdaptivePolicy(32), lambda step: 0.2, 3000, cost=slow_start_cost(1.5), totals=checked)[1500:]
    assert sum(1 for k in late if k) < 0.1 * len(late)  # plain decoding (and its re-probes)
    monkeypatch.setattr(policy_module, "RECHECK_EVERY", 10**9)
    late = simulate(AdaptivePolicy(32), lambda step: 0.2, 3000, cost=slow_start_cost(1.5), totals=unchecked)[1500:]
    assert all(late)  # never timed again: drafts on
    assert checked["tokens"] / checked["seconds"] > 1.1 * unchecked["tokens"] / unchecked["seconds"]


def test_checks_of_plain_decoding_cost_little_where_drafting_pays():
    # Drafts taken 70% of the time on a CPU-like target: drafting pays 1.2-1.3x; the checks
    # come every RECHECK_EVERY drafting steps and cost about 1% of the steps.
    lengths = simulate(AdaptivePolicy(32), lambda step: 0.7, 5000, cost=lambda n: 1.0 + 0.3 * (n - 1))
    plain_steps = sum(1 for k in lengths[100:] if k == 0)
    assert 0 < plain_steps <= FIRST_LOOK * (len(lengths) // RECHECK_EVERY + 1)
    # Where drafting is far ahead (every draft accepted, flat costs), there are none at all.
    assert all(simulate(AdaptivePolicy(32), lambda step: 1.0, 3000)[20:])


def test_a_running_time_follows_the_mean_of_noisy_timings_and_shrugs_off_a_stall():
    rng = np.random.default_rng(0)
    mean = None
    means = []
    for _ in range(2000):
        mean = running_time(mean, float(rng.uniform(0.7, 1.3)))  # 1.0 on average, spread 17%
        means.append(mean)
    assert np.mean(means[100:]) == pytest.approx(1.0, abs=0.01)
    assert running_time(1.0, 50.0) <= 1 + (NOISE - 1) / FIRST_LOOK + 1e-9  # a pass stalled by another process: clipped


def test_policy_notices_when_the_text_starts_to_pay():
    # Nothing is accepted for 1000 steps (e.g. free prose), then everything (a code block copied).
    waits, drafts = [], []
    for seed in range(10):
        lengths = simulate(AdaptivePolicy(32), lambda step: 0.0 if step < 1000 else 0.97, 1400, cost=cpu_cost, seed=seed)
        assert max(lengths[800:1000]) <= 2  # probing only
        recovered = next(i for i, k in enumerate(lengths[1000:]) if k > 8)
        waits.append(recovered)
        drafts.append(np.median(lengths[1000 + recovered + 50 :]))
    assert min(drafts) >= 14 and np.median(drafts) >= 16, drafts  # long drafts once recovered
    # Within tens of tokens: a probe here costs 1.1 plain steps more than a plain step, and
    # probes get PROBE_BUDGET of the time: one every ~55 steps (plus learning). A refusal by
    # chance early on (3% of drafts are refused) can cost a probe interval or two more (5-6 of
    # 30 seeds).
    assert np.median(waits) <= 40 and sum(w > 80 for w in waits) <= 3 and max(waits) <= 200, waits


def test_confidence_stops_a_draft_where_the_draft_model_is_unsure():
    # A calibrated draft model that is sure (0.97) or unsure (0.2) of each token, at random;
    # a draft token costs 10% of a one-token pass; passes cost as on a CPU. Unsure tokens
    # should end drafts.
    policy = AdaptivePolicy(32)
    pick = lambda rng: 0.97 if rng.random() < 0.8 else 0.2  # noqa: E731
    relative_cpu = lambda n: cpu_cost(n) / cpu_cost(1)  # noqa: E731
    lengths = simulate(policy, None, 1500, t_draft=0.1, confidence=pick, cost=relative_cpu)
    policy.limit("sim", 32)
    assert policy.keep("sim", 0, 0.97) is True
    policy.limit("sim", 32)
    # 0.2 expected tokens for a pass 74% dearer (T(2) / T(1) = 24 / 13.8): not worth it.
    assert policy.keep("sim", 0, 0.2) is False
    # Drafts end at unsure tokens: the runs of sure ones are 4 long on average.
    assert 2 < np.mean(lengths[500:]) < 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_draft_model_that_is_sure_and_wrong_is_left_alone(seed):
    # Like the synthetic pair a50: the draft model is sure (0.97) of 90% of its tokens, but the
    # target takes only 70% of those (and 30% of the unsure ones); a draft token costs 5% of a
    # one-token pass and passes cost as on a CPU, so drafting does not pay. The calibration has
    # to keep that lesson through the re-probes, which the text accepts now and then by
    # chance (half the time here: no news): plain decoding, within 2% of its speed. (Fading the
    # calibration at every probe sent such a pair back to drafting each time: 0.90-0.93 of
    # plain speed; at every fully accepted probe, 0.965-0.988.)
    policy = AdaptivePolicy(32)
    pick = lambda rng: 0.97 if rng.random() < 0.9 else 0.5  # noqa: E731
    relative_cpu = lambda n: cpu_cost(n) / cpu_cost(1)  # noqa: E731
    totals: dict = {}
    simulate(policy, None, 3000, t_draft=0.05, confidence=pick, trust=lambda c: 0.7 if c > 0.9 else 0.3,
             cost=relative_cpu, totals=totals, seed=seed)
    assert totals["tokens"] / totals["seconds"] >= 0.98  # plain decoding makes 1 token per unit


def test_a_draft_model_is_trusted_again_when_the_text_starts_to_pay():
    # The pair above for 1000 steps (only 20% accepted), then text where the draft model is
    # right as often as it is sure: a fully accepted re-probe reopens the calibration, and the
    # policy drafts again within two probe intervals (a probe can fail by chance).
    for seed in range(3):
        policy = AdaptivePolicy(32)
        pick = lambda rng: 0.97 if rng.random() < 0.9 else 0.5  # noqa: E731
        relative_cpu = lambda n: cpu_cost(n) / cpu_cost(1)  # noqa: E731
        before = simulate(policy, None, 1000, t_draft=0.05, confidence=pick, trust=lambda c: 0.2, cost=relative_cpu,
                          seed=seed)
        # Probing only, but for a longer draft after a probe accepted in full against the odds
        # (two sure tokens taken where one in five is: 4% of the probes).
        assert sum(1 for k in before[500:] if k > 2) <= 2
        after = simulate(policy, None, 600, t_draft=0.05, confidence=pick, cost=relative_cpu, seed=seed)
        recovered = next(i for i, k in enumerate(after) if k > 4)
        # (a probe here, two drafts and a three-token pass, costs 1.47 plain steps more than a
        # plain step: with PROBE_BUDGET of the time, one probe every ~74 steps)
        assert recovered <= 2 * 74 + 30
        assert np.median(after[recovered + 50 :]) >= 4


def test_a_draft_ends_on_its_last_useful_token_without_a_pass_to_see_the_next():
    # A calibrated draft model, always sure (0.95): the drafts should stop where the wider pass
    # stops paying, and they know where that is before seeing the next token, so nearly every
    # proposal ends by `last()` (no draft pass spent on a token that is then dropped).
    class Counting(AdaptivePolicy):
        ended = dropped = 0

        def keep(self, source, position, confidence):
            kept = super().keep(source, position, confidence)
            Counting.dropped += not kept and position > 0
            return kept

        def last(self):
            Counting.ended += super().last()
            return super().last()

    policy = Counting(32)
    relative_cpu = lambda n: cpu_cost(n) / cpu_cost(1)  # noqa: E731
    lengths = simulate(policy, None, 1000, t_draft=0.1, confidence=lambda rng: 0.95, cost=relative_cpu)
    assert 3 <= np.median(lengths[200:]) <= 12
    assert Counting.ended > 10 * Counting.dropped


def test_draft_timings_after_plain_steps_only_ever_lower_the_drafting_cost():
    # Draft passes after plain steps (a probe's, or the first when the gate reopens) run on
    # caches left cold by the plain passes (15-40% slower than in a run of drafting steps):
    # counted as they are, they kept a pair that pays plain for good.
    policy = AdaptivePolicy(32)
    for _ in range(2):
        policy.observe(StepReport(None, 0, 0, None, 0.0, 1, 1.0))  # plain decoding: 1 s a pass
    state = policy.source("sim")
    state.t_draft, state.start_s = 0.2, 0.1
    for _ in range(50):
        state.acceptance.observe(4, 0)  # drafts refused: plain decoding, with re-probes
    for slow in (True, False):
        state.plain_streak, policy._credit = 3, None  # the next step is a probe
        assert policy.limit("sim", 32) == 2 and policy.plan.probe
        token_s = 0.3 if slow else 0.1
        policy.observe(StepReport("sim", 2, 0, None, 0.5, 3, 1.2, token_s, 0.3 + token_s))
        if slow:
            assert (state.t_draft, state.start_s) == (0.2, 0.1)  # kept: the probe ran cold
        else:
            assert state.t_draft < 0.2  # the machine got faster: that counts
    # In a run of drafting steps, a slower draft counts as before.
    before = state.t_draft
    policy.observe(StepReport("sim", 3, 3, None, 0.9, 4, 1.5, 0.3, 0.4))
    assert state.t_draft > before
    # The first drafting step after a plain one (not a probe: the gate reopened) runs cold too.
    before = state.t_draft
    policy.observe(StepReport(None, 0, 0, None, 0.0, 1, 1.0))
    policy.observe(StepReport("sim", 3, 3, None, 1.5, 4, 1.5, 0.5, 0.6))
    assert state.t_draft == before


def test_after_a_draft_refused_early_the_next_reaches_only_twice_as_far_where_wide_passes_cost():
    # CPU-like costs: a 33-token pass costs 11 one-token ones. Drafts always accepted until one
    # is refused at its 3rd token: the next reaches 8 (twice the run it had, at least 8), or as
    # far as costs at most REACH_COST times that pass, then grows again as drafts are taken. On
    # flat (GPU-like) costs reaching further is free.
    for cost, limited in ((cpu_cost, True), (FLAT, False)):
        policy = AdaptivePolicy(32)
        simulate(policy, lambda step: 1.0, 40, cost=cost)
        assert policy.limit("sim", 32) == 32
        policy.observe(StepReport("sim", 32, 2, None, 0.0, 33, cost(33)))
        k = policy.limit("sim", 32)
        assert (cost(k + 1) <= REACH_COST * cost(9)) if limited else (k > 12), (cost, k)
        policy.observe(StepReport("sim", k, k, None, 0.0, k + 1, cost(k + 1)))
        assert policy.limit("sim", 32) >= min(2 * k, 32) or not limited
