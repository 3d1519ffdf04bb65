"""A loaded model and its single-sequence context (through llama-cpp-python's low-level API).

Everything else in specli sees a `LlamaModel`: a loaded GGUF with its own context and KV cache
for one sequence, that can tokenize, turn tokens into text pieces, evaluate tokens (returning
logits for the positions asked) and forget the tail of its cache.

The model tracks which tokens its KV cache holds (`cached`), position by position, so callers
never do position arithmetic: they say "make the cache hold this context" (`sync`) or "forget
everything after n" (`truncate`).

The rest of the llama package: context.py (several sequences on one model), templates.py (chat
templates), native.py (backend, native log, Ctrl-C), devices.py (devices, threads), compat.py
(can a draft model speak for a target).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import llama_cpp
import numpy as np

from specli.errors import ModelFileError, SpecliError
from specli.files import NotRegularFile, open_regular
from specli.gguf import check_model_header, not_regular_error
from specli.llama.devices import default_threads
from specli.llama.native import clear_native_log, ensure_backend, interrupt_requested, last_native_error, native, native_pass, progress_callback, warn_about_amx

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


def check_gguf_file(path: Path) -> None:
    """Raise ModelFileError unless `path` is a readable file that starts like a GGUF."""
    if not path.exists():
        raise ModelFileError(f"model file not found: {path} (check the path or use a models.toml name)")
    try:
        with open_regular(path) as handle:  # (a FIFO would block the open, a device be read)
            magic = handle.read(4)
    except NotRegularFile as err:
        raise not_regular_error(path, err.kind) from None
    except OSError as err:
        raise ModelFileError(f"cannot read {path}: {err.strerror} (check its permissions)") from err
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a llama.cpp .gguf model"
        )


@dataclass(frozen=True)
class _PendingTree:
    """An eval_tree pass whose nodes sit in the branch sequences until keep_branch."""

    start: int  # the position of its root (len(cached) before it)
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    seqs: tuple[tuple[int, ...], ...]  # per node, the branch sequences holding it
    n_seqs: int  # branch sequences used: 1 .. n_seqs


def tree_sequences(parents: Sequence[int]) -> list[list[int]]:
    """Per node of a tree (parents[i] < i, parents[0] == -1), the sequence ids of the branches
    through it: leaf j (in node order) is sequence 1 + j, a node holds every leaf's below it."""
    n = len(parents)
    assert n >= 1 and parents[0] == -1 and all(-1 < parents[i] < i for i in range(1, n)), "a tree: parents first, one root"
    is_parent = [False] * n
    for i in range(1, n):
        is_parent[parents[i]] = True
    seqs: list[list[int]] = [[] for _ in range(n)]
    leaf = 0
    for i in range(n):
        if not is_parent[i]:
            leaf += 1
            seqs[i].append(leaf)
    for i in range(n - 1, 0, -1):  # (children come after their parents)
        seqs[parents[i]].extend(seqs[i])
    return [sorted(s) for s in seqs]


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
        devices: Sequence[int] | None = None,
        tensor_split: Sequence[float] | None = None,
        branches: int = 1,
    ):
        """Load `path` (every layer offloaded to the GPU by default) and create its context.

        devices: the ggml devices (ggml_backend_dev_t) the offloaded layers go to (None:
        llama.cpp's choice, every local GPU; [] keeps the model on the CPU; rpc.py's devices
        put layers on other machines). tensor_split: each device's share of those layers, in
        that order (None: by free memory, as llama.cpp does).

        kv_type and flash_attn are llama.cpp's defaults. Batched and one-token decodes then
        differ by ~1e-2 in the logits; kv_type="f32" with flash_attn="off" brings that to
        ~1e-5 (what exactness tests on F32 models use).

        branches: the most branches one eval_tree pass may hold (1: no tree passes; more makes
        the context hold that many sequences besides the main one, in one unified cache).

        Raises ModelFileError for a missing/invalid/unloadable file and SpecliError when the
        context cannot be created (e.g. out of memory).
        """
        ensure_backend()
        path = Path(path)
        check_gguf_file(path)
        check_model_header(path)  # header facts llama.cpp would abort on
        self.path = path
        self._load_weights(n_gpu_layers, devices, tensor_split)
        if branches < 1:
            raise ValueError(f"branches must be at least 1, got {branches}")
        self.max_branches = branches
        self._create_context(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn)
        self.cached: list[int] = []
        self._tree: _PendingTree | None = None  # an eval_tree pass awaiting keep_branch
        self.synced_new = 0  # tokens the latest sync() evaluated
        # Logits of the newest cached token, when the latest eval produced them (else None).
        self._tail_logits: np.ndarray | None = None
        self._pieces: dict[int, bytes] = {}
        self._longest: int | None = None

    def _load_weights(self, n_gpu_layers: int, devices: Sequence[int] | None, tensor_split: Sequence[float] | None) -> None:
        """Load self.path's weights (`_model`) and its vocabulary; ModelFileError if llama.cpp cannot."""
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        mparams.progress_callback = progress_callback  # cancels the load on Ctrl-C
        warn_about_amx()
        fields = dict(llama_cpp.llama_model_params._fields_)
        if devices is not None:  # a NULL-terminated array, read during the load only
            device_array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            mparams.devices = ctypes.cast(device_array, fields["devices"])
        if tensor_split is not None:
            split_array = (ctypes.c_float * llama_cpp.llama_max_devices())(*tensor_split)
            mparams.tensor_split = ctypes.cast(split_array, fields["tensor_split"])
        clear_native_log()
        with native:
            model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
            if interrupt_requested():  # cancelled (or loaded just as Ctrl-C came): give it back
                if model:
                    llama_cpp.llama_model_free(model)
                model = None
        if not model:
            reason = last_native_error() or "the file is truncated, corrupt or of an unsupported architecture"
            raise ModelFileError(f"llama.cpp could not load {self.path}: {reason} (re-download the file; --verbose shows llama.cpp's log)")
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))

    def _create_context(self, *, n_ctx: int, n_batch: int, n_threads: int | None, kv_type: str, flash_attn: str) -> None:
        """Create this model's own context (`_ctx`) and batch on the loaded weights. If it
        cannot be made (SpecliError) or a Ctrl-C comes meanwhile, the weights are freed too."""
        cparams = context_params(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn)
        n_seq = 1 if self.max_branches == 1 else 1 + self.max_branches
        if n_seq > 1:
            # Branch sequences share the main one's cells (seq_cp adds an id to a cell, copies
            # nothing): that needs one unified cache, not a stream per sequence.
            cparams.n_seq_max = n_seq
            cparams.kv_unified = True
        try:
            ctx = self.new_context(cparams)
        except BaseException:  # Ctrl-C while the context was made: free the weights too
            self._free_weights()
            raise
        if not ctx:
            self._free_weights()
            reason = last_native_error() or "not enough memory?"
            raise SpecliError(f"llama.cpp could not create a {n_ctx}-token context for {self.path}: {reason} (try a smaller -c)")
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx))
        # llama.cpp caps the batch at the requested context (-c 32: 32) and aborts the process
        # on a longer decode, while it pads the context itself to 256: chunk by its figure.
        self.n_batch = int(llama_cpp.llama_n_batch(ctx))
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, n_seq)

    def new_context(self, cparams: llama_cpp.llama_context_params):
        """A new llama.cpp context (llama_context *) on these weights, or None when llama.cpp
        cannot make one (last_native_error() may say why). A Ctrl-C meanwhile frees it and
        raises KeyboardInterrupt. The caller owns it: free it with free_context."""
        with native:
            ctx = llama_cpp.llama_init_from_model(self._model, cparams)
            if interrupt_requested() and ctx:
                llama_cpp.llama_free(ctx)
                ctx = None
        return ctx

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

    def strips(self, token: int) -> tuple[bool, bool]:
        """Whether tokenize() with parse_special drops the whitespace before `token` (lstrip) and
        after it (rstrip), as some vocabularies ask for their control tokens."""
        attr = int(llama_cpp.llama_vocab_get_attr(self._vocab, token))
        return bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP), bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)

    def is_control(self, token: int) -> bool:
        """True for control tokens (a chat template's markers such as `<start_of_turn>`), which
        tokenize() makes from their text only with parse_special."""
        return bool(llama_cpp.llama_vocab_is_control(self._vocab, token))

    def longest_token_bytes(self) -> int:
        """The most bytes of text one token can stand for (the longest stored entry, which is
        never shorter than what it renders to): a text over n times this is over n tokens."""
        if self._longest is None:
            v = self._vocab
            self._longest = max(1, max(len(llama_cpp.llama_vocab_get_text(v, t) or b"") for t in range(self.n_vocab)))
        return self._longest

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, end-of-turn, ...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (a scan, once)."""
        if getattr(self, "_eog", None) is None:
            self._eog = tuple(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t))
        return self._eog

    def fim_tokens(self) -> dict[str, int | None]:
        """The vocabulary's fill-in-the-middle tokens as llama.cpp finds them (from the GGUF's
        tokenizer.ggml.fim_*_token_id, else by their text: <|fim_prefix|>, <PRE>, ...): "pre",
        "suf", "mid", and the repo-level "rep" and "sep"; None where the model has none."""
        v, null = self._vocab, llama_cpp.LLAMA_TOKEN_NULL
        found = {
            "pre": llama_cpp.llama_vocab_fim_pre(v), "suf": llama_cpp.llama_vocab_fim_suf(v), "mid": llama_cpp.llama_vocab_fim_mid(v),
            "rep": llama_cpp.llama_vocab_fim_rep(v), "sep": llama_cpp.llama_vocab_fim_sep(v),
        }
        return {name: None if token == null else int(token) for name, token in found.items()}

    def special_piece(self, token: int) -> bytes:
        """The bytes `token` renders to with control tokens as their text (llama.cpp's
        common_token_to_piece with special=true: what llama-server's /detokenize and /tokenize's
        pieces show). Not cached: piece() is the one generation uses."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n]

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

    def tokenize_prompt(self, text: str, *, parse_special: bool = True) -> list[int]:
        """A raw prompt's tokens as llama.cpp's CLI and server make them by default
        (common_tokenize with add_special and parse_special): a template's control text written
        into the prompt (`<|im_start|>`, `<start_of_turn>`) becomes its control token, and BOS
        comes first where the model wants one. One difference: a prompt that starts with the BOS
        text itself keeps one BOS, where llama.cpp sends two (and warns). parse_special=False
        (--no-parse-special): all of it is text, as chat messages always are."""
        info = self.vocab_info()
        ids = self.tokenize(text, add_bos=info.add_bos, parse_special=parse_special)
        if parse_special and info.add_bos and len(ids) >= 2 and ids[0] == ids[1] == info.bos:
            del ids[0]
        return ids

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
    def eval(self, tokens: Sequence[int], *, logits: Literal["all", "last", "none"] | int = "last") -> np.ndarray:
        """Append `tokens` to the cache and return their logits.

        Needs: len(cached) + len(tokens) <= n_ctx. Returns an array of shape (rows, n_vocab):
        one row per token for "all", one row for "last", zero rows for "none", and for a number
        m one row for each of the last m tokens (a prompt's end evaluated with a step's tokens:
        only these need rows). Rows come from the final batch only. The array is a view of
        llama.cpp's buffer, valid only until the next eval: copy what must outlive it.
        """
        self.drop_tree()
        if not tokens:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        n_rows = {"all": len(tokens), "last": 1, "none": 0}[logits] if isinstance(logits, str) else logits
        final_start = (len(tokens) - 1) // self.n_batch * self.n_batch
        assert 0 <= n_rows <= len(tokens) - final_start, "logits from the final batch only"
        if len(self.cached) + len(tokens) > self.n_ctx:
            raise SpecliError(f"internal: {len(self.cached)}+{len(tokens)} tokens exceed the context of {self.n_ctx}")
        self._tail_logits = None
        for start in range(0, len(tokens), self.n_batch):
            self._decode_chunk(tokens[start : start + self.n_batch], n_rows if start == final_start else 0)
        if n_rows == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        with native_pass:  # llama_decode returns before the pass is done: this waits for it
            ptr = llama_cpp.llama_get_logits(self._ctx)
        out = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))
        self._tail_logits = out[-1:]
        return out

    def _decode_chunk(self, chunk: Sequence[int], n_rows: int) -> None:
        """Decode one batch, with logits for its last n_rows tokens."""
        assert self._ctx, "internal: this model's own context was released"
        batch = self._batch
        pos0 = len(self.cached)
        n = len(chunk)
        batch.n_tokens = n
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i >= n - n_rows
        with native_pass:  # a Ctrl-C comes out after the bookkeeping
            status = llama_cpp.llama_decode(self._ctx, batch)
            if status == 0:
                self.cached.extend(chunk)
            else:
                # The cache may hold part of the chunk now: drop it so `cached` stays true.
                llama_cpp.llama_memory_seq_rm(self._memory, 0, pos0, -1)
        if status != 0:
            reason = last_native_error() or f"llama_decode returned {status}"
            raise SpecliError(f"decoding failed at position {pos0}: {reason}")

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Evaluate a token tree after the cache in one pass: tokens[0] (parents[0] == -1)
        follows the cached context, token i > 0 follows its parent parents[i] < i. Returns one
        row of logits per token, each conditioned on the context and its own path only (a view,
        valid until the next pass). Until keep_branch the tree sits beside the cache, which is
        unchanged; drop_tree, or any other eval, truncate or reset, forgets it (after a Ctrl-C
        between the pass and keep_branch, the cache is as before the pass).

        How (llama.cpp's examples/lookahead): each leaf's branch is a sequence of its own (1 ..
        leaves) that first gets the cached context (seq_cp: in the unified cache, the cells
        gain an id), and a token on several branches carries all their ids. Attention masks by a
        token's first id, which is a branch through that token: it sees the context and its
        ancestors, nothing else. Needs: at most max_branches leaves, all tokens in one batch."""
        self.drop_tree()
        seqs = tree_sequences(parents)
        n_leaves = max(max(s) for s in seqs)
        n = len(tokens)
        if n_leaves > self.max_branches:
            raise SpecliError(f"internal: a tree of {n_leaves} branches; this context holds {self.max_branches}")
        if n > self.n_batch:
            raise SpecliError(f"internal: a tree of {n} tokens exceeds the batch of {self.n_batch}")
        if len(self.cached) + n > self.n_ctx:
            raise SpecliError(f"internal: {len(self.cached)}+{n} tokens exceed the context of {self.n_ctx}")
        assert self._ctx, "internal: this model's own context was released"
        start = len(self.cached)
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        self._tail_logits = None
        self._tree = _PendingTree(start, tuple(int(t) for t in tokens), tuple(parents), tuple(map(tuple, seqs)), n_leaves)
        batch = self._batch
        batch.n_tokens = n
        with native_pass:  # a Ctrl-C comes out after the bookkeeping
            for s in range(1, n_leaves + 1):
                llama_cpp.llama_memory_seq_rm(self._memory, s, -1, -1)
                llama_cpp.llama_memory_seq_cp(self._memory, 0, s, 0, start)
            for i in range(n):
                batch.token[i] = tokens[i]
                batch.pos[i] = start + depth[i]
                batch.n_seq_id[i] = len(seqs[i])
                for j, s in enumerate(seqs[i]):
                    batch.seq_id[i][j] = s
                batch.logits[i] = True
            status = llama_cpp.llama_decode(self._ctx, batch)
        if status != 0:
            self.drop_tree()
            reason = last_native_error() or f"llama_decode returned {status}"
            raise SpecliError(f"decoding a tree of {n} tokens failed at position {start}: {reason}")
        with native_pass:  # llama_decode returns before the pass is done: this waits for it
            ptr = llama_cpp.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))

    def keep_branch(self, path: Sequence[int]) -> None:
        """After eval_tree: the cache keeps the tree's nodes `path` (node indices, the root
        first, each the next one's parent; [] keeps none) after what it held, and forgets
        every other node and the branch sequences."""
        tree = self._tree
        assert tree is not None, "internal: keep_branch follows eval_tree"
        path = list(path)
        assert all(tree.parents[b] == a for a, b in zip([-1, *path], path)), "a path from the root"
        if path:
            # Any branch through the path's last node holds exactly the path at those positions.
            branch = tree.seqs[path[-1]][0]
            llama_cpp.llama_memory_seq_cp(self._memory, branch, 0, tree.start, tree.start + len(path))
            self.cached.extend(tree.tokens[i] for i in path)
        self.drop_tree()

    def drop_tree(self) -> None:
        """Forget a pending tree's branch sequences (the nodes not kept; no-op without one)."""
        tree, self._tree = self._tree, None
        if tree is not None and self._ctx:
            for s in range(1, tree.n_seqs + 1):  # (cells left with no sequence are freed)
                llama_cpp.llama_memory_seq_rm(self._memory, s, -1, -1)

    def truncate(self, n_keep: int) -> None:
        """Forget every cached position >= n_keep. Raises SpecliError if llama.cpp cannot."""
        self.drop_tree()
        assert 0 <= n_keep, n_keep
        if n_keep >= len(self.cached):
            return
        self._tail_logits = None
        self._remove_from(n_keep)
        del self.cached[n_keep:]

    @property
    def can_shift(self) -> bool:
        """Whether cached entries can be moved to other positions (llama_memory_can_shift:
        not for M-RoPE models, nor sliding-window caches smaller than the context, which
        specli's contexts never make: llama.cpp's default keeps every position)."""
        return memory_can_shift(self._memory)

    def reuse_chunks(self, tokens: Sequence[int], min_chunk: int) -> int:
        """llama-server's --cache-reuse: keep the common prefix with `tokens`, then move every
        later run of at least `min_chunk` cached tokens that `tokens` holds next (plan_chunk_reuse)
        to its place in `tokens`, dropping the rest. Returns how many leading tokens of `tokens`
        the cache holds now. Needs can_shift."""
        self.drop_tree()
        n_before = len(self.cached)
        n_keep = reuse_cache_chunks(self._memory, 0, self.cached, tokens, min_chunk, self._remove_from)
        if n_keep < n_before:  # (entries dropped or moved: a move always leaves fewer behind it)
            self._tail_logits = None
        return n_keep

    def _remove_from(self, pos: int) -> None:
        assert self._ctx, "internal: this model's own context was released"
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
        return sync_cache(self, context)

    def reset(self) -> None:
        """Empty the cache."""
        self.drop_tree()
        if self._ctx:
            llama_cpp.llama_memory_clear(self._memory, True)
        self.cached.clear()
        self._tail_logits = None

    def release_context(self) -> None:
        """Free this model's own context (its KV cache and buffers), keeping the weights, for a
        caller that evaluates only through other contexts on them (MultiSequenceContext): on a
        GPU the unused cache would hold memory those need. Evaluating afterwards is a bug."""
        self._free_context()
        self._memory = None
        self.cached.clear()
        self._tail_logits = None

    def close(self) -> None:
        """Free the context, batch and weights (safe to call twice)."""
        self._free_context()
        self._free_weights()

    def _free_context(self) -> None:
        self._tree = None
        if getattr(self, "_ctx", None):  # (a half-built model has none)
            free_context(self._ctx, self._batch)
            self._ctx = None

    def _free_weights(self) -> None:
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
        self.drop_tree()
        self._tail_logits = None
        self._remove_from(len(self.cached))


def context_params(*, n_ctx: int, n_batch: int, n_threads: int | None, kv_type: str,
                   flash_attn: str) -> llama_cpp.llama_context_params:
    """llama.cpp's context parameters as specli sets them (a LlamaModel's own context, a
    MultiSequenceContext's, which adds its sequences): n_threads None = default_threads()."""
    threads = n_threads or default_threads()
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.no_perf = True
    cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
    cparams.flash_attn_type = FLASH_ATTN[flash_attn]
    return cparams


def free_context(ctx, batch) -> None:
    """Free a context (from LlamaModel.new_context) and the batch made for it; the owner, a
    LlamaModel or a MultiSequenceContext, calls it with its own and then drops them."""
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)


def sync_cache(model: LlamaModel, context: Sequence[int]) -> np.ndarray:
    """Make model's cache (a LlamaModel or a SequenceView) hold exactly `context` (non-empty)
    and return its last token's logits: keep the longest common prefix, evaluate the rest, at
    least the last token (the logits of an already-cached one are gone). Sets model.synced_new
    to the tokens evaluated."""
    common = min(common_prefix_len(model.cached, context), len(context) - 1)
    model.truncate(common)
    model.synced_new = len(context) - common
    return model.eval(context[common:], logits="last")


def fill_cache(model: LlamaModel, tokens: Sequence[int], budget: int | None = None) -> bool:
    """Make model's cache (a LlamaModel or a SequenceView) hold `tokens`: keep the longest
    common prefix, evaluate at most `budget` more (None: all) without logits. True once it
    holds all of them; called again, it goes on from what the cache holds."""
    start = common_prefix_len(model.cached, tokens)
    model.truncate(start)
    end = len(tokens) if budget is None else min(len(tokens), start + budget)
    model.eval(tokens[start:end], logits="none")
    return end == len(tokens)


def plan_chunk_reuse(cached: Sequence[int], tokens: Sequence[int], min_chunk: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Which cached entries a new prompt can keep, as llama-server's --cache-reuse N decides
    (server-context.cpp): the common prefix, then, walking both on, every run of at least
    `min_chunk` equal tokens (an editor's file after lines above the cursor changed: the rest of
    it, now at other positions). Returns (n_keep, moves): after the moves the cache holds
    tokens[:n_keep]; a move (src, dst, n) takes cached[src:src+n] to positions dst..dst+n-1
    (dst < src: each chunk moves left, over what lay between)."""
    n_keep = common_prefix_len(cached, tokens)
    moves: list[tuple[int, int, int]] = []
    if min_chunk < 1:
        return n_keep, moves
    head_c = head_p = n_keep
    while head_c < len(cached) and head_p < len(tokens):
        n = 0
        while head_c + n < len(cached) and head_p + n < len(tokens) and cached[head_c + n] == tokens[head_p + n]:
            n += 1
        if n >= min_chunk:
            moves.append((head_c, head_p, n))
            head_c, head_p = head_c + n, head_p + n
        else:
            head_c += 1
    return head_p, moves


def memory_can_shift(memory) -> bool:
    """Whether a llama.cpp memory (None: a released context) can move its entries to other
    positions (llama_memory_can_shift: not for M-RoPE models, nor sliding-window caches smaller
    than the context)."""
    return bool(memory) and bool(llama_cpp.llama_memory_can_shift(memory))


def reuse_cache_chunks(memory, seq: int, cached: list[int], tokens: Sequence[int], min_chunk: int,
                       remove_from: Callable[[int], None]) -> int:
    """--cache-reuse on sequence `seq` of a llama.cpp memory whose entries `cached` lists: plan
    (plan_chunk_reuse), move the chunks (shift_chunks), then drop every entry from the kept
    length on (`remove_from(pos)`, the owner's, which raises SpecliError when llama.cpp cannot);
    `cached` becomes tokens[:n_keep]. Returns n_keep. The owners (LlamaModel.reuse_chunks,
    MultiSequenceContext.reuse_chunks) add their own bookkeeping."""
    n_keep, moves = plan_chunk_reuse(cached, tokens, min_chunk)
    if moves:
        shift_chunks(memory, seq, moves)
    if moves or n_keep < len(cached):
        remove_from(n_keep)
        cached[:] = tokens[:n_keep]
    return n_keep


def shift_chunks(memory, seq: int, moves: Sequence[tuple[int, int, int]]) -> None:
    """Apply plan_chunk_reuse's moves to sequence `seq` of a llama.cpp memory: drop what lies
    between a chunk's new place and its old one, then shift its positions (llama.cpp re-rotates
    the keys at the next decode)."""
    for src, dst, n in moves:
        llama_cpp.llama_memory_seq_rm(memory, seq, dst, src)
        llama_cpp.llama_memory_seq_add(memory, seq, src, src + n, dst - src)


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
