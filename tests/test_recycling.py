"""Token Recycling (decoding/recycling.py): the table, the drafter protocol, and that a replay
with it reproduces the text whatever it drafts."""

from __future__ import annotations

import numpy as np
import pytest

from specli.decoding.drafters import PromptLookupDrafter
from specli.decoding.policy import FIXED
from specli.decoding.recycling import RECYCLING, UNKNOWN, RecyclingDrafter, RecyclingTable
from specli.decoding.replay import CostTable, replay


def test_observe_and_chain_hand_example():
    table = RecyclingTable(10, k=3)
    assert table.known == 0
    assert table.chain(1, 4) == []
    # After 1 the target expected 2 (then 5, 7); after 2: 3; after 3: 1 (a loop).
    table.observe([1, 2, 3], [[2, 5, 7], [3, 4, 0], [1, 9, 8]])
    assert table.candidates(1) == [2, 5, 7]
    assert table.chain(1, 2) == [2, 3]
    assert table.chain(1, 5) == [2, 3, 1, 2, 3]
    assert table.chain(4, 3) == []  # nothing known after 4
    assert table.known == 3
    # A later observation overwrites; within one batch the latest occurrence wins.
    table.observe([2, 6, 2], [[4, 5, 6], [0, 0, 0], [6, 1, 1]])
    assert table.candidates(2) == [6, 1, 1]
    assert table.chain(1, 4) == [2, 6, 0]  # 0 has no row: the chain stops
    # Fewer candidates than k: the rest is unknown.
    table.observe([3], [[8]])
    assert table.candidates(3) == [8]
    assert list(table.rows[3]) == [8, UNKNOWN, UNKNOWN]


def test_deep_branch_prefers_a_candidate_that_continues():
    table = RecyclingTable(10, k=3)
    table.observe([1, 4], [[2, 4, 5], [6, 7, 8]])  # 2 has no row, 4 has one
    assert table.chain(1, 3) == [2]
    assert table.chain(1, 3, branch="deep") == [4, 6]
    assert table.chain(1, 1, branch="deep") == [2]  # (the last token needs no continuation)


def test_probabilities_gate_the_chain():
    table = RecyclingTable(10, k=2, probs=True)
    table.observe([1, 2, 3], [[2, 5], [3, 4], [4, 0]], [[0.9, 0.05], [0.6, 0.3], [0.2, 0.1]])
    assert table.chain(1, 5) == [2, 3, 4]
    assert table.chain(1, 5, min_prob=0.5) == [2, 3]  # 3 -> 4 was a guess of 0.2
    assert table.chain(1, 5, min_prob=0.95) == []
    table.observe([2], [[3, 4]])  # without probabilities: not known, so not enough
    assert table.chain(1, 5, min_prob=0.5) == [2]
    drafter = RecyclingDrafter(table, min_prob=0.5)
    assert drafter.propose([7, 1], 4, FIXED).tokens == [2]
    with pytest.raises(ValueError):
        RecyclingTable(10, k=2).chain(1, 3, min_prob=0.5)  # no probabilities kept


def test_bounds():
    table = RecyclingTable(10, k=2)
    with pytest.raises(ValueError):
        table.observe([10], [[1, 2]])  # an input outside the vocabulary
    with pytest.raises(ValueError):
        table.observe([-1], [[1, 2]])
    with pytest.raises(ValueError):
        table.observe([1], [[1, 10]])  # a candidate outside it
    with pytest.raises(ValueError):
        table.observe([1, 2], [[1, 2]])  # a row per input
    assert table.known == 0  # refused batches change nothing
    assert table.chain(10, 3) == [] and table.chain(-1, 3) == [] and table.candidates(99) == []
    table.observe([], np.empty((0, 2), dtype=np.int32))
    assert table.rows.shape == (10, 2) and table.rows.dtype == np.int32
    with pytest.raises(ValueError):
        RecyclingTable(0)


def test_drafter_protocol():
    table = RecyclingTable(50, k=4)
    drafter = RecyclingDrafter(table)
    drafter.begin([1, 2, 3])
    empty = drafter.propose([1, 2, 3], 4, FIXED)
    assert empty.tokens == [] and empty.source == RECYCLING  # nothing known
    table.observe([3, 4, 5, 6, 7], [[4], [5], [6], [7], [8]])
    for n_max in (0, 1, 2, 4):
        proposal = drafter.propose([1, 2, 3], n_max, FIXED)
        assert proposal.tokens == [4, 5, 6, 7][:n_max]
        assert len(proposal.tokens) <= n_max
    assert drafter.propose([1, 2, 3], 8, FIXED).tokens == [4, 5, 6, 7, 8]  # the chain ends at 8
    drafter.update(4, 2)


def test_lookup_is_asked_first():
    table = RecyclingTable(50, k=2)
    table.observe([3], [[40, 41]])
    drafter = RecyclingDrafter(table, PromptLookupDrafter(ngram_min=2, ngram_max=3))
    context = [7, 1, 2, 3, 9, 9, 1, 2, 3]  # "1 2 3" was followed by 9 before: lookup copies it
    drafter.begin(context)
    proposal = drafter.propose(context, 2, FIXED)
    assert proposal.tokens == [9, 9] and proposal.source != RECYCLING
    other = [7, 5, 3]  # no match in the context: the table's chain
    drafter.begin(other)
    proposal = drafter.propose(other, 2, FIXED)
    assert proposal.tokens == [40] and proposal.source == RECYCLING


class _Judge:
    """A judge that allows only one token of a recycled draft."""

    def limit(self, source, n_max, context_len=0, match=0, agreed=None, cap=None):
        assert source == RECYCLING and cap is not None
        return min(1, n_max, cap)


def test_judge_sizes_the_draft():
    table = RecyclingTable(50, k=2)
    table.observe([3, 4], [[4, 1], [5, 1]])
    assert RecyclingDrafter(table).propose([3], 4, _Judge()).tokens == [4]


@pytest.mark.parametrize("n_draft", [1, 3, 8, "auto"])
def test_replay_reproduces_the_text(n_draft):
    """The accepted tokens of every pass are the text's: whatever the table holds (here partly
    right, partly wrong guesses), the replay emits exactly the text."""
    rng = np.random.default_rng(0)
    vocab = 30
    text = [int(t) for t in rng.integers(0, vocab, size=200)]
    prompt_len = 20
    table = RecyclingTable(vocab, k=3)
    # Candidates from the text itself (the target's true next token) and random noise.
    right = [[text[i + 1], int(rng.integers(vocab)), int(rng.integers(vocab))] for i in range(len(text) - 1)]
    table.observe(text[:-1], [row if i % 3 else row[::-1] for i, row in enumerate(right)])
    drafter = RecyclingDrafter(table, PromptLookupDrafter())
    r = replay(text, prompt_len, drafter, n_draft, CostTable.flat())
    assert r.n_tokens == len(text) - prompt_len
    assert sum(a + 1 for a in r.accepted) == r.n_tokens
    assert 0 <= r.refused <= r.drafted
    if n_draft != "auto":
        assert r.drafted > 0  # the table drafts: exactness is tested on real drafts
