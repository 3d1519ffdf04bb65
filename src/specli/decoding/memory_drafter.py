"""Drafting from memory: what specli has read and written before drafts what it writes next.

MemoryDrafter follows the drafter protocol (drafters.Drafter). Each step
it asks the context first (a PromptLookupDrafter: the prompt and the output so far); only when
that proposes nothing does it ask a TokenMemory (memory.py) of earlier prompts and outputs of
the same tokenizer, and copies a continuation found there: the memory's best-ranked one (most
places agreeing, then the longest match, then the latest) among those that start with the
token most places agree on, if more than half of them do (MemoryDrafter's docstring). The
judge sizes a memory draft from the same kind of evidence prompt lookup gives it, under the
source "memory" (so `--draft-max auto` keeps a record of memory drafts apart from lookup's):

- match: how many tokens at the end of the context equal those before the candidate's place
  (up to TokenMemory.MATCH_CAP);
- agreed: how many leading tokens the candidate shares with the most frequent other
  continuation found (None when there is no other); with the memory's best-ranked candidate,
  that is what the two most frequent continuations share;
- cap: the candidate's length (its place's continuation, up to n_max, cut at its document's
  end), or with `cap_at_consensus` how many leading tokens more than half of the places agree
  on.

Like every drafter it cannot change the output, only the speed: the target verifies each draft.
The front end calls `remember(prompt + output)` when a generation ends, to add it to the memory
(the drafter never adds the text on its own: what is remembered, and whether, is the caller's).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from specli.decoding.branches import choose_branches
from specli.decoding.drafters import Drafter, PromptLookupDrafter, Proposal, make_drafter
from specli.decoding.memory import Candidate, TokenMemory
from specli.decoding.policy import FIXED, DraftJudge
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.modes import DraftMode

MEMORY = "memory"  # Proposal.source of a draft from memory, and the judge's source name for it
BRANCH_SOURCE = MEMORY  # the stats' source of tokens accepted on a branch other than the draft's (only memories branch)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class MemoryChoice:
    """The memory's best candidate and the evidence for it."""

    candidate: Candidate
    agreed: int | None  # leading tokens it shares with the most frequent other one (None: no other)
    consensus: int  # leading tokens more than half of the places agree on
    votes: int  # places that agree on its first token
    places: int  # places found (the latest TokenMemory.MAX_PLACES at most)


POSITIONS = 16  # draft positions a MemoryRecord keeps apart (later ones share the last's record)
# The prior of a kind's record: its first token at MemoryRecord.MIN_RATE (closed: a new kind
# starts with a probe), later ones at 0.9 (so a kind's first drafts go long, and learn where its
# copies part from the text).
_PRIOR_ACCEPTED = np.r_[0.4, np.full(POSITIONS - 1, 0.9)]


@dataclass
class _Kind:
    """One kind of memory draft's record: per draft position, decayed counts of drafts that
    reached it and of those whose token there the target accepted (every one before it too);
    and when the kind is closed, the chances until its next probe."""

    drafted: np.ndarray = field(default_factory=lambda: np.ones(POSITIONS))
    accepted: np.ndarray = field(default_factory=lambda: _PRIOR_ACCEPTED.copy())
    wait: int = 1  # (a new kind: a probe at its first chance)
    interval: int = 0


@dataclass
class MemoryRecord:
    """How memory drafts fared, by their evidence (match length, places agreeing), across every
    generation that drafts from one memory: serve's slots and requests, batch's items, chat's
    turns. A memory draft of a kind stops before the first position where, lately, the target
    accepted MIN_RATE or less of that kind's tokens (given the ones before: a copy's first token
    is often right where the rest is not, an earlier text's next word, then its own words).
    A kind whose first position is that low is not drafted but for a probe now and then
    (PROBE_LENGTH tokens, after PROBE_FIRST chances, the wait doubling after each refused probe
    up to PROBE_MAX; an accepted one reopens it, and should it close again its first probe waits
    as long as the last one did); a new kind starts with a probe. The counts
    decay towards the prior (a window of about WINDOW drafts), so a position no longer drafted
    is tried again after a while. On text with nothing to recall memory then costs a few
    refused tokens, not a draft a step. A fixed --draft-max obeys it too; under auto the judge
    sizes what it lets through. It lives as long as the memory (record_for), never saved."""

    MIN_RATE = 0.4
    WINDOW = 32
    PROBE_FIRST = 4
    PROBE_MAX = 256
    PROBE_LENGTH = 1
    kinds: dict[tuple[int, int], _Kind] = field(default_factory=dict)

    @staticmethod
    def kind(match: int, votes: int) -> tuple[int, int]:
        """A draft's kind: its match length (under 6, 6-11, 12 and more) and places agreeing on
        its first token (1, more)."""
        return (0 if match < 6 else 1 if match < 12 else 2), (0 if votes <= 1 else 1)

    def rates(self, kind: tuple[int, int]) -> np.ndarray:
        """rates[i]: how often lately the target accepted the token at position i of this kind's
        drafts, of those whose earlier tokens it accepted."""
        k = self.kinds.get(kind) or _Kind()
        return np.minimum(k.accepted / k.drafted, 1.0)

    def length(self, kind: tuple[int, int], n_max: int) -> tuple[int, bool]:
        """How many tokens a draft of this kind may have now (0: none), and whether it is a probe."""
        k = self.kinds.setdefault(kind, _Kind())
        good = self.rates(kind) > self.MIN_RATE
        if good[0]:
            k.interval = 0
            n = n_max if good.all() else int(np.argmin(good))  # (beyond POSITIONS: the last one's rate)
            return min(n, n_max), False
        if k.interval == 0:  # just closed (or new: wait 1, a probe now; closed again: the last wait)
            k.interval = self.PROBE_FIRST
            k.wait = k.wait or self.PROBE_FIRST
        k.wait -= 1
        if k.wait > 0:
            return 0, False
        k.wait = k.interval
        return min(self.PROBE_LENGTH, n_max), True

    def observe(self, kind: tuple[int, int], n_drafted: int, n_accepted: int, probe: bool) -> None:
        k = self.kinds.setdefault(kind, _Kind())
        keep = 1.0 - 1.0 / self.WINDOW
        k.drafted = k.drafted * keep + (1.0 - keep)
        k.accepted = k.accepted * keep + (1.0 - keep) * _PRIOR_ACCEPTED
        n = min(n_drafted, POSITIONS)
        k.drafted[:n] += 1.0
        k.accepted[:n] += np.arange(n) < n_accepted
        if probe and n_accepted == 0:
            k.interval = k.wait = min(2 * k.interval, self.PROBE_MAX)
        elif probe:  # reopened: its first token at better than even odds until refusals say otherwise
            k.accepted[0] = max(k.accepted[0], 0.6 * k.drafted[0])


_RECORDS: "weakref.WeakKeyDictionary[TokenMemory, MemoryRecord]" = weakref.WeakKeyDictionary()


def record_for(memory: TokenMemory) -> MemoryRecord:
    """The one MemoryRecord of every drafter sharing `memory`."""
    record = _RECORDS.get(memory)
    if record is None:
        record = _RECORDS[memory] = MemoryRecord()
    return record


class MemoryDrafter(Drafter):
    """Prompt lookup in the context, else a continuation from a TokenMemory of earlier texts.

    It drafts the memory's best-ranked candidate (TokenMemory.lookup: most places, longest
    match, latest) among those that begin with the first token most places agree on, and only
    when more than half of the places found agree on it: where earlier texts went different
    ways after the same words (a name, a date, an argument), memory does not guess (docs/memory.md:
    fewer refused drafts for the same tokens per pass).
    Its `consensus` is how many leading tokens more than half of the places agree on; by
    default the judge's cap is the candidate's whole length, and with `cap_at_consensus` the
    consensus (the part the earlier texts vouch for; on those workloads 28-75% fewer refused
    drafts for 0.5-3% fewer tokens per pass).
    A short match (under LONG_MATCH tokens) may be asked for SHORT_VOTES agreeing places, like
    lookup's short keys; it is off (1): on those workloads it cost 7-14% of the tokens per pass,
    for a few refusals less on prose.

    Which kinds of memory draft are drafted at all is the shared MemoryRecord's call (one per
    memory: record_for): kinds the target has mostly refused lately are only probed.

    `lookup`: the drafter asked first (a default PromptLookupDrafter if None); `min_match`:
    the shortest memory match worth a draft (None: the memory's own minimum); `record`: the
    record to judge by (None: the memory's; `gate=False`: none)."""

    name = DraftMode.LOOKUP  # a lookup drafter whose copies may also come from memory
    LONG_MATCH = 8  # a match this long is evidence on its own (lookup's ngram_min)
    SHORT_VOTES = 1  # ... a shorter one needs this many places agreeing on the first token

    def __init__(self, memory: TokenMemory, lookup: PromptLookupDrafter | None = None, min_match: int | None = None,
                 cap_at_consensus: bool = False, record: MemoryRecord | None = None, gate: bool = True):
        self.memory = memory
        self.record = None if not gate else record if record is not None else record_for(memory)
        self._memory_draft: tuple[tuple[int, int], bool] | None = None  # the latest memory draft's kind, and if a probe
        self.cap_at_consensus = cap_at_consensus
        self.lookup = lookup if lookup is not None else PromptLookupDrafter()
        self.min_match = memory.min_match if min_match is None else max(min_match, memory.min_match)
        self.last_source: str | None = None  # the source of the latest non-empty proposal

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None,
              request: object | None = None) -> None:
        self.lookup.begin(prompt, sampling, rng, request)
        self.last_source = None

    def propose_branches(self, context: Sequence[int], chain: Sequence[int], n_max: int, max_branches: int,
                         costs: Callable[[int], float] | None = None, source: str | None = None) -> list[list[int]]:
        """The chain, then the memory's other continuations after the context
        (branches.choose_branches). With `costs`, none beside a copy from the context (a chain
        of another source than the memory): the memory's odds say nothing of a text that
        repeats itself (replayed on Spec-Bench, such branches cost up to 1% on the CPU table,
        gained under 0.5% on the flat one)."""
        if costs is not None and chain and source != MEMORY:
            return [list(chain)]
        found = self.memory.lookup(context, n_max) if n_max > 0 else []
        if not found:
            return [list(chain)] if chain else []
        return choose_branches(chain, [(c.tokens, c.count) for c in found], n_max, max_branches, costs)

    def remember(self, tokens: Sequence[int]) -> None:
        """Add a finished generation (prompt + output, one document) to the memory, and index it
        now, while the time does not count (a lookup would otherwise do it)."""
        self.memory.add(tokens)
        self.memory.index()

    def best(self, context: Sequence[int], n_max: int) -> MemoryChoice | None:
        """The memory's best candidate for what follows `context`, with its evidence, or None
        when it is too weak for a draft (see the class docstring)."""
        found = self.memory.lookup(context, n_max)
        if not found:
            return None
        places = sum(c.count for c in found)
        # The first token most places agree on; the memory's best-ranked candidate with it.
        votes_for: dict[int, int] = {}
        for c in found:
            if c.tokens:
                votes_for[c.tokens[0]] = votes_for.get(c.tokens[0], 0) + c.count
        if not votes_for:
            return None
        first = max(votes_for, key=votes_for.__getitem__)  # (a tie: the better-ranked one's)
        votes = votes_for[first]
        best = next(c for c in found if c.tokens[:1] == (first,))
        if votes * 2 <= places or best.match < self.min_match or (best.match < self.LONG_MATCH and votes < self.SHORT_VOTES):
            return None
        consensus, alive = 0, found
        for i, token in enumerate(best.tokens):
            alive = [c for c in alive if len(c.tokens) > i and c.tokens[i] == token]
            if sum(c.count for c in alive) * 2 <= places:
                break
            consensus = i + 1
        other = next((c for c in found if c is not best), None)
        agreed = None if other is None else shared_prefix(best.tokens, other.tokens)
        return MemoryChoice(best, agreed, consensus, votes, places)

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        self._memory_draft = None
        proposal = self.lookup.propose(context, n_max, judge)
        if proposal.tokens or n_max <= 0:
            self.last_source = proposal.source if proposal.tokens else None
            return proposal
        choice = self.best(context, n_max)
        probe = False
        if choice is not None and self.record is not None:
            kind = MemoryRecord.kind(choice.candidate.match, choice.votes)
            allowed, probe = self.record.length(kind, n_max)
            n_max = allowed  # (a judge may read its cap as evidence only: this bound is the record's)
            if allowed == 0:
                choice = None
        if choice is None:  # (lookup's empty proposal: the judge was asked only by lookup, if at all)
            self.last_source = None
            return proposal
        tokens = choice.candidate.tokens
        cap = choice.consensus if self.cap_at_consensus else len(tokens)
        cap = min(cap, n_max)
        n = judge.limit(MEMORY, n_max, len(context), match=choice.candidate.match, agreed=choice.agreed, cap=cap)
        self.last_source = MEMORY if n > 0 else None
        if n > 0 and self.record is not None:
            self._memory_draft = (kind, probe)
        return Proposal(list(tokens[: max(n, 0)]), source=MEMORY)

    def continuation(self, context: Sequence[int], n_max: int) -> list[int]:
        """What propose() would copy before any limit on its length (replay.candidates, for the
        oracle): lookup's, else the memory's best continuation."""
        tokens = self.lookup.continuation(context, n_max)
        if tokens or n_max <= 0:
            return tokens
        choice = self.best(context, n_max)
        return [] if choice is None else list(choice.candidate.tokens[:n_max])

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if self._memory_draft is not None and self.record is not None:
            kind, probe = self._memory_draft
            self.record.observe(kind, n_drafted, n_accepted, probe)
            self._memory_draft = None
        self.lookup.update(n_drafted, n_accepted)  # (the next context shows lookup what happened)


def drafter_with_memory(mode: DraftMode | str, model_dft=None, memory: TokenMemory | None = None) -> Drafter | None:
    """make_drafter(mode, model_dft), or with `memory` a MemoryDrafter over it: a lookup drafter
    that also copies from the memory, and whose `remember` adds a finished generation to it
    (StepLoop.remember); several drafters may share one memory (`--memory process`: every slot's).
    Memory drafting is lookup drafting: with another mode, ValueError."""
    if memory is None:
        return make_drafter(mode, model_dft)
    if DraftMode(mode) is not DraftMode.LOOKUP:
        raise ValueError(f"drafting from memory needs drafting mode {DraftMode.LOOKUP.value!r}, not {DraftMode(mode).value!r}")
    return MemoryDrafter(memory)
