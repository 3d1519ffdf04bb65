"""Drafters: cheap proposers of the tokens the target is likely to produce next.

Every drafter follows one small protocol (after HF transformers' candidate generators):
- begin(prompt, sampling, rng): called once before generation, e.g. to put the prompt into a
  draft model's cache; `sampling` and `rng` are the run's (the draft samples like the target);
- propose(context, n_max, judge): a Proposal of up to n_max tokens that might follow `context`
  (prompt + output so far), with the distributions q they were drawn from when there are any;
  the judge (policy.py) says how many are worth proposing, and for a draft model, token by
  token from its confidence, when to stop (fixed -n: exactly n_max);
- update(n_drafted, n_accepted): how the target judged the latest proposal.

Drafters never see logits of the target and cannot change the output: only its speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .llama import LlamaModel
from .policy import FIXED, DraftJudge
from .sampling import GREEDY, SamplingParams, greedy_choice, penalty_history, sample_from_logits


@dataclass
class Proposal:
    """Draft tokens, and for sampled drafts the distribution q each was drawn from.

    q_rows None means the drafter has no distribution (greedy drafts, prompt lookup): for
    rejection sampling q is then one-hot on each drafted token.
    """

    tokens: list[int]
    q_rows: list[np.ndarray] | None = None
    source: str | None = None  # the drafter that made it ("lookup", "draft-model")
    confidences: list[float] | None = None  # the draft model's probability of each token
    # A draft model's cost per drafted token in this proposal: mean seconds of one round of
    # its loop (choose the token, judge it, a one-token pass), without the catch-up of a cache
    # that fell behind during plain steps.
    token_s: float | None = None
    # Seconds until the first draft token was chosen (the judge's limit and the draft model's
    # pass over the target's newest token), when that was no catch-up: a step's start-up cost.
    first_s: float | None = None


def _empty(source: str | None = None) -> Proposal:
    return Proposal([], source=source)


class Drafter(Protocol):
    name: str

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, rng: np.random.Generator) -> None: ...

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal: ...

    def update(self, n_drafted: int, n_accepted: int) -> None: ...


class DraftModelDrafter:
    """Greedy drafts from a smaller model that shares the target's vocabulary.

    The draft model's cache is kept in step with the context: after each step it holds exactly
    accepted text (`update` drops rejected drafts), and `propose` reuses that prefix, evaluating
    only the tokens it has not seen (the target's own token, plus the last draft after a full
    accept) — never the whole history.

    After a stretch of plain decoding (`-n auto` not drafting) the cache is behind. Catching up
    is one batch pass over the tokens missed: about 1% of the time those plain steps took on the
    synthetic pairs (a 1-block draft for a 9-block target), but 10% when the draft model costs as
    much as its target (Gemma 270M Q4 for its F16: a re-probe after 128 plain steps would cost
    about as much as 13 of them). A draft that starts over from a short window guesses badly
    (a90's first-token acceptance: 0.26-0.45 from 16 tokens, 0.84-1.0 from all of them), which
    would make `-n auto`'s re-probes fail where drafting pays. So the cache catches up in full
    when that costs at most CATCH_UP_SHARE of the time since the last proposal (from the draft
    model's measured batch speed), and otherwise, when more than CATCH_UP_LIMIT tokens behind,
    starts over on a window: the context's first token (BOS) and its last CATCH_UP_LIMIT tokens,
    growing from there. A draft only has to guess well; the target's verification keeps the
    output exact.
    """

    name = "draft-model"
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

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None) -> None:
        self.sampling = sampling
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self._offset = 0
        self._timed_sync(prompt)
        self._last_call = time.perf_counter()

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
        behind = len(view) - len(self.model_dft.cached)
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
        t_start = time.perf_counter()
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
        q_rows: list[np.ndarray] | None = None if self.sampling.greedy else []
        # The draft's confidence steers -n auto token by token in greedy decoding only. A sampled
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
            logits = self.model_dft.eval([token], logits="last")
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


class PromptLookupDrafter:
    """Drafts by copying: find the latest earlier occurrence of the context's last tokens and
    propose what followed it there. No model, near-zero cost.

    Long matches predict well, short ones often mislead (a wrong draft still costs a wider target
    pass: on a CPU a 17-token pass costs about 5 one-token passes). So, like llama.cpp's
    ngram-simple, we want long keys: try key lengths from `ngram_max` down to `ngram_min` and use
    the longest that matches. Measured on Gemma 3 270M (2 cores, four code/summary/story
    prompts, N = 16): keys of 12 down to 8 gave a 1.63x geometric-mean speedup, 12..6 1.61x,
    12..12 1.61x, 8..2 1.36x (N = 16 also beat 24, 32 and 48 for all of them). The index of
    earlier n-grams grows incrementally: a step does O(ngram_max) Python work (plus one C-speed
    comparison of the context with the indexed one).
    """

    name = "lookup"

    def __init__(self, ngram_max: int = 12, ngram_min: int = 8):
        assert 1 <= ngram_min <= ngram_max
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._tokens: list[int] = []  # the context the index describes
        # _latest[n][key] = start of the latest indexed occurrence of the n-gram `key`.
        self._latest: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed_end = 0  # n-grams ending at or before this index are in _latest

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None) -> None:
        self._reset(prompt)

    def _reset(self, context: Sequence[int]) -> None:
        self._tokens = list(context)
        self._latest = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}
        self._indexed_end = 0

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
            for n, table in self._latest.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end - n
        self._indexed_end = max(self._indexed_end, end_limit)

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        if n_max <= 0:
            return _empty(self.name)
        self._follow(context)
        tokens = self._tokens
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            start = self._latest[n].get(tuple(tokens[-n:]))
            if start is not None:
                # Copying is free; only the target's wider pass costs: the judge sizes it.
                n_max = judge.limit(self.name, n_max, len(context))
                return Proposal(_continue_periodically(tokens, start + n, n_max) if n_max > 0 else [], source=self.name)
        return _empty(self.name)

    def update(self, n_drafted: int, n_accepted: int) -> None:
        pass


class HybridDrafter:
    """Prompt lookup when the text so far has a match, the draft model otherwise
    (`--lookup` with `-d`). The judge sizes each source's drafts from its own record."""

    name = "hybrid"

    def __init__(self, lookup: PromptLookupDrafter, draft: DraftModelDrafter):
        self.lookup = lookup
        self.draft = draft
        self._last_source: str | None = None

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None) -> None:
        self.lookup.begin(prompt, sampling, rng)
        self.draft.begin(prompt, sampling, rng)

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        proposal = self.lookup.propose(context, n_max, judge)
        if not proposal.tokens:
            proposal = self.draft.propose(context, n_max, judge)
        self._last_source = proposal.source
        return proposal

    def update(self, n_drafted: int, n_accepted: int) -> None:
        # Only the draft model keeps state about its proposal (its cache).
        if self._last_source == self.draft.name:
            self.draft.update(n_drafted, n_accepted)


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
