"""Generating for many items with the models loaded once: one at a time (`--parallel 1`, the
very `SpeculativeDecoder` that `run` uses), or several sequences in lockstep sharing each
target pass (`--parallel P`).

Both runners yield events: a `Step` per target pass and sequence (for the progress bar), and an
`ItemDone` when an item is finished (a Generation) or failed (an error sentence). A Ctrl-C
propagates out of them; the item in progress is then simply not reported.

The lockstep loop: every active sequence drafts for its own context (its own drafter), one
llama_decode evaluates every sequence's [last, d1..dk] (`MultiSequenceContext`), and each
sequence is verified with its own item's settings and random generator, trims its own cache,
and stops on its own; a free slot takes the next item. The step per sequence is the very one
`run` takes (engine.py's `SequenceStep`: plan before the pass, commit after it), so each item
gets the tokens `run` would give it (up to batch numerics, see README).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterable, Iterator, Protocol, Sequence

from specli.decoding.drafters import Drafter, make_drafter
from specli.modes import DraftMode
from specli.decoding.engine import AUTO, AUTO_MAX_DRAFT, Generation, SequenceStep, SpeculativeDecoder, Step
from specli.decoding.sampling import SamplingParams
from specli.errors import SpecliError
from specli.llama.context import MultiSequenceContext, SequenceView
from specli.llama.model import LlamaModel


class GenerationRequest(Protocol):
    """What the runners need of an item (session.batch's Item has it)."""

    prompt: str
    max_tokens: int
    sampling: SamplingParams
    stop: Sequence[str]  # the item's stop strings (engine.py's Generation.stop)


# How a front end words a SpecliError for an item's record (the CLI: its option names).
Describe = Callable[[SpecliError], str]


@dataclass
class ItemDone:
    item: GenerationRequest
    generation: Generation | None = None
    error: str | None = None


class DecoderPool:
    """One SpeculativeDecoder per sampling setting, all sharing the target and drafter. The
    seed is no part of the setting: each generation brings its own (`seed_of`), so items or
    requests with seeds of their own share a decoder and its -n auto policy; beyond LIMIT
    settings the least recently used goes. `first`: a decoder to start with (the loaded one)."""

    LIMIT = 8

    def __init__(self, model_tgt: LlamaModel, drafter: Drafter | None, n_draft: int | str, *, first: SpeculativeDecoder | None = None):
        self.model_tgt, self.drafter, self.n_draft = model_tgt, drafter, n_draft
        self._decoders: collections.OrderedDict[SamplingParams, SpeculativeDecoder] = collections.OrderedDict()
        if first is not None:
            self._decoders[dataclasses.replace(first.sampling, seed=None)] = first

    def get(self, sampling: SamplingParams) -> SpeculativeDecoder:
        key = dataclasses.replace(sampling, seed=None)
        decoder = self._decoders.pop(key, None) or SpeculativeDecoder(self.model_tgt, self.drafter, self.n_draft, key)
        self._decoders[key] = decoder
        while len(self._decoders) > self.LIMIT:
            self._decoders.popitem(last=False)
        return decoder


def tokenize_item(model_tgt: LlamaModel, item: GenerationRequest) -> list[int]:
    """The item's prompt tokens (the engine refuses a prompt that leaves no room to generate)."""
    ids = getattr(item, "prompt_ids", None)  # a chat item comes rendered and tokenized (batch --chat)
    if ids is not None:
        return list(ids)
    return model_tgt.tokenize(item.prompt, add_bos=model_tgt.vocab_info().add_bos)


def item_error(err: Exception, describe: Describe = str) -> str:
    """An item's error record text for a failure while generating it."""
    if isinstance(err, SpecliError):
        return describe(err)
    # Not a failure anyone foresaw (a bug): name it, so that it can be reported.
    return f"internal error: {type(err).__name__}: {err} (a bug in specli; please report it with this item)"


def run_sequential(pool: DecoderPool, items: Iterable[GenerationRequest], describe: Describe = str) -> Iterator[Step | ItemDone]:
    """One item after the other, exactly as `specli run` generates each. Whatever fails while an
    item is generated (a failed decode, or a bug) is that item's error; the batch goes on."""
    model_tgt = pool.model_tgt
    for item in items:
        try:
            prompt_ids = tokenize_item(model_tgt, item)
            gen = pool.get(item.sampling).generate(prompt_ids, max_tokens=item.max_tokens, stop=item.stop, seed=item.sampling.seed)
            for step in gen:
                yield step
        except Exception as err:  # this item fails, the batch goes on
            _forget_untracked(model_tgt)
            yield ItemDone(item, error=item_error(err, describe))
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


def verify_all(
    seqs, plans: dict[int, SequenceStep], requests: dict[int, list[int]], costs: SharedPassCost | None = None
) -> dict[int, Step | Exception]:
    """One target pass over every sequence's planned tokens (`requests`, from plan()) on `seqs`
    (a MultiSequenceContext, or anything with its eval), then each sequence's commit, charged
    its share of the pass (`costs`' split; without it, its tokens / all of them). Per
    sequence: its Step, or the exception that failed it (a failed pass fails every one)."""
    t_pass, cpu_pass = time.perf_counter(), time.process_time()
    try:
        rows = seqs.eval(requests, logits="all")
    except Exception as err:
        return {s: err for s in requests}
    cpu_s, pass_s = time.process_time() - cpu_pass, time.perf_counter() - t_pass
    n_tokens = {s: len(tokens) for s, tokens in requests.items()}
    shares = (costs or SharedPassCost()).shares(n_tokens)  # (a new one splits by tokens)
    if costs is not None:
        costs.add(sum(n_tokens.values()), pass_s)
    results: dict[int, Step | Exception] = {}
    for s in requests:
        try:
            results[s] = plans[s].commit(rows[s], pass_s, cpu_s=cpu_s, share=shares[s])
        except Exception as err:
            results[s] = err
    return results


@dataclass
class _Slot:
    """A sequence in the lockstep loop: the item it generates and that item's generation."""

    item: GenerationRequest
    seq: SequenceStep


class ParallelRunner:
    """`n_seq` sequences in lockstep on one target (see the module docstring).

    Each slot gets its own drafter for `mode`. The modes with a draft model
    (`model_dft`) draft through their own sequence of a second multi-sequence context on the
    draft model's weights: one draft cache per sequence, every slot's next draft token in one
    pass of it (`plan_all`).
    With `--draft-max auto` each slot's policy sizes its drafts; each is charged its part of a
    shared pass as `SharedPassCost` splits it, and its share of the shared draft passes.
    """

    def __init__(
        self, model_tgt: LlamaModel, mode: DraftMode | str, n_draft: int | str, n_seq: int,
        *, n_threads: int | None = None, kv_type: str = "f16", flash_attn: str = "auto",
        model_dft: LlamaModel | None = None, describe: Describe = str, release_models: bool = False,
    ):  # fmt: skip
        """release_models: free the models' own contexts (their KV caches) first, which the
        runner never evaluates through; the commands do, tests comparing with them do not."""
        self.model_tgt, self.describe = model_tgt, describe
        self.n_ctx = model_tgt.n_ctx  # per sequence, as for `run`
        mode = DraftMode(mode)
        if mode.needs_draft_model and model_dft is None:
            raise ValueError(f"drafting mode {mode!r} needs a draft model")
        if release_models:
            model_tgt.release_context()
            if mode.needs_draft_model:
                model_dft.release_context()
        self.draft_seqs = None
        if mode.needs_draft_model:
            self.draft_seqs = MultiSequenceContext(
                model_dft, n_seq=n_seq, n_ctx_per_seq=self.n_ctx, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
            )  # fmt: skip
            self.drafters: list[Drafter | None] = [
                make_drafter(mode, SequenceView(self.draft_seqs, s, model_dft)) for s in range(n_seq)
            ]
        else:
            self.drafters = [make_drafter(mode) for _ in range(n_seq)]
        self.pools = [DecoderPool(model_tgt, drafter, n_draft) for drafter in self.drafters]
        longest = AUTO_MAX_DRAFT if n_draft == AUTO else n_draft
        n_batch = max(512, n_seq * ((longest if self.drafters[0] is not None else 0) + 1))
        self.seqs = MultiSequenceContext(
            model_tgt, n_seq=n_seq, n_ctx_per_seq=self.n_ctx, n_batch=n_batch,
            n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
        )  # fmt: skip
        self.views = [SequenceView(self.seqs, s, model_tgt) for s in range(n_seq)]  # each slot's target cache
        self.pass_costs = SharedPassCost()

    def close(self) -> None:
        self.seqs.close()
        if self.draft_seqs is not None:
            self.draft_seqs.close()

    def run(self, items: Iterable[GenerationRequest]) -> Iterator[Step | ItemDone]:
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
                        slots[s] = self._start(s, item, tokenize_item(self.model_tgt, item))
                    except Exception as err:  # this item fails, the batch goes on
                        self._clear(s)
                        yield ItemDone(item, error=item_error(err, self.describe))
            active = [s for s, slot in enumerate(slots) if slot is not None]
            if not active:
                return
            finished = False
            for s in active:
                if slots[s].seq.ended():
                    yield ItemDone(slots[s].item, slots[s].seq.gen)
                    slots[s] = None
                    finished = True
            if finished:
                continue  # refill the freed slots first
            yield from self._pass(slots, active)
            for s in active:
                if slots[s].seq.gen.stop_reason is not None:
                    yield ItemDone(slots[s].item, slots[s].seq.gen)
                    slots[s] = None

    def plan_all(self, seqs: dict[int, SequenceStep]) -> tuple[dict[int, list[int]], dict[int, Exception]]:
        """Every sequence's plan (its draft, and the tokens of its part of the target's pass),
        with a draft model drafting in lockstep: each round evaluates the next draft token of
        every sequence still drafting in one pass of the draft model's context, rather than one
        pass per sequence. Returns (tokens by sequence, errors by sequence)."""
        requests: dict[int, list[int]] = {}
        failed: dict[int, Exception] = {}
        steps: dict[int, Generator] = {}
        pending: dict[int, int] = {}  # sequence -> the draft token its draft model must evaluate
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
                rows = self.draft_seqs.eval({s: [token] for s, token in pending.items()}, logits="all")
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

    def _start(self, s: int, item: GenerationRequest, prompt_ids: list[int]) -> _Slot:
        """Put the prompt (all but `last`) into sequence s and set up its generation."""
        seq = self.pools[s].get(item.sampling).sequence(
            prompt_ids, max_tokens=item.max_tokens, cache=self.views[s], stop=item.stop, seed=item.sampling.seed,
            max_pass=self.seqs.n_batch // self.seqs.n_seq,  # (every sequence's part fits the shared batch)
        )  # fmt: skip
        self.seqs.clear(s)  # (each item starts from an empty cache)
        seq.begin()
        return _Slot(item, seq)

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
        return ItemDone(item, error=item_error(err, self.describe))

    def _pass(self, slots: list[_Slot | None], active: list[int]) -> Iterator[Step | ItemDone]:
        """Draft for every active sequence, verify them all in one target pass, emit. A sequence
        whose drafting or verification fails ends its item with an error (ItemDone, its slot
        freed); a failed shared pass ends every item in it so."""
        requests, failed = self.plan_all({s: slots[s].seq for s in active})
        for s, err in failed.items():
            active.remove(s)
            yield self._fail(slots, s, err)
        if not requests:
            return
        results = verify_all(self.seqs, {s: slots[s].seq for s in requests}, requests, self.pass_costs)
        for s in list(active):
            if isinstance(results[s], Exception):
                active.remove(s)
                yield self._fail(slots, s, results[s])
            else:
                yield results[s]
