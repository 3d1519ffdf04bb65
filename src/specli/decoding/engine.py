"""The draft-then-verify loop.

Each step: the drafter proposes up to k tokens; the target evaluates [last, d1..dk] in one pass
with logits at every position; verification keeps the longest agreeing prefix plus the target's
own token; the rejected positions are removed from the target's cache.

Bookkeeping (target): between steps the target's cache holds the whole context except its newest
token `last`, which is the first token of the next pass. With j drafts accepted the pass emits
d1..dj and t*, the cache is trimmed to the context before t*, and t* becomes `last`. The first
pass also holds the prompt's end (SequenceStep.begin): the first tokens come from the pass that
finishes the prompt.

`generate()` returns a `Generation`: iterate it to run the loop step by step (each step is an
event for the UI); its fields always describe what has been produced so far, so an interrupted
run keeps its text and stats.

A step per sequence is `SequenceStep`'s: `plan()` drafts before the target pass, `commit()`
verifies and books that sequence's rows after it. `StepLoop` holds the sequences of one target
and does one step for all of them around one pass: every front end drives it, `run` and `chat`
with one sequence (`generate()`), `batch` (parallel.py) and `serve` (server/scheduler.py) with
one or several, feeding it and draining it by their own rules.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Generator, Iterator, Sequence

import numpy as np

from specli.decoding.branches import BRANCH_SOURCE, TokenTree, TreeVerdict, plan_branches, verify_tree
from specli.decoding.drafters import Drafter, Proposal, make_drafter
from specli.decoding.memory_drafter import drafter_with_memory, shared_prefix
from specli.errors import SettingError, SpecliError, UsageError
from specli.llama.context import MultiSequenceContext, SequenceView
from specli.llama.model import LlamaModel, common_prefix_len, fill_cache
from specli.modes import MAX_DRAFT, DraftLength, DraftMode
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
# An /infill request's limits (decoding/limits.py): a line indented less than n_indent, and a
# newline after t_max_predict_ms; like a stop string, each cuts the text where it ends.
STOP_INDENT = "indent"
STOP_TIME_LIMIT = "time_limit"
_CUTTING = (STOP_STRING, STOP_INDENT, STOP_TIME_LIMIT)  # reasons whose cut leaves no held text to flush


def draft_length_for(drafting: bool, value: DraftLength | int | str) -> DraftLength:
    """The draft length of a decoder with a drafter (`drafting`) or without: off without one
    (whatever `value` says), else `value` as a DraftLength: library callers (tests, benchmarks)
    give "auto" or a number, refused with SettingError("n_draft") when it is neither (the CLI
    parses --draft-max first)."""
    if not drafting:
        return DraftLength.off()
    try:
        return DraftLength.of(value)
    except ValueError:
        raise SettingError("n_draft", lambda name: f"{name} must be 'auto' or between 1 and {MAX_DRAFT} draft tokens per step, got {value}") from None


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
    # Limits checked after each token (decoding/limits.LineLimits: its after_token), or None.
    limits: object | None = None
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

    def record(self, tokens: list[int], n_accepted: int, n_drafted: int, is_eog, source: str | None = None) -> Step:
        """Book one verified pass: `tokens` = the verdict's (accepted drafts, then the target's
        own), cut at the first end-of-generation token (not emitted; it finishes the
        generation); drafts past it do not count as accepted. Returns the Step event."""
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
        self.text += text_drafted + text_own
        self.stats.record_step(n_drafted, n_from_draft, len(emitted), source=source if n_drafted else None, n_decided=n_decided)
        if stop is not None:
            self.finish(stop)
        return Step(emitted, text_drafted, text_own, n_drafted=n_drafted, n_accepted=n_from_draft)

    def _record_stopping(self, emitted: list[int], n_from_draft: int, n_drafted: int, stop: str | None, source: str | None,
                         n_decided: int) -> Step:  # fmt: skip
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
        self.text += released
        self.stats.record_step(n_drafted, n_from_draft, len(kept), source=source if n_drafted else None, n_decided=n_decided)
        if stop is not None:
            self.finish(stop)
        return Step(kept, released[:split], released[split:], n_drafted=n_drafted, n_accepted=n_from_draft)

    def finish(self, reason: str) -> None:
        """Stop with `reason` (one of the STOP_* values); flushes the text held back (a pending
        character, a possible start of a stop string) unless a stop string cut the text."""
        self.stop_reason = reason
        if self._stream is not None and reason not in _CUTTING:
            self.text += self._held + self._stream.flush()
        self._held, self._stream = "", None


class SpeculativeDecoder:
    """Speculative decoding with one target model and an optional drafter.

    With no drafter (target-only) each pass evaluates just `last`: plain decoding through the
    very same loop, the baseline every comparison uses. Greedy sampling (temperature 0) accepts
    drafts that equal the target's argmax; otherwise drafts go through rejection sampling, which
    keeps the output distributed exactly as the target's own sampling.

    `n_draft` is the draft length (modes.DraftLength; library callers may give "auto" or a
    number): a fixed number of drafts per step, or auto: the policy (decoding/policy) chooses
    each step's length, up to its maximum, from measured costs and acceptance. Either way only
    the speed changes, never the output. Without a drafter the length is off, whatever is given.
    """

    def __init__(
        self, model_tgt: LlamaModel, drafter: Drafter | None, n_draft: DraftLength | int | str, sampling: SamplingParams = GREEDY
    ):
        self.model_tgt = model_tgt
        self.drafter = drafter
        self.policy: AdaptivePolicy | None = None  # created by the first "auto"; kept after
        self.set_draft_length(n_draft)
        self.sampling = sampling.validate()

    def set_draft_length(self, length: DraftLength | int | str) -> None:
        """A fixed draft length or auto (see draft_length_for). The policy's measurements survive
        between generations (the machine and the pair do not change)."""
        self.draft_length = draft_length_for(self.drafter is not None, length)
        self.judge: DraftJudge = FIXED
        if self.draft_length.is_auto:
            self.policy = self.policy or AdaptivePolicy(self.draft_length.maximum)
            self.judge = self.policy

    @property
    def n_draft(self) -> int:
        """The most drafts one step may take (0 without a drafter)."""
        return self.draft_length.longest

    @property
    def adaptive(self) -> bool:
        return isinstance(self.judge, AdaptivePolicy)

    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), seed: int | None = None) -> Generation:
        """Start generating after `prompt_ids` (which must include BOS if the model wants it);
        it ends at the first of the `stop` strings (Generation.stop). `seed`: as sequence()'s.
        The step loop with one sequence, on the target's own context."""
        loop = StepLoop.on_model(self.model_tgt, DecoderPool(self.model_tgt, self.drafter, self.draft_length, first=self))
        seq = loop.start(0, prompt_ids, sampling=self.sampling, max_tokens=max_tokens, stop=stop, seed=seed)
        seq.gen._steps = _one_sequence(loop)
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
        `seed`, when given, replaces the sampling's own (DecoderPool keeps one
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

    def verify(self, logits_tgt: np.ndarray, proposal: Proposal, context: list[int], rng) -> Verdict:
        """Greedy: exact match against the argmax. Sampling: rejection sampling against p."""
        if self.sampling.greedy:
            if penalty_history(self.sampling, context):  # the penalty changes the argmax
                return verify_greedy(TargetRows(logits_tgt, self.sampling, context, proposal.tokens, row=penalized_row), proposal.tokens)
            return verify_greedy(logits_tgt, proposal.tokens)
        p_rows = TargetRows(logits_tgt, self.sampling, context, proposal.tokens)
        return verify_sampled(p_rows, proposal.q_rows, proposal.tokens, rng)

    def verify_tree(self, rows: np.ndarray, tree: TokenTree, context: list[int]) -> TreeVerdict:
        """Greedy only: each branch as verify() checks a chain, the longest accepted wins."""
        assert self.sampling.greedy, "tree passes are greedy only"
        if not penalty_history(self.sampling, context):
            return verify_tree(rows, tree)
        # (the penalty changes the argmax: each branch's rows see its own history, as verify's)
        return verify_tree(rows, tree, lambda node_rows, draft: TargetRows(node_rows, self.sampling, context, draft, row=penalized_row))


class SequenceStep:
    """One generation between target passes, and its step around each pass: `plan()` before it
    (the draft, and the tokens the pass evaluates for this sequence), `commit()` after it (the
    verdict on this sequence's rows, the cache trimmed, the Step booked on the Generation, the
    policy told). The loop that runs the passes calls, per sequence:

        seq.begin()                     # the prompt into the cache, the drafter started
        while not seq.ended():          # max_tokens, a full context, an end-of-generation token, a stop string
            tokens = seq.plan()         # [last, d1..dk] (the first: [prompt's end, last, d1..dk])
            rows = <the target's pass over tokens, logits for the last seq.n_rows of them>
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
        self._n_tail = 0  # prompt tokens left to the next pass (begin())
        self._pass_tail = 0  # those of them in the pending pass
        self.n_rows = 1  # the rows of logits the pending pass must return for this sequence
        self._tree: TokenTree | None = None  # the pending pass's branches, when a tree

    def begin(self, budget: int | None = None) -> bool:
        """Put the prompt into the cache (keeping what it already holds of it, such as a chat's
        history) but for its end, which the first step's pass evaluates with `last` and the
        first draft (`tail`): the first tokens come out of the pass that ends the prompt, as
        llama-server's do, not a pass after it. Then the prompt into a draft model's cache, and
        the drafter started; True when done.

        The tail is what is left of the prompt after whole passes of max_pass tokens (or of the
        budget, when smaller) from what the cache holds, so the prompt goes in the very batches
        one pass at a time would use, and a server's other sequences wait no longer for it.
        With a budget, each call evaluates at most that many tokens of the prompt (the target's
        cache first, then the draft model's), and returns False until the whole prompt is in: a
        server evaluates a long prompt between the other sequences' passes. A budget that is a
        multiple of the cache's batch size gives the very batches of one call. prompt_s is then
        the wall time from the first call to the last, the other sequences' passes included."""
        gen, cache, context = self.gen, self.cache, self.context
        prompt = context[:-1]  # (without `last`)
        if self._t_begin is None:
            self._t_begin = time.perf_counter()
            gen.stats.prompt_reused = common_prefix_len(cache.cached, prompt)
            gen.stats.prompt_tokens = len(context)
            self._n_tail = (len(prompt) - gen.stats.prompt_reused) % min(self.max_pass, budget or self.max_pass)
        if not fill_cache(cache, prompt[: len(prompt) - self._n_tail], budget):
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
        pass must evaluate for this sequence: [last, *draft], after the prompt's end on the first
        step (its rows are not needed: n_rows)."""
        k, t_draft = self._plan_start()
        drafter = self.decoder.drafter
        proposal = drafter.propose(self.context, k, self.decoder.judge) if (drafter is not None and k > 0) else Proposal([])
        return self._plan_end(proposal, k, t_draft, self._branches(proposal, k))

    def _branches(self, proposal: Proposal, k: int) -> TokenTree | None:
        """The tree of this step's pass (branches.py), or None for the chain alone: only greedy,
        on a cache with room for branches (LlamaModel(branches=N)), and not with the prompt's
        end in the pass. The cost table is -n auto's, else --branches alone decides."""
        room = getattr(self.cache, "max_branches", 1)
        decoder = self.decoder
        if room < 2 or k <= 0 or self._n_tail or decoder.drafter is None or not decoder.sampling.greedy:
            return None
        costs = None
        if decoder.adaptive:
            table = decoder.judge.pass_cost.table(1 + k * room, len(self.context))
            costs = table.__getitem__
        branches = plan_branches(decoder.drafter, self.context, proposal.tokens, k, room, costs, proposal.source)
        if len(branches) < 2 and (not branches or branches[0] == list(proposal.tokens)):
            return None  # (the chain alone, or nothing: a plain pass)
        tree = TokenTree.of(branches)
        if len(self.cache.cached) + tree.width > self.cache.n_ctx or tree.width > self.max_pass:
            return None  # (every node takes a cell of the cache for the pass, and a place in the batch)
        return tree

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
        # pass [tail, last, d1..dk] within max_pass (one llama.cpp batch: a small -c makes it small).
        k = min(self.decoder.n_draft, remaining - 1, room - 1, self.max_pass - 1 - self._n_tail)
        if self._n_tail and self.decoder.adaptive:
            # -n auto's first step drafts nothing when the pass also finishes the prompt: each
            # draft there adds a row of logits to the pass the first token waits for (on this
            # CPU about the one-token pass it would save), and auto has measured nothing yet.
            k = 0
        t_draft = time.perf_counter()
        self._gap_s = None if self._t_previous is None else t_draft - self._t_previous
        return k, t_draft

    def _plan_end(self, proposal: Proposal, k: int, t_draft: float, tree: TokenTree | None = None) -> list[int]:
        self._draft_s = time.perf_counter() - t_draft
        assert len(proposal.tokens) <= k
        n_tail, self._n_tail = self._n_tail, 0
        assert len(self.cache.cached) + n_tail == len(self.context) - 1
        self._proposal, self._pass_tail, self._tree = proposal, n_tail, tree
        if tree is not None:
            assert not n_tail
            self.n_rows = tree.width
            return [self.context[-1], *tree.tokens]
        self.n_rows = len(proposal.tokens) + 1
        return [*self.context[len(self.context) - 1 - n_tail :], *proposal.tokens]

    @property
    def tree_parents(self) -> list[int] | None:
        """For a tree pass, each of plan()'s tokens' parent (-1: `last`, the root; LlamaModel.eval_tree);
        None for a chain."""
        if self._tree is None:
            return None
        return [-1, *(p + 1 for p in self._tree.parents)]

    def book_shared_drafting(self, draft_s: float, token_s: float) -> None:
        """After plan_steps() drafted in lockstep with other sequences (StepLoop._plan_in_lockstep): what
        this sequence's drafting cost, its share of the shared draft passes included (the wall
        time of the rounds counts every sequence's), and the cost of one round of it."""
        self._draft_s = draft_s
        if self._proposal is not None and self._proposal.token_s is not None:
            self._proposal.token_s = token_s

    @property
    def pass_tail(self) -> int:
        """Prompt tokens in the pending pass (the first step's: the prompt's end)."""
        return self._pass_tail

    def commit(
        self, rows: np.ndarray, pass_s: float, *, cpu_s: float | None = None, share: float = 1.0, prompt_tokens: int = 0,
    ) -> Step:  # fmt: skip
        """Book the pass over plan()'s tokens: `rows` are the target's logits for the last
        n_rows of them ([last, *draft]), pass_s the pass's wall seconds, cpu_s the CPU seconds
        the process used during it (None: not measured), share this sequence's part of a pass
        shared with others (SharedPassCost), which the policy is charged; prompt_tokens, the
        prompt tokens the pass held (any sequence's: its times then price a prompt, and the
        policy learns only the verdict). Returns the Step event."""
        t_commit = time.perf_counter()
        decoder, gen, context, proposal = self.decoder, self.gen, self.context, self._proposal
        assert proposal is not None, "commit() follows plan()"
        self._proposal = None
        draft = proposal.tokens
        tree, self._tree = self._tree, None
        source = proposal.source
        if tree is None:
            verdict = decoder.verify(rows, proposal, context, self.rng)
            # Keep the cache = context before the new `last` (the target's own token).
            self.cache.truncate(len(context) + verdict.n_accepted)
            n_drafted, n_own = len(draft), verdict.n_accepted
        else:
            won = decoder.verify_tree(rows, tree, context)
            verdict = won.verdict
            self.cache.keep_branch([0, *(1 + i for i in tree.paths[won.branch][: verdict.n_accepted])])
            # The drafter and the policy are told how its own draft fared (what a chain pass
            # would have accepted: the greedy tokens are the same); the stats count every node,
            # and credit another branch's source where the chain accepted less.
            n_drafted, n_own = len(tree.tokens), min(shared_prefix(draft, verdict.tokens), len(draft))
            if n_own < verdict.n_accepted:
                source = BRANCH_SOURCE
        if decoder.drafter is not None and draft:
            decoder.drafter.update(len(draft), n_own)
        t_done = time.perf_counter()
        verify_s = t_done - t_commit  # this sequence's verification, after the pass
        if decoder.adaptive:  # (told how many prompt tokens the pass held: the first step's times price the prompt)
            decoder.judge.observe(StepReport(
                source=proposal.source, n_drafted=len(draft), n_accepted=n_own,
                confidences=proposal.confidences, draft_s=self._draft_s, pass_tokens=len(rows),
                pass_s=pass_s * share + verify_s, token_s=proposal.token_s, first_s=proposal.first_s,
                context_len=len(context), gap_s=self._gap_s, cpu_s=None if cpu_s is None else cpu_s * share,
                prompt_tokens=max(prompt_tokens, self._pass_tail),
            ))  # fmt: skip
        # (not after the first step: what follows it includes one-off work, such as the
        # live status's first drawing, 1 ms on a terminal)
        self._t_previous = t_done if gen.token_ids else None

        step = gen.record(verdict.tokens, verdict.n_accepted, n_drafted, decoder.model_tgt.is_eog, source)
        if tree is not None:
            step.n_branches, step.width = len(tree.paths), tree.width
        context.extend(verdict.tokens)
        gen.stats.draft_s += self._draft_s
        if self._pass_tail:
            # The pass that finished the prompt is the prompt's time (as llama.cpp counts it),
            # although its first tokens came out of it; generation starts after it.
            gen.stats.prompt_s += pass_s + verify_s
            gen.stats.prompt_pass_decided = gen.stats.decided
            self._t_gen = time.perf_counter()
        else:
            gen.stats.verify_s += pass_s + verify_s  # (a shared pass: its whole wall time)
        gen.stats.generation_s = time.perf_counter() - self._t_gen
        return step


class ModelPasses:
    """The target's own context behind MultiSequenceContext's pass API: one sequence (`run`,
    `chat`, `batch --parallel 1`, `serve --parallel 1`)."""

    n_seq = 1

    def __init__(self, model: LlamaModel):
        self.model = model
        self.n_batch = model.n_batch

    def eval(
        self, requests: dict[int, list[int]], *, rows: dict[int, int], trees: dict[int, list[int]] | None = None,
    ) -> dict[int, np.ndarray]:  # fmt: skip
        """Each request's logits for its last rows[s] tokens; a request in `trees` is a token
        tree (its tokens' parents, SequenceStep.tree_parents), a row for each token."""
        trees = trees or {}
        return {s: self.model.eval_tree(tokens, trees[s]) if s in trees else self.model.eval(tokens, logits=rows[s])
                for s, tokens in requests.items()}  # fmt: skip

    def clear(self, s: int) -> None:
        """After a failure: drop what the cache may hold beyond what is tracked (a failed or
        interrupted decode), keeping the rest for the next prompt; if even that fails, empty it."""
        try:
            self.model.forget_untracked()
        except SpecliError:
            self.model.reset()

    def close(self) -> None:
        pass  # (the context is the model's own)


class DecoderPool:
    """One SpeculativeDecoder per sampling setting, all sharing the target and drafter. The
    seed is no part of the setting: each generation brings its own (`seed_of`), so items or
    requests with seeds of their own share a decoder and its -n auto policy; beyond LIMIT
    settings the least recently used goes. `first`: a decoder to start with (the loaded one).
    `n_draft`: the decoders' draft length (as SpeculativeDecoder's)."""

    LIMIT = 8

    def __init__(self, model_tgt: LlamaModel, drafter: Drafter | None, n_draft: DraftLength | int | str, *, first: SpeculativeDecoder | None = None):
        self.model_tgt, self.drafter = model_tgt, drafter
        self.draft_length = draft_length_for(drafter is not None, n_draft)
        self._decoders: collections.OrderedDict[SamplingParams, SpeculativeDecoder] = collections.OrderedDict()
        if first is not None:
            self._decoders[dataclasses.replace(first.sampling, seed=None)] = first

    def get(self, sampling: SamplingParams) -> SpeculativeDecoder:
        key = dataclasses.replace(sampling, seed=None)
        decoder = self._decoders.pop(key, None) or SpeculativeDecoder(self.model_tgt, self.drafter, self.draft_length, key)
        self._decoders[key] = decoder
        while len(self._decoders) > self.LIMIT:
            self._decoders.popitem(last=False)
        return decoder


class SharedPassCost:
    """How a pass shared by several sequences is split among them, for their -n auto policies.

    A pass over T tokens costs about a + b*T: a (reading the weights) whatever T, b per token.
    Split in proportion to tokens, every sequence would see a linear cost, b + a/T a token,
    and conclude that drafting never pays, although the passes get fewer and the throughput
    higher when they draft: each one's drafts are paid by b each, while a is paid once a pass
    however many tokens are in it. So each sequence is charged an equal part of the pass as
    it would be with every sequence decoding plain, (a + b*N)/N for N sequences, plus b for
    each token it adds beyond its own one: what its drafts add to the pass. The charges add up
    to the pass. a and b are fitted to the passes seen (least squares, recent passes weighing
    more); until the passes' sizes vary enough, the split is by tokens.
    """

    DECAY = 0.98  # per pass: a pass's weight halves after about 35 more
    MIN_SPREAD = 0.5  # tokens: the standard deviation of pass sizes a fit needs

    def __init__(self):
        self._w = self._t = self._s = self._tt = self._ts = 0.0

    def add(self, n_tokens: int, pass_s: float) -> None:
        d = self.DECAY
        self._w, self._t, self._s = self._w * d + 1, self._t * d + n_tokens, self._s * d + pass_s
        self._tt, self._ts = self._tt * d + n_tokens * n_tokens, self._ts * d + n_tokens * pass_s

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of the recent passes, or None while their sizes hardly vary (a spread of
        under half a token: one odd pass must not set the slope). A pass that costs the same
        whatever its size (a GPU below its compute limit) gives b = 0: drafts then cost nothing
        extra, and each sequence pays 1/N."""
        w, t, s, tt, ts = self._w, self._t, self._s, self._tt, self._ts
        var = tt * w - t * t
        if w < 2 or var < self.MIN_SPREAD**2 * w * w:
            return None
        b = (ts * w - t * s) / var
        a = (s - b * t) / w
        if b < 0:
            a, b = s / w, 0.0
        elif a < 0:
            a, b = 0.0, ts / tt
        return (a, b) if a + b > 0 else None

    def shares(self, n_tokens: dict[int, int]) -> dict[int, float]:
        """Each sequence's part of a pass over n_tokens[s] tokens of each (adding up to 1)."""
        total = sum(n_tokens.values())
        fit = self.fit()
        if fit is None:
            return {s: n / total for s, n in n_tokens.items()}
        a, b = fit
        base = (a + b * len(n_tokens)) / len(n_tokens)
        return {s: (base + b * (n - 1)) / (a + b * total) for s, n in n_tokens.items()}



class StepLoop:
    """The sequences being generated on one target, and one step for all of them: each plans
    its draft (with a draft model, every sequence's next draft token in one pass of the draft
    model's context), one target pass evaluates every sequence's [last, d1..dk], each commits
    its own verdict. `run` and `chat` use it with one sequence (SpeculativeDecoder.generate),
    `batch` and `serve` with P; they decide what goes into which slot and when.

    Slot s has a target cache (`caches[s]`), its own drafter, and one decoder per sampling
    setting (`pools[s]`); `start` puts a generation into it, `prefill` its prompt into the
    caches, `step` advances the given slots by one target pass, `release` takes the generation
    out, and `clear` empties the slot's caches after a failure.
    """

    def __init__(
        self, passes, caches: list, pools: list[DecoderPool], *, max_pass: int,
        draft_passes=None, pass_costs: SharedPassCost | None = None,
    ):  # fmt: skip
        """passes: runs one target pass over several sequences (MultiSequenceContext, or
        ModelPasses); draft_passes: the draft model's, for lockstep drafting (None: each
        drafter drafts on its own); pass_costs: how a shared pass is split among the sequences
        (None: by tokens)."""
        self.passes, self.caches, self.pools = passes, caches, pools
        self.max_pass = max_pass
        self.draft_passes = draft_passes
        self.pass_costs = pass_costs
        self.sequences: dict[int, SequenceStep] = {}
        self.last_pass_sequences = 0  # sequences in the latest target pass

    @classmethod
    def on_model(cls, model_tgt: LlamaModel, pool: DecoderPool) -> "StepLoop":
        """One slot on the target's own context."""
        return cls(ModelPasses(model_tgt), [model_tgt], [pool], max_pass=model_tgt.n_batch)

    @classmethod
    def on_sequences(
        cls, model_tgt: LlamaModel, mode: DraftMode | str, n_draft: DraftLength | int | str, n_seq: int,
        *, n_threads: int | None = None, kv_type: str = "f16", flash_attn: str = "auto",
        model_dft: LlamaModel | None = None, release_models: bool = False, memory=None,
    ) -> "StepLoop":  # fmt: skip
        """`n_seq` slots on a MultiSequenceContext of the target's weights, each with its own
        drafter for `mode`; the modes with a draft model (`model_dft`) draft through their own
        sequence of a second one on the draft model's weights, every slot's next draft token in
        one pass of it. release_models: free the models' own contexts (their KV caches) first,
        which the loop never evaluates through; the commands do, tests comparing with them do not.
        `n_draft`: every slot's draft length (as SpeculativeDecoder's); `memory`: a TokenMemory
        every slot's lookup drafter also copies from (drafter_with_memory), one for all of them."""
        mode = DraftMode(mode)
        length = draft_length_for(mode != DraftMode.TARGET_ONLY, n_draft)
        if mode.needs_draft_model and model_dft is None:
            raise ValueError(f"drafting mode {mode!r} needs a draft model")
        if release_models:
            model_tgt.release_context()
            if mode.needs_draft_model:
                model_dft.release_context()
        n_ctx = model_tgt.n_ctx  # per sequence, as for `run`
        draft_passes = None
        if mode.needs_draft_model:
            draft_passes = MultiSequenceContext(
                model_dft, n_seq=n_seq, n_ctx_per_seq=n_ctx, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
            )  # fmt: skip
            drafters = [make_drafter(mode, SequenceView(draft_passes, s, model_dft)) for s in range(n_seq)]
        else:
            drafters = [drafter_with_memory(mode, memory=memory) for _ in range(n_seq)]
        n_batch = max(512, n_seq * (length.longest + 1))
        passes = MultiSequenceContext(
            model_tgt, n_seq=n_seq, n_ctx_per_seq=n_ctx, n_batch=n_batch, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
        )  # fmt: skip
        return cls(
            passes, [SequenceView(passes, s, model_tgt) for s in range(n_seq)],
            [DecoderPool(model_tgt, drafter, length) for drafter in drafters],
            max_pass=passes.n_batch // n_seq,  # every sequence's part fits the shared batch
            draft_passes=draft_passes, pass_costs=SharedPassCost(),
        )  # fmt: skip

    @property
    def n_slots(self) -> int:
        return len(self.caches)

    def start(
        self, s: int, prompt_ids: Sequence[int], *, sampling: SamplingParams, max_tokens: int,
        stop: Sequence[str] = (), seed: int | None = None, fresh: bool = False,
    ) -> "SequenceStep":  # fmt: skip
        """Put a generation after `prompt_ids` into slot s, with slot s's decoder for `sampling`
        (`seed`: as SpeculativeDecoder.sequence's); fresh: start from an empty cache. Nothing
        is evaluated before prefill()."""
        seq = self.pools[s].get(sampling).sequence(
            prompt_ids, max_tokens=max_tokens, cache=self.caches[s], max_pass=self.max_pass, stop=stop, seed=seed,
        )  # fmt: skip
        if fresh:
            self.caches[s].truncate(0)  # (the draft model's cache keeps what the next prompt may reuse)
        self.sequences[s] = seq
        return seq

    def prefill(self, s: int, budget: int | None = None) -> bool:
        """Slot s's prompt into its caches (SequenceStep.begin); True once it is all in."""
        return self.sequences[s].begin(budget)

    def release(self, s: int) -> Generation | None:
        """Take slot s's generation out (its cache stays as it is); None if it had none."""
        seq = self.sequences.pop(s, None)
        return None if seq is None else seq.gen

    def remember(self, s: int, gen: Generation) -> None:
        """A generation of slot s has ended: its prompt and output (Generation.document: not an
        interrupted one) go to slot s's drafter, if it keeps what it is shown (a MemoryDrafter
        adds them to its memory, which every slot's drafter may share); for other drafters
        nothing happens. The front ends call it for a generation that completed, never for a
        failed or cancelled one."""
        remember = getattr(self.pools[s].drafter, "remember", None)
        document = gen.document()
        if remember is not None and document is not None:
            remember(document)

    def clear(self, s: int) -> None:
        """After a failure (what a failed pass left in slot s's caches is unknown): several
        sequences' caches empty the slot's sequences, the target's and the draft model's; the
        model's own context drops what it holds beyond what is tracked. If even that fails, a
        later prompt finds the cache in an unknown state and is refused by llama.cpp; that
        generation's error then says so."""
        self.sequences.pop(s, None)
        for passes in (self.passes, self.draft_passes):
            if passes is not None:
                try:
                    passes.clear(s)
                except SpecliError:
                    pass  # (reported by the next pass on this slot, see above)

    def close(self) -> None:
        self.passes.close()
        if self.draft_passes is not None:
            self.draft_passes.close()

    def step(self, slots: Sequence[int]) -> dict[int, Step | Exception]:
        """One step of each of `slots` (started, prefilled, not ended) around one target pass:
        per slot, its Step, or the exception that failed it (its drafting, its verification,
        or the shared pass, which fails every slot in it)."""
        seqs = {s: self.sequences[s] for s in slots}
        requests, failed = self._plan(seqs)
        results: dict[int, Step | Exception] = dict(failed)
        if not requests:
            return results
        trees = {s: parents for s in requests if (parents := seqs[s].tree_parents) is not None}
        t_pass, cpu_pass = time.perf_counter(), time.process_time()
        try:
            if trees:  # (planned only on a cache with room for branches: ModelPasses' model)
                rows = self.passes.eval(requests, rows={s: seqs[s].n_rows for s in requests}, trees=trees)
            else:
                rows = self.passes.eval(requests, rows={s: seqs[s].n_rows for s in requests})
        except Exception as err:
            return {**results, **{s: err for s in requests}}
        cpu_s, pass_s = time.process_time() - cpu_pass, time.perf_counter() - t_pass
        self.last_pass_sequences = len(requests)
        # A prompt's end in the pass (a new sequence's first step) makes its time no drafting cost.
        prompt_tokens = sum(seqs[s].pass_tail for s in requests)
        n_tokens = {s: len(tokens) - seqs[s].pass_tail for s, tokens in requests.items()}
        shares = (self.pass_costs or SharedPassCost()).shares(n_tokens)  # (a new one splits by tokens)
        if self.pass_costs is not None and not prompt_tokens:
            self.pass_costs.add(sum(n_tokens.values()), pass_s)
        for s in requests:
            try:
                results[s] = seqs[s].commit(rows[s], pass_s, cpu_s=cpu_s, share=shares[s], prompt_tokens=prompt_tokens)
            except Exception as err:
                results[s] = err
        return results

    def _plan(self, seqs: dict[int, "SequenceStep"]) -> tuple[dict[int, list[int]], dict[int, Exception]]:
        """Every sequence's plan (its draft, and the tokens of its part of the target's pass):
        (tokens by slot, errors by slot)."""
        if self.draft_passes is None:
            requests, failed = {}, {}
            for s, seq in seqs.items():
                try:
                    requests[s] = seq.plan()
                except Exception as err:
                    failed[s] = err
            return requests, failed
        return self._plan_in_lockstep(seqs)

    def _plan_in_lockstep(self, seqs: dict[int, "SequenceStep"]) -> tuple[dict[int, list[int]], dict[int, Exception]]:
        """With a draft model: each round evaluates the next draft token of every sequence
        still drafting in one pass of the draft model's context, rather than one pass per
        sequence."""
        requests: dict[int, list[int]] = {}
        failed: dict[int, Exception] = {}
        steps: dict[int, Generator] = {}
        pending: dict[int, int] = {}  # slot -> the draft token its draft model must evaluate
        # Each sequence's drafting time as its policy must see it: its own work, and its share
        # of each shared draft pass, not the wall time of every sequence's rounds.
        first_s: dict[int, float] = {}
        rounds_s: dict[int, float] = {}
        n_rounds: dict[int, int] = {}
        for s, seq in seqs.items():
            steps[s] = seq.plan_steps()
            t0 = time.perf_counter()
            try:
                pending[s] = next(steps[s])
                first_s[s], rounds_s[s], n_rounds[s] = time.perf_counter() - t0, 0.0, 0
            except StopIteration as done:
                requests[s] = done.value
            except Exception as err:
                failed[s] = err
        while pending:
            t0 = time.perf_counter()
            try:
                rows = self.draft_passes.eval({s: [token] for s, token in pending.items()}, logits="all")
            except Exception as err:
                for s in pending:
                    failed[s] = err
                break
            share = (time.perf_counter() - t0) / len(pending)
            following = {}
            for s in pending:
                t0 = time.perf_counter()
                try:
                    following[s] = steps[s].send(rows[s])
                except StopIteration as done:
                    requests[s] = done.value
                except Exception as err:
                    failed[s] = err
                rounds_s[s] += share + time.perf_counter() - t0
                n_rounds[s] += 1
                if s in requests:
                    seqs[s].book_shared_drafting(first_s[s] + rounds_s[s], rounds_s[s] / n_rounds[s])
            pending = following
        return requests, failed


def _one_sequence(loop: StepLoop) -> Iterator[Step]:
    """The steps of a loop's one generation (slot 0), its prompt first; a failure is raised."""
    loop.prefill(0)
    seq = loop.sequences[0]
    while not seq.ended():
        result = loop.step([0])[0]
        if isinstance(result, Exception):
            raise result
        yield result


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
