"""The one place that talks to llama.cpp (through llama-cpp-python's low-level API).

Everything else in specli sees a `LlamaModel`: a loaded GGUF with its own context and KV cache
for one sequence, that can tokenize, turn tokens into text pieces, evaluate tokens (returning
logits for the positions asked) and forget the tail of its cache.

The model tracks which tokens its KV cache holds (`cached`), position by position, so callers
never do position arithmetic: they say "make the cache hold this context" (`sync`) or "forget
everything after n" (`truncate`).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

import llama_cpp

from specli.errors import ModelFileError, SpecliError, UsageError
from specli.models.header import check_model_header

GGUF_MAGIC = b"GGUF"

# KV cache element types a user may pick (ggml type ids).
KV_TYPES = {
    "f32": llama_cpp.GGML_TYPE_F32,
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}
FLASH_ATTN = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}

# llama.cpp's vocab types (enum llama_vocab_type), for messages.
VOCAB_TYPE_NAMES = {0: "none", 1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo2"}

# --- native log -------------------------------------------------------------------------------
# llama.cpp logs every tensor it loads. We keep its log quiet unless asked, but remember the
# last lines so that a failed load can say why. The ctypes callback must stay referenced for the
# life of the process: llama.cpp keeps the raw pointer (a collected callback means a call into
# freed memory).
_LOG_LEVEL_ERROR = 4
_recent_log: collections.deque[tuple[int, str]] = collections.deque(maxlen=64)
_log_lock = threading.Lock()
_verbose = False
_backend_ready = False


def _on_native_log(level: int, text: bytes | None, _user_data: ctypes.c_void_p) -> None:
    line = (text or b"").decode("utf-8", errors="replace")
    with _log_lock:
        _recent_log.append((level, line))
    if _verbose:
        try:
            os.write(2, text or b"")
        except OSError:  # stderr closed or full: the log is not worth failing for
            pass


_log_callback = llama_cpp.llama_log_callback(_on_native_log)


# --- Ctrl-C inside native calls ---------------------------------------------------------------
# llama.cpp calls back into Python (the log above, the load's progress below) while it loads or
# decodes. Python runs a SIGINT handler at the next Python instruction, which is then inside such
# a callback: a KeyboardInterrupt raised there cannot cross the C frames; ctypes prints it and
# drops it, and the load goes on. So while a native call that may call back runs (`with
# _native:`), specli's SIGINT handler only records the request; the load's progress callback then
# cancels the load, and KeyboardInterrupt is raised once the call returns. Outside such calls the
# handler is Python's own (KeyboardInterrupt at once). Entering and leaving costs two integer
# updates: it sits around every decode.
_interrupt_requested = False
_native_depth = 0


def _on_sigint(signum, frame) -> None:
    global _interrupt_requested
    if _native_depth:
        _interrupt_requested = True
    else:
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt


def _install_sigint_handler() -> None:
    """Take over SIGINT, only where it has Python's default handler (a program that set its
    own keeps it) and only from the main thread (the only one that may)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def _on_load_progress(_progress: float, _user_data: ctypes.c_void_p) -> bool:
    return not _interrupt_requested  # False cancels the load


_progress_callback = llama_cpp.llama_progress_callback(_on_load_progress)


class _NativeCall:
    """`with _native:` around a native call that may call back into Python: a Ctrl-C during
    it comes out as KeyboardInterrupt when the outermost such block is left."""

    def __enter__(self) -> None:
        global _native_depth
        _native_depth += 1

    def __exit__(self, *exc: object) -> None:
        global _native_depth, _interrupt_requested
        _native_depth -= 1
        if _interrupt_requested and not _native_depth:
            _interrupt_requested = False
            raise KeyboardInterrupt


_native = _NativeCall()


def init_backend(*, verbose: bool = False) -> None:
    """Initialise llama.cpp once per process; `verbose` lets its native log through to stderr."""
    global _backend_ready, _verbose
    _verbose = verbose
    if not _backend_ready:
        _install_sigint_handler()
        with _native:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
        _backend_ready = True


def _last_native_error() -> str | None:
    """The last error line llama.cpp logged (used to explain a failed load), or None."""
    with _log_lock:
        for level, line in reversed(_recent_log):
            if level == _LOG_LEVEL_ERROR and line.strip():
                return line.strip()
    return None


def check_gguf_file(path: Path) -> None:
    """Raise ModelFileError unless `path` is a readable file that starts like a GGUF."""
    if not path.exists():
        raise ModelFileError(f"model file not found: {path} (check the path or use a models.toml name)")
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, not a GGUF file (pass the .gguf file inside it)")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as err:
        raise ModelFileError(f"cannot read {path}: {err.strerror} (check its permissions)") from err
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a llama.cpp .gguf model"
        )


@dataclass(frozen=True)
class VocabInfo:
    """What the draft/target compatibility rule compares (see compat.py)."""

    vocab_type: int
    n_tokens: int
    bos: int
    eos: int
    add_bos: bool


class LlamaModel:
    """A loaded GGUF plus one context (KV cache) for a single sequence.

    Invariant: `cached[i]` is the token whose keys and values sit at position i of the cache.
    """

    def __init__(
        self,
        path: Path,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = -1,
        n_threads: int | None = None,
        n_batch: int = 512,
        kv_type: str = "f16",
        flash_attn: str = "auto",
    ):
        """Load `path` (every layer offloaded to the GPU by default) and create its context.

        kv_type and flash_attn are llama.cpp's defaults. Batched and one-token decodes then
        differ by ~1e-2 in the logits; kv_type="f32" with flash_attn="off" brings that to
        ~1e-5 (what exactness tests on F32 models use).

        Raises ModelFileError for a missing/invalid/unloadable file and SpecliError when the
        context cannot be created (e.g. out of memory).
        """
        init_backend(verbose=_verbose)
        path = Path(path)
        check_gguf_file(path)
        check_model_header(path)  # header facts llama.cpp would abort on
        self.path = path

        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        mparams.progress_callback = _progress_callback  # cancels the load on Ctrl-C
        _recent_log.clear()
        with _native:
            model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
            if _interrupt_requested:  # cancelled (or loaded just as Ctrl-C came): give it back
                if model:
                    llama_cpp.llama_model_free(model)
                model = None
        if not model:
            reason = _last_native_error() or "the file is truncated, corrupt or of an unsupported architecture"
            raise ModelFileError(f"llama.cpp could not load {path}: {reason} (re-download the file; --verbose shows llama.cpp's log)")
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))

        threads = n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
        cparams.flash_attn_type = FLASH_ATTN[flash_attn]
        try:
            with _native:
                ctx = llama_cpp.llama_init_from_model(model, cparams)
                if _interrupt_requested and ctx:
                    llama_cpp.llama_free(ctx)
                    ctx = None
        except BaseException:  # Ctrl-C while the context was made: free the weights too
            llama_cpp.llama_model_free(model)
            self._model = None
            raise
        if not ctx:
            llama_cpp.llama_model_free(model)
            self._model = None
            reason = _last_native_error() or "not enough memory?"
            raise SpecliError(f"llama.cpp could not create a {n_ctx}-token context for {path}: {reason} (try a smaller -c)")
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx))
        # llama.cpp caps the batch at the requested context (-c 32: 32) and aborts the process
        # on a longer decode, while it pads the context itself to 256: chunk by its figure.
        self.n_batch = int(llama_cpp.llama_n_batch(ctx))
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.cached: list[int] = []
        self.synced_new = 0  # tokens the latest sync() evaluated
        # Logits of the newest cached token, when the latest eval produced them (else None).
        self._tail_logits: np.ndarray | None = None
        self._pieces: dict[int, bytes] = {}

    # --- facts about the model ----------------------------------------------------------------
    @property
    def is_recurrent_or_hybrid(self) -> bool:
        """Recurrent and hybrid models cannot drop part of their state, which rejection needs."""
        return bool(llama_cpp.llama_model_is_recurrent(self._model)) or bool(
            llama_cpp.llama_model_is_hybrid(self._model)
        )

    def vocab_info(self) -> VocabInfo:
        v = self._vocab
        return VocabInfo(
            vocab_type=int(llama_cpp.llama_vocab_type(v)),
            n_tokens=self.n_vocab,
            bos=int(llama_cpp.llama_vocab_bos(v)),
            eos=int(llama_cpp.llama_vocab_eos(v)),
            add_bos=bool(llama_cpp.llama_vocab_get_add_bos(v)),
        )

    def token_text(self, token: int) -> bytes:
        """The vocabulary entry of `token` as stored in the GGUF (not rendered)."""
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, end-of-turn, ...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    # --- text <-> tokens --------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = True, parse_special: bool = False) -> list[int]:
        """Tokens of `text`, with BOS first when the model wants one and `add_bos` is set."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_bos, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_bos, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes `token` renders to (control tokens render empty). Cached: pieces never change."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            cached = buf.raw[:n]
            self._pieces[token] = cached
        return cached

    # --- the KV cache -------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], *, logits: Literal["all", "last", "none"] = "last") -> np.ndarray:
        """Append `tokens` to the cache and return their logits.

        Needs: len(cached) + len(tokens) <= n_ctx. Returns an array of shape (rows, n_vocab):
        one row per token for "all", one row for "last", zero rows for "none". The array is a
        view of llama.cpp's buffer, valid only until the next eval: copy what must outlive it.
        """
        if not tokens:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        assert logits != "all" or len(tokens) <= self.n_batch, "logits for all positions: one batch at most"
        if len(self.cached) + len(tokens) > self.n_ctx:
            raise SpecliError(f"internal: {len(self.cached)}+{len(tokens)} tokens exceed the context of {self.n_ctx}")
        rows = 0
        self._tail_logits = None
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            is_final_chunk = start + self.n_batch >= len(tokens)
            want = "none" if not is_final_chunk else logits
            rows = self._decode_chunk(chunk, want)
        if rows == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = llama_cpp.llama_get_logits(self._ctx)
        out = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        self._tail_logits = out[-1:]
        return out

    def _decode_chunk(self, chunk: Sequence[int], logits: str) -> int:
        batch = self._batch
        pos0 = len(self.cached)
        n = len(chunk)
        batch.n_tokens = n
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = logits == "all"
        if logits == "last":
            batch.logits[n - 1] = True
        with _native:  # a Ctrl-C comes out after the bookkeeping
            status = llama_cpp.llama_decode(self._ctx, batch)
            if status == 0:
                self.cached.extend(chunk)
            else:
                # The cache may hold part of the chunk now: drop it so `cached` stays true.
                llama_cpp.llama_memory_seq_rm(self._memory, 0, pos0, -1)
        if status != 0:
            reason = _last_native_error() or f"llama_decode returned {status}"
            raise SpecliError(f"decoding failed at position {pos0}: {reason}")
        return n if logits == "all" else (1 if logits == "last" else 0)

    def truncate(self, n_keep: int) -> None:
        """Forget every cached position >= n_keep. Raises SpecliError if llama.cpp cannot."""
        assert 0 <= n_keep, n_keep
        if n_keep >= len(self.cached):
            return
        self._tail_logits = None
        self._remove_from(n_keep)
        del self.cached[n_keep:]

    def _remove_from(self, pos: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(self._memory, 0, pos, -1):
            raise SpecliError(
                f"llama.cpp cannot remove cache entries from position {pos} for {self.path.name} "
                "(recurrent or hybrid models cannot be used for speculative decoding)"
            )

    def sync(self, context: Sequence[int]) -> np.ndarray:
        """Make the cache hold exactly `context` and return the logits of its last token (1 row).

        Reuses the longest common prefix already cached; evaluates only the rest. Needs a
        non-empty context.
        """
        assert context, "sync needs at least one token"
        if len(context) == len(self.cached) == common_prefix_len(self.cached, context) and self._tail_logits is not None:
            self.synced_new = 0
            return self._tail_logits
        return _sync(self, context)

    def reset(self) -> None:
        """Empty the cache."""
        llama_cpp.llama_memory_clear(self._memory, True)
        self.cached.clear()
        self._tail_logits = None

    def close(self) -> None:
        """Free the context, batch and weights (safe to call twice)."""
        _free_context(self)
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- for `specli chat` ----------------------------------------------------------------------
    def chat_template(self) -> str | None:
        """The chat template stored in the GGUF metadata (tokenizer.chat_template), or None."""
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        text = raw.decode("utf-8", errors="replace") if raw else ""
        return text if text.strip() else None  # some base models store an empty template

    def forget_untracked(self) -> None:
        """Drop cache entries beyond `cached`. A Ctrl-C between a decode and its bookkeeping can
        leave some behind, and the next positions would then collide with them."""
        self._tail_logits = None
        self._remove_from(len(self.cached))


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
    ):  # fmt: skip
        assert n_seq >= 1
        threads = n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_seq * n_ctx_per_seq
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
        cparams.flash_attn_type = FLASH_ATTN[flash_attn]
        with _native:
            ctx = llama_cpp.llama_init_from_model(model._model, cparams)
            if _interrupt_requested and ctx:
                llama_cpp.llama_free(ctx)
                ctx = None
        if not ctx:
            reason = _last_native_error() or "not enough memory?"
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

    def eval(self, requests: dict[int, Sequence[int]], *, logits: Literal["all", "none"] = "all") -> dict[int, np.ndarray]:
        """Append each request's tokens to its sequence; return {seq: logits, one row per token}
        (empty dict for "none"). "all" needs every token in one batch (<= n_batch in total).
        The arrays are views of llama.cpp's buffer, valid until the next eval."""
        flat = [(seq, len(self.cached[seq]) + i, token) for seq, tokens in requests.items() for i, token in enumerate(tokens)]
        for seq, tokens in requests.items():
            if len(self.cached[seq]) + len(tokens) > self.n_ctx_per_seq:
                raise SpecliError(f"internal: sequence {seq} would exceed its {self.n_ctx_per_seq} positions")
        if logits == "all":
            assert len(flat) <= self.n_batch, "logits for all positions: one batch at most"
        for start in range(0, len(flat), self.n_batch):
            self._decode_chunk(flat[start : start + self.n_batch], want_logits=logits == "all")
        if logits == "none" or not flat:
            return {}
        out = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(len(flat), self.n_vocab))
        rows, row = {}, 0
        for seq, tokens in requests.items():  # rows come in batch order: sequence by sequence
            rows[seq] = out[row : row + len(tokens)]
            row += len(tokens)
        return rows

    def _decode_chunk(self, chunk: list[tuple[int, int, int]], *, want_logits: bool) -> None:
        batch = self._batch
        batch.n_tokens = len(chunk)
        for i, (seq, pos, token) in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want_logits
        with _native:  # a Ctrl-C comes out after the bookkeeping
            status = llama_cpp.llama_decode(self._ctx, batch)
            if status != 0:
                for seq in {seq for seq, _, _ in chunk}:  # drop what may have landed, keep `cached` true
                    llama_cpp.llama_memory_seq_rm(self._memory, seq, len(self.cached[seq]), -1)
            else:
                for seq, _, token in chunk:
                    self.cached[seq].append(token)
        if status != 0:
            reason = _last_native_error() or f"llama_decode returned {status}"
            raise SpecliError(f"decoding {len(chunk)} tokens of {len({s for s, _, _ in chunk})} sequences failed: {reason}")

    def truncate(self, seq: int, n_keep: int) -> None:
        """Forget positions >= n_keep of sequence `seq`."""
        if n_keep >= len(self.cached[seq]):
            return
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq, n_keep, -1):
            raise SpecliError(f"llama.cpp cannot remove cache entries from position {n_keep} of sequence {seq} for {self.path.name}")
        del self.cached[seq][n_keep:]

    def clear(self, seq: int) -> None:
        """Empty sequence `seq` (its cells go back to the pool), including untracked entries."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq, 0, -1)
        self.cached[seq].clear()

    def close(self) -> None:
        """Free the context and batch (safe to call twice; the weights belong to the model)."""
        _free_context(self)


def _free_context(owner: "LlamaModel | MultiSequenceContext") -> None:
    """Free owner._ctx and owner._batch if they are still held (a half-built owner has neither)."""
    if getattr(owner, "_ctx", None):
        llama_cpp.llama_batch_free(owner._batch)
        llama_cpp.llama_free(owner._ctx)
        owner._ctx = None


class SequenceView:
    """One sequence of a MultiSequenceContext behind LlamaModel's cache API (`cached`, `sync`,
    `eval`, `truncate`, `is_eog`), so that a drafter written for a LlamaModel drafts for that
    sequence (`specli batch --parallel` with a draft model: one draft cache per sequence)."""

    def __init__(self, seqs: MultiSequenceContext, seq: int, model: LlamaModel):
        self._seqs, self._seq, self._model = seqs, seq, model
        self.n_ctx = seqs.n_ctx_per_seq
        self.synced_new = 0  # tokens the latest sync() evaluated

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

    def sync(self, context: Sequence[int]) -> np.ndarray:
        """As LlamaModel.sync: keep the common prefix, evaluate the rest, return the last logits."""
        assert context, "sync needs at least one token"
        return _sync(self, context)


def _sync(model: "LlamaModel | SequenceView", context: Sequence[int]) -> np.ndarray:
    """Make model's cache hold exactly `context` (non-empty) and return its last token's logits:
    keep the longest common prefix, evaluate the rest, at least the last token (the logits of an
    already-cached one are gone). Sets model.synced_new to the tokens evaluated."""
    common = min(common_prefix_len(model.cached, context), len(context) - 1)
    model.truncate(common)
    model.synced_new = len(context) - common
    return model.eval(context[common:], logits="last")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, done in C
        return n
    lo, hi = 0, n  # binary search on "prefixes of length m are equal"
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def default_threads() -> int:
    """Physical cores (llama.cpp's advice for generation), at least 1."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False)
    except Exception:  # psutil cannot tell on some platforms
        cores = None
    return max(1, cores or os.cpu_count() or 1)


MIN_CTX = 16
# llama.cpp keeps n_ctx in 32 bits (a larger -c would wrap around silently); 16M tokens is more
# than any GGUF model is trained for.
MAX_CTX = 1 << 24


def validate_ctx(n_ctx: int) -> None:
    if n_ctx < MIN_CTX:
        raise UsageError(f"context size {n_ctx} is too small; use -c {MIN_CTX} or more (default 4096)")
    if n_ctx > MAX_CTX:
        raise UsageError(f"context size {n_ctx} is over the maximum of {MAX_CTX} tokens (16M); use a smaller -c")


FILE_TYPES = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}


def convert(src: Path, dst: Path, file_type: str, *, n_threads: int | None = None) -> Path:
    """Write `src` re-quantized to `file_type` ("f32", "f16", "q8_0") at `dst` and return dst.

    Used to make a slower target of the same vocabulary (e.g. Gemma F16 beside its Q4_K_M).
    """
    init_backend(verbose=_verbose)
    check_gguf_file(Path(src))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.allow_requantize = True
    params.nthread = n_threads or default_threads()
    with _native:
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if status != 0:
        raise SpecliError(f"converting {src} to {file_type} failed: {_last_native_error() or status}")
    return Path(dst)


# --- chat templates (used by `specli chat`) -----------------------------------------------------
def builtin_chat_templates() -> list[str]:
    """Names of the chat templates llama.cpp knows by name (chatml, gemma, llama3, ...)."""
    n = int(llama_cpp.llama_chat_builtin_templates(None, 0))
    names = (ctypes.c_char_p * max(n, 1))()
    n = int(llama_cpp.llama_chat_builtin_templates(names, n))
    return [names[i].decode("utf-8") for i in range(max(n, 0))]


def apply_chat_template(template: str, messages: Sequence[tuple[str, str]], *, add_assistant: bool = True) -> str | None:
    """Render (role, content) messages with `template` (a built-in name or a template's source).

    add_assistant ends the text with the opening of an assistant turn. Returns None when
    llama.cpp does not recognise the template (its detection covers the common families only).
    """
    chat = (llama_cpp.llama_chat_message * max(len(messages), 1))()
    # Keep the encoded strings referenced while llama.cpp reads them.
    encoded = [(role.encode("utf-8"), content.encode("utf-8")) for role, content in messages]
    for i, (role, content) in enumerate(encoded):
        chat[i].role, chat[i].content = role, content
    tmpl = template.encode("utf-8")
    size = max(256, 2 * sum(len(r) + len(c) for r, c in encoded))
    for _ in range(2):  # a second try when the first buffer was too small
        buf = ctypes.create_string_buffer(size)
        n = int(llama_cpp.llama_chat_apply_template(tmpl, chat, len(encoded), add_assistant, buf, size))
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
    return None



# --- for `specli fit` ---------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendDevice:
    """One ggml backend device as llama.cpp sees it; memory in bytes."""

    name: str
    description: str
    kind: str  # "cpu", "gpu", "igpu", "accel" or "other"
    free: int
    total: int


_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def backend_devices() -> list[BackendDevice]:
    """llama.cpp's own device list (ggml_backend_dev_*), or [] when it cannot be queried.

    llama-cpp-python does not bind these functions, so they are called from libggml through
    ctypes; the library sits beside libllama in llama_cpp/lib. Never raises.
    """
    try:
        init_backend(verbose=_verbose)
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        names = sorted(lib_dir.glob("libggml.so*")) + sorted(lib_dir.glob("libggml*.dylib")) + sorted(lib_dir.glob("ggml.dll"))
        if not names:
            return []
        lib = ctypes.CDLL(str(names[0]))
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
            fn.restype = ctypes.c_char_p
            fn.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_memory.restype = None
        lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        devices = []
        for i in range(int(lib.ggml_backend_dev_count())):
            dev = lib.ggml_backend_dev_get(i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            devices.append(BackendDevice(
                name=(lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
                description=(lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
                kind=_DEVICE_KINDS.get(int(lib.ggml_backend_dev_type(dev)), "other"),
                free=int(free.value),
                total=int(total.value),
            ))
        return devices
    except (OSError, AttributeError):  # no such library or symbol in this build
        return []


def measure_kv_cache_bytes(path: Path, *, n_ctx: int, kv_type: str = "f16") -> int:
    """Bytes of KV cache llama.cpp allocates for `path` with an n_ctx context (CPU only).

    Loads the model and reads llama.cpp's own "llama_kv_cache: size = X MiB" log lines (one per
    cache; SWA models have two). The usual log ring is too short to keep them past the loader's
    lines, so a large one is swapped in for the duration. For tests of `specli fit`.
    """
    import re

    global _recent_log
    saved = _recent_log
    _recent_log = collections.deque(maxlen=100_000)
    try:
        with LlamaModel(Path(path), n_ctx=n_ctx, n_gpu_layers=0, n_threads=1, kv_type=kv_type):
            lines = [line for _, line in _recent_log]
    finally:
        _recent_log = saved
    sizes = [float(m.group(1)) for line in lines if (m := re.search(r"llama_kv_cache: size =\s*([\d.]+) MiB", line))]
    if not sizes:
        raise SpecliError(f"llama.cpp logged no KV cache size for {path}")
    return round(sum(sizes) * 1024 * 1024)
