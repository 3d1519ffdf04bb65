"""`--draft-max auto` with prompt lookup judges every step on the evidence behind the copy (the
match, what a second earlier place agrees on, where the drafter's own rules stop) and on the
run's verdicts per kind of evidence (policy/acceptance.py `CopyAcceptance`). Simulated costs and
verdicts; no model, no timing."""

from __future__ import annotations

from specli.decoding.drafters import PromptLookupDrafter
from specli.decoding.policy import AdaptivePolicy, DraftJudge, StepReport
from specli.decoding.policy.acceptance import CEILING_ACCEPT, CopyAcceptance
from specli.decoding.policy.store import Cost, Saved

T1 = 0.021  # a one-token pass on a 2-core CPU (Gemma 3 270M), and about 4.4 ms per extra token


def cpu(n: int) -> float:
    return T1 if n == 1 else 0.026 + 0.0044 * n


def step(policy: AdaptivePolicy, match: int, accepted: int | None = None, agreed: int | None = None,
         cap: int | None = None, context: int = 200) -> int:
    """One lookup step: the draft length the policy chose, after `accepted` of them were taken
    (None: all)."""
    k = policy.limit("lookup", 64, context, match=match, agreed=agreed, cap=cap)
    taken = k if accepted is None else min(accepted, k)
    policy.observe(StepReport("lookup" if k else None, k, taken, None, 0.0, k + 1, cpu(k + 1), context_len=context, gap_s=0.0))
    return k


def test_the_match_is_evidence_of_its_own_and_the_runs_verdicts_weigh_against_it():
    copy = CopyAcceptance(16)
    short, long = copy.rates(8, 3), copy.rates(8, 40)
    assert all(a < b for a, b in zip(short, long)) and long[0] > 0.95
    for _ in range(30):  # copies after short matches are refused at once
        copy.observe(3, 4, 0)
    assert copy.rates(8, 3)[0] < 0.25
    assert copy.rates(8, 40)[0] > 0.95  # a long match is judged on its own record


def test_tokens_two_places_agree_on_are_likely_and_the_fork_is_not():
    copy = CopyAcceptance(16)
    rates = copy.rates(8, 5, agreed=3, fork=3)
    assert min(rates[:3]) >= CEILING_ACCEPT - 1e-9
    assert rates[3] <= 0.5 + 1e-9  # even odds
    assert rates[4] > 0.8  # past the fork, the copy is judged on the match again
    for _ in range(40):  # this text always takes the fork the copy takes
        copy.observe(5, 6, 6, agreed=3, fork=3)
    assert copy.rates(8, 5, agreed=3, fork=3)[3] > 0.9


def test_after_refusals_a_long_match_drafts_at_once_without_waiting_for_a_probe():
    policy = AdaptivePolicy(64)
    for _ in range(3):
        step(policy, 0)  # plain steps: no candidate
    for _ in range(20):
        step(policy, 3, accepted=0)  # short matches, every draft refused
    assert step(policy, 3, accepted=0) == 0  # drafting short matches has stopped paying
    assert step(policy, 48) >= 8  # a copy 48 tokens long: drafted at once, and long


def test_on_a_gpu_like_table_a_fork_is_worth_drafting_through_and_on_a_cpu_it_is_not():
    flat = AdaptivePolicy(64)
    slow = AdaptivePolicy(64)
    for policy, cost in ((flat, lambda n: T1 * (1 + 0.1 * (n - 1) / 15)), (slow, cpu)):
        for _ in range(6):  # costs measured on plain steps and on fully accepted copies
            k = policy.limit("lookup", 64, 200, match=40)
            policy.observe(StepReport("lookup" if k else None, k, k, None, 0.0, k + 1, cost(k + 1), context_len=200, gap_s=0.0))
    # Two earlier places agree on 4 tokens of a copy after a short match, then differ.
    assert flat.limit("lookup", 64, 200, match=4, agreed=4, cap=None) > 5
    assert slow.limit("lookup", 64, 200, match=4, agreed=4, cap=None) <= 5


def test_a_fixed_draft_max_keeps_to_the_drafters_own_cap():
    assert DraftJudge().limit("lookup", 16, 100, match=3, agreed=2, cap=2) == 2
    assert DraftJudge().limit("lookup", 16, 100, match=3) == 16


def test_lookup_tells_the_judge_what_a_second_place_agrees_on():
    class Recording(DraftJudge):
        def limit(self, source, n_max, context_len=0, match=0, agreed=None, cap=None):
            self.seen = (match, agreed, cap)
            return super().limit(source, n_max, context_len, match, agreed, cap)

    judge = Recording()
    phrase = list(range(10, 22))  # 12 tokens: a long key
    context = [1] + phrase + [50, 51, 52, 53] + [2] + phrase + [50, 51, 60, 61] + [3] + phrase
    tokens = PromptLookupDrafter().propose(context, 6, judge).tokens
    match, agreed, _ = judge.seen
    assert agreed == 2  # the two earlier places agree on [50, 51], then differ
    assert tokens[:2] == [50, 51] and match >= 12


def test_a_saved_state_that_says_drafting_never_pays_is_overruled_by_a_long_match():
    # Saved costs from a run on a busy machine: every wide pass at 1.5 one-token passes per token.
    saved = Saved(passes={n: Cost(1.5 * n * T1, 30, 0.0) for n in (2, 4, 8, 16, 32, 64)}, saved_at=0.0)
    saved.passes[1] = Cost(T1, 30, 0.0)
    policy = AdaptivePolicy(64)
    policy.seed(saved)
    lengths = [step(policy, 24 + 8 * i) for i in range(6)]  # text copied verbatim
    # Drafted at every step, long at once; while the run's own wide passes check the saved costs
    # (FIRST_LOOK), the cost line mixes both and a draft or two is shorter; once they are
    # dropped, long again.
    assert lengths[0] >= 8 and min(lengths) > 0 and policy.seed_status == "dropped" and min(lengths[-2:]) >= 8, lengths
