"""Replays of drafting on a known text (decoding/replay.py): the oracle's dynamic programming
against exhaustive search, the replay against the real engine, and `--draft-max auto` on
scripted texts under a CPU-like and a GPU-like cost table. Deterministic: no timing."""

from __future__ import annotations

import functools
import random

import pytest

from conftest import load
from specli.decoding.drafters import PromptLookupDrafter
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.policy import AdaptivePolicy
from specli.decoding.policy.store import Cost, Saved
from specli.decoding.replay import CostTable, agreeing, candidates, oracle, replay
from specli.decoding.step import SpeculativeDecoder
from specli.modes import DraftLength

# A 2-core CPU's Gemma 3 270M (ms by pass width, ../shared/NOTES.md) and a GPU-like table where
# a pass over 16 tokens costs 1.1 one-token passes.
CPU = CostTable.from_points({1: 0.0225, 4: 0.066, 16: 0.127, 32: 0.312, 65: 0.762}, "cpu")
GPU = CostTable.flat(0.0225, 1.1, "gpu")


def test_a_cost_table_interpolates_its_points_and_never_falls():
    table = CostTable.from_points({1: 1.0, 3: 3.0, 5: 2.0}, widest=8)
    assert [table(n) for n in range(1, 6)] == [1.0, 2.0, 3.0, 3.0, 3.0]
    assert table(8) >= table(5) and table(100) >= table(8)
    assert CostTable.flat(1.0, 1.1)(16) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        CostTable.from_points({2: 1.0})
    assert CostTable.from_json(table.to_json()) == table
    # Noisy medians: one slow width is pooled with its neighbours, not carried to every wider one.
    fitted = CostTable.from_medians({1: 1.0, 2: 2.0, 3: 5.0, 4: 3.0, 5: 4.0, 6: 6.0}, widest=6)
    assert [fitted(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 4.0, 4.0, 6.0]


def _exhaustive(text, prompt_len, proposals, costs) -> float:
    end = len(text)

    @functools.lru_cache(maxsize=None)
    def best(pos: int) -> float:
        if pos >= end:
            return 0.0
        proposal = proposals[pos - prompt_len]
        out = float("inf")
        for k in range(0, min(len(proposal), end - pos - 1) + 1):
            accepted = agreeing(proposal[:k], text, pos)
            out = min(out, costs(k + 1) + best(pos + accepted + 1))
        return out

    return best(prompt_len)


def test_the_oracle_equals_an_exhaustive_search():
    rng = random.Random(7)
    for case in range(150):
        text = [rng.randrange(3) for _ in range(rng.randrange(4, 16))]
        prompt_len = rng.randrange(1, len(text))
        proposals = []
        for pos in range(prompt_len, len(text)):
            # Part of the true continuation, then noise: agreement of any length.
            true = text[pos : pos + rng.randrange(0, 6)]
            proposals.append(true + [rng.randrange(3) for _ in range(rng.randrange(0, 4))])
        points = {1: 1.0}
        for n in (2, 4, 8):
            points[n] = points[max(points)] + rng.random() * 2
        costs = CostTable.from_points(points, widest=16)
        best = oracle(text, prompt_len, proposals, costs)
        assert best.modelled_s == pytest.approx(_exhaustive(text, prompt_len, proposals, costs)), case
        assert sum(best.widths) == best.n_tokens == len(text) - prompt_len  # every pass accepted in full


def test_the_oracle_drafts_all_a_true_proposal_offers_only_where_wide_passes_pay():
    text = list(range(10)) + list(range(10))
    proposals = [text[10 + i :] for i in range(10)]  # always the true continuation
    assert oracle(text, 10, proposals, GPU).widths == (10,)  # one pass does it all
    linear = CostTable(tuple(1.2 * n for n in range(1, 20)))  # a token of a wide pass costs more than a plain pass
    linear = CostTable((1.0,) + linear.seconds[1:])
    assert oracle(text, 10, proposals, linear).widths == (1,) * 10
    nothing = [[] for _ in range(10)]
    assert oracle(text, 10, nothing, GPU).modelled_s == pytest.approx(10 * GPU(1))


def test_candidates_are_what_the_drafter_would_copy_at_every_position():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    found = candidates(text, 10, PromptLookupDrafter(ngram_max=4, ngram_min=2), n_max=4)
    assert len(found) == 10
    assert found[4] == [5, 6, 7, 8]  # after [..., 1, 2, 3, 4]: what followed it before
    assert found[-1] == []  # the last position has no room for a draft


@pytest.fixture(scope="module")
def target(pair_perturbed):
    return load(pair_perturbed[0])


def test_the_replay_counts_what_the_engine_does(target):
    # On an F32 fixture speculative output equals plain output, so replaying lookup on the plain
    # text must find every pass the engine made, with the same drafts accepted.
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
    ids = target.tokenize(prompt)
    plain = generate(SpeculativeDecoder(target, None, 0), Request(ids, max_tokens=48)).run()
    for n in (3, 8):
        gen = generate(SpeculativeDecoder(target, PromptLookupDrafter(), n), Request(ids, max_tokens=48)).run()
        assert gen.token_ids == plain.token_ids
        replayed = replay(ids + plain.token_ids, len(ids), PromptLookupDrafter(), n, CPU)
        assert replayed.passes == gen.stats.target_passes
        assert (replayed.drafted, replayed.n_accepted) == (gen.stats.drafted, gen.stats.accepted)
        assert replayed.n_tokens == len(plain.token_ids)
    # With auto the first pass, which also finishes the prompt, drafts nothing, in both.
    target.reset()
    gen = generate(SpeculativeDecoder(target, PromptLookupDrafter(), "auto"), Request(ids, max_tokens=48))
    assert next(iter(gen)).n_drafted == 0
    assert replay(ids + plain.token_ids, len(ids), PromptLookupDrafter(), "auto", CPU).widths[0] == 1


def _scripted(seed: int = 0) -> tuple[list[int], int, int]:
    """A prompt, then text where copies are refused (a phrase seen before, followed each time
    by something else), then a block of 20 tokens repeated over and over. Returns the text,
    the prompt's length and where the repetition begins."""
    rng = random.Random(seed)
    fresh = iter(rng.sample(range(100, 5000), 3000))
    phrase = [next(fresh) for _ in range(10)]
    prompt = [next(fresh) for _ in range(30)]
    for _ in range(3):
        prompt += phrase + [next(fresh) for _ in range(12)]
    text = list(prompt)
    for _ in range(4):  # the phrase again, and something new after it: drafts refused
        text += phrase + [next(fresh) for _ in range(12)]
    start = len(text)
    block = [next(fresh) for _ in range(20)]
    text += block * 8
    return text, len(prompt), start


@pytest.mark.parametrize("costs", [CPU, GPU], ids=["cpu", "gpu"])
def test_auto_drafts_a_text_that_starts_repeating_within_one_repetition(costs):
    text, prompt_len, start = _scripted()
    policy = AdaptivePolicy(64)
    run = replay(text, prompt_len, PromptLookupDrafter(), DraftLength.auto(), costs, policy=policy)
    assert run.refused > 0  # the copies before the repetition were tried and refused
    # Where each pass began: the first accepted draft in the repeated part comes within its
    # second occurrence (20 tokens), and the rest is drafted long.
    pos, first = prompt_len, None
    for _, accepted in zip(run.widths, run.accepted):
        if pos >= start + 20 and accepted > 0 and first is None:
            first = pos
        pos += accepted + 1
    assert first is not None and first <= start + 20 + 12, (first, start)
    tail = replay(text, prompt_len, PromptLookupDrafter(), DraftLength.auto(), costs)
    assert tail.tokens_per_pass > 2.5


def test_saved_costs_that_say_drafting_never_pays_are_overruled_by_a_long_match():
    # Saved costs that price every wide pass at its tokens' worth of plain passes and more (a
    # run under contention, or a machine where drafting lost): a long match drafts at once.
    t1 = CPU(1)
    saved = Saved(passes={n: Cost(1.5 * n * t1, 30, 0.0) for n in (1, 2, 4, 8, 16, 32, 64)}, saved_at=0.0)
    saved.passes[1] = Cost(t1, 30, 0.0)
    policy = AdaptivePolicy(64)
    policy.seed(saved)
    block = list(range(100, 140))
    text = list(range(1000, 1030)) + block + list(range(2000, 2005)) + block * 3
    prompt_len = 30 + 40 + 5 + 12  # the block's start is back: the match is 12 tokens long
    run = replay(text, prompt_len, PromptLookupDrafter(), DraftLength.auto(), CPU, policy=policy)
    assert run.widths[0] > 1 or run.widths[1] > 1, run.widths[:5]
    assert run.tokens_per_pass > 4


def test_a_replay_tells_the_policy_what_timing_says_and_nothing_else():
    # `timing` stands for a noisy machine: the policy hears it for every pass but the first
    # (which prices the prompt), and a timing that repeats the table is a clean replay.
    text, prompt_len, _ = _scripted()
    clean = replay(text, prompt_len, PromptLookupDrafter(), DraftLength.auto(), CPU, policy=AdaptivePolicy(64), utilization=2.0)
    told = []

    def timing(width):
        told.append(width)
        return CPU(width), 2.0

    same = replay(text, prompt_len, PromptLookupDrafter(), DraftLength.auto(), CPU, policy=AdaptivePolicy(64), timing=timing)
    assert same.widths == clean.widths and same.accepted == clean.accepted
    assert told == same.widths[1:]
    # Told that every wide pass stalled (3x, at half the CPU use): the policy hears it and
    # drafts differently, while the replay still counts the text's own passes.
    stalled = replay(text, prompt_len, PromptLookupDrafter(), DraftLength.auto(), CPU, policy=AdaptivePolicy(64),
                     timing=lambda w: (CPU(w) * (3.0 if w > 1 else 1.0), 1.0 if w > 1 else 2.0))
    assert stalled.n_tokens == clean.n_tokens
    assert stalled.widths != clean.widths
