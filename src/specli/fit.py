"""`specli fit`: will a target, its draft and both KV caches fit in this machine's memory?

Everything here is arithmetic on facts that need no model loading: GGUF header metadata (read
by the small reader below, so the `gguf` package stays a test dependency) or the facts stored in
models.toml, the file sizes, and the memory of the device llama.cpp would use.

The KV cache follows llama.cpp 0.3.36 (vendor/llama.cpp/src):
- the context is padded to a multiple of 256 (llama-context.cpp: GGML_PAD(n_ctx, 256));
- every attention layer holds n_ctx cells of n_head_kv(layer) x (key_length + value_length)
  elements; sliding-window layers too, because the default context parameter swa_full=true
  allocates the full-size SWA cache (llama-kv-cache-iswa.cpp), which is also what lets
  speculative decoding remove rejected entries;
- recurrent layers (n_head_kv = 0 in a hybrid's per-layer array, or a pure SSM/RWKV model) have
  no KV cache (their small fixed state is left to the overhead);
- element sizes: f16 2 bytes, q8_0 34 per 32, q4_0 18 per 32 (ggml block sizes).
"""

from __future__ import annotations

import mmap
import platform
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ModelFileError, UsageError

GB = 1_000_000_000  # the guide's sizes are decimal gigabytes
CTX_PAD = 256
KV_TYPES = ("f16", "q8_0", "q4_0")

# ggml row sizes: (bytes per block, elements per block).
_KV_BLOCK = {"f32": (4, 1), "f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}

# llama_ftype ids (include/llama.h) -> name, and approximate bits per weight of each quant
# (llama.cpp's quantize table; Q4_K_M / Q8_0 = 4.85 / 8.5 ~ 0.57).
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 7: "Q8_0", 10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M",
              13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}
BITS_PER_WEIGHT = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56,
                   "Q5_K_M": 5.69, "Q5_K_S": 5.54, "Q4_K_M": 4.85, "Q4_K_S": 4.58, "Q4_0": 4.55,
                   "Q3_K_L": 4.27, "Q3_K_M": 3.91, "Q3_K_S": 3.5, "Q2_K": 3.35}
# Smaller quantizations worth suggesting, heaviest first.
QUANT_LADDER = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")
_QUANT_RE = re.compile(r"(?<![A-Za-z0-9])(F32|F16|BF16|Q8_0|Q6_K|Q5_K_[MS]|Q4_K_[MS]|Q4_0|Q3_K_[LMS]|Q2_K)(?![A-Za-z0-9])", re.I)

RECURRENT_ARCHS = ("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")


# --- a minimal GGUF metadata reader ------------------------------------------------------------
# Layout (gguf docs): magic "GGUF", u32 version (2 or 3: counts are u64), u64 tensor count,
# u64 metadata count, then key (u64 length + UTF-8) / u32 type / value, little-endian.
# The file may be anything (a lying header must never hang, crash or abort the interpreter):
# every count and length is checked against the bytes left and a limit before it is used.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 4096  # longer arrays (token lists) keep only their length
MAX_KV = 1 << 16  # metadata pairs (real files: ~50)
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 24  # one string value (a chat template is ~10 KB)
MAX_ARRAY_ITEMS = 1 << 23  # elements of one array (vocabularies: up to ~1M)
MAX_HEADER_BYTES = 1 << 30  # the whole metadata section
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: more aborts the interpreter
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS
_U32 = 1 << 32
_Q = struct.Struct("<Q")


class _Corrupt(Exception):
    """The header breaks the format or a limit: the message says how (one line)."""


@dataclass(frozen=True)
class LongArray:
    """A metadata array too long to be worth keeping (e.g. the vocabulary): only its length."""

    length: int


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Return the key/value metadata of a GGUF file's header, reading no tensor data.

    Arrays longer than 4096 come back as LongArray(length). Raises ModelFileError (one line)
    for a file that is missing, not GGUF, of an unsupported version, truncated, or whose header
    breaks the format or the limits above (nested arrays, counts or lengths past the end of
    the file). Time and memory stay bounded whatever the file says.
    """
    path = Path(path)
    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(buf, path)
    except FileNotFoundError:
        raise ModelFileError(f"model file not found: {path} (check the path or use a models.toml name)") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path} is a directory, not a GGUF file") from None
    except ValueError as err:  # mmap of an empty file
        if path.is_file() and path.stat().st_size == 0:
            raise ModelFileError(f"{path} is empty, not a GGUF file (re-download it)") from None
        raise ModelFileError(f"cannot read {path} as GGUF: {err}") from None
    except OSError as err:
        raise ModelFileError(f"cannot read {path} as GGUF: {err.strerror or err}") from None


def _parse_header(buf, path: Path) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    if len(buf) < 24:
        raise ModelFileError(f"{path}: the GGUF header is truncated ({len(buf)} bytes; re-download the file)")
    version = struct.unpack_from("<I", buf, 4)[0]
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    try:
        _n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        # Each pair takes at least 13 bytes (key length, one key byte, type, one value byte).
        if n_kv > MAX_KV or n_kv * 13 > len(buf) - 24:
            raise _Corrupt(f"it claims {n_kv} metadata pairs, more than its {len(buf)} bytes can hold (truncated?)")
        pos, meta = 24, {}
        for _ in range(n_kv):
            key, pos = _read_string(buf, pos, MAX_KEY_BYTES)
            if not key:
                raise _Corrupt("a metadata key is empty")
            if key in meta:
                raise _Corrupt(f"metadata key {key!r} appears twice")
            vtype = _unpack("<I", buf, pos)
            value, pos = _read_value(buf, pos + 4, vtype, key)
            if pos > MAX_HEADER_BYTES:
                raise _Corrupt(f"its metadata is larger than {MAX_HEADER_BYTES >> 20} MiB")
            meta[key] = value
    except _Corrupt as err:
        raise ModelFileError(f"{path}: the GGUF header is corrupt: {err} (re-download the file)") from None
    except (struct.error, UnicodeDecodeError):
        raise ModelFileError(f"{path}: the GGUF header is truncated or corrupt (re-download the file)") from None
    return meta


def _unpack(fmt: str, buf, pos: int):
    if pos + struct.calcsize(fmt) > len(buf):
        raise _Corrupt("it ends in the middle of a value (truncated)")
    return struct.unpack_from(fmt, buf, pos)[0]


def _read_string(buf, pos: int, limit: int = MAX_STRING_BYTES) -> tuple[str, int]:
    n = _unpack("<Q", buf, pos)
    if n > limit or pos + 8 + n > len(buf):
        raise _Corrupt(f"a string of {n} bytes at offset {pos} runs past the end or a limit")
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _read_value(buf, pos: int, vtype: int, key: str) -> tuple[Any, int]:
    if vtype == _STRING:
        return _read_string(buf, pos)
    if vtype == _ARRAY:
        etype = _unpack("<I", buf, pos)
        count = _unpack("<Q", buf, pos + 4)
        pos += 12
        if etype == _ARRAY:  # as llama.cpp's own reader: no arrays of arrays
            raise _Corrupt(f"{key} is an array of arrays")
        if etype in _SCALARS:  # fixed-size elements: read or skip in one go
            fmt = _SCALARS[etype]
            size = struct.calcsize(fmt)
            if count > MAX_ARRAY_ITEMS or pos + size * count > len(buf):
                raise _Corrupt(f"{key} claims {count} elements, past the end of the file or a limit")
            if count > _KEEP_ARRAY:
                return LongArray(count), pos + size * count
            values = list(struct.unpack_from("<" + fmt[1] * count, buf, pos))
            return values, pos + size * count
        if etype != _STRING:
            raise _Corrupt(f"{key} has elements of unknown type {etype}")
        if count > MAX_ARRAY_ITEMS or pos + 8 * count > len(buf):
            raise _Corrupt(f"{key} claims {count} strings, past the end of the file or a limit")
        if count > _KEEP_ARRAY:  # skip the strings without decoding them
            end, unpack = len(buf), _Q.unpack_from
            for _ in range(count):
                if pos + 8 > end:
                    raise _Corrupt(f"{key} ends in the middle of a string (truncated)")
                n = unpack(buf, pos)[0]
                pos += 8 + n
                if n > MAX_STRING_BYTES or pos > end:
                    raise _Corrupt(f"a string of {key} runs past the end of the file or a limit")
            return LongArray(count), pos
        values = []
        for _ in range(count):
            value, pos = _read_string(buf, pos)
            values.append(value)
        return values, pos
    if vtype not in _SCALARS:
        raise _Corrupt(f"{key} has unknown value type {vtype}")
    fmt = _SCALARS[vtype]
    return _unpack(fmt, buf, pos), pos + struct.calcsize(fmt)


# --- checking the facts llama.cpp trusts ---------------------------------------------------------
# llama.cpp (0.3.36) asserts rather than reports on some header facts: a block_count of 0 or
# over 512, an expert count over 1024, inconsistent expert counts, an unknown RoPE scaling type
# all abort the whole interpreter (SIGABRT, exit 134). Check them first and refuse in one line.

# Counts a GGUF stores per model; llama.cpp reads them as u32 (some per layer, as arrays).
_COUNT_KEYS = ("context_length", "embedding_length", "vocab_size", "attention.key_length",
               "attention.value_length", "attention.sliding_window", "expert_count",
               "expert_group_count", "expert_group_used_count", "nextn_predict_layers",
               "posnet.block_count", "convnext.block_count", "rope.dimension_count")
_PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length",
                   "expert_used_count")
_ROPE_SCALING = ("none", "linear", "yarn", "longrope")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _U32


def check_metadata(meta: dict[str, Any], label: str) -> None:
    """Raise ModelFileError (one line) unless the header's model facts are ones llama.cpp (and
    the arithmetic of `fit`) can take: an architecture name, 1 to 512 layers, counts that are
    whole numbers from 0 to 2^32 - 1 (per-layer arrays of at most one entry per layer),
    consistent expert counts and a known RoPE scaling type."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{label}: the GGUF header names no general.architecture (not a model file?)")

    def bad(key: str, why: str) -> ModelFileError:
        return ModelFileError(f"{label}: the GGUF header is invalid: {arch}.{key} {why} (re-download the file)")

    n_layer = meta.get(f"{arch}.block_count")
    if n_layer is None:
        raise ModelFileError(f"{label}: the GGUF header has no {arch}.block_count")
    if not _is_count(n_layer) or not 1 <= n_layer <= MAX_LAYERS:
        raise bad("block_count", f"is {n_layer!r}; llama.cpp takes 1 to {MAX_LAYERS} layers")
    for key in _COUNT_KEYS:
        value = meta.get(f"{arch}.{key}")
        if value is not None and not _is_count(value):
            raise bad(key, f"is {_show(value)}, not a count from 0 to 2^32 - 1")
    for key in _PER_LAYER_KEYS:
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, LongArray) or (isinstance(value, list) and len(value) > n_layer):
            raise bad(key, f"has more entries than the {n_layer} layers")
        values = value if isinstance(value, list) else [value]
        if value is not None and not all(_is_count(v) for v in values):
            raise bad(key, f"is {_show(value)}, not a count from 0 to 2^32 - 1 (or one per layer)")
    get = lambda key, default=0: meta.get(f"{arch}.{key}", default)  # noqa: E731
    for key in ("nextn_predict_layers", "posnet.block_count", "convnext.block_count"):
        if get(key) > n_layer:
            raise bad(key, f"({get(key)}) exceeds block_count ({n_layer})")
    n_expert, groups, group_used = get("expert_count"), get("expert_group_count"), get("expert_group_used_count")
    used = get("expert_used_count")
    used_max = max(used, default=0) if isinstance(used, list) else used
    if n_expert > MAX_EXPERTS:
        raise bad("expert_count", f"is {n_expert}; llama.cpp takes at most {MAX_EXPERTS}")
    if used_max > n_expert or (n_expert and not used_max):
        raise bad("expert_used_count", f"({used_max}) must be 1 to expert_count ({n_expert})" if n_expert
                  else f"({used_max}) must be 0 without experts")
    if n_expert and groups >= n_expert or not n_expert and groups:
        raise bad("expert_group_count", f"({groups}) must be below expert_count ({n_expert})")
    if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        raise bad("expert_group_used_count", f"({group_used}) or expert_group_count ({groups}) is inconsistent")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in _ROPE_SCALING:
        raise bad("rope.scaling.type", f"is {_show(scaling)}; llama.cpp knows {', '.join(_ROPE_SCALING)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_model_header(path: Path) -> dict[str, Any]:
    """The cheap check before llama.cpp opens `path`: a bounded read of the GGUF header and
    check_metadata. Returns the metadata; raises ModelFileError (exit 2) with one line."""
    path = Path(path)
    meta = read_gguf_metadata(path)
    check_metadata(meta, str(path))
    return meta


# --- model shapes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What memory arithmetic needs about one model.

    n_head_kv has one entry per layer (0 = a recurrent layer, no KV cache). weight_bytes is the
    whole file (every part of a split GGUF). quant is the file type name ("Q4_K_M") or None.
    origin says where the facts came from ("GGUF header" or "models.toml").
    """

    label: str
    weight_bytes: int
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    origin: str
    quant: str | None = None
    n_ctx_train: int | None = None
    n_swa: int | None = None

    @property
    def n_layer(self) -> int:
        return len(self.n_head_kv)

    def kv_bytes_per_cell(self, kv_type: str) -> int:
        """Bytes of K plus V for one context position, over all layers."""
        per_block, per_elements = _KV_BLOCK[kv_type]
        total = 0
        for heads in self.n_head_kv:
            for dim in (self.head_dim_k, self.head_dim_v):
                # A ggml row is whole blocks; llama.cpp's quantized KV needs rows of full blocks.
                total += -(-heads * dim // per_elements) * per_block
        return total

    def kv_bytes(self, n_ctx: int, kv_type: str, *, pad: bool = True) -> int:
        """KV cache bytes for an n_ctx context (padded to 256 as llama.cpp does, unless pad=False)."""
        return (padded_ctx(n_ctx) if pad else n_ctx) * self.kv_bytes_per_cell(kv_type)


def kv_type_problem(shape: ModelShape, kv_type: str) -> str | None:
    """Why llama.cpp would refuse this KV type for this model (a quantized cache needs head
    sizes that are whole blocks of 32), or None."""
    per_elements = _KV_BLOCK[kv_type][1]
    for dim in (shape.head_dim_k, shape.head_dim_v):
        if dim % per_elements:
            return f"--kv-type {kv_type} needs attention heads of a multiple of {per_elements} elements; {shape.label} has {dim}: use --kv-type f16"
    return None


def padded_ctx(n_ctx: int) -> int:
    """The context llama.cpp really allocates: n_ctx rounded up to a multiple of 256."""
    return -(-n_ctx // CTX_PAD) * CTX_PAD


def shape_from_metadata(meta: dict[str, Any], weight_bytes: int, label: str) -> ModelShape:
    """A ModelShape from GGUF metadata (see read_gguf_metadata); ModelFileError if incomplete."""
    check_metadata(meta, label)  # every count below is then a whole number in range
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_layer = get("block_count")
    n_head = _per_layer(get("attention.head_count", 0), n_layer)
    recurrent = arch in RECURRENT_ARCHS or f"{arch}.ssm.state_size" in meta
    # llama.cpp's default for head_count_kv is head_count; a pure recurrent model has neither.
    default_kv = 0 if recurrent and get("attention.head_count_kv") is None else get("attention.head_count", 0)
    n_head_kv = _per_layer(get("attention.head_count_kv", default_kv), n_layer)
    n_embd = get("embedding_length", 0)
    some_head = next((h for h in n_head if h), 0)
    fallback = n_embd // some_head if some_head else 0
    # As llama.cpp: each of key/value length defaults to n_embd / n_head on its own.
    head_k = get("attention.key_length", fallback)
    head_v = get("attention.value_length", fallback)
    if any(n_head_kv) and not (head_k and head_v):
        raise ModelFileError(f"{label}: the GGUF header gives no attention head size ({arch}.attention.key_length)")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = get("vocab_size") or (tokens.length if isinstance(tokens, LongArray) else len(tokens) if isinstance(tokens, list) else 0)
    n_ctx_train, n_swa = get("context_length"), get("attention.sliding_window")
    file_type = meta.get("general.file_type")
    return ModelShape(
        label=label,
        weight_bytes=weight_bytes,
        n_head_kv=tuple(n_head_kv),
        head_dim_k=int(head_k),
        head_dim_v=int(head_v),
        n_vocab=int(n_vocab),
        origin="GGUF header",
        quant=FILE_TYPES.get(file_type) if isinstance(file_type, int) else quant_from_name(label),
        n_ctx_train=n_ctx_train,
        n_swa=n_swa,
    )


def _per_layer(value: Any, n_layer: int) -> list[int]:
    """A per-layer list from a scalar or an array metadata value."""
    if isinstance(value, list):
        values = [int(v) for v in value]
        return (values + [values[-1]] * n_layer)[:n_layer] if values else [0] * n_layer
    return [int(value)] * n_layer


def shape_from_file(path: Path) -> ModelShape:
    """Read a local GGUF's header; weight bytes = size of the file (all parts when split)."""
    path = Path(path)
    meta = read_gguf_metadata(path)
    return shape_from_metadata(meta, split_file_bytes(path, meta), path.name)


def split_file_bytes(path: Path, meta: dict[str, Any]) -> int:
    """Total size of a GGUF and, when split ("-00001-of-00003.gguf"), of its sibling parts."""
    count = meta.get("split.count", 1)
    if not isinstance(count, int) or count <= 1 or count > 99999:
        return path.stat().st_size
    match = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", path.name)
    if not match:
        return path.stat().st_size
    total = 0
    for i in range(1, count + 1):
        part = path.with_name(path.name[: match.start()] + f"-{i:05d}-of-{count:05d}.gguf")
        if not part.is_file():
            raise ModelFileError(f"{path.name} is part of a {count}-part GGUF but {part.name} is missing beside it")
        total += part.stat().st_size
    return total


def quant_from_name(name: str) -> str | None:
    """The quantization named in a file name ("...-Q4_K_M.gguf" -> "Q4_K_M"), or None."""
    match = _QUANT_RE.search(name)
    return match.group(1).upper() if match else None


def shape_from_facts(source, label: str) -> ModelShape:
    """A ModelShape from the facts a models.toml source records; UsageError naming what is missing."""
    needed = ("size_bytes", "n_layer", "n_head_kv", "head_dim", "n_vocab")
    missing = [key for key in needed if getattr(source, key) is None]
    if missing:
        how = f"; download it ({source.download_command}) so fit can read its header" if source.download_command else ""
        raise UsageError(f"models.toml does not record {', '.join(missing)} for {label}{how}")
    return ModelShape(
        label=label,
        weight_bytes=source.size_bytes,
        n_head_kv=(source.n_head_kv,) * source.n_layer,
        head_dim_k=source.head_dim,
        head_dim_v=source.head_dim,
        n_vocab=source.n_vocab,
        origin="models.toml",
        quant=quant_from_name(source.hf_files[0]) if source.hf_files else None,
        n_ctx_train=source.n_ctx_train,
    )


def shape_from_source(source, label: str) -> ModelShape:
    """The local file's header when the source is on disk (offline check), else stored facts."""
    from .registry import source_status

    status = source_status(source)
    if status.downloaded and status.path is not None:
        return replace(shape_from_file(status.path), label=label)
    return shape_from_facts(source, label)


# --- memory needed -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Bytes each part needs. Draft fields are 0 without a draft model."""

    target: ModelShape
    draft: ModelShape | None
    n_ctx: int
    kv_type: str
    n_draft: int
    overhead: int
    weights_target: int
    weights_draft: int
    kv_target: int
    kv_draft: int
    logits_target: int
    logits_draft: int

    @property
    def total(self) -> int:
        """The exact figure: weights, padded KV caches, logits buffers and the overhead."""
        return (self.weights_target + self.weights_draft + self.kv_target + self.kv_draft
                + self.logits_target + self.logits_draft + self.overhead)

    @property
    def flat(self) -> int:
        """The guide's flat formula: target + draft + KV(both, unpadded context) + overhead."""
        kv = self.target.kv_bytes(self.n_ctx, self.kv_type, pad=False)
        if self.draft is not None:
            kv += self.draft.kv_bytes(self.n_ctx, self.kv_type, pad=False)
        return self.weights_target + self.weights_draft + kv + self.overhead


def estimate(target: ModelShape, draft: ModelShape | None, *, n_ctx: int, kv_type: str = "f16",
             n_draft: int = 5, overhead: int = 2 * GB) -> Estimate:
    """Bytes needed to run target (+ draft) with an n_ctx context.

    Logits: a verification pass returns N+1 rows of n_vocab floats from the target; the draft
    returns one row per step.
    """
    return Estimate(
        target=target, draft=draft, n_ctx=n_ctx, kv_type=kv_type, n_draft=n_draft, overhead=overhead,
        weights_target=target.weight_bytes,
        weights_draft=draft.weight_bytes if draft else 0,
        kv_target=target.kv_bytes(n_ctx, kv_type),
        kv_draft=draft.kv_bytes(n_ctx, kv_type) if draft else 0,
        logits_target=(n_draft + 1) * target.n_vocab * 4,
        logits_draft=draft.n_vocab * 4 if draft else 0,
    )


def context_for_kv(models: list[ModelShape], kv_bytes: int, kv_type: str = "f16") -> int:
    """The largest context (a multiple of 256) whose KV caches of all `models` stay <= kv_bytes."""
    per_cell = sum(m.kv_bytes_per_cell(kv_type) for m in models)
    return (kv_bytes // per_cell) // CTX_PAD * CTX_PAD if per_cell else 0


# --- the machine's memory ----------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """The memory the models would live in.

    kind: "gpu" (a discrete device: weights and KV of offloaded layers go there, the rest to
    RAM), "unified" (Apple Silicon: one pool) or "ram" (CPU only). free/total: that pool;
    ram_free/ram_total: system RAM. source: how it was found.
    """

    kind: str
    name: str
    free: int
    total: int
    ram_free: int
    ram_total: int
    source: str
    others: tuple[str, ...] = field(default_factory=tuple)


def parse_nvidia_smi(text: str) -> list[tuple[str, int, int]]:
    """(name, free, total) per GPU from `nvidia-smi --query-gpu=name,memory.total,memory.free
    --format=csv,noheader,nounits` (MiB figures)."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            gpus.append((parts[0], int(parts[2]) * 1024 * 1024, int(parts[1]) * 1024 * 1024))
    return gpus


def _nvidia_smi_gpus() -> list[tuple[str, int, int]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_nvidia_smi(out.stdout) if out.returncode == 0 else []


def detect_memory(device: str | None = None) -> Memory:
    """Find the memory to fit into: a GPU (llama.cpp's device query, else nvidia-smi), Apple
    Silicon's unified memory, or system RAM (psutil). `device` picks a GPU by index or by a
    part of its name; without it the GPU with the most free memory is used.
    Raises UsageError when `device` matches nothing.
    """
    import psutil

    vm = psutil.virtual_memory()
    ram_free, ram_total = int(vm.available), int(vm.total)
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        if device is not None:
            raise UsageError("--device: Apple Silicon has one unified memory; drop --device")
        return Memory("unified", "Apple Silicon unified memory", ram_free, ram_total, ram_free, ram_total, "psutil (unified memory)")

    from .llama import backend_devices

    gpus = [(f"{d.name} ({d.description})", d.free, d.total) for d in backend_devices() if d.kind in ("gpu", "igpu")]
    source = "llama.cpp device query"
    if not gpus:
        gpus, source = _nvidia_smi_gpus(), "nvidia-smi"
    if gpus:
        index = _pick_device(gpus, device)
        name, free, total = gpus[index]
        others = tuple(g[0] for i, g in enumerate(gpus) if i != index)
        return Memory("gpu", name, free, total, ram_free, ram_total, source, others)
    if device is not None:
        raise UsageError(f"--device {device}: no GPU found (llama.cpp sees none, no nvidia-smi); drop --device to fit into RAM")
    return Memory("ram", "system RAM", ram_free, ram_total, ram_free, ram_total, "psutil")


def _pick_device(gpus: list[tuple[str, int, int]], device: str | None) -> int:
    """Index of the chosen GPU: --device as an index or a name fragment, else the freest."""
    if device is None:
        return max(range(len(gpus)), key=lambda i: gpus[i][1])
    if device.isdigit() and int(device) < len(gpus):
        return int(device)
    matches = [i for i, g in enumerate(gpus) if device.lower() in g[0].lower()]
    if not matches:
        names = ", ".join(f"{i}: {g[0]}" for i, g in enumerate(gpus))
        raise UsageError(f"--device {device!r} matches no GPU; choose one of {names}")
    return matches[0]


# --- verdict and suggestions ---------------------------------------------------------------------


def offload_fraction(ngl: int, n_layer: int) -> float:
    """Share of a model's layers on the GPU for --ngl (-1 or more than the layers = all)."""
    return 1.0 if ngl < 0 or ngl >= n_layer else ngl / n_layer


@dataclass(frozen=True)
class Placement:
    """Bytes on the GPU and in RAM (kind "gpu"), or all in one pool (gpu_bytes = 0)."""

    gpu_bytes: int
    ram_bytes: int


def place(est: Estimate, memory: Memory, ngl: int = -1, draft_ngl: int = -1) -> Placement:
    """Split an estimate between GPU and RAM: each model's weights and KV follow its offloaded
    share of layers; compute buffers (the overhead) sit on the GPU, logits in host memory."""
    if memory.kind != "gpu":
        return Placement(0, est.total)
    ft = offload_fraction(ngl, est.target.n_layer)
    fd = offload_fraction(draft_ngl, est.draft.n_layer) if est.draft else 0.0
    on_gpu = ft * (est.weights_target + est.kv_target) + fd * (est.weights_draft + est.kv_draft) + est.overhead
    gpu = round(on_gpu)
    return Placement(gpu, est.total - gpu)


def fits(p: Placement, memory: Memory) -> bool:
    """True when the placement fits in free memory (GPU free and RAM available)."""
    if memory.kind == "gpu":
        return p.gpu_bytes <= memory.free and p.ram_bytes <= memory.ram_free
    return p.ram_bytes <= memory.free


@dataclass(frozen=True)
class Suggestion:
    kind: str  # "ctx", "ngl" or "quant"
    detail: str
    command: str


def max_context(target: ModelShape, draft: ModelShape | None, memory: Memory, *, kv_type: str, n_draft: int,
                overhead: int, ngl: int = -1, draft_ngl: int = -1, limit: int) -> int | None:
    """The largest context (a multiple of 256, below `limit`) that fits, or None."""
    best, lo, hi = None, 1, max(1, (limit - 1) // CTX_PAD)
    while lo <= hi:  # the need grows with the context: binary search
        mid = (lo + hi) // 2
        est = estimate(target, draft, n_ctx=mid * CTX_PAD, kv_type=kv_type, n_draft=n_draft, overhead=overhead)
        if fits(place(est, memory, ngl, draft_ngl), memory):
            best, lo = mid * CTX_PAD, mid + 1
        else:
            hi = mid - 1
    return best


def layer_split(est: Estimate, memory: Memory, draft_ngl: int = -1) -> tuple[int, int] | None:
    """(ngl, draft_ngl) with the most target layers on the GPU that fits, or None.

    The draft stays fully offloaded when it can: it runs N times per target pass.
    """
    if memory.kind != "gpu":
        return None
    n_t = est.target.n_layer
    draft_options = [draft_ngl] if draft_ngl >= 0 else []
    if est.draft is not None and draft_ngl < 0:
        draft_options = [est.draft.n_layer, *range(est.draft.n_layer - 1, -1, -1)]
    for dn in draft_options or [-1]:
        for tn in range(n_t, -1, -1):
            if fits(place(est, memory, tn, dn), memory):
                return tn, dn
    return None


def smaller_quant(target: ModelShape, draft: ModelShape | None, memory: Memory, *, n_ctx: int, kv_type: str,
                  n_draft: int, overhead: int, ngl: int, draft_ngl: int) -> tuple[str, ModelShape] | None:
    """The heaviest quantization below the target's that fits (weights scaled by bits per
    weight), as (name, the rescaled target), or None."""
    current = target.quant or "F16"
    bits = BITS_PER_WEIGHT.get(current)
    if bits is None:
        return None
    for name in QUANT_LADDER:
        if BITS_PER_WEIGHT[name] >= bits:
            continue
        smaller = replace(target, weight_bytes=round(target.weight_bytes * BITS_PER_WEIGHT[name] / bits), quant=name)
        est = estimate(smaller, draft, n_ctx=n_ctx, kv_type=kv_type, n_draft=n_draft, overhead=overhead)
        if fits(place(est, memory, ngl, draft_ngl), memory):
            return name, smaller
    return None


def gb(n: int | float) -> str:
    """Bytes as decimal gigabytes for tables ("42.50 GB")."""
    return f"{n / GB:.2f} GB"
