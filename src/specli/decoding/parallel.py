"""Generating for many items with the models loaded once: one at a time (`--parallel 1`, the
very `SpeculativeDecoder` that `run` uses), or several sequences in lockstep sharing each
target pass (`--parallel P`).

Both runners yield events: a `Step` per target pass and sequence (for the progress bar), and an
`ItemDone` when an item is finished (a Generation) or failed (an error sentence). A Ctrl-C
propagates out of them; the item in progress is then simply not reported.

The lockstep loop: every active sequence drafts for its own context (its own drafter), one
llama_decode evaluates every sequence's [last, d1..dk] (`MultiSequenceContext`), and each
sequence is verified by its own `SpeculativeDecoder._verify` (greedy match or rejection
sampling, the item's settings, its own random generator), trims its own cache, and stops on
its own; a free slot takes the next item. The bookkeeping per sequence is the one engine.py
documents, so each item gets the tokens `run` would give it (up to batch numerics, see README).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from specli.session.batch import Item, prompt_too_long
from specli.decoding.drafters import DraftModelDrafter, Drafter, HybridDrafter, PromptLookupDrafter, Proposal
from specli.decoding.engine import AUTO, AUTO_MAX_DRAFT, STOP_CONTEXT_FULL, STOP_MAX_TOKENS, Generation, SpeculativeDecoder, Step
from specli.errors import SpecliError
from specli.llama.model import LlamaModel, MultiSequenceContext, SequenceView
from specli.decoding.sampling import make_rng


@dataclass
class ItemDone:
    item: Item
    generation: Generation | None = None
    error: str | None = None


class DecoderPool:
    """One SpeculativeDecoder per distinct sampling setting, all sharing the target and drafter."""

    def __init__(self, model_tgt: LlamaModel, drafter: Drafter | None, n_draft: int | str):
        self.model_tgt, self.drafter, self.n_draft = model_tgt, drafter, n_draft
        self._decoders: dict = {}

    def get(self, item: Item) -> SpeculativeDecoder:
        if item.sampling not in self._decoders:
            self._decoders[item.sampling] = SpeculativeDecoder(self.model_tgt, self.drafter, self.n_draft, item.sampling)
        return self._decoders[item.sampling]


def tokenize_item(model_tgt: LlamaModel, item: Item) -> tuple[list[int], str | None]:
    """The item's prompt tokens, and an error when they leave no room to generate."""
    ids = model_tgt.tokenize(item.prompt, add_bos=model_tgt.vocab_info().add_bos)
    return ids, prompt_too_long(len(ids), model_tgt.n_ctx)


def item_error(err: Exception) -> str:
    """An item's error record text for a failure while generating it."""
    if isinstance(err, SpecliError):
        return str(err)
    # Not a failure anyone foresaw (a bug): name it, so that it can be reported.
    return f"internal error: {type(err).__name__}: {err} (a bug in specli; please report it with this item)"


def run_sequential(pool: DecoderPool, items: Iterable[Item]) -> Iterator[Step | ItemDone]:
    """One item after the other, exactly as `specli run` generates each. Whatever fails while an
    item is generated (a failed decode, or a bug) is that item's error; the batch goes on."""
    model_tgt = pool.model_tgt
    for item in items:
        try:
            prompt_ids, problem = tokenize_item(model_tgt, item)
            if problem:
                yield ItemDone(item, error=problem)
                continue
            gen = pool.get(item).generate(prompt_ids, max_tokens=item.max_tokens)
            for step in gen:
                yield step
        except Exception as err:  # this item fails, the batch goes on
            _forget_untracked(model_tgt)
            yield ItemDone(item, error=item_error(err))
            continue
        yield ItemDone(item, gen)


def _forget_untracked(model) -> None:
    """Drop cache entries a failed pass may have left; if even that fails, the next item's
    prompt evaluation starts over from an empty cache."""
    try:
        model.forget_untracked()
    except Exception:
        try:
            model.reset()
        except Exception:
            pass


@dataclass
class _Slot:
    """A sequence in the lockstep loop: the item it generates and that item's state."""

    item: Item
    gen: Generation
    decoder: SpeculativeDecoder  # the item's settings; its _verify is the verification
    context: list[int]  # prompt + output; context[-1] is `last`, not yet in the cache
    rng: np.random.Generator
    t_gen: float  # when its generation began
    proposal: Proposal | None = None
    draft_s: float = 0.0  # time its latest proposal took


class ParallelRunner:
    """`n_seq` sequences in lockstep on one target (see the module docstring).

    make_drafter() gives each slot its own drafter (prompt lookup) or None (target-only). With
    `model_dft`, each slot drafts with the draft model instead (with prompt lookup first when
    `hybrid`), through its own sequence of a second multi-sequence context on the draft
    model's weights: one draft cache per sequence. (Each slot's draft passes run on their own;
    only the target's passes are shared.)
    With `-n auto` each slot's policy sizes its drafts; a shared pass is charged to each
    sequence in proportion to the tokens it put into it (an approximation: one sequence's
    extra drafts widen a pass that the others share).
    """

    def __init__(
        self, model_tgt: LlamaModel, make_drafter: Callable[[], Drafter | None] | None, n_draft: int | str, n_seq: int,
        *, n_threads: int | None = None, kv_type: str = "f16", flash_attn: str = "auto",
        model_dft: LlamaModel | None = None, hybrid: bool = False,
    ):  # fmt: skip
        self.model_tgt = model_tgt
        self.n_ctx = model_tgt.n_ctx  # per sequence, as for `run`
        self.draft_seqs = None
        if model_dft is not None:
            self.draft_seqs = MultiSequenceContext(
                model_dft, n_seq=n_seq, n_ctx_per_seq=self.n_ctx, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
            )  # fmt: skip
            views = [SequenceView(self.draft_seqs, s, model_dft) for s in range(n_seq)]
            self.drafters: list[Drafter | None] = [
                HybridDrafter(PromptLookupDrafter(), DraftModelDrafter(view)) if hybrid else DraftModelDrafter(view)
                for view in views
            ]
        else:
            assert make_drafter is not None
            self.drafters = [make_drafter() for _ in range(n_seq)]
        self.pools = [DecoderPool(model_tgt, drafter, n_draft) for drafter in self.drafters]
        longest = AUTO_MAX_DRAFT if n_draft == AUTO else n_draft
        n_batch = max(512, n_seq * ((longest if self.drafters[0] is not None else 0) + 1))
        self.seqs = MultiSequenceContext(
            model_tgt, n_seq=n_seq, n_ctx_per_seq=self.n_ctx, n_batch=n_batch,
            n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
        )  # fmt: skip

    def close(self) -> None:
        self.seqs.close()
        if self.draft_seqs is not None:
            self.draft_seqs.close()

    def run(self, items: Iterable[Item]) -> Iterator[Step | ItemDone]:
        queue = iter(items)
        slots: list[_Slot | None] = [None] * self.seqs.n_seq
        exhausted = False
        while True:
            for s in range(len(slots)):
                while slots[s] is None and not exhausted:
                    item = next(queue, None)
                    if item is None:
                        exhausted = True
                        break
                    try:
                        prompt_ids, problem = tokenize_item(self.model_tgt, item)
                        if problem:
                            yield ItemDone(item, error=problem)
                            continue
                        slots[s] = self._start(s, item, prompt_ids)
                    except Exception as err:  # this item fails, the batch goes on
                        self._clear(s)
                        yield ItemDone(item, error=item_error(err))
            active = [s for s, slot in enumerate(slots) if slot is not None]
            if not active:
                return
            finished = False
            for s in active:
                reason = self._stop_before_pass(slots[s])
                if reason:
                    slots[s].gen._finish(reason)
                    yield ItemDone(slots[s].item, slots[s].gen)
                    slots[s] = None
                    finished = True
            if finished:
                continue  # refill the freed slots first
            yield from self._pass(slots, active)
            for s in active:
                if slots[s].gen.stop_reason is not None:
                    yield ItemDone(slots[s].item, slots[s].gen)
                    slots[s] = None

    def _start(self, s: int, item: Item, prompt_ids: list[int]) -> _Slot:
        """Put the prompt (all but `last`) into sequence s and set up its generation."""
        decoder = self.pools[s].get(item)
        gen = decoder.generate(prompt_ids, max_tokens=item.max_tokens)  # validates, draws the seed
        gen._steps = None  # this loop, not the decoder's, drives it
        t0 = time.perf_counter()
        self.seqs.clear(s)
        self.seqs.eval({s: prompt_ids[:-1]}, logits="none")
        rng = make_rng(gen.seed)
        if self.drafters[s] is not None:
            self.drafters[s].begin(prompt_ids, decoder.sampling, rng)
        gen.stats.prompt_tokens = len(prompt_ids)
        gen.stats.prompt_s = time.perf_counter() - t0
        return _Slot(item, gen, decoder, list(prompt_ids), rng, time.perf_counter())

    def _stop_before_pass(self, slot: _Slot) -> str | None:
        if len(slot.gen.token_ids) >= slot.item.max_tokens:
            return STOP_MAX_TOKENS
        if len(slot.context) >= self.n_ctx:
            return STOP_CONTEXT_FULL
        return None

    def _clear(self, s: int) -> None:
        """Empty sequence s (the target's and the draft's) after its item failed."""
        for seqs in (self.seqs, self.draft_seqs):
            if seqs is not None:
                try:
                    seqs.clear(s)
                except Exception:
                    pass

    def _fail(self, slots: list[_Slot | None], s: int, err: Exception) -> ItemDone:
        """Sequence s's item failed: free its slot, return its error event."""
        item = slots[s].item
        slots[s] = None
        self._clear(s)
        return ItemDone(item, error=item_error(err))

    def _pass(self, slots: list[_Slot | None], active: list[int]) -> Iterator[Step | ItemDone]:
        """Draft for every active sequence, verify them all in one target pass, emit. A sequence
        whose drafting or verification fails ends its item with an error (ItemDone, its slot
        freed); a failed shared pass ends every item in it so."""
        requests = {}
        for s in list(active):
            slot = slots[s]
            try:
                remaining = slot.item.max_tokens - len(slot.gen.token_ids)
                room = self.n_ctx - len(slot.context)
                k = min(slot.decoder.n_draft, remaining - 1, room - 1)  # the pass emits up to k+1 tokens
                t_draft = time.perf_counter()
                drafter = self.drafters[s]
                slot.proposal = (
                    drafter.propose(slot.context, k, slot.decoder.judge) if (drafter is not None and k > 0) else Proposal([])
                )
            except Exception as err:
                active.remove(s)
                yield self._fail(slots, s, err)
                continue
            slot.draft_s = time.perf_counter() - t_draft
            slot.gen.stats.draft_s += slot.draft_s
            requests[s] = [slot.context[-1], *slot.proposal.tokens]
        if not requests:
            return
        t_verify = time.perf_counter()
        try:
            logits = self.seqs.eval(requests, logits="all")
        except Exception as err:
            for s in list(active):
                yield self._fail(slots, s, err)
            active.clear()
            return
        pass_s = time.perf_counter() - t_verify
        n_pass = sum(len(tokens) for tokens in requests.values())
        for s in list(active):
            try:
                yield from self._finish_pass(slots[s], s, logits[s], t_verify, pass_s, len(requests[s]), n_pass)
            except Exception as err:
                active.remove(s)
                yield self._fail(slots, s, err)

    def _finish_pass(self, slot: _Slot, s: int, logits, t_verify: float, pass_s: float, n_request: int, n_pass: int) -> Iterator[Step]:
        """Verify sequence s's drafts against its rows of the shared pass, trim, emit."""
        draft = slot.proposal.tokens
        verdict = slot.decoder._verify(logits, slot.proposal, slot.context, slot.rng)
        if slot.decoder.adaptive:
            share = pass_s * n_request / n_pass
            slot.decoder.judge.observe(slot.proposal.source, len(draft), verdict.n_accepted, slot.proposal.confidences,
                                       slot.draft_s, n_request, share, slot.proposal.token_s,
                                       slot.proposal.first_s, len(slot.context))  # fmt: skip
        self.seqs.truncate(s, len(slot.context) + verdict.n_accepted)
        if self.drafters[s] is not None and draft:
            self.drafters[s].update(len(draft), verdict.n_accepted)
        step = slot.gen.record(verdict.tokens, verdict.n_accepted, len(draft), self.model_tgt.is_eog, slot.proposal.source)
        slot.context.extend(verdict.tokens)
        slot.gen.stats.verify_s += time.perf_counter() - t_verify  # the shared pass, wall time
        slot.gen.stats.generation_s = time.perf_counter() - slot.t_gen
        yield step


