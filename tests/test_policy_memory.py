"""What `-n auto` keeps between runs: a busy run, a change of text or a damaged file must never
make a later run slower than a fresh start. Simulated costs; no model, no timing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from specli.decoding.policy import store as policy_store
from specli.decoding.policy.acceptance import CopyAcceptance
from specli.decoding.policy.adaptive import FIRST_LOOK, PRIOR_WEIGHT, AdaptivePolicy, StepReport
from specli.decoding.policy.store import Rejected
from specli.modes import MAX_DRAFT

NOW = 1_800_000_000.0
LONG_MATCH = 12  # a lookup match as long as native ngram-simple's key
# Gemma 3 270M on 2 quiet CPU threads, ms per pass over n tokens (measured here), and what busy
# loops on both cores did to them: one-token passes 2x slower, wide ones 4.7x (a pass waits for
# its slowest thread, and wide passes have more to wait for). Their CPU use per second: 2.0
# quiet, 1.0 busy.
QUIET_MS = {1: 10.0, 3: 29.7, 9: 52.5, 17: 65.3, 33: 100.0}


def quiet(n: int) -> float:
    sizes = sorted(QUIET_MS)
    if n in QUIET_MS:
        return QUIET_MS[n] / 1000
    lo = max(s for s in sizes if s < n)
    hi = min(s for s in sizes if s > n)
    return (QUIET_MS[lo] + (QUIET_MS[hi] - QUIET_MS[lo]) * (n - lo) / (hi - lo)) / 1000


def busy(n: int) -> float:
    return quiet(n) * (2.0 if n == 1 else 4.7)


def run(saved: policy_store.Saved | None, cost, accept: float, steps: int = 160, utilization: float | None = 2.0,
        seed: int = 0, match: int = 0) -> tuple[AdaptivePolicy, list[int], float]:
    """One run of `steps` target passes of -n auto (lookup-like: free drafts), starting from
    `saved`. Returns the policy, the draft length of each step and the tokens per second."""
    policy = AdaptivePolicy(32)
    if saved is not None:
        policy.seed(saved)
    rng = np.random.default_rng(seed)
    lengths, tokens, seconds = [], 0, 0.0
    for _ in range(steps):
        k = policy.limit("lookup", 32, 100 + tokens, match=match)
        n_accepted = 0
        while n_accepted < k and rng.random() < accept:
            n_accepted += 1
        pass_s = cost(k + 1)
        cpu_s = None if utilization is None else utilization * pass_s
        policy.observe(StepReport("lookup" if k else None, k, n_accepted, None, 1e-5 * k, k + 1, pass_s, context_len=100 + tokens,
                       gap_s=1e-4, cpu_s=cpu_s))
        lengths.append(k)
        tokens += n_accepted + 1
        seconds += 1e-5 * k + pass_s + 1e-4
    return policy, lengths, tokens / seconds


def through_a_file(policy: AdaptivePolicy) -> policy_store.Saved | None:
    """What the next run reads back: saved, written as JSON, parsed and checked."""
    saved = policy.saved(NOW)
    return None if saved is None else policy_store.parse(policy_store.dumps(saved), now=NOW + 60)


@pytest.mark.parametrize("cpu_measured", [True, False])
def test_one_busy_run_does_not_slow_the_runs_after_it(cpu_measured):
    # A text copied verbatim (every draft accepted): a fresh run, one run on a busy machine,
    # then three quiet runs. The third quiet run must be within 10% of the fresh one. With the
    # CPU measured the busy run's passes are recognised and not saved; without, the next run
    # finds its own passes 2-5x faster than the saved costs and drops them.
    quiet_u, busy_u = (2.0, 1.0) if cpu_measured else (None, None)
    fresh, _, fresh_rate = run(None, quiet, 1.0, utilization=quiet_u)
    saved = through_a_file(fresh)
    policy, _, _ = run(saved, busy, 1.0, utilization=busy_u)
    saved = through_a_file(policy) or saved
    if cpu_measured:  # the busy run's passes were not saved
        assert all(c.seconds < 1.5 * quiet(n) for n, c in saved.passes.items())
    rates = []
    for _ in range(3):
        policy, lengths, rate = run(saved, quiet, 1.0, utilization=quiet_u)
        assert max(lengths[:12]) >= 16  # drafting long within a dozen steps
        saved = through_a_file(policy) or saved
        rates.append(rate)
    assert rates[-1] >= 0.9 * fresh_rate, (rates, fresh_rate)
    assert min(rates) >= 0.85 * fresh_rate, (rates, fresh_rate)


def test_saved_costs_that_disagree_with_the_run_are_dropped_within_a_few_passes():
    # Saved costs 3x too high (a busy run whose CPU use was not measured): the run's own
    # plain and wide passes refute them within FIRST_LOOK of each, and it goes on as fresh.
    inflated = lambda n: 3 * quiet(n)  # noqa: E731
    saved = through_a_file(run(None, inflated, 1.0, utilization=None)[0])
    policy, lengths, _ = run(saved, quiet, 1.0, steps=40, utilization=None)
    assert policy.seed_status == "dropped"
    assert np.mean(lengths[10:]) >= 16
    # Saved costs that agree are kept, and confirmed.
    saved = through_a_file(run(None, quiet, 0.9, utilization=None)[0])
    policy, _, _ = run(saved, quiet, 0.9, steps=300, utilization=None)
    assert policy.seed_status == "confirmed"


def test_a_saved_context_slope_far_from_the_machines_is_refuted_like_any_saved_cost():
    # store.py bounds a saved slope only as loosely as any duration (MAX_PASS_S): one that is
    # absurd but within it (1 ms per token per token of context: a one-token pass 0.1 s dearer
    # at 100 tokens) is read, then refuted by the run's own passes, which go on as fresh.
    saved = through_a_file(run(None, quiet, 1.0)[0])
    saved.context_one = saved.context_wide = 1e-3
    saved = policy_store.parse(policy_store.dumps(saved), now=NOW + 60)
    assert saved.context_one == 1e-3
    policy, lengths, _ = run(saved, quiet, 1.0, steps=40)
    assert policy.seed_status == "dropped"
    assert np.mean(lengths[10:]) >= 16


def test_a_run_that_starts_from_saved_costs_drafts_at_once():
    saved = through_a_file(run(None, quiet, 1.0)[0])
    _, lengths, _ = run(saved, quiet, 1.0, steps=10)
    assert lengths[0] > 0  # no plain steps to measure plain decoding first
    _, fresh_lengths, _ = run(None, quiet, 1.0, steps=10)
    assert fresh_lengths[:2] == [0, 0]
    # A copy with a long match behind it needs no plain step first either: copying costs no
    # model pass, and plain decoding's cost is the passes' own T(1).
    _, fresh_copy, _ = run(None, quiet, 1.0, steps=10, match=LONG_MATCH)
    assert fresh_copy[0] > 0


def test_acceptance_is_the_texts_not_the_pairs():
    # A run where drafts always fail, then a text that copies: the saved record is a weak
    # prior that the new text's first evidence overrides (drafting long within a few steps).
    saved = through_a_file(run(None, quiet, 0.0, steps=400)[0])
    assert all(judged <= PRIOR_WEIGHT for judged, _ in saved.sources["lookup"].acceptance)
    _, lengths, _ = run(saved, quiet, 1.0, steps=120)
    first_long = next(i for i, k in enumerate(lengths) if k >= 8)
    assert first_long <= 40, lengths[:60]


def test_a_long_match_is_judged_on_its_own_record():
    # Short matches fail all along (prose); a long match (text being copied) is not held back by
    # them: it drafts long at once.
    policy, lengths, _ = run(None, quiet, 0.0, steps=300)
    assert max(lengths[100:]) <= 2
    assert policy.limit("lookup", 32, 500, match=LONG_MATCH) >= 8


def test_a_warm_run_drafts_on_short_matches_until_a_draft_is_refused():
    # Saved costs price a wide pass near its tokens' worth of plain passes: judged on them alone
    # the prior acceptance never pays on a short match, where a fresh run (optimistic costs)
    # drafts and, on text that copies, wins. A warm run prices drafts as a fresh run would until
    # its first refusal, and only then on what it knows.
    saved = through_a_file(run(None, quiet, 0.0, steps=200)[0])
    _, copying, _ = run(saved, quiet, 1.0, steps=40, match=3)
    assert copying[0] > 0 and sum(copying) >= 40, copying
    _, failing, _ = run(saved, quiet, 0.0, steps=200, match=3)
    drafted = [k for k in failing if k]
    # After the first refusal, drafts only until the run's own wide passes have checked the
    # saved costs (the first pass of a size checks nothing), then none.
    assert drafted and len(drafted) <= 1 + FIRST_LOOK + 1 and not any(failing[20:]), failing


def test_the_length_of_a_lookup_match_is_evidence_the_copy_goes_on():
    # A text that has copied m tokens in a row: by the rule of succession the next follows with
    # (m + 1) / (m + 2), so a longer match promises more.
    fresh = CopyAcceptance(8)
    short, at_12, at_60 = fresh.rates(8, 2), fresh.rates(8, LONG_MATCH), fresh.rates(8, 60)
    assert all(a < b < c for a, b, c in zip(short, at_12, at_60)), (short, at_12, at_60)
    # It is a prior: the record's verdicts on matches that long outweigh it at the refused position.
    refused = CopyAcceptance(8)
    for _ in range(40):
        refused.observe(60, 8, 1)  # the second draft token always refused
    rates = refused.rates(8, 60)
    assert rates[0] > 0.9 and rates[1] < 0.5, rates


def test_contended_passes_are_used_by_the_run_but_never_saved():
    policy = AdaptivePolicy(32)
    for i in range(40):
        busy_now = 10 <= i < 30
        k = policy.limit("lookup", 32, 100)
        cost, u = (busy, 1.0) if busy_now else (quiet, 2.0)
        policy.observe(StepReport("lookup" if k else None, k, k, None, 0.0, k + 1, cost(k + 1), context_len=100, cpu_s=u * cost(k + 1)))
    saved = policy.saved(NOW)
    # The quiet passes are saved (a test that saved nothing would pass the loop below) ...
    assert 1 in saved.passes, saved.passes
    # ... and no contended one moved what is saved.
    for n, c in saved.passes.items():
        assert c.seconds <= quiet(n) * 1.5, (n, c)


def test_a_wide_pass_is_never_charged_more_than_its_tokens_in_one_token_passes():
    policy = AdaptivePolicy(32)
    for _ in range(3):
        policy.observe(StepReport(None, 0, 0, None, 0.0, 1, 0.01))
    policy.observe(StepReport("lookup", 21, 21, None, 0.0, 22, 4.2))  # a 4.2 s stall
    assert policy.pass_cost.table(22)[22] <= policy_store.NOISE * 22 * 0.01 + 1e-9


def test_what_is_saved_round_trips_and_seeds_the_next_run():
    trained, _, _ = run(None, quiet, 0.9, steps=300)
    saved = trained.saved(NOW, {"target": "/m.gguf", "mode": "lookup"})
    again = policy_store.parse(policy_store.dumps(saved), now=NOW)
    assert again == saved
    fresh = AdaptivePolicy(32)
    fresh.seed(again)
    assert fresh.plain_s == pytest.approx(saved.passes[1].seconds)
    for n in (1, 3, 9):
        assert fresh.pass_cost.table(9)[n] == pytest.approx(trained.pass_cost.table(9)[n], rel=0.15)


GOOD = policy_store.to_json(
    policy_store.Saved(
        passes={1: policy_store.Cost(0.01, 5, NOW), 3: policy_store.Cost(0.03, 4, NOW)}, saved_at=NOW,
        sources={"lookup": policy_store.SourceRecord(t_draft=policy_store.Cost(1e-5, 3, NOW), acceptance=[(2.0, 1.5)])},
    )
)


def edited(path: str, value) -> str:
    data = json.loads(json.dumps(GOOD))
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    return json.dumps(data)


HOSTILE = {
    "garbage": "\x00\x01 not json at all {",
    "empty": "",
    "deep nesting": "[" * 200_000,
    "deep objects": '{"a":' * 50_000,
    "a list": "[1, 2, 3]",
    "another version": edited("version", 3),
    "NaN cost": edited("passes.1.s", math.nan).replace("NaN", "NaN"),
    "Infinity cost": json.dumps(GOOD).replace('"s": 0.03', '"s": Infinity'),
    "overflowing cost": json.dumps(GOOD).replace('"s": 0.03', '"s": 1e400'),
    "huge cost": edited("passes.3.s", 1e308),
    "zero cost": edited("passes.1.s", 0),
    "negative cost": edited("passes.3.s", -0.03),
    "string cost": edited("passes.3.s", "0.03"),
    "bool cost": edited("passes.3.s", True),
    "passes not an object": edited("passes", [0.01, 0.03]),
    "bad pass size": edited("passes", {"0": GOOD["passes"]["1"]}),
    "huge pass size": edited("passes", {"1" * 5000: GOOD["passes"]["1"]}),
    "future clock": edited("saved_at", NOW + 10 * 86400),
    "future sample": edited("passes.3.at", NOW + 10 * 86400),
    "samples not a count": edited("passes.3.samples", 2.5),
    "busy-run costs": edited("passes.3.s", 4.2),  # a 3-token pass 420x a one-token one
    "accepted above judged": edited("sources.lookup.acceptance", [[1.0, 2.0]]),
    "negative acceptance": edited("sources.lookup.acceptance", [[-1.0, 0.0]]),
    "NaN slope": json.dumps(GOOD).replace('"context_one": 0.0', '"context_one": NaN'),
    "huge slope": edited("context_wide", 1e300),
    "huge integer": json.dumps(GOOD).replace('"samples": 5', '"samples": ' + "9" * 5000),
    "too large": json.dumps({**GOOD, "padding": "x" * (policy_store.MAX_BYTES + 1)}),
    "too many sources": edited("sources", {str(i): {} for i in range(100)}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_file_is_rejected_whole_with_a_reason(name):
    with pytest.raises(Rejected) as err:
        policy_store.parse(HOSTILE[name], now=NOW)
    assert str(err.value) and "\n" not in str(err.value)


def test_a_good_file_is_read_and_old_costs_age_out():
    saved = policy_store.parse(json.dumps(GOOD), now=NOW)
    assert saved.passes[3].seconds == 0.03 and saved.sources["lookup"].acceptance == [(2.0, 1.5)]
    later = policy_store.parse(json.dumps(GOOD), now=NOW + policy_store.MAX_AGE_S + 1)
    assert later.passes == {}
    # A record written with more weight than a prior may have is scaled down to it.
    heavy = policy_store.parse(edited("sources.lookup.acceptance", [[200.0, 150.0]]), now=NOW)
    assert heavy.sources["lookup"].acceptance == [(PRIOR_WEIGHT, 0.75 * PRIOR_WEIGHT)]


def test_the_widest_saved_pass_is_the_widest_a_step_makes():
    # store.py keeps its own copy of the bound (the policy imports nothing outside itself).
    assert policy_store.MAX_WIDTH == MAX_DRAFT + 1
    wide = {str(MAX_DRAFT + 1): GOOD["passes"]["3"], "1": GOOD["passes"]["1"]}
    assert MAX_DRAFT + 1 in policy_store.parse(edited("passes", wide), now=NOW).passes
    with pytest.raises(Rejected):
        policy_store.parse(edited("passes", {str(MAX_DRAFT + 2): GOOD["passes"]["3"]}), now=NOW)


def test_nothing_invalid_is_ever_written():
    policy = AdaptivePolicy(32)
    saved = policy.saved(NOW)
    assert saved is None  # nothing measured: nothing to write
    run_policy, _, _ = run(None, quiet, 0.8, steps=50)
    saved = run_policy.saved(NOW)
    saved.passes[1].seconds = math.nan
    with pytest.raises(ValueError):
        policy_store.dumps(saved)


def test_seed_checks_need_only_a_few_passes():
    assert 2 <= FIRST_LOOK <= 5


def test_only_a_draft_models_acceptance_seeds_the_next_run():
    # Lookup's acceptance is the text's: shown by `specli cache`, not carried into a run. A draft
    # model's is partly the pair's: it comes back as a weak prior.
    policy = AdaptivePolicy(32)
    for _ in range(3):
        policy.observe(StepReport(None, 0, 0, None, 0.0, 1, 0.01))
    for _ in range(50):
        for source, token_s in (("lookup", None), ("draft-model", 0.001)):
            policy.limit(source, 32)
            policy.observe(StepReport(source, 4, 0, None, 0.004, 5, 0.03, token_s, token_s))
    saved = policy_store.parse(policy_store.dumps(policy.saved(NOW)), now=NOW)
    assert saved.sources["lookup"].acceptance and not saved.sources["lookup"].runs_model
    assert saved.sources["draft-model"].runs_model
    fresh = AdaptivePolicy(32)
    fresh.seed(saved)
    assert fresh.source("lookup").acceptance.rates(1)[0] == pytest.approx(0.7)  # the prior
    assert fresh.source("draft-model").acceptance.rates(1)[0] < 0.5
