"""Pure parts: verification, text streaming, stats, the lookup drafter, the compatibility rule,
the draft length."""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.helpers import detokenize
from specli.decoding.drafters import PromptLookupDrafter, _softmax_at
from specli.decoding.stats import Stats
from specli.decoding.text import TextStream
from specli.decoding.verifier import verify_greedy
from specli.errors import IncompatibleDraftError
from specli.llama.compat import check_compatible
from specli.llama.model import VocabInfo, common_prefix_len
from specli.modes import AUTO_MAX_DRAFT, MAX_DRAFT, DraftLength


def one_hot_rows(choices: list[int], n_vocab: int = 10) -> np.ndarray:
    logits = np.zeros((len(choices), n_vocab), dtype=np.float32)
    for row, token in enumerate(choices):
        logits[row, token] = 1.0
    return logits


# --- verification -------------------------------------------------------------------------
def test_full_accept_emits_bonus_token():
    verdict = verify_greedy(one_hot_rows([3, 4, 5, 6]), [3, 4, 5])
    assert verdict.n_accepted == 3
    assert verdict.tokens == [3, 4, 5, 6]


def test_first_mismatch_emits_targets_choice_and_stops():
    verdict = verify_greedy(one_hot_rows([3, 9, 5, 6]), [3, 4, 5])
    assert verdict.n_accepted == 1
    assert verdict.tokens == [3, 9]  # the later agreement at position 2 must not count


def test_no_draft_is_plain_greedy_decoding():
    verdict = verify_greedy(one_hot_rows([7]), [])
    assert (verdict.n_accepted, verdict.tokens) == (0, [7])


def test_reject_at_first_position():
    verdict = verify_greedy(one_hot_rows([1, 2]), [2])
    assert (verdict.n_accepted, verdict.tokens) == (0, [1])


def test_shape_mismatch_is_a_bug():
    with pytest.raises(AssertionError):
        verify_greedy(one_hot_rows([1, 2]), [1, 2])


# --- text ---------------------------------------------------------------------------------
PIECES = {1: "h".encode(), 2: "é".encode()[:1], 3: "é".encode()[1:], 4: "😀".encode()[:2], 5: "😀".encode()[2:], 6: b" x"}


def test_split_multibyte_character_is_held_back_until_complete():
    stream = TextStream(PIECES.__getitem__)
    assert stream.feed([1, 2]) == "h"  # half of é: nothing printed yet
    assert stream.feed([3]) == "é"
    assert stream.feed([4]) == ""
    assert stream.feed([5, 6]) == "😀 x"
    assert stream.flush() == ""


def test_incomplete_tail_becomes_replacement_char_at_the_end():
    stream = TextStream(PIECES.__getitem__)
    assert stream.feed([1, 4]) == "h"
    assert stream.flush() == "\ufffd"


def test_detokenize_all_at_once():
    assert detokenize(PIECES.__getitem__, [1, 2, 3, 6]) == "hé x"


# --- stats --------------------------------------------------------------------------------
def test_stats_definitions():
    stats = Stats()
    stats.record_step(n_drafted=4, n_accepted=4, n_emitted=5)
    stats.record_step(n_drafted=4, n_accepted=1, n_emitted=2)
    stats.record_step(n_drafted=0, n_accepted=0, n_emitted=1)
    stats.generation_s = 2.0
    assert stats.acceptance_rate == 5 / 8
    assert stats.target_passes == 3
    assert stats.mean_tokens_per_pass == 8 / 3
    assert stats.tokens_per_s == 4.0
    assert stats.to_dict()["acceptance_by_position"] == [1.0, 0.5, 0.5, 0.5]
    assert stats.mean_draft_length == 8 / 3 and stats.draft_lengths == [1, 0, 0, 0, 2]


def test_stats_keep_drafted_and_accepted_per_source():
    stats = Stats()
    stats.record_step(6, 6, 7, source="lookup")
    stats.record_step(3, 1, 2, source="draft-model")
    stats.record_step(0, 0, 1)
    other = Stats()
    other.record_step(2, 0, 1, source="draft-model")
    stats.add(other)
    by_source = stats.to_dict()["by_source"]
    assert by_source["lookup"] == {"drafted": 6, "accepted": 6, "acceptance_rate": 1.0}
    assert by_source["draft-model"] == {"drafted": 5, "accepted": 1, "acceptance_rate": 0.2}
    assert stats.draft_lengths == [1, 0, 1, 1, 0, 0, 1]


def test_stats_add_sums_counts_times_and_positions():
    a, b = Stats(), Stats()
    a.record_step(2, 1, 2)
    b.record_step(3, 3, 4)
    a.generation_s, b.generation_s, b.prompt_reused = 1.0, 0.5, 7
    a.add(b)
    assert (a.n_tokens, a.drafted, a.accepted, a.target_passes) == (6, 5, 4, 2)
    assert a.generation_s == 1.5 and a.prompt_reused == 7
    assert a.drafted_at == [2, 2, 1] and a.accepted_at == [2, 1, 1]
    assert a.draft_lengths == [0, 0, 1, 1]


def test_stats_without_drafts_has_no_acceptance():
    stats = Stats()
    stats.record_step(0, 0, 1)
    assert stats.acceptance_rate is None
    assert stats.to_dict()["acceptance_rate"] is None


# --- prompt lookup --------------------------------------------------------------------------
def test_lookup_copies_continuation_of_latest_longest_match():
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=1)
    context = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    drafter.begin(context)
    # [1, 2, 3] occurs at 0 and 5; the latest (5) is followed by 4, 5, 6.
    assert drafter.propose(context, 3).tokens == [4, 5, 6]


def test_lookup_prefers_longer_key_over_more_recent_short_one():
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=1)
    context = [7, 8, 9, 1, 5, 5, 9, 2, 7, 8, 9]
    drafter.begin(context)
    # The 3-gram [7, 8, 9] matches at 0 (continuation 1); the 1-gram [9] matches later at 6.
    assert drafter.propose(context, 1).tokens == [1]


def test_lookup_without_match_proposes_nothing():
    drafter = PromptLookupDrafter(ngram_max=4, ngram_min=2)
    drafter.begin([1, 2, 3, 4])
    assert drafter.propose([1, 2, 3, 4], 5).tokens == []


def test_lookup_follows_a_growing_context_and_a_rewritten_one():
    drafter = PromptLookupDrafter(ngram_max=2, ngram_min=2)
    context = [5, 6, 7, 8]
    drafter.begin(context)
    assert drafter.propose(context, 2).tokens == []
    context += [5, 6]
    assert drafter.propose(context, 2).tokens == [7, 8]
    # A context that is not an extension (e.g. a chat reset) rebuilds the index.
    assert drafter.propose([1, 2, 3, 1, 2], 2).tokens == [3, 1]


def test_lookup_matches_overlapping_repetition():
    drafter = PromptLookupDrafter(ngram_max=2, ngram_min=2)
    context = [4, 4, 4, 4]
    drafter.begin(context)
    # The latest earlier [4, 4] (at 1) is followed by one 4; the loop continues past the end.
    assert drafter.propose(context, 3).tokens == [4, 4, 4]


def test_lookup_continues_a_loop_with_its_period():
    drafter = PromptLookupDrafter(ngram_max=2, ngram_min=2)
    context = [1, 2, 3, 1, 2, 3, 1, 2]
    drafter.begin(context)
    assert drafter.propose(context, 7).tokens == [3, 1, 2, 3, 1, 2, 3]


def test_draft_confidence_is_the_softmax_probability_of_the_token():
    rng = np.random.default_rng(0)
    for scale in (0.5, 3.0, 10.0):
        row = (rng.standard_normal(50_000) * scale).astype(np.float32)
        full = np.exp(row.astype(np.float64) - row.max())
        full /= full.sum()
        for token in (int(row.argmax()), 7):  # the greedy pick, and a token a penalty picked
            assert _softmax_at(row, token) == pytest.approx(full[token], rel=1e-4, abs=1e-12)
    assert _softmax_at(np.array([0.0, -40.0, -50.0], dtype=np.float32), 0) == 1.0


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)) + [1], list(range(1000)) + [2]) == 1000


# --- compatibility --------------------------------------------------------------------------
def vocab(**changes) -> VocabInfo:
    base = dict(vocab_type=1, n_tokens=300, bos=1, eos=2, add_bos=True)
    base.update(changes)
    return VocabInfo(**base)


def texts(overrides: dict[int, bytes] | None = None):
    overrides = overrides or {}
    return lambda token: overrides.get(token, f"tok{token}".encode())


def recorded(text_of, seen: set[int]):
    """text_of, noting each token id it is asked about in `seen`."""
    def text(token: int) -> bytes:
        seen.add(token)
        return text_of(token)
    return text


def test_identical_vocabularies_are_compatible():
    seen_tgt, seen_dft = set(), set()
    check_compatible(vocab(), vocab(), recorded(texts(), seen_tgt), recorded(texts(), seen_dft))
    assert seen_tgt == seen_dft == set(range(5, 300))  # every token text from id 5 on was compared


def test_vocabularies_differing_in_size_by_at_most_128_are_compatible():
    seen = set()
    check_compatible(vocab(), vocab(n_tokens=300 + 128), texts(), recorded(texts(), seen))
    assert seen == set(range(5, 300))  # the ids both have, and only those


@pytest.mark.parametrize(
    "draft_info, draft_texts, expected",
    [
        (vocab(vocab_type=2), texts(), "different tokenizer types (target SPM, draft BPE)"),
        (vocab(bos=5), texts(), "different BOS tokens (target 1, draft 5)"),
        (vocab(eos=3), texts(), "different EOS tokens (target 2, draft 3)"),
        (vocab(n_tokens=300 + 129), texts(), "differ in size by 129 tokens"),
        (vocab(), texts({42: b"other"}), "disagree on token 42 (target 'tok42', draft 'other')"),
    ],
)
def test_incompatible_draft_names_the_difference(draft_info, draft_texts, expected):
    with pytest.raises(IncompatibleDraftError, match="^.*" + expected.replace("(", r"\(").replace(")", r"\)")):
        check_compatible(vocab(), draft_info, texts(), draft_texts)


def test_token_texts_below_5_may_differ():
    check_compatible(vocab(), vocab(), texts(), texts({0: b"<pad>", 4: b"<mask>"}))


# --- the draft length -----------------------------------------------------------------------
def test_a_draft_length_reads_as_typed_and_writes_json_as_before():
    auto, four, off = DraftLength.parse(" AUTO "), DraftLength.parse("4"), DraftLength.off()
    assert auto == DraftLength.auto() and four == DraftLength.fixed_at(4)
    assert (str(auto), str(four), str(off)) == ("auto", "4", "0")
    assert (auto.json_value, four.json_value, off.json_value) == ("auto", 4, 0)
    assert (auto.maximum, four.maximum, off.maximum) == (AUTO_MAX_DRAFT, 4, 0)
    assert auto.is_auto and not four.is_auto and off.is_off and not four.is_off
    assert len({DraftLength.auto(), auto, four, DraftLength.fixed_at(4)}) == 2  # a value: hashable, equal by content


@pytest.mark.parametrize("text, message", [("x", "'x' is not a number"), ("", "'' is not a number"), ("0", "got 0"),
                                           (str(MAX_DRAFT + 1), f"got {MAX_DRAFT + 1}"), ("2.5", "'2.5' is not a number")])
def test_a_bad_draft_length_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        DraftLength.parse(text)


def test_library_callers_give_auto_or_a_number():
    assert DraftLength.of("auto") == DraftLength.auto() and DraftLength.of(MAX_DRAFT) == DraftLength.fixed_at(MAX_DRAFT)
    assert DraftLength.of(DraftLength.fixed_at(3)) == DraftLength.fixed_at(3)
    for bad in (0, MAX_DRAFT + 1, "AUTO", "4", 2.0, None, DraftLength.off()):
        with pytest.raises(ValueError):
            DraftLength.of(bad)
