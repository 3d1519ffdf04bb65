"""PromptLookupDrafter: which earlier place it copies, on what evidence, and what it tells the
judge (docs/lookup.md). Pure and fast: token lists, no model."""

from __future__ import annotations

import random

from specli.decoding.drafters import PromptLookupDrafter, _continue_periodically, _match_length, _resync
from specli.decoding.policy import DraftJudge


class RecordingJudge(DraftJudge):
    """Drafts up to `allow` tokens (default: all asked) and records every limit() call."""

    def __init__(self, allow: int | None = None):
        self.allow = allow
        self.calls: list[dict] = []

    def limit(self, source: str, n_max: int, context_len: int = 0, match: int = 0, agreed: int | None = None,
              cap: int | None = None) -> int:
        n_max = super().limit(source, n_max, context_len, match, agreed, cap)  # (the drafter's own cap)
        self.calls.append({"source": source, "n_max": n_max, "context_len": context_len, "match": match})
        self.agreed = agreed
        return n_max if self.allow is None else min(n_max, self.allow)


def proposal(drafter: PromptLookupDrafter, context: list[int], n_max: int, judge: DraftJudge | None = None) -> list[int]:
    return drafter.propose(context, n_max, judge or DraftJudge()).tokens


# --- which occurrence ------------------------------------------------------------------------
def test_the_occurrence_matching_furthest_back_wins_over_the_latest():
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=3)
    # [2, 3, 4] occurs at 2 (after 9, 1: as at the end) and at 7 (after 7).
    context = [9, 1, 2, 3, 4, 5, 7, 2, 3, 4, 6, 9, 1, 2, 3, 4]
    judge = RecordingJudge()
    assert proposal(drafter, context, 2, judge) == [5, 7]
    assert judge.calls == [{"source": "lookup", "n_max": 2, "context_len": len(context), "match": 5}]


def test_on_equal_matches_the_latest_occurrence_wins():
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=2)
    context = [5, 1, 2, 3, 7, 6, 1, 2, 3, 8, 4, 1, 2, 3]
    assert proposal(drafter, context, 2) == [8, 4]


def test_a_copy_goes_on_from_where_it_is():
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=3)
    source = [1, 2, 3, 4, 5, 6, 7, 8]
    # Later, [4, 5, 6] is repeated with something else after it.
    context = source + [50, 4, 5, 6, 99, 51, 1, 2, 3]
    drafter.begin(context)
    assert proposal(drafter, context, 2) == [4, 5]
    context += [4, 5, 6]  # both accepted, and the target's own token follows the source too
    judge = RecordingJudge()
    assert proposal(drafter, context, 2, judge) == [7, 8]
    assert judge.calls[-1]["match"] == 6


# --- continuation statistics: two votes for short keys, memory of departures -------------------
NL, PHRASE = 0, [20, 21, 22, 23, 24, 25]


def item(number: int, word: int) -> list[int]:
    """A list item: newline, its number, a phrase repeated in every item, its own word, '.'."""
    return [NL, number, *PHRASE, word, 9]


def test_short_keys_draft_only_what_two_earlier_occurrences_agree_on():
    drafter = PromptLookupDrafter(ngram_max=6, ngram_min=5, consensus_min=2)
    context = item(11, 31) + item(12, 32) + [NL, 13, 20, 21]
    judge = RecordingJudge()
    # Every key of 5+ tokens holds the new number; [20, 21] was followed twice by
    # [22, 23, 24, 25] and then by different words: the draft is the agreed part.
    assert proposal(drafter, context, 8, judge) == [22, 23, 24, 25]
    assert judge.calls[-1]["n_max"] == 4 and judge.calls[-1]["match"] == 2


def test_short_keys_need_two_votes_that_agree():
    drafter = PromptLookupDrafter(ngram_max=6, ngram_min=5, consensus_min=2)
    once = item(11, 31) + [NL, 13, 20, 21]
    assert proposal(drafter, once, 8) == []  # one earlier occurrence is no vote
    drafter = PromptLookupDrafter(ngram_max=6, ngram_min=5, consensus_min=2)
    # A short phrase [40, 41, 42] after which the two items part at once.
    split = [NL, 11, 40, 41, 42, 31, 9, NL, 12, 40, 41, 42, 32, 9, NL, 13, 40, 41, 42]
    assert proposal(drafter, split, 8) == []
    # Agreeing on fewer than CONSENSUS_DRAFT tokens is not enough either.
    drafter = PromptLookupDrafter(ngram_max=6, ngram_min=5, consensus_min=2)
    short = item(11, 31) + item(12, 32) + [NL, 13, 20, 21, 22, 23]
    assert proposal(drafter, short, 8) == []


def test_a_key_whose_copy_was_left_at_once_drafts_nothing_until_followed_again():
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=3)
    context = [1, 2, 3, 7, 5, 1, 2, 3, 8, 6, 1, 2, 3]
    drafter.begin(context)
    assert proposal(drafter, context, 3) == [8, 6, 1]  # the latest of two equal matches
    context += [9, 4, 1, 2, 3]  # the target wrote 9, not 8: the key [1, 2, 3] varies
    assert proposal(drafter, context, 3) == []
    context += [9]  # this time the text follows the latest occurrence (9 4 1 ...)
    assert proposal(drafter, context, 3) == [4, 1, 2]


def test_a_key_left_after_j_tokens_drafts_at_most_j_next_time():
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=3)
    context = [1, 2, 3, 4, 5, 6, 7, 50, 1, 2, 3]
    drafter.begin(context)
    assert proposal(drafter, context, 4) == [4, 5, 6, 7]
    context += [4, 5, 8, 60, 1, 2, 3]  # followed for two tokens, then left
    judge = RecordingJudge()
    assert proposal(drafter, context, 4, judge) == [4, 5]
    assert judge.calls[-1]["n_max"] == 2


# --- resuming a copy after an edit ------------------------------------------------------------
def test_a_copy_resumes_two_tokens_after_an_edit():
    source = list(range(10, 30))
    drafter = PromptLookupDrafter(ngram_max=4, ngram_min=4, consensus_min=4)
    context = source + [90, 10, 11, 12, 13]
    drafter.begin(context)
    assert proposal(drafter, context, 4) == [14, 15, 16, 17]
    context += [14, 15, 77]  # two accepted, then the target's edit (77 for 16)
    assert proposal(drafter, context, 4) == []
    context += [17]  # one token matching again is not enough
    assert proposal(drafter, context, 4) == []
    context += [18]
    judge = RecordingJudge()
    assert proposal(drafter, context, 4, judge) == [19, 20, 21, 22]
    assert judge.calls[-1]["match"] == 2
    # Long keys alone (no copy to resume) wait for four tokens after the edit.
    fresh = PromptLookupDrafter(ngram_max=4, ngram_min=4, consensus_min=4)
    assert proposal(fresh, context, 4) == []


def test_resync_prefers_the_longest_match_in_its_window():
    tokens = [5, 1, 2, 7, 3, 1, 2, 8, 9, 3, 1, 2]
    assert _resync(tokens, 0, 11, 8) == (7, 3)  # [3, 1, 2] ends at 7; [1, 2] alone at 3
    assert _resync(tokens, 0, 5, 8) == (3, 2)


# --- the match reported, loops, limits --------------------------------------------------------
def test_match_is_measured_beyond_the_key():
    drafter = PromptLookupDrafter()  # keys of 12 down to 8
    text = list(range(100, 140))
    context = text + [7] + text[:30]
    judge = RecordingJudge()
    assert proposal(drafter, context, 5, judge) == text[30:35]
    assert judge.calls == [{"source": "lookup", "n_max": 5, "context_len": len(context), "match": 30}]
    assert _match_length(context, 30, len(context), 16) == 16  # (capped)


def test_a_loop_is_continued_with_its_period():
    drafter = PromptLookupDrafter()
    context = [1, 2, 3, 4, 5] * 4 + [1, 2]
    judge = RecordingJudge()
    assert proposal(drafter, context, 16, judge) == ([3, 4, 5, 1, 2] * 4)[:16]
    assert judge.calls[-1]["match"] == len(context) - 5


def test_the_judges_limit_is_respected_and_nothing_is_asked_without_a_candidate():
    drafter = PromptLookupDrafter(ngram_max=2, ngram_min=2)
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposal(drafter, context, 6, RecordingJudge(allow=2)) == [3, 4]
    assert proposal(drafter, context, 6, RecordingJudge(allow=0)) == []
    judge = RecordingJudge()
    assert proposal(PromptLookupDrafter(ngram_max=2, ngram_min=2), [1, 2, 3, 4], 6, judge) == []
    assert judge.calls == []


def test_periodic_continuation_helper():
    assert _continue_periodically([1, 2, 3, 1, 2], 2, 5) == [3, 1, 2, 3, 1]
    assert _continue_periodically([4, 4], 1, 3) == [4, 4, 4]


# --- incremental index ------------------------------------------------------------------------
def test_incremental_index_equals_a_rebuild_and_drafts_stay_within_bounds():
    rng = random.Random(7)
    stream = [rng.choice([1, 2, 3, 4, 5]) if rng.random() < 0.7 else rng.randrange(100) for _ in range(400)]
    grown = PromptLookupDrafter()
    grown.begin(stream[:40])
    at = 40
    while at < len(stream):
        n_max = rng.choice([1, 4, 16])
        draft = grown.propose(stream[:at], n_max).tokens
        assert len(draft) <= n_max
        at += rng.randint(1, 6)
    grown.propose(stream, 4)
    rebuilt = PromptLookupDrafter()
    rebuilt.propose(stream, 4)
    assert grown._tokens == rebuilt._tokens == stream
    assert grown._latest == rebuilt._latest
    assert grown._previous == rebuilt._previous
    # A context that is not an extension rebuilds the index from scratch.
    grown.propose(stream[:100], 4)
    fresh = PromptLookupDrafter()
    fresh.propose(stream[:100], 4)
    assert grown._latest == fresh._latest and grown._previous == fresh._previous
