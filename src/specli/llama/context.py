"""Several sequences on one model's weights: MultiSequenceContext (`specli batch --parallel`),
SequenceView (one of its sequences behind LlamaModel's cache API), ModelPasses (a model's own
context behind MultiSequenceContext's pass API), and the context size limits."""

from __future__ import annotations

from typing import Literal, Sequence

import llama_cpp
import numpy as np

from specli.errors import SettingError, SpecliError
from specli.llama.model import LlamaModel, context_params, free_context, memory_can_shift, reuse_cache_chunks, sync_cache
from specli.llama.native import last_native_error, native_pass

MIN_CTX = 16
# llama.cpp keeps n_ctx in 32 bits (a larger -c would wrap around silently); 16M tokens is more
# than any GGUF model is trained for.
MAX_CTX = 1 << 24


def validate_ctx(n_ctx: int) -> None:
    """SettingError (n_ctx) unless n_ctx is within MIN_CTX..MAX_CTX."""
    if not MIN_CTX <= n_ctx <= MAX_CTX:
        raise SettingError("n_ctx", lambda name: f"{name} must be between {MIN_CTX} and {MAX_CTX:,} tokens, got {n_ctx}")


class MultiSequenceContext:
    """A second context on a loaded model's weights, holding up to `n_seq` independent
    sequences (llama.cpp sequence ids 0..n_seq-1), each with up to `n_ctx_per_seq` positions.

    One `eval` puts tokens of several sequences through a single llama_decode, each token with
    its own position and sequence id, so the weights are read once for all of them (`specli
    batch --parallel`). The KV buffer is unified (one pool of n_seq * n_ctx_per_seq cells,
    attention masked per sequence), so a pass of unequal lengths per sequence is still one
    micro-batch. Per sequence, `cached[s]` is what its cache holds, position by position, as
    LlamaModel.cached is for the single sequence.
    """

    def __init__(
        self, model: LlamaModel, *, n_seq: int, n_ctx_per_seq: int, n_batch: int = 512,
        n_threads: int | None = None, kv_type: str = "f16", flash_attn: str = "auto",
    ):
        assert n_seq >= 1
        cparams = context_params(n_ctx=n_seq * n_ctx_per_seq, n_batch=n_batch, n_threads=n_threads,
                                 kv_type=kv_type, flash_attn=flash_attn)
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True
        ctx = model.new_context(cparams)
        if not ctx:
            reason = last_native_error() or "not enough memory?"
            raise SpecliError(
                f"llama.cpp could not create a context for {n_seq} sequences of {n_ctx_per_seq} tokens "
                f"for {model.path}: {reason} (try a smaller --parallel or -c)"
            )
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self.path = model.path
        self.n_vocab = model.n_vocab
        self.n_seq = n_seq
        self.n_ctx_per_seq = n_ctx_per_seq
        self.n_batch = int(llama_cpp.llama_n_batch(ctx))  # capped by llama.cpp, as in LlamaModel
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.cached: list[list[int]] = [[] for _ in range(n_seq)]

    def eval(
        self, requests: dict[int, Sequence[int]], *, logits: Literal["all", "none"] = "all", rows: dict[int, int] | None = None,
    ) -> dict[int, np.ndarray]:
        """Append each request's tokens to its sequence; return {seq: logits, one row per token}
        (empty dict for "none"); with `rows`, one row for each of the last rows[seq] tokens of
        sequence seq only (a prompt's end evaluated with a step's tokens). Logits need every
        token in one batch (<= n_batch in total). The arrays are views of llama.cpp's buffer,
        valid until the next eval."""
        if logits == "none":
            rows = {seq: 0 for seq in requests}
        elif rows is None:
            rows = {seq: len(tokens) for seq, tokens in requests.items()}
        flat = [
            (seq, len(self.cached[seq]) + i, token, i >= len(tokens) - rows[seq])
            for seq, tokens in requests.items() for i, token in enumerate(tokens)
        ]
        for seq, tokens in requests.items():
            if len(self.cached[seq]) + len(tokens) > self.n_ctx_per_seq:
                raise SpecliError(f"internal: sequence {seq} would exceed its {self.n_ctx_per_seq} positions")
        if logits == "all":
            assert len(flat) <= self.n_batch, "logits: one batch at most"
        for start in range(0, len(flat), self.n_batch):
            self._decode_chunk(flat[start : start + self.n_batch])
        n_out = sum(rows.values())
        if logits == "none" or not n_out:
            return {}
        with native_pass:  # llama_decode returns before the pass is done: this waits for it
            ptr = llama_cpp.llama_get_logits(self._ctx)
        out = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
        by_seq, row = {}, 0
        for seq in requests:  # rows come in batch order: sequence by sequence
            by_seq[seq] = out[row : row + rows[seq]]
            row += rows[seq]
        return by_seq

    def _decode_chunk(self, chunk: list[tuple[int, int, int, bool]]) -> None:
        batch = self._batch
        batch.n_tokens = len(chunk)
        for i, (seq, pos, token, want_logits) in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want_logits
        with native_pass:  # a Ctrl-C comes out after the bookkeeping
            status = llama_cpp.llama_decode(self._ctx, batch)
            if status != 0:
                for seq in {seq for seq, *_ in chunk}:  # drop what may have landed, keep `cached` true
                    llama_cpp.llama_memory_seq_rm(self._memory, seq, len(self.cached[seq]), -1)
            else:
                for seq, _, token, _ in chunk:
                    self.cached[seq].append(token)
        if status != 0:
            reason = last_native_error() or f"llama_decode returned {status}"
            raise SpecliError(f"decoding {len(chunk)} tokens of {len({s for s, *_ in chunk})} sequences failed: {reason}")

    def truncate(self, seq: int, n_keep: int) -> None:
        """Forget positions >= n_keep of sequence `seq`."""
        if n_keep >= len(self.cached[seq]):
            return
        self._remove_from(seq, n_keep)
        del self.cached[seq][n_keep:]

    @property
    def can_shift(self) -> bool:
        """Whether cached entries can be moved to other positions (LlamaModel.can_shift)."""
        return memory_can_shift(self._memory if self._ctx else None)

    def reuse_chunks(self, seq: int, tokens: Sequence[int], min_chunk: int) -> int:
        """LlamaModel.reuse_chunks for sequence `seq`."""
        return reuse_cache_chunks(self._memory, seq, self.cached[seq], tokens, min_chunk, lambda pos: self._remove_from(seq, pos))

    def _remove_from(self, seq: int, pos: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq, pos, -1):
            raise SpecliError(f"llama.cpp cannot remove cache entries from position {pos} of sequence {seq} for {self.path.name}")

    def clear(self, seq: int) -> None:
        """Empty sequence `seq` (its cells go back to the pool), including untracked entries."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq, 0, -1)
        self.cached[seq].clear()

    def close(self) -> None:
        """Free the context and batch (safe to call twice; the weights belong to the model)."""
        if getattr(self, "_ctx", None):  # (a half-built one has none)
            free_context(self._ctx, self._batch)
            self._ctx = None


class SequenceView:
    """One sequence of a MultiSequenceContext behind LlamaModel's cache API (`cached`, `sync`,
    `eval`, `truncate`, `is_eog`), so that a drafter written for a LlamaModel drafts for that
    sequence (`specli batch --parallel` with a draft model: one draft cache per sequence)."""

    def __init__(self, seqs: MultiSequenceContext, seq: int, model: LlamaModel):
        self._seqs, self._seq, self._model = seqs, seq, model
        self.n_ctx = seqs.n_ctx_per_seq
        self.synced_new = 0  # tokens the latest sync() evaluated
        self.max_branches = 1  # (tree passes need LlamaModel(branches=N)'s sequences)

    @property
    def cached(self) -> list[int]:
        return self._seqs.cached[self._seq]

    def is_eog(self, token: int) -> bool:
        return self._model.is_eog(token)

    def eval(self, tokens: Sequence[int], *, logits: Literal["last", "none"] = "last") -> np.ndarray:
        """Append `tokens`; the logits of the last one (one row), or none."""
        if logits == "none" or not tokens:
            self._seqs.eval({self._seq: tokens}, logits="none")
            return np.empty((0, self._seqs.n_vocab), dtype=np.float32)
        if len(tokens) > 1:
            self._seqs.eval({self._seq: tokens[:-1]}, logits="none")
        return self._seqs.eval({self._seq: tokens[-1:]}, logits="all")[self._seq]

    def truncate(self, n_keep: int) -> None:
        self._seqs.truncate(self._seq, n_keep)

    @property
    def can_shift(self) -> bool:
        return self._seqs.can_shift

    def reuse_chunks(self, tokens: Sequence[int], min_chunk: int) -> int:
        return self._seqs.reuse_chunks(self._seq, tokens, min_chunk)

    def sync(self, context: Sequence[int]) -> np.ndarray:
        """As LlamaModel.sync: keep the common prefix, evaluate the rest, return the last logits."""
        assert context, "sync needs at least one token"
        return sync_cache(self, context)


class ModelPasses:
    """A model's own context behind MultiSequenceContext's pass API: one sequence (the step
    loop's on the target for `run`, `chat`, `batch --parallel 1`, `serve --parallel 1`)."""

    n_seq = 1

    def __init__(self, model: LlamaModel):
        self.model = model
        self.n_batch = model.n_batch

    def eval(
        self, requests: dict[int, list[int]], *, rows: dict[int, int], trees: dict[int, list[int]] | None = None,
    ) -> dict[int, np.ndarray]:
        """Each request's logits for its last rows[s] tokens; a request in `trees` is a token
        tree (its tokens' parents: -1 for the first, LlamaModel.eval_tree), a row for each token."""
        trees = trees or {}
        return {s: self.model.eval_tree(tokens, trees[s]) if s in trees else self.model.eval(tokens, logits=rows[s])
                for s, tokens in requests.items()}

    def clear(self, s: int) -> None:
        """After a failure: drop what the cache may hold beyond what is tracked (a failed or
        interrupted decode), keeping the rest for the next prompt; if even that fails, empty it."""
        try:
            self.model.forget_untracked()
        except SpecliError:
            self.model.reset()

    def close(self) -> None:
        pass  # (the context is the model's own)
