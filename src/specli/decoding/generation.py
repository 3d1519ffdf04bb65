"""A generation: what a front end asks for (Request), what each target pass gives (Step), and
the generation so far (Generation), which books every step's tokens and text and applies the
stop strings and limits (stopping.py)."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from specli.decoding.sampling import SamplingParams, distribution
from specli.decoding.stats import Stats
from specli.decoding.stopping import _CUTTING, STOP_EOS, STOP_INTERRUPTED, STOP_STRING, LineLimits, check_stop, first_stop, partial_stop_len
from specli.decoding.text import TextStream


@dataclass(frozen=True, eq=False)
class Request:
    """One generation as every front end asks the step loop for it (`run` and `chat`, batch's
    items, the server's jobs and /infill): the loop takes nothing else."""

    prompt_ids: Sequence[int]  # with BOS if the model wants one
    max_tokens: int  # below 1: the generation ends with no tokens (the CLI and the server refuse it)
    sampling: SamplingParams | None = None  # None: the decoder's own (loop.generate)
    seed: int | None = None  # None: the sampling's own, else a fresh one (reported); unused when greedy
    stop: Sequence[str] = ()  # stop strings (stopping.check_stop refuses an empty one)
    limits: LineLimits | None = None  # an /infill request's n_indent and t_max_predict_ms (stateful: one per request)
    fresh: bool = False  # start from an empty cache (llama-server's cache_prompt: false; batch --parallel)
    cache_reuse: int | None = None  # the request's n_cache_reuse (None: the server's --cache-reuse)
    # The output's constraint (constraints.Constraint, docs/constraints.md): the step loop gives it to
    # the sequence's step, which masks verification and cuts drafts with it. None: unconstrained.
    constraint: Any = None
    # Log probabilities of each emitted token and of the `logprobs` most likely ones at its place,
    # from the target's own row (Generation.logprobs); None: not computed.
    logprobs: int | None = None
    post_sampling: bool = False  # logprobs of the sampling chain's distribution (llama-server's post_sampling_probs), not the raw logits'

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", list(self.prompt_ids))
        object.__setattr__(self, "stop", check_stop(self.stop))
        if self.limits is not None and not self.limits.active:
            object.__setattr__(self, "limits", None)


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log probability under the target's own distribution at its place (the
    raw logits' log-softmax, before sampling and any constraint: what llama-server reports), and
    the `top` most likely tokens there, as (token, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(row, token: int, n_top: int) -> TokenLogprob:
    """`token`'s entry from one row of the target's logits (float64 log-softmax)."""
    logits = np.asarray(row, dtype=np.float64)
    best = float(logits.max())
    log_total = best + math.log(float(np.exp(logits - best).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        n = min(n_top, logits.shape[0])
        ids = np.argpartition(-logits, n - 1)[:n] if n < logits.shape[0] else np.arange(n)
        ids = ids[np.lexsort((ids, -logits[ids]))]  # most likely first, ties to the lower id
        top = tuple((int(t), float(logits[t] - log_total)) for t in ids)
    return TokenLogprob(int(token), float(logits[token] - log_total), top)


def sampled_logprobs(row, token: int, n_top: int, sampling, history) -> TokenLogprob:
    """`token`'s entry from the distribution the sampling chain makes of `row` (temperature,
    top-k, top-p, min-p, penalties, bias: llama-server's post_sampling_probs): the kept tokens
    only, most likely first (ties to the lower id)."""
    dist = distribution(row, sampling, history)
    order = np.lexsort((dist.ids, -dist.probs))[:n_top]
    top = tuple((int(dist.ids[k]), math.log(float(dist.probs[k]))) for k in order if dist.probs[k] > 0)
    p = dist[int(token)]
    return TokenLogprob(int(token), math.log(p) if p > 0 else -math.inf, top)


@dataclass
class Step:
    """One target pass: what it emitted and how the draft fared."""

    tokens: list[int]  # emitted tokens (accepted drafts first, then the target's own)
    text_drafted: str  # text completed by the accepted draft tokens
    text_own: str  # text completed by the target's own token
    n_drafted: int
    n_accepted: int  # the first n_accepted emitted tokens came from the draft
    n_branches: int = 1  # the draft's branches (more than 1: a tree pass, branches.py)
    width: int = 0  # tokens in this sequence's part of the pass (0: not a tree pass)

    @property
    def text(self) -> str:
        """All text this step completed (may be "" while a character is incomplete)."""
        return self.text_drafted + self.text_own


@dataclass
class Generation:
    """A generation in progress or finished. Iterate to advance it."""

    prompt_ids: list[int]
    seed: int | None = None  # the seed of this run's random draws (None when greedy)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str | None = None
    stats: Stats = field(default_factory=Stats)
    # Stop strings: the generation ends at the first one completed in its text; neither it nor
    # anything after it is output (`text`), and token_ids end with the token holding the text's
    # last character (the token in which the stop string begins, when it begins mid-token).
    stop: tuple[str, ...] = ()
    stop_word: str = ""  # the stop string that ended it (STOP_STRING)
    # Limits checked after each token (stopping.LineLimits: its after_token), or None.
    limits: LineLimits | None = None
    # With Request.logprobs: one TokenLogprob per token of token_ids (cut with them).
    logprobs: list[TokenLogprob] | None = None
    _steps: Iterator[Step] | None = None
    _stream: TextStream | None = None
    _held: str = ""  # decoded text not released yet: it may be the start of a stop string
    _starts: list[int] = field(default_factory=list)  # with stop strings: each token's offset in the text

    def __iter__(self) -> Iterator[Step]:
        assert self._steps is not None
        return self._steps

    def run(self) -> "Generation":
        """Run to the end without looking at the steps."""
        for _ in self:
            pass
        return self

    def document(self) -> list[int] | None:
        """What a memory keeps of this generation: its prompt and output; None while it runs, or
        when the user or a shutdown interrupted it (such text is never kept)."""
        if self.stop_reason is None or self.stop_reason == STOP_INTERRUPTED:
            return None
        return [*self.prompt_ids, *self.token_ids]

    def interrupt(self) -> None:
        """Mark as stopped by the user (keeps everything produced so far)."""
        if self.stop_reason is None:
            self.finish(STOP_INTERRUPTED)

    def record(self, tokens: list[int], n_accepted: int, n_drafted: int, is_eog, source: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> Step:
        """Book one verified pass: `tokens` = the verdict's (accepted drafts, then the target's
        own), cut at the first end-of-generation token (not emitted; it finishes the
        generation); drafts past it do not count as accepted; `logprobs`, one per token (when
        the request asks for them). Returns the Step event."""
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(logprobs[: len(tokens)])  # (cut below with token_ids: _cut_logprobs)
        emitted, stop = tokens, None
        for i, token in enumerate(tokens):
            if is_eog(token):
                emitted, stop = tokens[:i], STOP_EOS
                break
        n_decided = len(emitted) + (stop is not None)  # (the end-of-generation token is the pass's too)
        n_from_draft = min(n_accepted, len(emitted))
        if self.stop or self.limits is not None:
            return self._record_stopping(emitted, n_from_draft, n_drafted, stop, source, n_decided)
        text_drafted = self._stream.feed(emitted[:n_from_draft])
        text_own = self._stream.feed(emitted[n_from_draft:])
        self.token_ids.extend(emitted)
        self._cut_logprobs()
        self.text += text_drafted + text_own
        self.stats.record_step(n_drafted, n_from_draft, len(emitted), source=source if n_drafted else None, n_decided=n_decided)
        if stop is not None:
            self.finish(stop)
        return Step(emitted, text_drafted, text_own, n_drafted=n_drafted, n_accepted=n_from_draft)

    def _record_stopping(self, emitted: list[int], n_from_draft: int, n_drafted: int, stop: str | None, source: str | None,
                         n_decided: int) -> Step:
        """record() with stop strings: the text is searched token by token (a stop string may
        span tokens, or lie inside an accepted draft); what may begin a stop string is held back
        until the next text settles it; at a stop string the generation ends, cut right before it.
        With `limits`, each token's text is also shown to them; one that ends the generation
        says where its text ends."""
        base = len(self.text)  # the offset of `_held` (and so of `buffer`) in the whole text
        buffer, n_held = self._held, len(self._held)
        cut = None  # the stop string's offset in `buffer`
        drafted_end = n_held  # where the accepted drafts' text ends in `buffer`
        for i, token in enumerate(emitted):
            self._starts.append(base + len(buffer))
            piece = self._stream.feed([token])
            searched, buffer = len(buffer), buffer + piece
            if i < n_from_draft:
                drafted_end = len(buffer)
            cut = first_stop(buffer, max(0, searched), self.stop) if piece and self.stop else None
            if cut is not None:
                # (the shortest stop string there completed first: a longer one would end later)
                self.stop_word, reason = min((s for s in self.stop if buffer.startswith(s, cut)), key=len), STOP_STRING
                break
            if self.limits is not None:
                hit = self.limits.after_token(self.text + buffer, base + searched)
                if hit is not None:
                    reason, end = hit
                    cut = end - base
                    break
        if cut is None:
            keep = len(buffer) - partial_stop_len(buffer, self.stop)
            released, self._held = buffer[:keep], buffer[keep:]
            kept = emitted
        else:
            released, self._held = buffer[:cut], ""
            # Tokens that begin before the cut hold output text; later ones (in this step, or
            # held from an earlier one) are the stop string's and are dropped.
            n_keep = bisect_left(self._starts, base + cut)
            n_before = len(self.token_ids)
            kept = emitted[: max(0, n_keep - n_before)]
            if n_keep < n_before:
                del self.token_ids[n_keep:]
                self.stats.n_tokens -= n_before - n_keep
            del self._starts[n_keep:]
            stop = reason
        n_from_draft = min(n_from_draft, len(kept))
        # (text held back from an earlier step is shown with this step's drafts, if it has any)
        split = min(drafted_end, len(released)) if n_from_draft else 0
        self.token_ids.extend(kept)
        self._cut_logprobs()
        self.text += released
        self.stats.record_step(n_drafted, n_from_draft, len(kept), source=source if n_drafted else None, n_decided=n_decided)
        if stop is not None:
            self.finish(stop)
        return Step(kept, released[:split], released[split:], n_drafted=n_drafted, n_accepted=n_from_draft)

    def _cut_logprobs(self) -> None:
        """Keep one logprob entry per kept token (an end-of-generation token, a stop string's
        tokens are not output)."""
        if self.logprobs is not None:
            del self.logprobs[len(self.token_ids) :]

    def finish(self, reason: str) -> None:
        """Stop with `reason` (one of the STOP_* values); flushes the text held back (a pending
        character, a possible start of a stop string) unless a stop string cut the text."""
        self.stop_reason = reason
        if self._stream is not None and reason not in _CUTTING:
            self.text += self._held + self._stream.flush()
        self._held, self._stream = "", None
