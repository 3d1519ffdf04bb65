"""The draft-then-verify loop.

Each step: the drafter proposes up to k tokens; the target evaluates [last, d1..dk] in one pass
with logits at every position; verification keeps the longest agreeing prefix plus the target's
own token; the rejected positions are removed from the target's cache.

Bookkeeping (target): between steps the target's cache holds the whole context except its newest
token `last`, which is the first token of the next pass. With j drafts accepted the pass emits
d1..dj and t*, the cache is trimmed to the context before t*, and t* becomes `last`.

`generate()` returns a `Generation`: iterate it to run the loop step by step (each step is an
event for the UI); its fields always describe what has been produced so far, so an interrupted
run keeps its text and stats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from specli.decoding.drafters import Drafter, Proposal
from specli.errors import UsageError
from specli.llama.model import LlamaModel, common_prefix_len
from specli.decoding.policy.adaptive import FIXED, AdaptivePolicy, DraftJudge
from specli.decoding.sampling import GREEDY, SamplingParams, make_rng, penalized_row, penalty_history, probabilities, verify_sampled
from specli.decoding.stats import Stats
from specli.decoding.text import TextStream
from specli.decoding.verify import Verdict, verify_greedy

STOP_EOS = "eos"
STOP_MAX_TOKENS = "max_tokens"
STOP_CONTEXT_FULL = "context_full"
STOP_INTERRUPTED = "interrupted"

MAX_DRAFT = 64  # draft lengths beyond this only waste target work
AUTO = "auto"
AUTO_MAX_DRAFT = 64  # the longest draft `-n auto` considers (text copied verbatim pays up to native's 48-64)


def parse_draft_length(text: str) -> int | str:
    """`-n`'s value as typed: "auto" or a whole number of drafts from 1 to MAX_DRAFT. Raises
    ValueError saying what is wrong (callers put it in their own words)."""
    text = text.strip()
    if text.lower() == AUTO:
        return AUTO
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"'{text}' is not a number") from None
    if not 1 <= n <= MAX_DRAFT:
        raise ValueError(f"got {n}")
    return n


@dataclass
class Step:
    """One target pass: what it emitted and how the draft fared."""

    tokens: list[int]  # emitted tokens (accepted drafts first, then the target's own)
    text_drafted: str  # text completed by the accepted draft tokens
    text_own: str  # text completed by the target's own token
    n_drafted: int
    n_accepted: int  # the first n_accepted emitted tokens came from the draft

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
    _steps: Iterator[Step] | None = None
    _stream: TextStream | None = None

    def __iter__(self) -> Iterator[Step]:
        assert self._steps is not None
        return self._steps

    def run(self) -> "Generation":
        """Run to the end without looking at the steps."""
        for _ in self:
            pass
        return self

    def interrupt(self) -> None:
        """Mark as stopped by the user (keeps everything produced so far)."""
        if self.stop_reason is None:
            self._finish(STOP_INTERRUPTED)

    def record(self, tokens: list[int], n_accepted: int, n_drafted: int, is_eog, source: str | None = None) -> Step:
        """Book one verified pass: `tokens` = the verdict's (accepted drafts, then the target's
        own), cut at the first end-of-generation token (not emitted; it finishes the
        generation); drafts past it do not count as accepted. Returns the Step event."""
        emitted, stop = tokens, None
        for i, token in enumerate(tokens):
            if is_eog(token):
                emitted, stop = tokens[:i], STOP_EOS
                break
        n_from_draft = min(n_accepted, len(emitted))
        text_drafted = self._stream.feed(emitted[:n_from_draft])
        text_own = self._stream.feed(emitted[n_from_draft:])
        self.token_ids.extend(emitted)
        self.text += text_drafted + text_own
        self.stats.record_step(n_drafted, n_from_draft, len(emitted), source=source if n_drafted else None)
        if stop is not None:
            self._finish(stop)
        return Step(emitted, text_drafted, text_own, n_drafted=n_drafted, n_accepted=n_from_draft)

    def _finish(self, reason: str) -> None:
        self.stop_reason = reason
        if self._stream is not None:
            self.text += self._stream.flush()
            self._stream = None


class SpeculativeDecoder:
    """Speculative decoding with one target model and an optional drafter.

    With no drafter (target-only) each pass evaluates just `last`: plain decoding through the
    very same loop, the baseline every comparison uses. Greedy sampling (temperature 0) accepts
    drafts that equal the target's argmax; otherwise drafts go through rejection sampling, which
    keeps the output distributed exactly as the target's own sampling.

    `n_draft` is a fixed number of drafts per step, or "auto": the policy (policy.py) chooses
    each step's length, up to AUTO_MAX_DRAFT, from measured costs and acceptance. Either way
    only the speed changes, never the output.
    """

    def __init__(
        self, model_tgt: LlamaModel, drafter: Drafter | None, n_draft: int | str, sampling: SamplingParams = GREEDY
    ):
        self.model_tgt = model_tgt
        self.drafter = drafter
        self.policy: AdaptivePolicy | None = None  # created by the first "auto"; kept after
        self.set_n_draft(n_draft)
        self.sampling = sampling.validate()

    def set_n_draft(self, n_draft: int | str) -> None:
        """A fixed draft length (1 .. MAX_DRAFT) or "auto". The policy's measurements survive
        between generations (the machine and the pair do not change)."""
        self.judge: DraftJudge = FIXED
        if self.drafter is None:
            self.n_draft = 0
        elif n_draft == AUTO:
            self.n_draft = AUTO_MAX_DRAFT
            self.policy = self.policy or AdaptivePolicy(AUTO_MAX_DRAFT)
            self.judge = self.policy
        elif isinstance(n_draft, int) and 1 <= n_draft <= MAX_DRAFT:
            self.n_draft = n_draft
        else:
            raise UsageError(f"-n must be 'auto' or between 1 and {MAX_DRAFT} draft tokens per step, got {n_draft}")

    @property
    def adaptive(self) -> bool:
        return isinstance(self.judge, AdaptivePolicy)

    @property
    def n_draft_label(self) -> int | str:
        """-n as the user would write it: "auto" or the fixed length (0 without a drafter)."""
        return AUTO if self.adaptive else self.n_draft

    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int) -> Generation:
        """Start generating after `prompt_ids` (which must include BOS if the model wants it)."""
        prompt = list(prompt_ids)
        if not prompt:
            raise UsageError("the prompt is empty; give some text to continue")
        if max_tokens < 1:
            raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
        n_ctx = self.model_tgt.n_ctx
        if len(prompt) >= n_ctx:
            raise UsageError(
                f"the prompt is {len(prompt)} tokens but the context holds {n_ctx}; raise -c above {len(prompt)}"
            )
        seed = None
        if not self.sampling.greedy:
            # A fresh seed is drawn when none is given, and reported, so any run can be replayed.
            seed = self.sampling.seed if self.sampling.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
        gen = Generation(prompt_ids=prompt, seed=seed, _stream=TextStream(self.model_tgt.piece))
        gen._steps = self._steps(gen, max_tokens)
        return gen

    def _steps(self, gen: Generation, max_tokens: int) -> Iterator[Step]:
        model_tgt, drafter, stats = self.model_tgt, self.drafter, gen.stats
        context = list(gen.prompt_ids)  # prompt + output; context[-1] is `last`
        n_ctx = model_tgt.n_ctx

        t0 = time.perf_counter()
        reused = common_prefix_len(model_tgt.cached, context[:-1])
        model_tgt.truncate(reused)
        model_tgt.eval(context[reused:-1], logits="none")
        rng = make_rng(gen.seed)
        if drafter is not None:
            drafter.begin(context, self.sampling, rng)
        stats.prompt_tokens = len(context)
        stats.prompt_reused = reused
        stats.prompt_s = time.perf_counter() - t0

        t_gen = time.perf_counter()
        t_previous_pass = None  # when the previous step's pass and verification ended
        while True:
            remaining = max_tokens - len(gen.token_ids)
            room = n_ctx - len(context)  # positions left after the context
            if remaining <= 0:
                gen._finish(STOP_MAX_TOKENS)
                return
            if room <= 0:
                gen._finish(STOP_CONTEXT_FULL)
                return
            # A pass emits up to k+1 tokens; keep them within the budget and the context, and
            # the pass [last, d1..dk] within one llama.cpp batch (a small -c makes it small).
            k = min(self.n_draft, remaining - 1, room - 1, model_tgt.n_batch - 1)

            t_draft = time.perf_counter()
            proposal = drafter.propose(context, k, self.judge) if (drafter is not None and k > 0) else Proposal([])
            draft = proposal.tokens
            assert len(draft) <= k
            t_verify = time.perf_counter()
            cpu_verify = time.process_time()  # (CPU use per second of the pass tells contention)
            assert len(model_tgt.cached) == len(context) - 1
            logits_tgt = model_tgt.eval([context[-1], *draft], logits="all")
            cpu_s = time.process_time() - cpu_verify
            verdict = self._verify(logits_tgt, proposal, context, rng)
            # Keep the cache = context before the new `last` (the target's own token).
            model_tgt.truncate(len(context) + verdict.n_accepted)
            if drafter is not None and draft:
                drafter.update(len(draft), verdict.n_accepted)
            t_done = time.perf_counter()
            if self.adaptive:
                self.judge.observe(proposal.source, len(draft), verdict.n_accepted, proposal.confidences,
                                   t_verify - t_draft, len(draft) + 1, t_done - t_verify, proposal.token_s,
                                   proposal.first_s, len(context),
                                   gap_s=None if t_previous_pass is None else t_draft - t_previous_pass, cpu_s=cpu_s)  # fmt: skip
            # (not after the first step: what follows it includes one-off work, such as the
            # live status's first drawing, 1 ms on a terminal)
            t_previous_pass = t_done if gen.token_ids else None

            step = gen.record(verdict.tokens, verdict.n_accepted, len(draft), model_tgt.is_eog, proposal.source)
            context.extend(verdict.tokens)
            stats.draft_s += t_verify - t_draft
            stats.verify_s += t_done - t_verify
            stats.generation_s = time.perf_counter() - t_gen
            yield step
            if gen.stop_reason is not None:
                return

    def _verify(self, logits_tgt: np.ndarray, proposal: Proposal, context: list[int], rng) -> Verdict:
        """Greedy: exact match against the argmax. Sampling: rejection sampling against p."""
        if self.sampling.greedy:
            if penalty_history(self.sampling, context):  # the penalty changes the argmax
                rows = [penalized_row(logits_tgt[i], self.sampling, context, proposal.tokens[:i]) for i in range(len(logits_tgt))]
                logits_tgt = np.stack(rows)
            return verify_greedy(logits_tgt, proposal.tokens)
        p_rows = TargetRows(logits_tgt, self.sampling, context, proposal.tokens)
        return verify_sampled(p_rows, proposal.q_rows, proposal.tokens, rng)


class TargetRows:
    """The target's distributions p for each position of a pass, computed only when read.

    Row i is for the token after context + draft[:i]; its repetition penalty sees exactly that
    history, as plain decoding would have. Rejection stops at the first rejected draft, so later
    rows are usually never computed.
    """

    def __init__(self, logits_tgt: np.ndarray, sampling: SamplingParams, context: list[int], draft: list[int]):
        self._logits = logits_tgt
        self._sampling = sampling
        self._context = context
        self._draft = draft

    def __len__(self) -> int:
        return len(self._draft) + 1

    def __getitem__(self, i: int) -> np.ndarray:
        return probabilities(self._logits[i], self._sampling, penalty_history(self._sampling, self._context, self._draft[:i]))
