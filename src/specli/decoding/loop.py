"""The step loop: the sequences being generated on one target, and one step for all of them
around one target pass (StepLoop); the decoders a slot keeps per sampling setting
(DecoderPool); generate(), the loop with one sequence.

Every front end drives the loop: `run` and `chat` with one sequence (generate()), `batch`
(parallel.py) and `serve` (server/scheduler.py) with one or several, feeding it and draining it
by their own rules. A step per sequence is step.py's SequenceStep.

`generate()` returns a `Generation`: iterate it to run the loop step by step (each step is an
event for the UI); its fields always describe what has been produced so far, so an interrupted
run keeps its text and stats.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Generator, Iterator, Sequence

from specli.decoding.drafters import Drafter, make_drafter
from specli.decoding.generation import Generation, Request, Step
from specli.decoding.memory_drafter import drafter_with_memory
from specli.decoding.policy.costs import SharedPassCost
from specli.decoding.sampling import SamplingParams
from specli.decoding.step import SequenceStep, SpeculativeDecoder, draft_length_for
from specli.errors import SpecliError
from specli.llama.context import ModelPasses, MultiSequenceContext, SequenceView
from specli.llama.model import LlamaModel
from specli.modes import DraftLength, DraftMode


class StepLoop:
    """The sequences being generated on one target, and one step for all of them: each plans
    its draft (with a draft model, every sequence's next draft token in one pass of the draft
    model's context), one target pass evaluates every sequence's [last, d1..dk], each commits
    its own verdict. `run` and `chat` use it with one sequence (generate(), below), `batch` and
    `serve` with P; they decide what goes into which slot and when.

    Slot s has a target cache (`caches[s]`), its own drafter, and one decoder per sampling
    setting (`pools[s]`); `start` puts a generation into it, `prefill` its prompt into the
    caches, `step` advances the given slots by one target pass, `release` takes the generation
    out, and `clear` empties the slot's caches after a failure.
    """

    def __init__(
        self, passes, caches: list, pools: list[DecoderPool], *, max_pass: int,
        draft_passes=None, pass_costs: SharedPassCost | None = None,
    ):
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
        cls, model_tgt: LlamaModel, mode: DraftMode | str, draft_length: DraftLength | int | str, n_seq: int,
        *, n_threads: int | None = None, kv_type: str = "f16", flash_attn: str = "auto",
        model_dft: LlamaModel | None = None, release_models: bool = False, memory=None,
    ) -> "StepLoop":
        """`n_seq` slots on a MultiSequenceContext of the target's weights, each with its own
        drafter for `mode`; the modes with a draft model (`model_dft`) draft through their own
        sequence of a second one on the draft model's weights, every slot's next draft token in
        one pass of it. release_models: free the models' own contexts (their KV caches) first,
        which the loop never evaluates through; the commands do, tests comparing with them do not.
        `draft_length`: every slot's (as SpeculativeDecoder's); `memory`: a TokenMemory
        every slot's lookup drafter also copies from (drafter_with_memory), one for all of them."""
        mode = DraftMode(mode)
        length = draft_length_for(mode != DraftMode.TARGET_ONLY, draft_length)
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
            )
            drafters = [make_drafter(mode, SequenceView(draft_passes, s, model_dft)) for s in range(n_seq)]
        else:
            drafters = [drafter_with_memory(mode, memory=memory) for _ in range(n_seq)]
        n_batch = max(512, n_seq * (length.maximum + 1))
        passes = MultiSequenceContext(
            model_tgt, n_seq=n_seq, n_ctx_per_seq=n_ctx, n_batch=n_batch, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
        )
        return cls(
            passes, [SequenceView(passes, s, model_tgt) for s in range(n_seq)],
            [DecoderPool(model_tgt, drafter, length) for drafter in drafters],
            max_pass=passes.n_batch // n_seq,  # every sequence's part fits the shared batch
            draft_passes=draft_passes, pass_costs=SharedPassCost(),
        )

    @property
    def n_slots(self) -> int:
        return len(self.caches)

    def start(self, s: int, request: Request) -> SequenceStep:
        """Put the generation of `request` into slot s, with slot s's decoder for its sampling;
        a fresh request starts from an empty cache. Nothing is evaluated before prefill()."""
        seq = self.pools[s].get(request.sampling).sequence(request, cache=self.caches[s], max_pass=self.max_pass)
        if request.fresh:
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
        drafter, document = self.pools[s].drafter, gen.document()
        if drafter is not None and document is not None:
            drafter.remember(document)

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

    def _plan(self, seqs: dict[int, SequenceStep]) -> tuple[dict[int, list[int]], dict[int, Exception]]:
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

    def _plan_in_lockstep(self, seqs: dict[int, SequenceStep]) -> tuple[dict[int, list[int]], dict[int, Exception]]:
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


def generate(decoder: SpeculativeDecoder, request: Request) -> Generation:
    """Start generating `request` with `decoder` (its sampling unless the request has its own):
    the step loop with one sequence, on the target's own context (`run`, `chat`, bench, the
    tests). Iterate the Generation to run it a step at a time, or call run()."""
    if request.sampling is None:
        request = dataclasses.replace(request, sampling=decoder.sampling)
    loop = StepLoop.on_model(decoder.model_tgt, DecoderPool(decoder.model_tgt, decoder.drafter, decoder.draft_length, first=decoder))
    seq = loop.start(0, request)
    seq.gen._steps = _one_sequence(loop)
    return seq.gen


class DecoderPool:
    """One SpeculativeDecoder per sampling setting, all sharing the target and drafter. The
    seed is no part of the setting: each generation brings its own (`seed_of`), so items or
    requests with seeds of their own share a decoder and its -n auto policy; beyond LIMIT
    settings the least recently used goes. `first`: a decoder to start with (the loaded one).
    `draft_length`: the decoders' (as SpeculativeDecoder's)."""

    LIMIT = 8

    def __init__(self, model_tgt: LlamaModel, drafter: Drafter | None, draft_length: DraftLength | int | str, *,
                 first: SpeculativeDecoder | None = None):
        self.model_tgt, self.drafter = model_tgt, drafter
        self.draft_length = draft_length_for(drafter is not None, draft_length)
        self._decoders: collections.OrderedDict[SamplingParams, SpeculativeDecoder] = collections.OrderedDict()
        if first is not None:
            self._decoders[dataclasses.replace(first.sampling, seed=None)] = first

    def get(self, sampling: SamplingParams | None) -> SpeculativeDecoder:
        """The decoder for `sampling` (a Request's: generate() fills in its decoder's)."""
        if sampling is None:
            raise ValueError("a request for the step loop names its sampling (generate() uses its decoder's)")
        key = dataclasses.replace(sampling, seed=None)
        decoder = self._decoders.pop(key, None) or SpeculativeDecoder(self.model_tgt, self.drafter, self.draft_length, key)
        self._decoders[key] = decoder
        while len(self._decoders) > self.LIMIT:
            self._decoders.popitem(last=False)
        return decoder
