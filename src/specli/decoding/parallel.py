"""Generating batch's items with the models loaded once, on the step loop (loop.py's
`StepLoop`): one at a time on the target's own context (`--parallel 1`, the very loop `run`
takes), or P sequences in lockstep sharing each target pass (`--parallel P`).

The runner yields events: a `Step` per target pass and sequence (for the progress bar), and an
`ItemDone` when an item is finished (a Generation) or failed (an error sentence). A Ctrl-C
propagates out of it; the item in progress is then simply not reported.

What is batch's own is the feeding: a free slot takes the next item; an item that fails ends
with its error and the batch goes on. Each item is verified with its own settings and random
generator, trims its own cache and stops on its own, so it gets the tokens `run` would give it
(up to batch numerics, see README).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

from specli.decoding.generation import Generation, Request, Step
from specli.decoding.loop import DecoderPool, StepLoop
from specli.errors import SpecliError
from specli.llama.model import LlamaModel
from specli.modes import DraftLength, DraftMode


class Item(Protocol):
    """What the runners need of an item (session.batch's Item has it): its generation's Request,
    tokenized on the loop's side (the engine refuses a prompt that leaves no room to generate)."""

    def request(self, model_tgt: LlamaModel) -> Request: ...


# How a front end words a SpecliError for an item's record (the CLI: its option names).
Describe = Callable[[SpecliError], str]


@dataclass
class ItemDone:
    item: Item
    generation: Generation | None = None
    error: str | None = None


def item_error(err: Exception, describe: Describe = str) -> str:
    """An item's error record text for a failure while generating it."""
    if isinstance(err, SpecliError):
        return describe(err)
    # Not a failure anyone foresaw (a bug): name it, so that it can be reported.
    return f"internal error: {type(err).__name__}: {err} (a bug in specli; please report it with this item)"


def run_sequential(pool: DecoderPool, items: Iterable[Item], describe: Describe = str) -> Iterator[Step | ItemDone]:
    """One item after the other on the target's own context, exactly as `specli run` generates
    each (a prompt keeps what the cache holds of it). Whatever fails while an item is generated
    (a failed decode, or a bug) is that item's error; the batch goes on."""
    return _feed(StepLoop.on_model(pool.model_tgt, pool), items, describe, fresh=False)


class ParallelRunner:
    """`n_seq` sequences in lockstep on one target (StepLoop.on_sequences: each slot its own
    drafter for `mode`, a draft model drafting every slot's next token in one pass of its own
    context); each item starts from an empty cache. With `--draft-max auto` each slot's policy
    sizes its drafts, charged its part of a shared pass as `SharedPassCost` splits it."""

    def __init__(
        self, model_tgt: LlamaModel, mode: DraftMode | str, draft_length: DraftLength | int | str, n_seq: int,
        *, n_threads: int | None = None, kv_type: str = "f16", flash_attn: str = "auto",
        model_dft: LlamaModel | None = None, describe: Describe = str, release_models: bool = False, memory=None,
    ):
        """memory: a TokenMemory every slot's lookup drafter also copies from (StepLoop.on_sequences);
        each item done is remembered in it."""
        self.describe = describe
        self.loop = StepLoop.on_sequences(
            model_tgt, mode, draft_length, n_seq, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn,
            model_dft=model_dft, release_models=release_models, memory=memory,
        )

    def close(self) -> None:
        self.loop.close()

    def run(self, items: Iterable[Item]) -> Iterator[Step | ItemDone]:
        return _feed(self.loop, items, self.describe, fresh=True)


@dataclass
class _Slot:
    """A slot's item (its generation is the loop's)."""

    item: Item


def release_done(loop: StepLoop, s: int) -> Generation:
    """Take slot s's finished generation out of the loop; one that completed (not interrupted)
    is remembered by the slot's drafter (StepLoop.remember: a memory drafter's memory), prompt
    and output."""
    gen = loop.release(s)
    loop.remember(s, gen)
    return gen


def _feed(loop: StepLoop, items: Iterable[Item], describe: Describe, *, fresh: bool) -> Iterator[Step | ItemDone]:
    """Batch's policy over the loop: each free slot takes the next item (its prompt in at
    once), every busy slot steps; a finished item is reported (and remembered, `release_done`) and
    its slot refilled before the next pass; a failed one is not remembered. fresh: each item
    starts from an empty cache."""
    queue = iter(items)
    slots: list[_Slot | None] = [None] * loop.n_slots
    exhausted = False
    while True:
        for s in range(len(slots)):
            while slots[s] is None and not exhausted:
                item = next(queue, None)
                if item is None:
                    exhausted = True
                    break
                try:
                    request = item.request(loop.pools[s].model_tgt)
                    loop.start(s, dataclasses.replace(request, fresh=True) if fresh else request)
                    loop.prefill(s)
                    slots[s] = _Slot(item)
                except Exception as err:  # this item fails, the batch goes on
                    loop.clear(s)
                    yield ItemDone(item, error=item_error(err, describe))
        active = [s for s, slot in enumerate(slots) if slot is not None]
        if not active:
            return
        finished = False
        for s in active:
            if loop.sequences[s].ended():
                yield ItemDone(slots[s].item, release_done(loop, s))
                slots[s] = None
                finished = True
        if finished:
            continue  # refill the freed slots first
        for s, result in loop.step(active).items():
            if isinstance(result, Exception):
                loop.clear(s)
                yield ItemDone(slots[s].item, error=item_error(result, describe))
                slots[s] = None
            else:
                yield result
        for s in active:
            if slots[s] is not None and loop.sequences[s].gen.stop_reason is not None:
                yield ItemDone(slots[s].item, release_done(loop, s))
                slots[s] = None
