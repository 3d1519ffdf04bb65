"""Drafting from memory: what specli has read and written before drafts what it writes next.

MemoryDrafter follows the drafter protocol (drafters.py: begin / propose / update). Each step
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

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specli.decoding.drafters import Drafter, Proposal, PromptLookupDrafter, make_drafter
from specli.decoding.memory import Candidate, TokenMemory
from specli.decoding.policy import FIXED, DraftJudge
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.modes import DraftMode

MEMORY = "memory"  # Proposal.source of a draft from memory, and the judge's source name for it


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


class MemoryDrafter:
    """Prompt lookup in the context, else a continuation from a TokenMemory of earlier texts.

    It drafts the memory's best-ranked candidate (TokenMemory.lookup: most places, longest
    match, latest) among those that begin with the first token most places agree on, and only
    when more than half of the places found agree on it: where earlier texts went different
    ways after the same words (a name, a date, an argument), memory does not guess. (Replayed on repeated workloads,
    benchmarks/memory_replay.py, at a fixed --draft-max of 8 or 16: 6-21% fewer refused drafts,
    tokens per pass within 1%.)
    Its `consensus` is how many leading tokens more than half of the places agree on; by
    default the judge's cap is the candidate's whole length, and with `cap_at_consensus` the
    consensus (the part the earlier texts vouch for; on those workloads 28-75% fewer refused
    drafts for 0.5-3% fewer tokens per pass).
    A short match (under LONG_MATCH tokens) may be asked for SHORT_VOTES agreeing places, like
    lookup's short keys; it is off (1): on those workloads it cost 7-14% of the tokens per pass,
    for a few refusals less on prose.

    `lookup`: the drafter asked first (a default PromptLookupDrafter if None); `min_match`:
    the shortest memory match worth a draft (None: the memory's own minimum)."""

    name = DraftMode.LOOKUP  # a lookup drafter whose copies may also come from memory
    LONG_MATCH = 8  # a match this long is evidence on its own (lookup's ngram_min)
    SHORT_VOTES = 1  # ... a shorter one needs this many places agreeing on the first token

    def __init__(self, memory: TokenMemory, lookup: PromptLookupDrafter | None = None, min_match: int | None = None,
                 cap_at_consensus: bool = False):  # fmt: skip
        self.memory = memory
        self.cap_at_consensus = cap_at_consensus
        self.lookup = lookup if lookup is not None else PromptLookupDrafter()
        self.min_match = memory.min_match if min_match is None else max(min_match, memory.min_match)
        self.last_source: str | None = None  # the source of the latest non-empty proposal

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None) -> None:
        self.lookup.begin(prompt, sampling, rng)
        self.last_source = None

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
        proposal = self.lookup.propose(context, n_max, judge)
        if proposal.tokens or n_max <= 0:
            self.last_source = proposal.source if proposal.tokens else None
            return proposal
        choice = self.best(context, n_max)
        if choice is None:  # (lookup's empty proposal: the judge was asked only by lookup, if at all)
            self.last_source = None
            return proposal
        tokens = choice.candidate.tokens
        cap = choice.consensus if self.cap_at_consensus else len(tokens)
        n = judge.limit(MEMORY, n_max, len(context), match=choice.candidate.match, agreed=choice.agreed, cap=cap)
        self.last_source = MEMORY if n > 0 else None
        return Proposal(list(tokens[: max(n, 0)]), source=MEMORY)

    def longest(self, context: Sequence[int], n_max: int) -> list[int]:
        """What propose() would copy before any limit on its length (replay.candidates, for the
        oracle): lookup's, else the memory's best continuation."""
        tokens = self.lookup.longest(context, n_max)
        if tokens or n_max <= 0:
            return tokens
        choice = self.best(context, n_max)
        return [] if choice is None else list(choice.candidate.tokens[:n_max])

    def update(self, n_drafted: int, n_accepted: int) -> None:
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
