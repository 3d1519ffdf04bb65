"""One sequence's step around each target pass (SequenceStep), and the decoder it steps with
(SpeculativeDecoder: the target, the drafter, the draft length and its judge, one sampling
setting).

Bookkeeping (target): between steps the target's cache holds the whole context except its newest
token `last`, which is the first token of the next pass. With j drafts accepted the pass emits
d1..dj and t*, the cache is trimmed to the context before t*, and t* becomes `last`. The first
pass also holds the prompt's end (SequenceStep.begin): the first tokens come from the pass that
finishes the prompt. The loop that runs the passes for several sequences is loop.py's;
docs/life-of-a-step.md follows one step through every file.
"""

from __future__ import annotations

import time
from typing import Generator

import numpy as np

from specli.decoding.branches import TokenTree
from specli.decoding.drafters import Drafter, Proposal
from specli.decoding.generation import Generation, Request, Step, sampled_logprobs, token_logprobs
from specli.decoding.memory_drafter import BRANCH_SOURCE, shared_prefix
from specli.decoding.policy import FIXED, AdaptivePolicy, DraftJudge, StepReport
from specli.decoding.sampling import GREEDY, SamplingParams, make_rng, penalty_history
from specli.decoding.stopping import STOP_CONTEXT_FULL, STOP_EOS, STOP_MAX_TOKENS
from specli.decoding.text import TextStream
from specli.decoding.verifier import masked, verify
from specli.errors import SettingError, UsageError
from specli.llama.context import SequenceView
from specli.llama.model import LlamaModel, common_prefix_len, fill_cache
from specli.modes import MAX_DRAFT, DraftLength

GRAMMAR = "grammar"  # Proposal.source of the tokens a constraint forces (stats.by_source keeps them apart)


def draft_length_for(drafting: bool, value: DraftLength | int | str) -> DraftLength:
    """The draft length of a decoder with a drafter (`drafting`) or without: off without one
    (whatever `value` says), else `value` as a DraftLength: library callers (tests, benchmarks)
    give "auto" or a number, refused with SettingError("draft_length") when it is neither (the CLI
    parses --draft-max first)."""
    if not drafting:
        return DraftLength.off()
    try:
        return DraftLength.of(value)
    except ValueError:
        raise SettingError("draft_length", lambda name: f"{name} must be 'auto' or between 1 and {MAX_DRAFT} draft tokens per step, got {value}") from None


class SpeculativeDecoder:
    """Speculative decoding with one target model and an optional drafter.

    With no drafter (target-only) each pass evaluates just `last`: plain decoding through the
    very same loop, the baseline every comparison uses. Greedy sampling (temperature 0) accepts
    drafts that equal the target's argmax; otherwise drafts go through rejection sampling, which
    keeps the output distributed exactly as the target's own sampling.

    `draft_length` is the draft length (modes.DraftLength; library callers may give "auto" or a
    number): a fixed number of drafts per step, or auto: the policy (decoding/policy) chooses
    each step's length, up to its maximum, from measured costs and acceptance. Either way only
    the speed changes, never the output. Without a drafter the length is off, whatever is given.
    """

    def __init__(
        self, model_tgt: LlamaModel, drafter: Drafter | None, draft_length: DraftLength | int | str, sampling: SamplingParams = GREEDY
    ):
        self.model_tgt = model_tgt
        self.drafter = drafter
        self.policy: AdaptivePolicy | None = None  # created by the first "auto"; kept after
        self.set_draft_length(draft_length)
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
    def adaptive(self) -> bool:
        return isinstance(self.judge, AdaptivePolicy)

    def sequence(self, request: Request, *, cache: LlamaModel | SequenceView, max_pass: int) -> SequenceStep:
        """A generation of `request` for a loop that runs the target's passes itself (StepLoop).

        `cache` is the target's cache for this sequence: `model_tgt`, or one sequence of a
        MultiSequenceContext (its SequenceView); `max_pass` the most tokens one pass may evaluate
        for it. Checks the prompt and draws the seed now; nothing is evaluated before begin().
        The request's seed, when given, replaces the sampling's own (DecoderPool keeps one
        decoder per setting and gives each generation its seed).
        """
        prompt = list(request.prompt_ids)
        # (library callers, tests and benchmarks, reach this without a front end's checks)
        if not prompt:
            raise UsageError("the prompt is empty; give some text to continue")
        n_ctx = cache.n_ctx
        if len(prompt) >= n_ctx:
            raise SettingError(
                "n_ctx", lambda name: f"the prompt is {len(prompt)} tokens but the context holds {n_ctx}; raise {name} above {len(prompt)} or shorten the prompt"
            )
        seed = request.seed
        if self.sampling.greedy:
            seed = None
        else:
            # A fresh seed is drawn when none is given, and reported, so any run can be replayed.
            seed = seed if seed is not None else self.sampling.seed
            seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**32)
        gen = Generation(prompt_ids=prompt, seed=seed, stop=tuple(request.stop), limits=request.limits, _stream=TextStream(self.model_tgt.piece),
                         logprobs=[] if request.logprobs is not None else None)
        return SequenceStep(self, request, gen, cache, max_pass)


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
        self, decoder: SpeculativeDecoder, request: Request, gen: Generation, cache: LlamaModel | SequenceView, max_pass: int
    ):
        self.decoder = decoder
        self.request = request
        # The constraint's place in its grammar for this sequence (docs/constraints.md), or None.
        self.matcher = request.constraint.start() if request.constraint is not None else None
        self._masks = None  # the pending pass's allowed tokens per row (with a constraint)
        self.gen = gen
        self.cache = cache
        self.max_tokens = request.max_tokens
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
        self._committed = False  # whether a pass was booked (the first one finishes the prompt)
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
        if budget is not None and drafter is not None and not drafter.prefill(context, budget):
            return False
        self.rng = make_rng(gen.seed)
        if drafter is not None:
            drafter.begin(context, self.decoder.sampling, self.rng, self.request)
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
        n_max, t_draft = self._plan_start()
        drafter = self.decoder.drafter
        proposal = self._forced(n_max)
        if proposal is None:
            proposal = drafter.propose(self.context, n_max, self.decoder.judge) if (drafter is not None and n_max > 0) else Proposal([])
        return self._plan_end(proposal, n_max, t_draft, None if self.matcher is not None else self._branches(proposal, n_max))

    def _branches(self, proposal: Proposal, n_max: int) -> TokenTree | None:
        """The tree of this step's pass (branches.py), or None for the chain alone: only greedy,
        on a cache with room for branches (LlamaModel(branches=N)), and not with the prompt's
        end in the pass. The cost table is -n auto's, else --branches alone decides."""
        room = self.cache.max_branches
        decoder = self.decoder
        if room < 2 or n_max <= 0 or self._n_tail or decoder.drafter is None or not decoder.sampling.greedy:
            return None
        costs = None
        if decoder.adaptive:
            table = decoder.judge.pass_cost.table(1 + n_max * room, len(self.context))
            costs = table.__getitem__
        branches = decoder.drafter.propose_branches(self.context, proposal.tokens, n_max, room, costs, proposal.source)
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
        n_max, t_draft = self._plan_start()
        drafter = self.decoder.drafter
        proposal = self._forced(n_max)
        if proposal is None and drafter is not None and n_max > 0:
            proposal = yield from drafter.propose_steps(self.context, n_max, self.decoder.judge)
        return self._plan_end(proposal or Proposal([]), n_max, t_draft)

    def _forced(self, n_max: int) -> Proposal | None:
        """With a constraint: the tokens its grammar forces next, as this step's draft (never
        refused by the grammar; the target still verifies them, so their tokenization stays its
        own choice); None when it forces nothing."""
        if self.matcher is None or n_max <= 0:
            return None
        forced = self.matcher.forced(n_max)
        return Proposal(forced, source=GRAMMAR) if forced else None

    def _allowed(self, proposal: Proposal) -> Proposal:
        """With a constraint: a draft cut at its first token the grammar forbids, so the pass never
        sees one, and the masks of its rows. A draft sampled from a distribution q (a draft model at
        T > 0) is kept whole: cutting it on what it drew would bias the output, and the masked p
        refuses a forbidden token exactly (its masks after that token are never read)."""
        if self.matcher is None:
            return proposal
        tokens = proposal.tokens
        n_valid = self.matcher.valid_prefix(tokens)
        if n_valid < len(tokens) and proposal.q_rows is None:
            proposal.tokens = tokens = tokens[:n_valid]
            if proposal.confidences is not None:
                proposal.confidences = proposal.confidences[:n_valid]
        masks = self.matcher.masks(tokens[:n_valid])
        if len(masks) < len(tokens) + 1:  # (rows past the first forbidden token: all allowed, never read)
            masks = np.concatenate([masks, np.full((len(tokens) + 1 - len(masks), masks.shape[1]), -1, dtype=masks.dtype)])
        self._masks = masks
        return proposal

    def _plan_start(self) -> tuple[int, float]:
        remaining = self.max_tokens - len(self.gen.token_ids)
        room = self.cache.n_ctx - len(self.context)  # positions left after the context
        # A pass emits up to n_max + 1 tokens; keep them within the budget and the context, and the
        # pass [tail, last, d1..dn] within max_pass (one llama.cpp batch: a small -c makes it small).
        n_max = min(self.decoder.draft_length.maximum, remaining - 1, room - 1, self.max_pass - 1 - self._n_tail)
        if self._n_tail and self.decoder.adaptive:
            # -n auto's first step drafts nothing when the pass also finishes the prompt: each
            # draft there adds a row of logits to the pass the first token waits for (on this
            # CPU about the one-token pass it would save), and auto has measured nothing yet.
            n_max = 0
        t_draft = time.perf_counter()
        self._gap_s = None if self._t_previous is None else t_draft - self._t_previous
        return n_max, t_draft

    def _plan_end(self, proposal: Proposal, n_max: int, t_draft: float, tree: TokenTree | None = None) -> list[int]:
        if self.matcher is not None:
            t_constraint = time.perf_counter()
            proposal = self._allowed(proposal)
            self.gen.stats.constraint_s += time.perf_counter() - t_constraint
        self._draft_s = time.perf_counter() - t_draft
        assert len(proposal.tokens) <= n_max
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
    ) -> Step:
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
        masks, self._masks = self._masks, None
        verdict = verify(rows, draft, context, decoder.sampling, self.rng, q_rows=proposal.q_rows, tree=tree, masks=masks)
        if self.matcher is not None:
            t_constraint = time.perf_counter()
            self.matcher.accept(verdict.tokens, decoder.model_tgt.is_eog)
            gen.stats.constraint_s += time.perf_counter() - t_constraint
        forced = source == GRAMMAR  # (the grammar's tokens: neither the drafter's nor the policy's to learn from)
        if tree is None:
            # Keep the cache = context before the new `last` (the target's own token).
            self.cache.truncate(len(context) + verdict.n_accepted)
            n_drafted, n_own = len(draft), verdict.n_accepted
        else:
            self.cache.keep_branch([0, *(1 + i for i in tree.paths[verdict.branch][: verdict.n_accepted])])
            # The drafter and the policy are told how its own draft fared (what a chain pass
            # would have accepted: the greedy tokens are the same); the stats count every node,
            # and credit another branch's source where the chain accepted less.
            n_drafted, n_own = len(tree.tokens), min(shared_prefix(draft, verdict.tokens), len(draft))
            if n_own < verdict.n_accepted:
                source = BRANCH_SOURCE
        if decoder.drafter is not None and draft and not forced:
            decoder.drafter.update(len(draft), n_own)
        t_done = time.perf_counter()
        verify_s = t_done - t_commit  # this sequence's verification, after the pass
        if decoder.adaptive and not forced:  # (told how many prompt tokens the pass held: the first step's times price the prompt)
            decoder.judge.observe(StepReport(
                source=proposal.source, n_drafted=len(draft), n_accepted=n_own,
                confidences=proposal.confidences, draft_s=self._draft_s, pass_tokens=len(rows),
                pass_s=pass_s * share + verify_s, token_s=proposal.token_s, first_s=proposal.first_s,
                context_len=len(context), gap_s=self._gap_s, cpu_s=None if cpu_s is None else cpu_s * share,
                prompt_tokens=max(prompt_tokens, self._pass_tail),
            ))
        # (not after the first step: what follows it includes one-off work, such as the
        # live status's first drawing, 1 ms on a terminal)
        self._t_previous = t_done if gen.token_ids else None

        logprobs = None
        if self.request.logprobs is not None:
            # Each emitted token's row of this pass: the row it was verified (or chosen) on, so
            # an accepted draft's logprob is the target's own, as plain decoding reports it.
            at = range(len(verdict.tokens)) if tree is None else [0, *(1 + i for i in tree.paths[verdict.branch][: verdict.n_accepted])]
            n_top = self.request.logprobs
            if self.request.post_sampling:  # (the chain's distribution at each place, as verification saw it: masked, penalised)
                logprobs = [sampled_logprobs(rows[i] if masks is None else masked(rows[i], masks[j]), t, n_top, decoder.sampling,
                                             penalty_history(decoder.sampling, context, verdict.tokens[:j]))
                            for j, (i, t) in enumerate(zip(at, verdict.tokens))]
            else:
                logprobs = [token_logprobs(rows[i], t, n_top) for i, t in zip(at, verdict.tokens)]
        step = gen.record(verdict.tokens, verdict.n_accepted, n_drafted, decoder.model_tgt.is_eog, source, logprobs=logprobs)
        if self.matcher is not None and self.matcher.done and gen.stop_reason is None:
            gen.finish(STOP_EOS)  # (only an end-of-generation token can follow: the pass it would take is saved)
        if tree is not None:
            step.n_branches, step.width = len(tree.paths), tree.width
        context.extend(verdict.tokens)
        gen.stats.draft_s += self._draft_s
        first, self._committed = not self._committed, True
        if self._pass_tail or first:
            # The pass that finished the prompt (the first: it holds at least the prompt's last
            # token, even when the cache held the rest) is the prompt's time, as llama.cpp counts
            # it, although its first tokens came out of it; generation starts after it.
            gen.stats.prompt_s += pass_s + verify_s
            gen.stats.prompt_pass_decided = gen.stats.decided
            self._t_gen = time.perf_counter()
        else:
            gen.stats.verify_s += pass_s + verify_s  # (a shared pass: its whole wall time)
        gen.stats.generation_s = time.perf_counter() - self._t_gen
        return step
