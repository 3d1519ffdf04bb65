"""Drafters: cheap proposers of the tokens the target is likely to produce next.

Every drafter follows one protocol, the Drafter base class (after HF transformers' candidate
generators and llama.cpp's common/speculative.h):
- begin(prompt, sampling, rng, request): the door of each new sequence, e.g. to put the prompt
  into a draft model's cache; `sampling` and `rng` are the run's (the draft samples like the
  target), `request` the sequence's whole Request;
- propose(context, n_max, judge): a Proposal of up to n_max tokens that might follow `context`
  (prompt + output so far), with the distributions q they were drawn from when there are any;
  the judge (decoding/policy) says how many are worth proposing, and for a draft model, token by
  token from its confidence, when to stop (fixed --draft-max: exactly n_max);
- update(n_drafted, n_accepted): how the target judged the latest proposal.
The optional capabilities have defaults in the base class: propose_steps (a token at a time,
for lockstep drafting), prefill (a long prompt into a draft cache a batch at a time), remember
(a finished generation kept), propose_branches (a tree pass), continuation (the uncapped
proposal, for the oracle), draft_cache (the draft model's cache). docs/drafters.md: how to add one.

Drafters never see logits of the target and cannot change the output: only its speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import numpy as np

from specli.decoding.policy import FIXED, DraftJudge
from specli.decoding.sampling import GREEDY, Dist, SamplingParams, greedy_choice, penalty_history, sample_from_logits
from specli.llama.model import LlamaModel, common_prefix_len, fill_cache
from specli.modes import DraftMode


@dataclass
class Proposal:
    """Draft tokens, and for sampled drafts the distribution q each was drawn from.

    q_rows None means the drafter has no distribution (greedy drafts, prompt lookup): for
    rejection sampling q is then one-hot on each drafted token.
    """

    tokens: list[int]
    q_rows: list[Dist] | None = None
    source: str | None = None  # the drafter that made it ("lookup", "draft-model")
    confidences: list[float] | None = None  # the draft model's probability of each token
    # A draft model's cost per drafted token in this proposal: mean seconds of one round of
    # its loop (choose the token, judge it, a one-token pass), without the catch-up of a cache
    # that fell behind during plain steps.
    token_s: float | None = None
    # Seconds until the first draft token was chosen (the judge's limit and the draft model's
    # pass over the target's newest token), when that was no catch-up: a step's start-up cost.
    first_s: float | None = None


def run_steps(steps: Generator[int, np.ndarray, Proposal], model) -> Proposal:
    """Drive a propose_steps() generator on its own: each token it yields is evaluated on
    `model` (the drafter's cache) and its logits sent back; returns the Proposal."""
    try:
        token = next(steps)
        while True:
            token = steps.send(model.eval([token], logits="last"))
    except StopIteration as done:
        return done.value


def _empty(source: str | None = None) -> Proposal:
    return Proposal([], source=source)


class Drafter:
    """The protocol every drafter follows, declared in full: propose() is the one method a
    drafter must have; every other one is a capability with its default here (what a drafter
    without it does), so that nothing probes a drafter for what it can do.

    A drafter belongs to one slot of the step loop and drafts for one sequence at a time:
    begin() is the door of each new sequence (its prompt, sampling, random generator and
    request, where a constraint rides); propose() drafts each step; update() hears the verdict.
    """

    name: str = ""  # the drafter's source name (Proposal.source, the judge's records)
    # What the latest proposal cost in modelled seconds (a replay's drafters, which model their
    # time instead of spending it; replay.replay charges it). Live drafting is timed by the step.
    last_draft_s: float = 0.0

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None,
              request: object | None = None) -> None:
        """A new sequence after `prompt`, drafted with its `sampling` and `rng` (a draft samples
        like the target); `request` is its decoding.generation.Request (None from replays).
        Default: nothing to set up."""

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        """A Proposal of at most n_max tokens that might follow `context` (prompt + output);
        the judge says how many are worth it."""
        raise NotImplementedError

    def update(self, n_drafted: int, n_accepted: int) -> None:
        """How the target judged the latest proposal. Default: nothing kept."""

    def propose_steps(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Generator[int, np.ndarray, Proposal]:
        """propose() a token at a time, for lockstep drafting (StepLoop): yields each token a
        draft model must evaluate, is sent its logits, returns the Proposal. Default: no
        model to evaluate, propose() at once."""
        return self.propose(context, n_max, judge)
        yield  # (a generator that yields nothing)

    def prefill(self, prompt: Sequence[int], budget: int) -> bool:
        """Up to `budget` more tokens of a long prompt into the drafter's own cache; True once
        all are in. Default: no cache of its own."""
        return True

    def remember(self, document: Sequence[int]) -> None:
        """A finished generation (prompt + output, Generation.document) to keep for later
        drafts. Default: nothing kept."""

    def propose_branches(self, context: Sequence[int], chain: Sequence[int], n_max: int, max_branches: int,
                         costs: Callable[[int], float] | None = None, source: str | None = None) -> list[list[int]]:
        """This step's branches for a tree pass (branches.py), the proposal `chain` (from
        `source`) first; with `costs`, only those that pay. Default: the chain alone."""
        return [list(chain)] if chain else []

    def continuation(self, context: Sequence[int], n_max: int) -> list[int]:
        """What propose() would draft before any cap on its length (replay.candidates, for the
        oracle). Default: a proposal of n_max under a fixed judge."""
        return list(self.propose(context, n_max, FIXED).tokens)

    @property
    def draft_cache(self) -> LlamaModel | None:
        """The cache of a draft model this drafter evaluates (a server keeps it in step with the
        slot's prompts); None without one."""
        return None


class DraftModelDrafter(Drafter):
    """Greedy drafts from a smaller model that shares the target's vocabulary.

    The draft model's cache is kept in step with the context: after each step it holds exactly
    accepted text (`update` drops rejected drafts), and `propose` reuses that prefix, evaluating
    only the tokens it has not seen (the target's own token, plus the last draft after a full
    accept) — never the whole history.

    After a stretch of plain decoding (`--draft-max auto` not drafting) the cache is behind. Catching up
    is one batch pass over the tokens missed: about 1% of the time those plain steps took on the
    synthetic pairs (a 1-block draft for a 9-block target), but 10% when the draft model costs as
    much as its target (Gemma 270M Q4 for its F16: a re-probe after 128 plain steps would cost
    about as much as 13 of them). A draft that starts over from a short window guesses badly
    (a90's first-token acceptance: 0.26-0.45 from 16 tokens, 0.84-1.0 from all of them), which
    would make `--draft-max auto`'s re-probes fail where drafting pays. So the cache catches up in full
    when that costs at most CATCH_UP_SHARE of the time since the last proposal (from the draft
    model's measured batch speed), and otherwise, when more than CATCH_UP_LIMIT tokens behind,
    starts over on a window: the context's first token (BOS) and its last CATCH_UP_LIMIT tokens,
    growing from there. A draft only has to guess well; the target's verification keeps the
    output exact.
    """

    name = DraftMode.DRAFT_MODEL
    CATCH_UP_LIMIT = 16
    CATCH_UP_SHARE = 0.03

    def __init__(self, model_dft: LlamaModel):
        self.model_dft = model_dft
        self._context_len = 0  # length of the view the latest proposal continued
        self._offset = 0  # the draft model sees context[:1] + context[offset:] (0: all of it)
        self.sampling = GREEDY
        self.rng = np.random.default_rng(0)
        self._batch_s: float | None = None  # seconds per token of a batch pass (catch-up)
        self._last_call = time.perf_counter()  # when begin() or propose() last returned
        # The judge of its latest proposal (a server's or a chat's policy outlives a generation):
        # while it rests this drafter, a new prompt is not read (its re-probe catches up on the
        # context's end, _view), so a pair that cannot pay costs nothing per request.
        self._judge: DraftJudge = FIXED

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None,
              request: object | None = None) -> None:
        self.sampling = sampling
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self._offset = 0
        if not self._judge.resting(self.name):
            self._timed_sync(prompt)
        self._last_call = time.perf_counter()

    def prefill(self, prompt: Sequence[int], budget: int) -> bool:
        """Put up to `budget` more tokens of the prompt (all but its last) into the draft model's
        cache, keeping what it holds of it; True once all are in (begin() then evaluates only
        the last). For a caller that evaluates a long prompt between other sequences' passes."""
        return self._judge.resting(self.name) or fill_cache(self.model_dft, prompt[:-1], budget)

    def _timed_sync(self, view: Sequence[int]) -> tuple[np.ndarray, int]:
        """sync(view) and how many tokens were new to the cache; learns the batch speed from
        passes over 8 tokens or more."""
        t0 = time.perf_counter()
        logits = self.model_dft.sync(view)
        n_new = self.model_dft.synced_new
        if n_new >= 8:
            self._batch_s = (time.perf_counter() - t0) / n_new
        return logits, n_new

    def _view(self, context: Sequence[int]) -> Sequence[int]:
        """The part of the context the draft model conditions on (see the class docstring)."""
        view = context if self._offset == 0 else [*context[:1], *context[self._offset :]]
        behind = len(view) - common_prefix_len(self.model_dft.cached, view)
        if behind > self.CATCH_UP_LIMIT and len(context) > self.CATCH_UP_LIMIT + 1 and not self._affordable(behind):
            self._offset = len(context) - self.CATCH_UP_LIMIT
            view = [*context[:1], *context[self._offset :]]
        return view

    def _affordable(self, behind: int) -> bool:
        """Whether a batch pass over `behind` tokens costs at most CATCH_UP_SHARE of the time
        since the last proposal (from the measured batch speed)."""
        elapsed = time.perf_counter() - self._last_call
        return self._batch_s is not None and behind * self._batch_s <= self.CATCH_UP_SHARE * elapsed

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        return run_steps(self.propose_steps(context, n_max, judge), self.model_dft)

    def propose_steps(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Generator[int, np.ndarray, Proposal]:
        """propose() as a generator: it yields each draft token the draft model must evaluate
        next and is sent that token's logits (one row, as eval(logits="last") gives them), so
        that a caller can evaluate several sequences' tokens in one pass (parallel.py); it
        returns the Proposal. The catch-up of the cache (sync) runs here, on its own."""
        t_start = time.perf_counter()
        self._judge = judge
        n_max = judge.limit(self.name, n_max, len(context)) if n_max > 0 else 0
        if n_max <= 0:
            return _empty(self.name)
        view = self._view(context)
        logits, n_new = self._timed_sync(view)
        # Usually 1 or 2 tokens are new to the draft cache (the target's own token, and the last
        # draft after a full accept); more is a catch-up after plain steps.
        caught_up = n_new > 2
        self._context_len = len(view)
        tokens: list[int] = []
        q_rows: list[Dist] | None = None if self.sampling.greedy else []
        # The draft's confidence steers --draft-max auto token by token in greedy decoding only. A sampled
        # token's q (T 0.8, a90 pair) stopped proposals where drafting on paid: auto 1.34x
        # against 1.53x from per-position acceptance alone (N=12: 1.55x).
        confidences: list[float] | None = [] if judge.wants_confidence and q_rows is None else None
        one_token_s: list[float] = []
        t_round = time.perf_counter()
        first_s = None if caught_up else t_round - t_start
        while True:
            history = penalty_history(self.sampling, context, tokens)
            if q_rows is None:
                token = greedy_choice(logits[-1], self.sampling, history)
                q = None
            else:
                token, q = sample_from_logits(logits[-1], self.sampling, history, self.rng)
            if confidences is not None:
                confidence = _softmax_at(logits[-1], token)
                if not judge.keep(self.name, len(tokens), confidence):
                    break
                confidences.append(confidence)
            tokens.append(token)
            if q_rows is not None:
                q_rows.append(q)
            # The last draft token is not evaluated: only the target's verdict says if it stays.
            if len(tokens) == n_max or self.model_dft.is_eog(token) or (confidences is not None and judge.last()):
                break
            logits = yield token
            now = time.perf_counter()
            one_token_s.append(now - t_round)
            t_round = now
        token_s = sum(one_token_s) / len(one_token_s) if one_token_s else None
        self._last_call = time.perf_counter()
        return Proposal(tokens, q_rows, self.name, confidences, token_s, first_s)

    def update(self, n_drafted: int, n_accepted: int) -> None:
        # Drop the rejected drafts now, so the cache holds only accepted text between steps
        # (the last draft and the target's own token are evaluated by the next propose()).
        self.model_dft.truncate(self._context_len + min(n_accepted, n_drafted - 1))

    @property
    def draft_cache(self) -> LlamaModel:
        return self.model_dft


class PromptLookupDrafter(Drafter):
    """Drafts by copying: find where the text so far occurred before and propose what followed
    it there. No model, near-zero cost. docs/lookup.md compares it with llama.cpp's n-gram
    drafters (ngram-simple, ngram-map-k/-k4v, ngram-mod, ngram-cache) it borrows from.

    On a CPU a wider target pass is far from free (a 17-token pass costs about 5 one-token
    passes on Gemma 270M), so the question each step is what evidence the copy has. In order:

    1. Long keys (ngram_max down to ngram_min tokens, the longest that matches), like
       ngram-simple; measured on Gemma 3 270M (2 cores, code/summary/story prompts, N = 16):
       keys of 12 down to 8 gave 1.63x, 12..6 1.61x, 12..12 1.61x, 8..2 1.36x. The candidates
       are the key's latest and previous earlier occurrences and the place the last draft
       copied from, if the text still follows it; the one matching furthest back wins (the
       place being copied on a tie, then the latest): a copy goes on from where it is rather
       than jumping to a later repeat of its key, and a short repeat does not beat a long one.
    2. After the text left the place it was copying (an edit, a changed word), the last
       RESYNC_MIN or more tokens are looked for just after that place (RESYNC_WINDOW tokens
       ahead, for RESYNC_SPAN tokens of text): copying resumes two tokens after an edit
       rather than ngram_min. Such a draft is at most RESYNC_DRAFT tokens long (a short match
       often misleads: on a table, 61 of 241 such drafted tokens were accepted at N = 16);
       once the text follows the place again, 1. copies on at full length.
    3. Shorter keys (ngram_min - 1 down to consensus_min) only on two votes, like
       ngram-cache's minimum sample and map-k4v's statistics: the key's two latest earlier
       occurrences must agree on at least CONSENSUS_DRAFT following tokens, and the draft is
       the part they agree on: the repeated phrase of a list item right after the number
       that breaks every long key, not the item-specific word after it.
    4. Like ngram-map-k, each key remembers how far the text followed its last candidate
       (read from the next context, drafted or not): after a departure at token j it drafts
       at most j tokens (none if j = 0) until the text follows it in full again. A phrase
       repeated in a list with a different item after it each time is not drafted twice.

    The judge gets `match`: how many tokens at the end of the context equal those before the
    copied place (up to MATCH_CAP), the policy's evidence for a long draft. Drafts past the
    end of the context continue a loop with its period. Per step the Python work is
    O(ngram_max): the index of earlier n-grams grows incrementally, matches are measured by
    C-speed slice comparisons.
    """

    name = DraftMode.LOOKUP
    MATCH_CAP = 128  # a match is measured this far back at most
    CONSENSUS_DRAFT = 3  # a two-vote draft needs this many agreed tokens (shorter ones rarely pay)
    RESYNC_MIN = 2  # the shortest match that resumes a copy after the text left it
    RESYNC_SPAN = 32  # ... looked for during this many tokens after it left
    RESYNC_WINDOW = 48  # ... this far ahead of where it left (and 2 tokens behind)
    RESYNC_DRAFT = 4  # ... and drafts at most this many tokens (then the copy goes on as in 1.)

    def __init__(self, ngram_max: int = 12, ngram_min: int = 8, consensus_min: int = 3):
        assert 1 <= ngram_min <= ngram_max
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.key_min = min(ngram_min, max(1, consensus_min))  # the shortest key indexed
        self._reset([])

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None,
              request: object | None = None) -> None:
        self._reset(prompt)

    def _reset(self, context: Sequence[int]) -> None:
        self._tokens: list[int] = list(context)  # the context the index describes
        # _latest[n][key] / _previous[n][key]: start of the latest / the one before indexed
        # occurrence of the n-gram `key`.
        self._latest: dict[int, dict[tuple[int, ...], int]] = {}
        self._previous: dict[int, dict[tuple[int, ...], int]] = {}
        for n in range(self.key_min, self.ngram_max + 1):
            self._latest[n], self._previous[n] = {}, {}
        self._tables = [(n, self._latest[n], self._previous[n]) for n in range(self.key_min, self.ngram_max + 1)]
        self._indexed_end = 0  # n-grams ending at or before this index are indexed
        # The latest candidate, whose outcome the next context shows: (key, source, context length).
        self._last: tuple[tuple[int, ...], int, int] | None = None
        self._offset: int | None = None  # source position - context position of the copy
        self._aligned_at = 0  # the context followed the copy up to this length
        self._cut: dict[tuple[int, ...], int] = {}  # key -> tokens followed after its last candidate

    def _follow(self, context: Sequence[int]) -> None:
        """Bring the index up to date with `context` (rebuild if it is not an extension)."""
        known = len(self._tokens)
        if len(context) < known or list(context[:known]) != self._tokens:
            self._reset(context)
        else:
            self._tokens.extend(context[known:])
        # Index every n-gram that ends before the final position: the final n-gram is the key
        # we look up, and it must match an *earlier* occurrence.
        tokens = self._tokens
        end_limit = len(tokens) - 1
        for end in range(self._indexed_end + 1, end_limit + 1):
            for n, latest, previous in self._tables:
                if end >= n:
                    key = tuple(tokens[end - n : end])
                    before = latest.get(key)
                    if before is not None:
                        previous[key] = before
                    latest[key] = end - n
        self._indexed_end = max(self._indexed_end, end_limit)

    def _learn(self) -> None:
        """Read how far the text followed the latest candidate's source since it was made."""
        if self._last is None:
            return
        key, src, at = self._last
        tokens = self._tokens
        followed = _followed(tokens, src, at)
        if at + followed < len(tokens):
            self._cut[key] = followed  # it left the source after `followed` tokens
        else:
            self._cut.pop(key, None)
        self._offset, self._aligned_at = src - at, at + followed
        self._last = None

    def _candidate(self, n_max: int) -> tuple[int, int, int, int | None] | None:
        """(source, match, cap, agreed): where to copy from, how long the match there is, how
        many tokens the evidence allows, and how many tokens a second earlier occurrence agrees
        on (None: no second one); None without a candidate."""
        tokens = self._tokens
        end = len(tokens)
        cap = self.MATCH_CAP
        # 1. Long keys, and the place being copied if the text still follows it.
        found: list[tuple[int, int, int]] = []  # (match, preference, source)
        if self._offset is not None and self._aligned_at == end and end + self._offset < end:
            src = end + self._offset
            found.append((_match_length(tokens, src, end, cap), 2, src))
        for n in range(min(self.ngram_max, end - 1), self.ngram_min - 1, -1):
            key = tuple(tokens[end - n :])
            start = self._latest[n].get(key)
            if start is None:
                continue
            for preference, begin in ((1, start), (0, self._previous[n].get(key))):
                if begin is not None and all(src != begin + n for _, _, src in found):
                    found.append((_match_length(tokens, begin + n, end, cap), preference, begin + n))
            break
        if found:
            match, _, src = max(found)
            others = [other for _, _, other in sorted(found, reverse=True) if other != src]
            agreed = _agreement(tokens, max(src, others[0]), min(src, others[0]), n_max) if others else None
            return src, match, n_max, agreed
        # 2. Resume a copy the text left a few tokens ago.
        if self._offset is not None and 0 < end - self._aligned_at <= self.RESYNC_SPAN:
            left = self._aligned_at + self._offset  # the source position the text left
            src, match = _resync(tokens, left - 2, left + self.RESYNC_WINDOW, self.ngram_min)
            if match >= self.RESYNC_MIN:
                return src, match, min(n_max, self.RESYNC_DRAFT), None
        # 3. Shorter keys on two agreeing votes.
        for n in range(min(self.ngram_min - 1, end - 1), self.key_min - 1, -1):
            key = tuple(tokens[end - n :])
            start, before = self._latest[n].get(key), self._previous[n].get(key)
            if start is None or before is None:
                continue
            agreed = _agreement(tokens, start + n, before + n, n_max)
            if agreed >= min(self.CONSENSUS_DRAFT, n_max):
                return start + n, _match_length(tokens, start + n, end, cap), agreed, agreed
            return None
        return None

    def _locate(self, context: Sequence[int], n_max: int) -> tuple[int, int, int, int | None] | None:
        """_candidate() on the context brought up to date, remembered for `_learn`, its cap
        lowered by the key's departures (4. in the class docstring)."""
        self._follow(context)
        self._learn()
        found = self._candidate(n_max)
        if found is None:
            return None
        src, match, cap, agreed = found
        tokens = self._tokens
        key = tuple(tokens[len(tokens) - min(match, self.ngram_max) :])
        self._last = (key, src, len(tokens))
        return src, match, min(cap, self._cut.get(key, cap)), agreed

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        if n_max <= 0:
            return _empty(self.name)
        found = self._locate(context, n_max)
        if found is None:
            return _empty(self.name)
        src, match, cap, agreed = found
        # Copying is free; only the target's wider pass costs: the judge sizes it, from the
        # evidence (a fixed --draft-max drafts up to the cap, --draft-max auto weighs it).
        n = judge.limit(self.name, n_max, len(context), match=match, agreed=agreed, cap=cap)
        return Proposal(_continue_periodically(self._tokens, src, n) if n > 0 else [], source=self.name)

    def continuation(self, context: Sequence[int], n_max: int) -> list[int]:
        """What propose() would copy, n_max tokens of it whatever the evidence allows (the
        drafter's choice before any cap on the length: replay.oracle's candidates)."""
        found = self._locate(context, n_max) if n_max > 0 else None
        return [] if found is None else _continue_periodically(self._tokens, found[0], n_max)

    def update(self, n_drafted: int, n_accepted: int) -> None:
        pass  # the next context shows how far the text followed the copy (`_learn`)


class HybridDrafter(Drafter):
    """Prompt lookup when the text so far has a match, the draft model otherwise
    (`--lookup` with `-d`). The judge sizes each source's drafts from its own record."""

    name = DraftMode.HYBRID

    def __init__(self, lookup: PromptLookupDrafter, draft: DraftModelDrafter):
        self.lookup = lookup
        self.draft = draft
        self._last_source: str | None = None

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None,
              request: object | None = None) -> None:
        self.lookup.begin(prompt, sampling, rng, request)
        self.draft.begin(prompt, sampling, rng, request)

    def prefill(self, prompt: Sequence[int], budget: int) -> bool:
        return self.draft.prefill(prompt, budget)

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        return run_steps(self.propose_steps(context, n_max, judge), self.draft.model_dft)

    def propose_steps(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Generator[int, np.ndarray, Proposal]:
        """propose() as a generator (DraftModelDrafter.propose_steps)."""
        proposal = self.lookup.propose(context, n_max, judge)
        if not proposal.tokens:
            proposal = yield from self.draft.propose_steps(context, n_max, judge)
        self._last_source = proposal.source
        return proposal

    def update(self, n_drafted: int, n_accepted: int) -> None:
        # Only the draft model keeps state about its proposal (its cache).
        if self._last_source == self.draft.name:
            self.draft.update(n_drafted, n_accepted)

    @property
    def draft_cache(self) -> LlamaModel:
        return self.draft.model_dft


MODES = tuple(DraftMode)  # a drafter's name each (Drafter.name), or no drafter


def make_drafter(mode: DraftMode | str, model_dft: LlamaModel | None = None) -> Drafter | None:
    """A new drafter for a drafting mode, or None for target-only. The modes that need a draft
    model (DraftMode.needs_draft_model) draft with `model_dft`: a loaded draft model, or one
    sequence of a multi-sequence context on its weights (a SequenceView). Every call makes a
    drafter with its own state: one per sequence when several are decoded at once.
    (memory_drafter.drafter_with_memory: the same, or a lookup drafter that copies from memory too.)"""
    try:
        mode = DraftMode(mode)
    except ValueError:
        raise ValueError(f"unknown drafting mode {mode!r}; expected one of {', '.join(MODES)}") from None
    if mode is DraftMode.TARGET_ONLY:
        return None
    if mode is DraftMode.LOOKUP:
        return PromptLookupDrafter()
    if model_dft is None:
        raise ValueError(f"drafting mode {mode!r} needs a draft model")
    draft = DraftModelDrafter(model_dft)
    return HybridDrafter(PromptLookupDrafter(), draft) if mode is DraftMode.HYBRID else draft


# Logits more than this below the picked token's add under e^-16 each to softmax's sum: left
# out, as a full softmax over a 262k vocabulary costs 0.25 ms per draft token (a GPU draft pass
# of a 1B model costs a few ms), the selection 0.05-0.1 ms on a confident row.
SOFTMAX_TAIL = 16.0


def _softmax_at(logits: np.ndarray, token: int) -> float:
    """The probability softmax(logits) gives `token` (the draft's confidence in a greedy pick),
    from the logits within SOFTMAX_TAIL of the token's: exact to ~1e-4 on real models' rows."""
    own = logits[token]
    near = logits
    if logits.size > 8192:  # (a small vocabulary costs less whole than selected)
        near = np.extract(logits > own - SOFTMAX_TAIL, logits)
        if near.size > logits.size // 8:
            near = logits  # a flat row: the whole softmax costs less than selecting most of it
    return float(1.0 / np.exp(near - own).sum(dtype=np.float64))


def _continue_periodically(tokens: list[int], begin: int, n_max: int) -> list[int]:
    """tokens[begin:begin + n_max], where reading past the end repeats the last period.

    The key at the end of `tokens` repeats the one ending at `begin`, so the text since then
    (period len - begin) is a loop in progress: continue it rather than stop short.
    """
    period = len(tokens) - begin
    out = tokens[begin : begin + n_max]
    while len(out) < n_max:
        out.append(out[len(out) - period])
    return out


def _match_length(tokens: list[int], a: int, b: int, cap: int) -> int:
    """How many tokens end alike at positions a < b (tokens[a - m:a] == tokens[b - m:b]),
    at most cap: slices of 16 compared at C speed, then one token at a time."""
    m, limit = 0, min(cap, a)
    while m + 16 <= limit and tokens[a - m - 16 : a - m] == tokens[b - m - 16 : b - m]:
        m += 16
    while m < limit and tokens[a - m - 1] == tokens[b - m - 1]:
        m += 1
    return m


def _followed(tokens: list[int], src: int, at: int) -> int:
    """How many of tokens[at:] repeat the copy that starts at src < at (read periodically past
    `at`, as `_continue_periodically` drafts it)."""
    n = 0
    while at + n < len(tokens) and tokens[at + n] == tokens[src + n]:
        n += 1
    return n


def _agreement(tokens: list[int], a: int, b: int, n_max: int) -> int:
    """How many tokens the continuations at a and b share from their start (at most n_max,
    and only as far as the one at a is known)."""
    n = 0
    while n < n_max and a + n < len(tokens) and tokens[a + n] == tokens[b + n]:
        n += 1
    return n


def _resync(tokens: list[int], lo: int, hi: int, cap: int) -> tuple[int, int]:
    """The source position q in [lo, hi] (q < len(tokens)) whose preceding tokens match the
    end of `tokens` furthest back (at most cap; the first such q on a tie), and that match."""
    end = len(tokens)
    lo, hi = max(lo, 1), min(hi, end - 1)
    best, best_match = -1, 0
    i = lo - 1
    while i < hi:
        try:
            i = tokens.index(tokens[-1], i, hi)  # q - 1 holds the last token
        except ValueError:
            break
        match = _match_length(tokens, i + 1, end, cap)
        if match > best_match:
            best, best_match = i + 1, match
        i += 1
    return best, best_match
