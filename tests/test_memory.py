"""Drafting from memory: TokenMemory (decoding/memory.py) against a brute-force search, its size
bound and binary form, and MemoryDrafter (decoding/memory_drafter.py): memory asked only when
the context has no match, honest evidence for the judge, and output == target-only in the
engine on the F32 fixture models, also with a memory built to mislead."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import load
from fixtures.clock import VirtualClock
from specli.decoding.drafters import PromptLookupDrafter
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.memory import Candidate, MemoryFileError, TokenMemory
from specli.decoding.memory_drafter import MEMORY, MemoryDrafter, MemoryRecord, record_for, shared_prefix
from specli.decoding.policy import FIXED, DraftJudge
from specli.decoding.replay import CostTable, replay
from specli.decoding.step import SpeculativeDecoder

# --------------------------------------------------------------------------------------------
# The reference: every place of every live document, by brute force


def reference(docs: list[list[int]], context: list[int], max_len: int, memory: TokenMemory) -> list[tuple]:
    """What lookup must return, as (tokens, count, match) triples: the places of the longest key
    length that some place matches (its match measured up to MATCH_CAP, within its document),
    the latest MAX_PLACES of them, grouped by continuation, ranked by count, match, recency."""
    if max_len <= 0:
        return []
    tail = list(context[-memory.MATCH_CAP :])
    places = []  # (order, tokens that follow, match)
    for doc in docs:
        for p in range(1, len(doc)):
            m = 0
            while m < min(len(tail), p) and doc[p - 1 - m] == tail[-1 - m]:
                m += 1
            places.append((len(places), tuple(doc[p : p + min(max_len, memory.MAX_CONTINUATION)]), m))
    for n in reversed(memory.key_lengths):
        if n > len(tail):
            continue
        hits = [pl for pl in places if pl[2] >= n][-memory.MAX_PLACES :]
        if hits:
            groups: dict[tuple, list[int]] = {}
            for order, follow, m in hits:
                g = groups.setdefault(follow, [0, 0, -1])
                g[0], g[1], g[2] = g[0] + 1, max(g[1], m), max(g[2], order)
            ranked = sorted(groups.items(), key=lambda kv: (-kv[1][0], -kv[1][1], -kv[1][2]))
            return [(tokens, c, m) for tokens, (c, m, _) in ranked]
    return []


def as_triples(found: list[Candidate]) -> list[tuple]:
    return [(c.tokens, c.count, c.match) for c in found]


def live_reference_docs(added: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The documents a store bounded to max_tokens holds after these adds: each cut to its last
    max_tokens tokens, the oldest dropped while more are held."""
    docs: list[list[int]] = []
    for doc in added:
        if doc:
            docs.append(list(doc[-max_tokens:]))
        while sum(map(len, docs)) > max_tokens:
            docs.pop(0)
    return docs


# --------------------------------------------------------------------------------------------
# The store


def test_the_longest_match_wins_and_its_continuations_are_counted():
    memory = TokenMemory("t")
    memory.add([1, 2, 3, 4, 5, 6, 7, 8])  # ... 3 4 5 -> 6 7 8
    memory.add([9, 3, 4, 5, 6, 7, 0])  # ... 3 4 5 -> 6 7 0
    memory.add([9, 3, 4, 5, 6, 7, 0, 1])  # ... 3 4 5 -> 6 7 0 (a second place agrees)
    memory.add([2, 2, 3, 4, 5, 1, 1])  # 2 3 4 5 -> 1 1: the longest match for ... 2 3 4 5
    assert as_triples(memory.lookup([7, 2, 3, 4, 5], 3)) == [((1, 1), 1, 4), ((6, 7, 8), 1, 4)]
    # Only 3 tokens match everywhere: counts rank first, then the match, then the latest.
    assert as_triples(memory.lookup([0, 3, 4, 5], 3)) == [((6, 7, 0), 2, 3), ((1, 1), 1, 3), ((6, 7, 8), 1, 3)]
    # Continuations stop at max_len and at their document's end.
    assert as_triples(memory.lookup([3, 4, 5, 6, 7], 5)) == [((0, 1), 1, 5), ((0,), 1, 5), ((8,), 1, 5)]
    # Fewer than min_match tokens match: nothing.
    assert memory.lookup([8, 4, 5], 3) == [] and memory.lookup([4, 5], 3) == []
    assert memory.lookup([3, 4, 5], 0) == []


def test_a_match_never_crosses_a_document_boundary():
    memory = TokenMemory("t")
    memory.add([10, 11, 12])
    memory.add([13, 14, 15, 16])
    # 11 12 13 14 exists only across the boundary; 12 13 14 too.
    assert memory.lookup([11, 12, 13, 14], 4) == []
    assert memory.lookup([12, 13, 14], 4) == []
    # Inside the second document it matches, measured only back to its start.
    assert as_triples(memory.lookup([11, 12, 13, 14, 15], 4)) == [((16,), 1, 3)]
    # The end of a document has nothing after it: no candidate.
    assert memory.lookup([10, 11, 12], 4) == []


def test_the_size_bound_drops_the_oldest_documents_first():
    memory = TokenMemory("t", max_tokens=10)
    memory.add([1, 2, 3, 4, 5])
    memory.add([6, 7, 8, 9])
    assert memory.lookup([1, 2, 3], 2) == [Candidate((4, 5), 1, 3)]
    memory.add([20, 21, 22])  # 12 tokens: the first document goes
    assert memory.n_tokens == 7 and memory.n_documents == 2
    assert memory.lookup([1, 2, 3], 2) == []
    assert memory.lookup([6, 7, 8], 2) == [Candidate((9,), 1, 3)]
    memory.add(list(range(100, 125)))  # longer than the bound: its last 10 tokens stay
    assert memory.documents() == [list(range(115, 125))]
    assert memory.lookup([6, 7, 8], 2) == [] and memory.lookup([116, 117, 118], 2) == [Candidate((119, 120), 1, 3)]


def test_many_adds_without_a_lookup_keep_the_buffer_bounded():
    memory = TokenMemory("t", max_tokens=100)
    for i in range(1000):
        memory.add([i % 7, 1000 + i, 2000 + i, 3000 + i, 4000 + i])
        assert memory._n <= 2 * 100 + 5  # (evicted tokens are dropped, not only skipped)
    assert memory.n_tokens == 100 and memory.documents()[-1] == [999 % 7, 1999, 2999, 3999, 4999]
    assert memory.lookup([1999, 2999, 3999], 2) == [Candidate((4999,), 1, 3)]
    assert memory.lookup([1000, 2000, 3000], 2) == []


def test_documents_evicted_and_added_across_many_rebuilds_match_the_reference():
    rng = np.random.default_rng(5)
    memory = TokenMemory("t", max_tokens=3000)
    memory.RECENT_MIN = 200  # (small segments: the recent one, merges and compactions all happen)
    added = []
    for i in range(120):
        doc = rng.integers(0, 6, size=int(rng.integers(1, 90))).tolist()
        memory.add(doc)
        added.append(doc)
        if i % 3 == 0:
            docs = live_reference_docs(added, 3000)
            assert memory.documents() == docs
            for _ in range(5):
                source = docs[int(rng.integers(len(docs)))]
                at = int(rng.integers(0, len(source) + 1))
                context = rng.integers(0, 6, size=3).tolist() + source[max(0, at - 20) : at]
                assert as_triples(memory.lookup(context, 6)) == reference(docs, context, 6, memory)


def test_many_places_keep_the_latest():
    memory = TokenMemory("t")
    for i in range(100):
        memory.add([1, 2, 3, 1000 + i])
    found = memory.lookup([1, 2, 3], 4)
    assert len(found) == memory.MAX_PLACES
    assert found[0] == Candidate((1099,), 1, 3) and found[-1] == Candidate((1100 - memory.MAX_PLACES,), 1, 3)


def test_refuses_bad_tokens_and_settings():
    memory = TokenMemory("t", vocab_size=50)
    with pytest.raises(ValueError):
        memory.add([1, 50])
    with pytest.raises(ValueError):
        memory.add([-1, 2])
    with pytest.raises(ValueError):
        memory.add([[1, 2], [3, 4]])
    memory.add([])  # nothing stored
    assert memory.n_documents == 0 and memory.lookup([1, 2, 3], 4) == []
    for bad in ({"max_tokens": 0}, {"max_tokens": 1 << 30}, {"min_match": 0}, {"min_match": 40}, {"vocab_size": 0}):
        with pytest.raises(ValueError):
            TokenMemory("t", **bad)


# --------------------------------------------------------------------------------------------
# Against the brute force (hypothesis)

docs_strategy = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=40), min_size=0, max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=docs_strategy, pick=st.integers(0, 10**6), cut=st.integers(0, 40), noise=st.lists(st.integers(0, 4), max_size=4),
       max_len=st.integers(0, 12), min_match=st.integers(1, 5), max_tokens=st.sampled_from([15, 60, 1000]),
       max_places=st.sampled_from([2, 64]), match_cap=st.sampled_from([6, 64]))
def test_lookup_equals_a_brute_force_search(docs, pick, cut, noise, max_len, min_match, max_tokens, max_places, match_cap):
    memory = TokenMemory("t", max_tokens=max_tokens, min_match=min_match)
    memory.RECENT_MIN = 8
    memory.MAX_PLACES, memory.MATCH_CAP = max_places, match_cap
    memory.extend(docs[: len(docs) // 2])
    memory.index()  # (the later ones go to the recent segment, or a rebuild)
    memory.extend(docs[len(docs) // 2 :])
    live = live_reference_docs(docs, max_tokens)
    assert memory.documents() == live
    assert memory.n_tokens == sum(map(len, live)) <= max_tokens
    # A context that ends inside a stored document (mostly), after a few other tokens, or
    # after the end of the document before it (what a match across the boundary would be).
    i = pick % len(live) if live else 0
    source = live[i] if live else []
    before = live[i - 1][-(pick % 7) :] if i > 0 and pick % 3 == 0 else []
    context = noise + before + source[: min(cut, len(source))]
    assert as_triples(memory.lookup(context, max_len)) == reference(live, context, max_len, memory)


@settings(max_examples=100, deadline=None)
@given(docs=docs_strategy, fingerprint=st.text(max_size=20), context=st.lists(st.integers(0, 4), max_size=10))
def test_the_binary_form_round_trips(docs, fingerprint, context):
    memory = TokenMemory(fingerprint, max_tokens=200, min_match=2, vocab_size=5)
    memory.extend(docs)
    back = TokenMemory.from_bytes(memory.to_bytes(), fingerprint=fingerprint)
    assert back.documents() == memory.documents()
    assert (back.fingerprint, back.max_tokens, back.min_match, back.vocab_size) == (fingerprint, 200, 2, 5)
    assert back.lookup(context, 5) == memory.lookup(context, 5)
    assert back.to_bytes() == memory.to_bytes()


# --------------------------------------------------------------------------------------------
# The binary form's refusals


def saved(**kwargs) -> bytes:
    memory = TokenMemory("gemma3:262144:abc", max_tokens=1000, vocab_size=100, **kwargs)
    memory.extend([[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]])
    return memory.to_bytes()


def resealed(body: bytes) -> bytes:
    """A body with a fresh digest: damage that the digest alone would not catch."""
    return body + hashlib.blake2b(body, digest_size=16).digest()


def test_a_smaller_bound_on_load_keeps_the_newest_documents():
    back = TokenMemory.from_bytes(saved(), max_tokens=8)
    assert back.documents() == [[6, 7, 8], [9, 10, 11, 12]] and back.max_tokens == 8
    assert TokenMemory.from_bytes(saved(), max_tokens=3).documents() == [[10, 11, 12]]
    assert TokenMemory.from_bytes(TokenMemory("x").to_bytes()).documents() == []


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"NOTAMEMO" + b[8:], "wrong magic"),
    (lambda b: b[:8] + struct.pack("<H", 2) + b[10:], "version 2"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\0", "truncated"),
    (lambda b: b[:20], "header"),
    (lambda b: b[:5], "header"),
    (lambda b: b[:60] + bytes([b[60] ^ 1]) + b[61:], "digest"),
    (lambda b: b[:-20] + bytes([b[-20] ^ 0x40]) + b[-19:], "digest"),
])
def test_damaged_data_is_refused(damage, message):
    with pytest.raises(MemoryFileError, match=message):
        TokenMemory.from_bytes(damage(saved()))


def test_a_memory_of_another_tokenizer_is_refused():
    with pytest.raises(MemoryFileError, match="another tokenizer"):
        TokenMemory.from_bytes(saved(), fingerprint="llama3:128256:def")
    assert TokenMemory.from_bytes(saved(), fingerprint="gemma3:262144:abc").n_documents == 3


def test_oversized_data_is_refused_before_it_is_read():
    data = saved()
    with pytest.raises(MemoryFileError, match="more than 10 allowed"):
        TokenMemory.from_bytes(data, limit=10)
    head = TokenMemory._HEADER
    fields = list(head.unpack_from(data))
    fields[7] = 10**12  # tokens: a header that claims a terabyte
    with pytest.raises(MemoryFileError, match="allowed"):
        TokenMemory.from_bytes(head.pack(*fields) + data[head.size :])
    fields = list(head.unpack_from(data))
    fields[3] = 1 << 30  # a fingerprint of a gigabyte
    with pytest.raises(MemoryFileError, match="fingerprint"):
        TokenMemory.from_bytes(head.pack(*fields) + data[head.size :])


def test_counts_that_disagree_are_refused_even_with_a_valid_digest():
    body = saved()[:-16]
    head = TokenMemory._HEADER
    fields = list(head.unpack_from(body))
    fp_len, n_docs = fields[3], fields[6]
    lengths_at = head.size + fp_len
    # Document lengths that do not add up to the tokens (5 + 3 + 4 -> 5 + 2 + 4 ... + 1 token moved).
    lengths = np.frombuffer(body, "<u4", count=n_docs, offset=lengths_at).copy()
    lengths[1] -= 1
    bad = body[:lengths_at] + lengths.astype("<u4").tobytes() + body[lengths_at + 4 * n_docs :]
    with pytest.raises(MemoryFileError, match="do not add up"):
        TokenMemory.from_bytes(resealed(bad))
    lengths[1] = 0  # an empty document
    lengths[0] += 4
    bad = body[:lengths_at] + lengths.astype("<u4").tobytes() + body[lengths_at + 4 * n_docs :]
    with pytest.raises(MemoryFileError, match="do not add up"):
        TokenMemory.from_bytes(resealed(bad))
    fields[6] = fields[7] + 1  # more documents than tokens
    with pytest.raises(MemoryFileError, match="disagree"):
        TokenMemory.from_bytes(resealed(head.pack(*fields) + body[head.size :]))
    tokens_at = lengths_at + 4 * n_docs
    for token in (-5, 100):  # outside the vocabulary of 100
        bad = body[:tokens_at] + struct.pack("<i", token) + body[tokens_at + 4 :]
        with pytest.raises(MemoryFileError, match="outside its vocabulary"):
            TokenMemory.from_bytes(resealed(bad))
    bad = body[: head.size] + b"\xff" * fp_len + body[head.size + fp_len :]
    with pytest.raises(MemoryFileError, match="UTF-8"):
        TokenMemory.from_bytes(resealed(bad))


# --------------------------------------------------------------------------------------------
# The drafter


class RecordingJudge(DraftJudge):
    """The fixed judge, keeping what each limit() was told."""

    def __init__(self) -> None:
        self.asked: list[dict] = []

    def limit(self, source, n_max, context_len=0, match=0, agreed=None, cap=None):
        self.asked.append({"source": source, "n_max": n_max, "context_len": context_len, "match": match, "agreed": agreed, "cap": cap})
        return super().limit(source, n_max, context_len, match, agreed, cap)


def test_memory_is_asked_only_when_the_context_has_no_match():
    memory = TokenMemory("t")
    memory.add([0, 50, 51, 52, 53, 54, 60, 61, 62, 63])
    memory.add([5, 50, 51, 52, 53, 54, 60, 61, 62, 63])
    memory.add([50, 51, 52, 53, 54, 55, 56, 57])
    drafter = MemoryDrafter(memory, gate=False)
    asked = []
    lookup = memory.lookup
    memory.lookup = lambda context, n: asked.append(list(context)) or lookup(context, n)
    # The context repeats a 12-token stretch: prompt lookup copies it, memory is not asked.
    phrase = list(range(100, 112))
    context = [1] + phrase + [7, 8] + phrase
    drafter.begin(context)
    judge = RecordingJudge()
    proposal = drafter.propose(context, 4, judge)
    assert proposal.source == "lookup" and proposal.tokens == [7, 8, 100, 101] and asked == []
    assert drafter.last_source == "lookup"
    # No match in the context: the memory's best (two places agree on 60 .. 63; the third differs).
    context = [1, 2, 3, 51, 52, 53, 54]
    drafter.begin(context)
    judge = RecordingJudge()
    proposal = drafter.propose(context, 4, judge)
    assert proposal.source == MEMORY and proposal.tokens == [60, 61, 62, 63] and len(asked) == 1
    assert judge.asked == [{"source": MEMORY, "n_max": 4, "context_len": 7, "match": 4, "agreed": 0, "cap": 4}]
    assert drafter.last_source == MEMORY
    # Nothing anywhere: an empty proposal.
    assert drafter.propose([1, 2, 3, 4, 5], 4, judge).tokens == []
    assert drafter.continuation([1, 2, 3, 51, 52, 53, 54], 4) == [60, 61, 62, 63]


def test_the_evidence_is_the_best_candidates():
    memory = TokenMemory("t")
    memory.add([9, 1, 2, 3, 4, 5, 6, 7])
    drafter = MemoryDrafter(memory, gate=False)
    judge = RecordingJudge()
    # One continuation: agreed None, cap its length, match measured back to the document start.
    assert drafter.propose([0, 9, 1, 2, 3], 8, judge).tokens == [4, 5, 6, 7]
    assert judge.asked[-1] | {"context_len": 0} == {"source": MEMORY, "n_max": 8, "context_len": 0, "match": 4, "agreed": None, "cap": 4}
    memory.add([5, 9, 1, 2, 3, 4, 5, 6, 7])  # a second place agrees
    memory.add([9, 1, 2, 3, 4, 5, 0])  # the latest place disagrees after 4 5
    memory.add([8, 1, 2, 3, 7, 7, 7])  # a shorter match (3) is not among the candidates
    assert drafter.propose([0, 9, 1, 2, 3], 8, judge).tokens == [4, 5, 6, 7]  # two votes beat one
    assert judge.asked[-1]["agreed"] == 2 and judge.asked[-1]["match"] == 4 and judge.asked[-1]["cap"] == 4
    # A judge that says no: nothing proposed.
    class No(DraftJudge):
        def limit(self, *a, **k):
            return 0

    assert drafter.propose([0, 9, 1, 2, 3], 8, No()).tokens == []
    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2 and shared_prefix([], [1]) == 0
    # A drafter that wants longer matches than the memory's minimum.
    assert MemoryDrafter(memory, min_match=5, gate=False).propose([7, 1, 2, 3], 8).tokens == []


def test_a_fork_in_memory_is_not_guessed_and_the_consensus_can_cap_the_draft():
    memory = TokenMemory("t")
    for value in (70, 71, 72):  # the same words, then a different value each time
        memory.add([1, 2, 3, 4, value, 9, 9])
    drafter = MemoryDrafter(memory, gate=False)
    assert drafter.best([0, 2, 3, 4], 4) is None and drafter.propose([0, 2, 3, 4], 4).tokens == []
    memory = TokenMemory("t")
    memory.add([1, 2, 3, 5, 6, 7, 7])
    memory.add([1, 2, 3, 5, 6, 8, 8])
    memory.add([1, 2, 3, 9, 9])  # the latest (ranked first on a tie), but alone on its first token
    choice = MemoryDrafter(memory, gate=False).best([0, 1, 2, 3], 4)
    assert choice.candidate == Candidate((5, 6, 8, 8), 1, 3)  # the best-ranked of the two agreeing on 5
    assert (choice.votes, choice.places, choice.consensus, choice.agreed) == (2, 3, 2, 0)
    judge = RecordingJudge()
    assert MemoryDrafter(memory, gate=False).propose([0, 1, 2, 3], 4, judge).tokens == [5, 6, 8, 8]
    assert MemoryDrafter(memory, cap_at_consensus=True, gate=False).propose([0, 1, 2, 3], 4, judge).tokens == [5, 6]
    assert [a["cap"] for a in judge.asked] == [4, 2]
    # A short match may be asked for two agreeing places (off by default).
    strict = MemoryDrafter(memory, gate=False)
    strict.SHORT_VOTES = 2
    memory.add([4, 4, 4, 3, 3, 3])
    assert strict.best([0, 4, 4, 4], 4) is None and MemoryDrafter(memory, gate=False).best([0, 4, 4, 4], 4) is not None
    assert strict.best([0, 1, 2, 3], 4) is not None


def test_refused_memory_drafts_close_their_kind_until_a_probe_is_accepted():
    memory = TokenMemory("t")
    memory.add([1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13])
    drafter = MemoryDrafter(memory, record=MemoryRecord())
    context = [9, 5, 6, 7]  # a match of 3 at one place: kind (0, 0)

    def step(accepted: int | None = None) -> list[int]:
        tokens = drafter.propose(context, 4).tokens
        if tokens:
            drafter.update(len(tokens), len(tokens) if accepted is None else accepted)
        return tokens

    probe_first = MemoryRecord.PROBE_FIRST
    assert step(accepted=0) == [10]  # a new kind starts with a 1-token probe; refused, the wait doubles
    waits = [len(step(accepted=0)) for _ in range(6 * probe_first)]
    assert [i for i, n in enumerate(waits) if n] == [2 * probe_first - 1, 6 * probe_first - 1]
    assert all(n in (0, MemoryRecord.PROBE_LENGTH) for n in waits)
    assert drafter.record.rates(MemoryRecord.kind(3, 1))[0] <= MemoryRecord.MIN_RATE
    # Another kind of draft (a longer match) is judged apart: its own first probe.
    assert drafter.propose([1, 2, 3, 4, 5, 6, 7], 4).tokens == [10]
    # An accepted probe reopens the kind: full drafts again.
    for _ in range(8 * probe_first - 1):
        assert step() == []
    assert step() == [10]
    assert step() == [10, 11, 12, 13]
    # Without the gate, every opportunity drafts.
    assert MemoryDrafter(memory, gate=False).propose(context, 4).tokens == [10, 11, 12, 13]


def test_memory_drafts_stop_where_that_kind_of_copy_usually_parts_from_the_text():
    memory = TokenMemory("t")
    memory.add([1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15])
    drafter = MemoryDrafter(memory, record=MemoryRecord())
    context = [9, 5, 6, 7]
    lengths = []
    for _ in range(12):  # the target takes the first two tokens of each copy, never the third
        tokens = drafter.propose(context, 6).tokens
        if tokens:
            drafter.update(len(tokens), min(2, len(tokens)))
        lengths.append(len(tokens))
    assert lengths[0] == 1  # the new kind's probe
    assert lengths[1] == 6  # reopened: long at first ...
    assert lengths[-3:] == [2, 2, 2]  # ... then as long as that kind's copies hold
    rates = drafter.record.rates(MemoryRecord.kind(3, 1))
    assert rates[0] > 0.9 and rates[1] > 0.9 and rates[2] <= MemoryRecord.MIN_RATE


def test_drafters_of_one_memory_share_its_record():
    memory, other = TokenMemory("t"), TokenMemory("t")
    assert MemoryDrafter(memory).record is MemoryDrafter(memory).record is record_for(memory)
    assert record_for(other) is not record_for(memory)
    assert MemoryDrafter(memory, gate=False).record is None


def test_on_text_with_nothing_to_recall_memory_costs_a_few_refused_drafts():
    rng = np.random.default_rng(5)
    memory = TokenMemory("t", min_match=2)
    for _ in range(20):
        memory.add(rng.integers(0, 40, size=200).tolist())  # short matches everywhere, continuations random
    text = rng.integers(0, 40, size=600).tolist()
    costs = CostTable.flat(0.01, 1.1)

    def memory_drafted(gate: bool) -> int:
        record = MemoryRecord()
        drafted = 0
        for start in range(0, 600, 200):  # three generations sharing one record
            drafter = MemoryDrafter(memory, record=record, gate=gate)
            r = replay(text[start : start + 200], 20, drafter, 4, costs)
            drafted += r.drafted
        return drafted

    gated, ungated = memory_drafted(True), memory_drafted(False)
    assert ungated > 300 and gated < ungated / 20


def test_remember_adds_a_document_and_indexes_it():
    memory = TokenMemory("t")
    drafter = MemoryDrafter(memory)
    drafter.remember([5, 6, 7, 8, 9])
    assert memory.documents() == [[5, 6, 7, 8, 9]] and memory._indexed == memory._n
    assert drafter.propose([1, 6, 7, 8], 3, FIXED).tokens == [9]


def test_a_replay_with_memory_of_the_same_text_needs_fewer_passes():
    rng = np.random.default_rng(3)
    text = rng.integers(0, 1000, size=300).tolist()
    costs = CostTable.flat(0.01, 1.1)
    alone = replay(text, 50, PromptLookupDrafter(), 16, costs)
    memory = TokenMemory("t")
    memory.add(text)
    helped = replay(text, 50, MemoryDrafter(memory), 16, costs)
    assert alone.drafted == 0 and helped.refused == 0
    # The whole reply drafted from memory, 16 at a time, after the first draft of its kind: a 1-token probe.
    assert helped.passes == 1 + -(-249 // 17)


# --------------------------------------------------------------------------------------------
# Exactness in the engine (F32 fixtures)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, in a small village, there lived",
]


@pytest.fixture(scope="module")
def target(pair_perturbed):
    model = load(pair_perturbed[0])
    yield model
    model.close()


def target_only(model, ids, max_tokens=40):
    return generate(SpeculativeDecoder(model, None, 0), Request(ids, max_tokens=max_tokens)).run()


@pytest.mark.parametrize("n_draft", [4, "auto"])
def test_output_equals_target_only_with_a_helpful_memory(target, n_draft):
    references = {p: target_only(target, target.tokenize(p)) for p in PROMPTS}
    memory = TokenMemory("fixture", vocab_size=target.n_vocab)
    drafted = accepted = 0
    for prompt in PROMPTS:
        ids = target.tokenize(prompt)
        memory.add(ids + references[prompt].token_ids)  # as if asked before
        drafter = MemoryDrafter(memory)
        gen = generate(SpeculativeDecoder(target, drafter, n_draft), Request(ids, max_tokens=40)).run()
        assert gen.token_ids == references[prompt].token_ids, (prompt, n_draft)
        d, a = gen.stats.by_source.get(MEMORY, [0, 0])
        drafted, accepted = drafted + d, accepted + a
        if n_draft == 4:
            assert gen.stats.target_passes < references[prompt].stats.target_passes
    assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("n_draft", [4, 8, "auto"])
def test_output_equals_target_only_with_a_memory_built_to_mislead(target, monkeypatch, n_draft):
    if n_draft == "auto":  # (costs where drafting pays, on any machine: auto drafts, and is refused)
        VirtualClock(monkeypatch).charge(target)
    rng = np.random.default_rng(11)
    memory = TokenMemory("fixture", vocab_size=target.n_vocab)
    references = {}
    for prompt in PROMPTS:
        ids = target.tokenize(prompt)
        references[prompt] = target_only(target, ids).token_ids
        right = references[prompt]
        for copy in range(3):
            # The prompt, then the right first tokens and a wrong turn: each place agrees with
            # the reply for a while and counts three votes for its wrong continuation.
            wrong = rng.integers(3, target.n_vocab, size=40).tolist()
            memory.add(ids + right[: 2 + 5 * copy] + wrong)
            memory.add(ids + wrong)
            memory.add(right[:10] + wrong + right[10:20] + wrong)
    drafted = accepted = 0
    for prompt in PROMPTS:
        ids = target.tokenize(prompt)
        drafter = MemoryDrafter(memory)
        gen = generate(SpeculativeDecoder(target, drafter, n_draft), Request(ids, max_tokens=40)).run()
        assert gen.token_ids == references[prompt], (prompt, n_draft)
        d, a = gen.stats.by_source.get(MEMORY, [0, 0])
        drafted, accepted = drafted + d, accepted + a
        drafter.remember(ids + gen.token_ids)
    assert drafted > accepted  # memory drafted, and was refused
