"""A bounded reader of GGUF headers and the checks run before llama.cpp opens a file.

llama.cpp aborts the interpreter on some header facts (too many layers or experts, unknown rope
scaling); a lying header must never hang, crash or abort specli, so the file is read here first,
with every count and length checked against the bytes left and a limit. The `gguf` package stays
a test dependency.

It stands on the bottom floor (beside errors.py and files.py), below both of its users, which
import nothing of each other: llama/model.py checks a header before the load, models/fit.py does
its arithmetic on one. The numbers of llama.cpp's draft/target vocabulary rule live here too, for
the same two: llama/compat.py applies the rule to loaded vocabularies, models/fit.py to the
tokenizer facts of headers (tokenizer.ggml.*), before anything is loaded.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specli.errors import ModelFileError
from specli.files import NotRegularFile, kind_of, open_regular

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

# llama.cpp's rule for a draft speaking for a target (common/speculative.cpp): vocabulary sizes
# within 128 of each other (padding differs between exports), identical token texts from id 5 on
# (the first few are special tokens that exports name differently).
MAX_VOCAB_SIZE_DIFFERENCE = 128
FIRST_CHECKED_TOKEN_ID = 5


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
        with open_regular(path) as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(buf, path)
    except NotRegularFile as err:
        raise not_regular_error(path, err.kind) from None
    except FileNotFoundError:
        raise ModelFileError(f"model file not found: {path} (check the path or use a models.toml name)") from None
    except ValueError as err:  # mmap of an empty file
        if path.is_file() and path.stat().st_size == 0:
            raise ModelFileError(f"{path} is empty, not a GGUF file (re-download it)") from None
        raise ModelFileError(f"cannot read {path} as GGUF: {err}") from None
    except OSError as err:
        raise ModelFileError(f"cannot read {path} as GGUF: {err.strerror or err}") from None


def not_regular_error(path: Path, kind: str) -> ModelFileError:
    """The one line for a model path that is a directory, FIFO, device or socket."""
    if kind == "a directory":
        return ModelFileError(f"{path} is a directory, not a GGUF file (pass the .gguf file inside it)")
    return ModelFileError(f"{path} is {kind}, not a regular file; pass the path of a .gguf model file")


def check_model_path(path: Path) -> None:
    """ModelFileError when `path` exists and is no regular file, found with stat alone: opening a
    FIFO to read it waits for a writer for ever, and a device would be read as if it were a
    model. A missing or unreadable path is left to the reader, which names it."""
    try:
        kind = kind_of(Path(path).stat().st_mode)
    except (OSError, ValueError):
        return
    if kind:
        raise not_regular_error(Path(path), kind)


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
