"""The server's generation loop, without HTTP: one thread owns the models; requests wait in a
bounded queue for one of P slots; every pass verifies all active slots together.

A slot is one of the step loop's (decoding/loop.py's StepLoop: with `--parallel 1`, the target's own
context, the very path `specli run` takes; else one sequence of a MultiSequenceContext, as
`batch --parallel`), with its own drafter and one SpeculativeDecoder per sampling setting. Each
pass is the loop's step: every active slot plans its draft, one target pass evaluates them all,
each slot commits its own verdict. What is the server's own: between passes it takes new jobs
into free slots, puts long prompts in a batch at a time, frees the slots of jobs whose client
left, and has a slot's drafter remember each job that completes there (StepLoop.remember: with
`--memory process`, the prompts and outputs later jobs' drafts may copy from).

A slot keeps its cache after its job ends, and a new job goes to the free slot whose cache
shares the longest prefix with its prompt: a client that resends the conversation so far
evaluates only what is new (SequenceStep.begin keeps the common prefix).

The front end talks to the loop through `submit`, `cancel` and `stop`, all thread-safe; the
loop answers through each job's `emit` callback (called on the loop's thread) with Delta,
Done and Failed events.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from specli.decoding.generation import Generation, Request
from specli.decoding.loop import DecoderPool, StepLoop
from specli.decoding.parallel import item_error
from specli.decoding.stats import Stats
from specli.decoding.step import SequenceStep
from specli.errors import SpecliError
from specli.llama.model import common_prefix_len
from specli.session.loading import Loaded


@dataclass
class Delta:
    text: str  # text released since the previous event
    tokens: tuple[int, ...] = ()  # tokens generated since the previous event
    logprobs: tuple = ()  # their Generation.logprobs entries (when the request asked for them)


@dataclass
class Done:
    generation: Generation  # finished (its stop_reason set); no longer touched by the loop
    tail: str  # text released since the last Delta
    slot: int


@dataclass
class Failed:
    message: str
    status: int = 500  # 400: the request's own fault; 503: the server is stopping


Event = Delta | Done | Failed


@dataclass(eq=False)
class Job:
    """One request's generation, as the loop sees it: the Request, and how to answer."""

    request: Request
    emit: Callable[[Event], None]
    cancelled: bool = False
    t_submitted: float = field(default_factory=time.perf_counter)


class QueueFull(Exception):
    pass


SHUTTING_DOWN = "the server is shutting down; send the request again once it is back"


class ShuttingDown(Exception):
    pass


class _ServeSlot:
    """What the server keeps of a loop slot: its job and how much of its text was sent."""

    def __init__(self, cache):
        self.cache = cache  # the slot's target cache (the loop's)
        self.job: Optional[Job] = None
        self.seq: Optional[SequenceStep] = None
        self.sent = 0  # characters of the generation's text already emitted
        self.sent_tokens = 0  # and tokens
        self.last_used = 0
        self.ready = False  # its prompt is in the cache: it takes part in passes
        # Per cache (the target's, a draft model's; Scheduler._caches): how many leading entries
        # were computed exactly, after the very text before them, when entries after them are
        # not (--cache-reuse moved chunks there, and what followed was computed after those);
        # None: every entry is exact. A job that does not reuse chunks keeps no more than these.
        self.exact_upto: list[Optional[int]] = [None, None]


class Scheduler:
    def __init__(
        self, loaded: Loaded, *, n_seq: int, queue_limit: int, n_threads: Optional[int] = None, describe=str,
        kv_type: str = "f16", flash_attn: str = "auto", prefill_batch: Optional[int] = None, release_models: bool = False,
        on_idle: Optional[Callable[[], Optional[float]]] = None, cache_reuse: int = 0,
    ):
        """prefill_batch: how many tokens of a new prompt go in between two passes of the other
        slots (default: the context's batch size, so that prompts go in run's very batches).
        release_models: with several slots, free the models' own contexts, which the slots'
        context replaces (ParallelRunner). on_idle: called by the loop's thread each time it
        has nothing to do (no request queued or running), before it waits; it returns None, or
        the seconds after which, still idle, it is to be called again. cache_reuse: llama-server's
        --cache-reuse N (0: off): a new prompt also keeps the runs of at least N tokens its slot's
        cache holds after the common prefix, moved to their new positions (reuse_chunks), where
        the caches can move entries (`can_reuse`)."""
        self.model_tgt = loaded.model_tgt
        self.mode = loaded.plan.mode
        self.draft_length = loaded.decoder.draft_length
        self.queue_limit = queue_limit
        self.describe = describe
        self.on_idle = on_idle
        if n_seq == 1:
            # the loaded decoder, with the saved -n auto measurements, serves its own setting
            self.loop = StepLoop.on_model(self.model_tgt, DecoderPool(self.model_tgt, loaded.decoder.drafter, self.draft_length, first=loaded.decoder))
        else:
            self.loop = StepLoop.on_sequences(
                self.model_tgt, self.mode, self.draft_length, n_seq, n_threads=n_threads, model_dft=loaded.model_dft,
                kv_type=kv_type, flash_attn=flash_attn, release_models=release_models, memory=loaded.memory,
            )
        self.slots = [_ServeSlot(cache) for cache in self.loop.caches]
        self.prefill_batch = prefill_batch or self.loop.passes.n_batch
        self.n_ctx = self.slots[0].cache.n_ctx
        self.cache_reuse = cache_reuse
        self.can_reuse = self.slots[0].cache.can_shift  # (not M-RoPE models)
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._uses = 0
        self.broken: Optional[str] = None  # why the loop died (then every request gets 503)
        # For /health: counts since start.
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "passes": 0, "most_sequences_in_a_pass": 0, "tokens": 0}
        # For /metrics: every finished generation's stats added up, the sequences of every pass
        # added up, and the longest prompt + output.
        self.totals = Stats()
        self.pass_sequences = 0
        self.most_tokens = 0

    # --- the front end's side (any thread) ---------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specli-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull beyond the bound, ShuttingDown once stop() was called."""
        with self._cond:
            if self._stopping or self.broken:
                raise ShuttingDown()
            free = sum(slot.job is None for slot in self.slots)  # (pending jobs take these first)
            if len(self._pending) >= self.queue_limit + free:
                raise QueueFull()
            self._pending.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client left: drop the job (its slot is freed before the next pass)."""
        with self._cond:
            if job.cancelled:
                return
            job.cancelled = True
            try:
                self._pending.remove(job)
                self.counts["cancelled"] += 1
            except ValueError:
                pass  # in a slot, or done: the loop sees the flag
            self._cond.notify()

    def stop(self) -> None:
        """Stop taking jobs: queued ones fail (503), running ones end now with what they have."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the loop to end; False if it is still running (inside a long decode)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        self.loop.close()

    def health(self) -> dict:
        with self._cond:
            busy = sum(slot.job is not None for slot in self.slots)
            return {"slots_idle": len(self.slots) - busy, "slots_processing": busy, "queued": len(self._pending), **self.counts}

    def metrics(self) -> dict:
        """A consistent snapshot of the counters /metrics shows."""
        with self._cond:
            totals = Stats()
            totals.add(self.totals)
            return {"totals": totals, "counts": dict(self.counts), "pass_sequences": self.pass_sequences, "most_tokens": self.most_tokens,
                    "processing": sum(slot.job is not None for slot in self.slots), "queued": len(self._pending)}

    def slot_states(self) -> list[dict]:
        """Each slot's state for /slots: whether it is generating, and its generation so far."""
        with self._cond:
            taken = [(slot.job, slot.seq) for slot in self.slots]
        states = []
        for s, (job, seq) in enumerate(taken):
            state = {"id": s, "is_processing": job is not None, "n_cached": len(self.slots[s].cache.cached)}
            if job is not None:
                gen = seq.gen if seq is not None else None
                state.update(n_prompt_tokens=len(job.request.prompt_ids), n_decoded=len(gen.token_ids) if gen else 0,
                             n_remain=job.request.max_tokens - (len(gen.token_ids) if gen else 0), generated=gen.text if gen else "",
                             has_new_line="\n" in gen.text if gen else False, sampling=job.request.sampling)
            states.append(state)
        return states

    def stalled(self, why: str) -> None:
        """The backend stopped answering (an RPC server: a pass that never returns; called from
        the watchdog's thread while the loop is stuck): /health and every request get 503 from
        now on, and the queued and running requests are answered so."""
        self._fail_all(why, 503)  # (the slots stay as they are: the stuck loop holds them)

    def _fail_all(self, why: str, status: int) -> None:
        """From now on every request is refused with `why`; the queued and running ones are
        answered so."""
        self.broken = why
        with self._cond:
            jobs, self._pending = list(self._pending), collections.deque()
        for job in jobs + [slot.job for slot in self.slots if slot.job is not None]:
            _emit(job, Failed(why, status))

    # --- the loop (its own thread) ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # a bug: answer everyone rather than leave them waiting
            self._fail_all(f"internal error: {type(err).__name__}: {err} (a bug in specli; please report it)", 500)
            for slot in self.slots:
                slot.job, slot.seq = None, None

    def _idle(self) -> bool:
        return not self._stopping and not self._pending and not self._active()

    def _loop(self) -> None:
        while True:
            again = None
            if self.on_idle is not None:
                with self._cond:
                    idle = self._idle()
                if idle:
                    again = self.on_idle()  # (outside the lock: requests queue meanwhile)
            with self._cond:
                while self._idle():
                    if not self._cond.wait(timeout=again):
                        break  # (still idle, and on_idle wanted to be called again by now)
                if self._stopping:
                    break
                starts = self._assign()
            for s in starts:
                self._start(s)
            self._drop_cancelled()
            self._prefill()
            active = [s for s in self._active() if self.slots[s].ready]
            if active:
                self._pass(active)
        self._shut_down()

    def _active(self) -> list[int]:
        return [s for s, slot in enumerate(self.slots) if slot.job is not None]

    def _assign(self) -> list[int]:
        """Give queued jobs the free slots (under the lock): to each, the free slot whose cache
        shares the longest prefix with its prompt, else the one used least recently."""
        starts = []
        free = [s for s, slot in enumerate(self.slots) if slot.job is None]
        while free and self._pending:
            job = self._pending.popleft()
            best = max(free, key=lambda s: (self._keepable(s, job), -self.slots[s].last_used))
            free.remove(best)
            self.slots[best].job = job
            starts.append(best)
        return starts

    def _start(self, s: int) -> None:
        slot = self.slots[s]
        job = slot.job
        if job.cancelled:  # it left while waiting: no prompt to evaluate for nobody
            self._free(s)
            with self._cond:
                self.counts["cancelled"] += 1
            return
        self._uses += 1
        slot.last_used = self._uses
        try:
            slot.seq = self.loop.start(s, job.request)
            slot.sent = slot.sent_tokens = 0
            slot.ready = False
            self._reuse(s, job)
            if common_prefix_len(slot.cache.cached, job.request.prompt_ids) <= 1:
                # Nothing worth keeping (at most BOS): start from an empty cache, so the prompt is
                # evaluated in the very batches `run` uses (another split rounds otherwise on
                # quantized models, enough to flip a near-tie).
                slot.cache.truncate(0)
                slot.exact_upto[0] = None
        except Exception as err:
            self._fail(s, err)

    def _caches(self, s: int) -> list:
        """Slot s's caches: the target's, and a draft model's (None without one)."""
        drafter = self.loop.pools[s].drafter
        return [self.slots[s].cache, None if drafter is None else drafter.draft_cache]

    def _reuse_min(self, job: Job) -> int:
        """The shortest chunk the job's prompt keeps from a slot's cache past the common prefix
        (--cache-reuse, or the request's n_cache_reuse); 0: it keeps the common prefix alone."""
        n_min = self.cache_reuse if job.request.cache_reuse is None else job.request.cache_reuse
        return n_min if n_min > 0 and self.can_reuse and not job.request.fresh else 0

    def _keepable(self, s: int, job: Job) -> int:
        """How much of slot s's target cache the job would keep (_assign's choice)."""
        cache, exact = self.slots[s].cache, self.slots[s].exact_upto[0]
        common = common_prefix_len(cache.cached, job.request.prompt_ids)
        return common if exact is None or self._reuse_min(job) else min(common, exact)

    def _reuse(self, s: int, job: Job) -> None:
        """Slot s's caches (the target's, and a draft model's) made ready for the job's prompt.

        --cache-reuse (a job with _reuse_min): the chunks the new prompt holds later are moved
        to their places in it; SequenceStep.begin then keeps them as it keeps a common prefix
        (prompt_reused counts them). A moved chunk was computed after other text than now
        precedes it, so it and all that follows is approximate (as in llama-server): the slot
        notes where the exact entries end (exact_upto). A job without reuse (the server's
        --cache-reuse 0 or the request's n_cache_reuse 0, cache_prompt false) keeps no
        approximate entry: its caches are cut to the exact ones first, so it gives what `run`
        gives, whatever an earlier request on the slot asked for."""
        slot, n_min = self.slots[s], self._reuse_min(job)
        prompt = job.request.prompt_ids[:-1]  # (what the caches hold before the first pass: all but `last`)
        for i, cache in enumerate(self._caches(s)):
            exact = slot.exact_upto[i]
            if cache is None:
                continue
            if exact is not None and exact >= len(cache.cached):  # (emptied since: a fresh job's, a failure's)
                exact = None
            if n_min and cache.can_shift:
                common = common_prefix_len(cache.cached, prompt)
                n_keep = cache.reuse_chunks(prompt, n_min)
                if n_keep > common:  # chunks moved: approximate from the first one on
                    exact = common if exact is None else min(exact, common)
                elif exact is not None and exact >= n_keep:
                    exact = None
            elif exact is not None:
                cache.truncate(exact)
                exact = None
            slot.exact_upto[i] = exact

    def _prefill(self) -> None:
        """One batch of each new slot's prompt, into the target's cache and then the draft
        model's: a long prompt goes in between the other slots' passes instead of holding them
        up (in whole batches, so in `run`'s very batches)."""
        for s, slot in enumerate(self.slots):
            if slot.job is not None and not slot.ready:
                try:
                    slot.ready = self.loop.prefill(s, budget=self.prefill_batch)
                except Exception as err:
                    self._fail(s, err)

    def _drop_cancelled(self) -> None:
        for s, slot in enumerate(self.slots):
            if slot.job is not None and slot.job.cancelled:
                self._free(s)  # (its cache stays: a resent conversation reuses it)
                with self._cond:
                    self.counts["cancelled"] += 1

    def _free(self, s: int) -> None:
        self.loop.release(s)
        with self._cond:
            self.slots[s].job = None
            self.slots[s].seq = None

    def _fail(self, s: int, err: Exception) -> None:
        job = self.slots[s].job
        status = 400 if isinstance(err, SpecliError) and err.exit_code == 2 else 500
        self._free(s)
        self.loop.clear(s)
        with self._cond:
            self.counts["failed"] += 1
        _emit(job, Failed(item_error(err, self.describe), status))

    def _finish(self, s: int) -> None:
        slot = self.slots[s]
        job, gen = slot.job, slot.seq.gen
        self._free(s)
        with self._cond:
            self.counts["completed"] += 1
            self.counts["tokens"] += len(gen.token_ids)
            self.totals.add(gen.stats)
            self.most_tokens = max(self.most_tokens, len(gen.prompt_ids) + len(gen.token_ids))
        _emit(job, Done(gen, gen.text[slot.sent :], s))
        self.loop.remember(s, gen)  # (after the answer: it waits for nothing; not one cut short by a shutdown)

    def _pass(self, active: list[int]) -> None:
        """One step of every active slot (the loop's), then each slot's text out."""
        stepping = []
        for s in active:
            try:
                if self.slots[s].seq.ended():
                    self._finish(s)
                else:
                    stepping.append(s)
            except Exception as err:
                self._fail(s, err)
        if not stepping:
            return
        results = self.loop.step(stepping)
        n_stepped = sum(not isinstance(result, Exception) for result in results.values())
        if n_stepped:
            with self._cond:
                self.counts["passes"] += 1
                self.counts["most_sequences_in_a_pass"] = max(self.counts["most_sequences_in_a_pass"], self.loop.last_pass_sequences)
                self.pass_sequences += self.loop.last_pass_sequences
        for s, result in results.items():
            if isinstance(result, Exception):
                self._fail(s, result)
                continue
            slot = self.slots[s]
            gen = slot.seq.gen
            if slot.seq.ended():  # (an end-of-generation token, a stop string, max_tokens, a full context)
                self._finish(s)
            elif len(gen.text) > slot.sent:
                n_tokens = released_tokens(gen)
                _emit(slot.job, Delta(gen.text[slot.sent :], tuple(gen.token_ids[slot.sent_tokens : n_tokens]),
                                      tuple(gen.logprobs[slot.sent_tokens : n_tokens]) if gen.logprobs is not None else ()))
                slot.sent, slot.sent_tokens = len(gen.text), n_tokens

    def _shut_down(self) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        for job in pending:
            _emit(job, Failed(SHUTTING_DOWN, 503))
        for s in self._active():
            slot = self.slots[s]
            if slot.seq is not None and slot.ready and not slot.job.cancelled:
                slot.seq.gen.interrupt()
                self._finish(s)
            else:  # (its prompt not yet in: nothing to send but what a queued request gets)
                job = slot.job
                self._free(s)
                if not job.cancelled:
                    _emit(job, Failed(SHUTTING_DOWN, 503))


def released_tokens(gen: Generation) -> int:
    """How many of gen's tokens a Delta may send: those whose text begins within the text
    released so far. With stop strings or limits the rest may be held back (the start of a stop
    string) and later cut with their text, so their ids wait for the text (Generation._starts:
    each token's offset in the text, kept only then); a cut never drops a token before it."""
    if not gen.stop and gen.limits is None:
        return len(gen.token_ids)
    return bisect.bisect_left(gen._starts, len(gen.text))


def _emit(job: Job, event: Event) -> None:
    try:
        job.emit(event)
    except RuntimeError:  # the front end's event loop is closed (call_soon_threadsafe): nobody to tell
        pass
