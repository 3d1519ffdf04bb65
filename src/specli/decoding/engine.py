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

A step per sequence is `SequenceStep`'s: `plan()` drafts before the target pass, `commit()`
verifies and books that sequence's rows after it. Both loops use it, `SpeculativeDecoder` with
a pass over one sequence and parallel.py's `ParallelRunner` with one over many; only how the
pass runs is theirs.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Generator, Iterator, Sequence

import numpy as np

from specli.decoding.drafters import Drafter, Proposal
from specli.errors import SettingError, UsageError
from specli.llama.context import SequenceView
from specli.llama.model import LlamaModel, common_prefix_len, fill_cache
from specli.decoding.policy import FIXED, AdaptivePolicy, DraftJudge, StepReport
from specli.decoding.sampling import GREEDY, Dist, SamplingParams, distribution, make_rng, penalized_row, penalty_history, verify_sampled
from specli.decoding.stats import Stats
from specli.decoding.text import TextStream
from specli.decoding.verify import Verdict, verify_greedy

STOP_EOS = "eos"
STOP_MAX_TOKENS = "max_tokens"
STOP_CONTEXT_FULL = "context_full"
STOP_INTERRUPTED = "interrupted"
STOP_STRING = "stop"  # the text reached one of the generation's stop strings

MAX_DRAFT = 64  # draft lengths beyond this only waste target work
AUTO = "auto"
AUTO_MAX_DRAFT = 64  # the longest draft `--draft-max auto` considers (text copied verbatim pays up to native's 48-64)


def parse_draft_length(text: str) -> int | str:
    """`--draft-max`'s value as typed: "auto" or a whole number of drafts from 1 to MAX_DRAFT. Raises
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


def check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    """The stop strings as a tuple; SettingError("stop") for an empty one (it would match at once)."""
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise SettingError("stop", lambda name: f"{name} needs non-empty text (an empty stop string would end every generation at once)")
    return stop


def first_stop(text: str, start: int, stop: Sequence[str]) -> int | None:
    """Where the first stop string to be completed in `text` after position `start` begins
    (None: none is). Scanning end positions in order makes the cut the one a character-by-
    character stream would find, however the text is split into tokens; at one end position
    the longest stop string wins (it begins first)."""
    by_length = sorted(stop, key=len, reverse=True)
    for end in range(start + 1, len(text) + 1):
        for s in by_length:
            if text.endswith(s, 0, end):
                return end - len(s)
    return None


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins a stop string without completing
    it: text that must be held back until what follows shows whether a stop string is there."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


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
    # Stop strings: the generation ends at the first one completed in its text; neither it nor
    # anything after it is output (`text`), and token_ids end with the token holding the text's
    # last character (the token in which the stop string begins, when it begins mid-token).
    stop: tuple[str, ...] = ()
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

    def interrupt(self) -> None:
        """Mark as stopped by the user (keeps everything produced so far)."""
        if self.stop_reason is None:
            self.finish(STOP_INTERRUPTED)

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
        if self.stop:
            return self._record_stopping(emitted, n_from_draft, n_drafted, stop, source)
        text_drafted = self._stream.feed(emitted[:n_from_draft])
        text_own = self._stream.feed(emitted[n_from_draft:])
        self.token_ids.extend(emitted)
        self.text += text_drafted + text_own
        self.stats.record_step(n_drafted, n_from_draft, len(emitted), source=source if n_drafted else None)
        if stop is not None:
            self.finish(stop)
        return Step(emitted, text_drafted, text_own, n_drafted=n_drafted, n_accepted=n_from_draft)

    def _record_stopping(self, emitted: list[int], n_from_draft: int, n_drafted: int, stop: str | None, source: str | None) -> Step:
        """record() with stop strings: the text is searched token by token (a stop string may
        span tokens, or lie inside an accepted draft); what may begin a stop string is held back
        until the next text settles it; at a stop string the generation ends, cut right before it."""
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
            cut = first_stop(buffer, max(0, searched), self.stop) if piece else None
            if cut is not None:
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
            stop = STOP_STRING
        n_from_draft = min(n_from_draft, len(kept))
        # (text held back from an earlier step is shown with this step's drafts, if it has any)
        split = min(drafted_end, len(released)) if n_from_draft else 0
        self.token_ids.extend(kept)
        self.text += released
        self.stats.record_step(n_drafted, n_from_draft, len(kept), source=source if n_drafted else None)
        if stop is not None:
            self.finish(stop)
        return Step(kept, released[:split], released[split:], n_drafted=n_drafted, n_accepted=n_from_draft)

    def finish(self, reason: str) -> None:
        """Stop with `reason` (one of the STOP_* values); flushes the text held back (a pending
        character, a possible start of a stop string) unless a stop string cut the text."""
        self.stop_reason = reason
        if self._stream is not None and reason != STOP_STRING:
            self.text += self._held + self._stream.flush()
        self._held, self._stream = "", None


class SpeculativeDecoder:
    """Speculative decoding with one target model and an optional drafter.

    With no drafter (target-only) each pass evaluates just `last`: plain decoding through the
    very same loop, the baseline every comparison uses. Greedy sampling (temperature 0) accepts
    drafts that equal the target's argmax; otherwise drafts go through rejection sampling, which
    keeps the output distributed exactly as the target's own sampling.

    `n_draft` is a fixed number of drafts per step, or "auto": the policy (decoding/policy) chooses
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
        else:  # (the CLI parses --draft-max first; library callers, tests and benchmarks, do not)
            raise SettingError("n_draft", lambda name: f"{name} must be 'auto' or between 1 and {MAX_DRAFT} draft tokens per step, got {n_draft}")

    @property
    def adaptive(self) -> bool:
        return isinstance(self.judge, AdaptivePolicy)

    @property
    def n_draft_label(self) -> int | str:
        """--draft-max as the user would write it: "auto" or the fixed length (0 without a drafter)."""
        return AUTO if self.adaptive else self.n_draft

    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), seed: int | None = None) -> Generation:
        """Start generating after `prompt_ids` (which must include BOS if the model wants it);
        it ends at the first of the `stop` strings (Generation.stop). `seed`: as sequence()'s."""
        seq = self.sequence(prompt_ids, max_tokens=max_tokens, cache=self.model_tgt, max_pass=self.model_tgt.n_batch, stop=stop, seed=seed)
        seq.gen._steps = self._steps(seq)
        return seq.gen

    def sequence(
        self, prompt_ids: Sequence[int], *, max_tokens: int, cache: LlamaModel | SequenceView, max_pass: int,
        stop: Sequence[str] = (), seed: int | None = None,
    ) -> "SequenceStep":
        """A generation after `prompt_ids` for a loop that runs the target's passes itself.

        `cache` is the target's cache for this sequence: `model_tgt`, or one sequence of a
        MultiSequenceContext (its SequenceView); `max_pass` the most tokens one pass may evaluate
        for it. Checks the prompt and draws the seed now; nothing is evaluated before begin().
        A max_tokens below 1 (the CLI and batch items refuse it) ends the generation with no tokens.
        `seed`, when given, replaces the sampling's own (parallel.py's DecoderPool keeps one
        decoder per setting and gives each generation its seed).
        """
        prompt = list(prompt_ids)
        # Kept although `run`, `chat` and `batch` check their prompts: library callers (tests,
        # benchmarks) reach this directly, and the prompt's length is only checked here for `run`.
        if not prompt:
            raise UsageError("the prompt is empty; give some text to continue")
        n_ctx = cache.n_ctx
        if len(prompt) >= n_ctx:
            raise SettingError(
                "n_ctx", lambda name: f"the prompt is {len(prompt)} tokens but the context holds {n_ctx}; raise {name} above {len(prompt)} or shorten the prompt"
            )
        if self.sampling.greedy:
            seed = None
        else:
            # A fresh seed is drawn when none is given, and reported, so any run can be replayed.
            seed = seed if seed is not None else self.sampling.seed
            seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**32)
        gen = Generation(prompt_ids=prompt, seed=seed, stop=check_stop(stop), _stream=TextStream(self.model_tgt.piece))
        return SequenceStep(self, gen, cache, max_tokens, max_pass)

    def _steps(self, seq: "SequenceStep") -> Iterator[Step]:
        """The loop on the target alone: each pass evaluates this one sequence."""
        model_tgt = self.model_tgt
        seq.begin()
        while not seq.ended():
            tokens = seq.plan()
            t_pass = time.perf_counter()
            cpu_pass = time.process_time()  # (CPU use per second of the pass tells contention)
            rows = model_tgt.eval(tokens, logits="all")
            cpu_s = time.process_time() - cpu_pass
            yield seq.commit(rows, time.perf_counter() - t_pass, cpu_s=cpu_s)

    def verify(self, logits_tgt: np.ndarray, proposal: Proposal, context: list[int], rng) -> Verdict:
        """Greedy: exact match against the argmax. Sampling: rejection sampling against p."""
        if self.sampling.greedy:
            if penalty_history(self.sampling, context):  # the penalty changes the argmax
                return verify_greedy(TargetRows(logits_tgt, self.sampling, context, proposal.tokens, row=penalized_row), proposal.tokens)
            return verify_greedy(logits_tgt, proposal.tokens)
        p_rows = TargetRows(logits_tgt, self.sampling, context, proposal.tokens)
        return verify_sampled(p_rows, proposal.q_rows, proposal.tokens, rng)


class SequenceStep:
    """One generation between target passes, and its step around each pass: `plan()` before it
    (the draft, and the tokens the pass evaluates for this sequence), `commit()` after it (the
    verdict on this sequence's rows, the cache trimmed, the Step booked on the Generation, the
    policy told). The loop that runs the passes calls, per sequence:

        seq.begin()                     # the prompt into the cache, the drafter started
        while not seq.ended():          # max_tokens, a full context, an end-of-generation token, a stop string
            tokens = seq.plan()         # [last, d1..dk]
            rows = <the target's pass over tokens, logits for every position>
            step = seq.commit(rows, pass_s, cpu_s=..., share=...)

    Between steps `cache` holds the context but its newest token `last` (module docstring).
    """

    def __init__(
        self, decoder: SpeculativeDecoder, gen: Generation, cache: LlamaModel | SequenceView, max_tokens: int, max_pass: int
    ):
        self.decoder = decoder
        self.gen = gen
        self.cache = cache
        self.max_tokens = max_tokens
        self.max_pass = max_pass
        self.context = list(gen.prompt_ids)  # prompt + output; context[-1] is `last`
        self.rng: np.random.Generator | None = None
        self._proposal: Proposal | None = None
        self._draft_s = 0.0  # what the pending proposal took
        self._gap_s: float | None = None  # from the previous step's end to the pending one's start
        self._t_previous: float | None = None  # when the previous step's pass and verification ended
        self._t_gen = 0.0
        self._t_begin: float | None = None  # when begin() was first called

    def begin(self, budget: int | None = None) -> bool:
        """Put the prompt but `last` into the cache (keeping what it already holds of it, such as
        a chat's history), and into a draft model's, and start the drafter; True when done.

        With a budget, each call evaluates at most that many tokens of the prompt (the target's
        cache first, then the draft model's), and returns False until the whole prompt is in: a
        server evaluates a long prompt between the other sequences' passes. A budget that is a
        multiple of the cache's batch size gives the very batches of one call. prompt_s is then
        the wall time from the first call to the last, the other sequences' passes included."""
        gen, cache, context = self.gen, self.cache, self.context
        if self._t_begin is None:
            self._t_begin = time.perf_counter()
            gen.stats.prompt_reused = common_prefix_len(cache.cached, context[:-1])
            gen.stats.prompt_tokens = len(context)
        if not fill_cache(cache, context[:-1], budget):
            return False
        drafter = self.decoder.drafter
        prefill = getattr(drafter, "prefill", None)  # (drafters with a cache of their own)
        if budget is not None and prefill is not None and not prefill(context, budget):
            return False
        self.rng = make_rng(gen.seed)
        if drafter is not None:
            drafter.begin(context, self.decoder.sampling, self.rng)
        self._t_gen = time.perf_counter()
        gen.stats.prompt_s = self._t_gen - self._t_begin
        return True

    def ended(self) -> bool:
        """Whether the generation is over; before a pass, ends it when it has max_tokens or
        fills the context."""
        gen = self.gen
        if gen.stop_reason is None:
            if len(gen.token_ids) >= self.max_tokens:
                gen.finish(STOP_MAX_TOKENS)
            elif len(self.context) >= self.cache.n_ctx:
                gen.finish(STOP_CONTEXT_FULL)
        return gen.stop_reason is not None

    def plan(self) -> list[int]:
        """Draft for this step (the drafter asks the decoder's judge); the tokens the target's
        pass must evaluate for this sequence: [last, *draft]."""
        k, t_draft = self._plan_start()
        drafter = self.decoder.drafter
        proposal = drafter.propose(self.context, k, self.decoder.judge) if (drafter is not None and k > 0) else Proposal([])
        return self._plan_end(proposal, k, t_draft)

    def plan_steps(self) -> Generator[int, np.ndarray, list[int]]:
        """plan() as a generator, for a loop that evaluates several sequences' draft tokens in
        one pass: with a draft model it yields each token the draft model must evaluate and is
        sent its logits (drafters.DraftModelDrafter.propose_steps); returns plan()'s tokens."""
        k, t_draft = self._plan_start()
        drafter = self.decoder.drafter
        if drafter is None or k <= 0:
            proposal = Proposal([])
        elif hasattr(drafter, "propose_steps"):
            proposal = yield from drafter.propose_steps(self.context, k, self.decoder.judge)
        else:
            proposal = drafter.propose(self.context, k, self.decoder.judge)
        return self._plan_end(proposal, k, t_draft)

    def _plan_start(self) -> tuple[int, float]:
        remaining = self.max_tokens - len(self.gen.token_ids)
        room = self.cache.n_ctx - len(self.context)  # positions left after the context
        # A pass emits up to k+1 tokens; keep them within the budget and the context, and the
        # pass [last, d1..dk] within max_pass (one llama.cpp batch: a small -c makes it small).
        k = min(self.decoder.n_draft, remaining - 1, room - 1, self.max_pass - 1)
        t_draft = time.perf_counter()
        self._gap_s = None if self._t_previous is None else t_draft - self._t_previous
        return k, t_draft

    def _plan_end(self, proposal: Proposal, k: int, t_draft: float) -> list[int]:
        self._draft_s = time.perf_counter() - t_draft
        assert len(proposal.tokens) <= k
        assert len(self.cache.cached) == len(self.context) - 1
        self._proposal = proposal
        return [self.context[-1], *proposal.tokens]

    def book_shared_drafting(self, draft_s: float, token_s: float) -> None:
        """After plan_steps() drafted in lockstep with other sequences (parallel.plan_all): what
        this sequence's drafting cost, its share of the shared draft passes included (the wall
        time of the rounds counts every sequence's), and the cost of one round of it."""
        self._draft_s = draft_s
        if self._proposal is not None and self._proposal.token_s is not None:
            self._proposal.token_s = token_s

    def commit(self, rows: np.ndarray, pass_s: float, *, cpu_s: float | None = None, share: float = 1.0) -> Step:
        """Book the pass over plan()'s tokens: `rows` are the target's logits for them, pass_s
        the pass's wall seconds, cpu_s the CPU seconds the process used during it (None: not
        measured), share this sequence's part of a pass shared with others (parallel.py's
        SharedPassCost), which the policy is charged. Returns the Step event."""
        t_commit = time.perf_counter()
        decoder, gen, context, proposal = self.decoder, self.gen, self.context, self._proposal
        assert proposal is not None, "commit() follows plan()"
        self._proposal = None
        draft = proposal.tokens
        verdict = decoder.verify(rows, proposal, context, self.rng)
        # Keep the cache = context before the new `last` (the target's own token).
        self.cache.truncate(len(context) + verdict.n_accepted)
        if decoder.drafter is not None and draft:
            decoder.drafter.update(len(draft), verdict.n_accepted)
        t_done = time.perf_counter()
        verify_s = t_done - t_commit  # this sequence's verification, after the pass
        if decoder.adaptive:
            decoder.judge.observe(StepReport(
                source=proposal.source, n_drafted=len(draft), n_accepted=verdict.n_accepted,
                confidences=proposal.confidences, draft_s=self._draft_s, pass_tokens=len(draft) + 1,
                pass_s=pass_s * share + verify_s, token_s=proposal.token_s, first_s=proposal.first_s,
                context_len=len(context), gap_s=self._gap_s, cpu_s=None if cpu_s is None else cpu_s * share,
            ))  # fmt: skip
        # (not after the first step: what follows it includes one-off work, such as the
        # live status's first drawing, 1 ms on a terminal)
        self._t_previous = t_done if gen.token_ids else None

        step = gen.record(verdict.tokens, verdict.n_accepted, len(draft), decoder.model_tgt.is_eog, proposal.source)
        context.extend(verdict.tokens)
        gen.stats.draft_s += self._draft_s
        gen.stats.verify_s += pass_s + verify_s  # (a shared pass: its whole wall time)
        gen.stats.generation_s = time.perf_counter() - self._t_gen
        return step


class TargetRows:
    """The target's rows for each position of a pass, computed only when read: its
    distributions p (`row=distribution`, for rejection sampling), or its logits after the
    repetition penalty (`row=penalized_row`, for greedy verification).

    Row i is for the token after context + draft[:i]; its repetition penalty sees exactly that
    history, as plain decoding would have. Verification stops at the first rejected draft, so
    later rows are usually never computed.
    """

    def __init__(self, logits_tgt: np.ndarray, sampling: SamplingParams, context: list[int], draft: list[int], row=distribution):
        self._logits = logits_tgt
        self._sampling = sampling
        self._context = context
        self._draft = draft
        self._row = row  # (logits, sampling, history) -> the row

    def __len__(self) -> int:
        return len(self._draft) + 1

    def __getitem__(self, i: int) -> Dist | np.ndarray:
        return self._row(self._logits[i], self._sampling, penalty_history(self._sampling, self._context, self._draft[:i]))
