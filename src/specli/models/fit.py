"""`specli fit`: will a target, its draft and both KV caches fit in this machine's memory?

Everything here is arithmetic on facts that need no model loading: GGUF header metadata (read
by specli.gguf's small reader, so the `gguf` package stays a test dependency) or the facts stored
in models.toml, the file sizes, and the memory of the device llama.cpp would use (its device list
handed in by the caller: models/ and llama/ stand side by side, importing nothing of each other).

The KV cache follows llama.cpp as llama-cpp-python 0.3.36 bundles it (its src/ files named below):
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

import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from specli.errors import ModelFileError, UsageError
from specli.gguf import FIRST_CHECKED_TOKEN_ID, MAX_VOCAB_SIZE_DIFFERENCE, LongArray, check_metadata, read_gguf_metadata

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
QUANT_RE = re.compile(r"(?<![A-Za-z0-9])(F32|F16|BF16|Q8_0|Q6_K|Q5_K_[MS]|Q4_K_[MS]|Q4_0|Q3_K_[LMS]|Q2_K)(?![A-Za-z0-9])", re.I)

RECURRENT_ARCHS = ("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")


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
    # From a GGUF header only: general.parameter_count when the file states it, and the
    # tokenizer facts that pair_problem compares before anything is loaded.
    n_params: int | None = None
    vocab: VocabFacts | None = field(default=None, repr=False)

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
        n_params=_positive_int(meta.get("general.parameter_count")),
        vocab=vocab_facts(meta),
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
    match = QUANT_RE.search(name)
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
    from specli.models.names import source_status

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
    draft_length: int
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
             draft_length: int = 5, overhead: int = 2 * GB) -> Estimate:
    """Bytes needed to run target (+ draft) with an n_ctx context.

    Logits: a verification pass returns N+1 rows of n_vocab floats from the target; the draft
    returns one row per step.
    """
    return Estimate(
        target=target, draft=draft, n_ctx=n_ctx, kv_type=kv_type, draft_length=draft_length, overhead=overhead,
        weights_target=target.weight_bytes,
        weights_draft=draft.weight_bytes if draft else 0,
        kv_target=target.kv_bytes(n_ctx, kv_type),
        kv_draft=draft.kv_bytes(n_ctx, kv_type) if draft else 0,
        logits_target=(draft_length + 1) * target.n_vocab * 4,
        logits_draft=draft.n_vocab * 4 if draft else 0,
    )


# --- the machine's memory ----------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMemory:
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


def detect_memory(device: str | None = None, query_devices: Callable[[], Iterable[Any]] | None = None) -> DeviceMemory:
    """Find the memory to fit into: a GPU (llama.cpp's device query, else nvidia-smi), Apple
    Silicon's unified memory, or system RAM (psutil). `device` picks a GPU by index or by a
    part of its name; without it the GPU with the most free memory is used.

    query_devices: llama.cpp's device list, asked only when a GPU is looked for (the caller
    passes specli.llama.devices.backend_devices: models/ and llama/ import nothing of each
    other). Each item has name, description, kind ("gpu", "igpu", ...), free and total
    bytes; None asks nvidia-smi alone.
    Raises UsageError when `device` matches nothing.
    """
    import psutil

    vm = psutil.virtual_memory()
    ram_free, ram_total = int(vm.available), int(vm.total)
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        if device is not None:
            raise UsageError("--device: Apple Silicon has one unified memory; drop --device")
        return DeviceMemory("unified", "Apple Silicon unified memory", ram_free, ram_total, ram_free, ram_total, "psutil (unified memory)")

    listed = query_devices() if query_devices is not None else ()
    gpus = [(f"{d.name} ({d.description})", d.free, d.total) for d in listed if d.kind in ("gpu", "igpu")]
    source = "llama.cpp device query"
    if not gpus:
        gpus, source = _nvidia_smi_gpus(), "nvidia-smi"
    if gpus:
        index = _pick_device(gpus, device)
        name, free, total = gpus[index]
        others = tuple(g[0] for i, g in enumerate(gpus) if i != index)
        return DeviceMemory("gpu", name, free, total, ram_free, ram_total, source, others)
    if device is not None:
        raise UsageError(f"--device {device}: no GPU found (llama.cpp sees none, no nvidia-smi); drop --device to fit into RAM")
    return DeviceMemory("ram", "system RAM", ram_free, ram_total, ram_free, ram_total, "psutil")


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


def place(est: Estimate, memory: DeviceMemory, ngl: int = -1, draft_ngl: int = -1) -> Placement:
    """Split an estimate between GPU and RAM: each model's weights and KV follow its offloaded
    share of layers; compute buffers (the overhead) sit on the GPU, logits in host memory."""
    if memory.kind != "gpu":
        return Placement(0, est.total)
    ft = offload_fraction(ngl, est.target.n_layer)
    fd = offload_fraction(draft_ngl, est.draft.n_layer) if est.draft else 0.0
    on_gpu = ft * (est.weights_target + est.kv_target) + fd * (est.weights_draft + est.kv_draft) + est.overhead
    gpu = round(on_gpu)
    return Placement(gpu, est.total - gpu)


def fits(p: Placement, memory: DeviceMemory) -> bool:
    """True when the placement fits in free memory (GPU free and RAM available)."""
    if memory.kind == "gpu":
        return p.gpu_bytes <= memory.free and p.ram_bytes <= memory.ram_free
    return p.ram_bytes <= memory.free


@dataclass(frozen=True)
class Suggestion:
    kind: str  # "ctx", "ngl" or "quant"
    detail: str
    command: str


def max_context(target: ModelShape, draft: ModelShape | None, memory: DeviceMemory, *, kv_type: str, draft_length: int,
                overhead: int, ngl: int = -1, draft_ngl: int = -1, limit: int) -> int | None:
    """The largest context (a multiple of 256, below `limit`) that fits, or None."""
    best, lo, hi = None, 1, max(1, (limit - 1) // CTX_PAD)
    while lo <= hi:  # the need grows with the context: binary search
        mid = (lo + hi) // 2
        est = estimate(target, draft, n_ctx=mid * CTX_PAD, kv_type=kv_type, draft_length=draft_length, overhead=overhead)
        if fits(place(est, memory, ngl, draft_ngl), memory):
            best, lo = mid * CTX_PAD, mid + 1
        else:
            hi = mid - 1
    return best


def layer_split(est: Estimate, memory: DeviceMemory, draft_ngl: int = -1) -> tuple[int, int] | None:
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


def smaller_quant(target: ModelShape, draft: ModelShape | None, memory: DeviceMemory, *, n_ctx: int, kv_type: str,
                  draft_length: int, overhead: int, ngl: int, draft_ngl: int) -> tuple[str, ModelShape] | None:
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
        est = estimate(smaller, draft, n_ctx=n_ctx, kv_type=kv_type, draft_length=draft_length, overhead=overhead)
        if fits(place(est, memory, ngl, draft_ngl), memory):
            return name, smaller
    return None


def gb(n: int | float) -> str:
    """Bytes as decimal gigabytes for tables ("42.50 GB")."""
    return f"{n / GB:.2f} GB"


def size_text(n: int | float) -> str:
    """Bytes for a line of text, in the unit that keeps them readable ("4.92 GB", "1.2 MB")."""
    for unit, scale in (("GB", GB), ("MB", GB // 1000), ("kB", GB // 1_000_000)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} bytes"


# --- does this pair make sense? (from headers or models.toml facts, before any load) --------------
# The same rule as llama/compat.py (llama.cpp's common/speculative.cpp), on what a header tells:
# the load still runs the full check on the loaded vocabularies (the header reader keeps the token
# texts of vocabularies up to 4096 tokens only).

# tokenizer.ggml.model -> llama.cpp's vocabulary type (llama-vocab.cpp), as compat.py names them.
_VOCAB_TYPES = {"no_vocab": "none", "none": "none", "llama": "SPM", "gpt2": "BPE", "bert": "WPM",
                "t5": "UGM", "rwkv": "RWKV", "plamo2": "PLaMo2"}
_COMPAT_FIX = "pick a draft model from the target's family (same tokenizer)"


@dataclass(frozen=True)
class VocabFacts:
    """A header's tokenizer: its type name (None if unknown), BOS/EOS ids (None when unset: then
    llama.cpp picks a per-type default, so they are not compared), the number of tokens, and
    their texts when the header reader kept them."""

    kind: str | None
    bos: int | None
    eos: int | None
    n_tokens: int
    tokens: tuple[str, ...] | None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def vocab_facts(meta: dict[str, Any]) -> VocabFacts | None:
    """The tokenizer facts of GGUF metadata, or None when it has no token list."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, LongArray):
        n_tokens, texts = tokens.length, None
    elif isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
        n_tokens, texts = len(tokens), tuple(tokens)
    else:
        return None
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")]
    bos, eos = (i if isinstance(i, int) and not isinstance(i, bool) else None for i in ids)
    return VocabFacts(_VOCAB_TYPES.get(meta.get("tokenizer.ggml.model")), bos, eos, n_tokens, texts)


def vocab_problem(target: ModelShape, draft: ModelShape) -> str | None:
    """Why `draft` cannot draft for `target` as far as their headers (or models.toml's n_vocab)
    tell, in compat.py's words, or None: no difference seen (the load checks the rest)."""
    t, d = target.vocab, draft.vocab
    head = f"{draft.label} cannot draft for {target.label}: "
    if t is not None and d is not None:
        if t.kind and d.kind and t.kind != d.kind:
            return head + f"draft and target use different tokenizer types (target {t.kind}, draft {d.kind}); {_COMPAT_FIX}"
        for what, a, b in (("BOS", t.bos, d.bos), ("EOS", t.eos, d.eos)):
            if a is not None and b is not None and a != b:
                return head + f"draft and target have different {what} tokens (target {a}, draft {b}); {_COMPAT_FIX}"
    n_t = t.n_tokens if t is not None else target.n_vocab
    n_d = d.n_tokens if d is not None else draft.n_vocab
    if n_t and n_d and abs(n_t - n_d) > MAX_VOCAB_SIZE_DIFFERENCE:
        return head + (f"draft and target vocabularies differ in size by {abs(n_t - n_d)} tokens (target {n_t}, "
                       f"draft {n_d}; at most {MAX_VOCAB_SIZE_DIFFERENCE} allowed); {_COMPAT_FIX}")
    if t is not None and d is not None and t.tokens is not None and d.tokens is not None:
        for token in range(FIRST_CHECKED_TOKEN_ID, min(len(t.tokens), len(d.tokens))):
            if t.tokens[token] != d.tokens[token]:
                return head + (f"draft and target disagree on token {token} (target {t.tokens[token]!r}, "
                               f"draft {d.tokens[token]!r}); {_COMPAT_FIX}")
    return None


def larger_draft_warning(target: ModelShape, draft: ModelShape) -> str | None:
    """One line when the draft is bigger than the target (more parameters or a bigger file):
    drafting with it costs more than verifying; most likely -m and -d are swapped."""
    fix = "a draft should be a much smaller model of the target's family (are -m and -d swapped?)"
    if target.n_params and draft.n_params and draft.n_params > target.n_params:
        return (f"warning: the draft {draft.label} has more parameters ({draft.n_params / 1e9:.3g}B) than the "
                f"target {target.label} ({target.n_params / 1e9:.3g}B): {fix}")
    # Beyond 1%: a copy of the target (same weights, a longer name in its header) is no larger.
    if draft.weight_bytes > target.weight_bytes * 1.01:
        return (f"warning: the draft {draft.label} ({size_text(draft.weight_bytes)}) is larger than the target "
                f"{target.label} ({size_text(target.weight_bytes)}): {fix}")
    return None


def ctx_warning(shape: ModelShape, n_ctx: int, *, draft: bool = False) -> str | None:
    """One line when -c is above a model's training context (GGUF <arch>.context_length), as
    llama.cpp's own "possible training context overflow" warning (shown only with --verbose)."""
    if not shape.n_ctx_train or n_ctx <= shape.n_ctx_train:
        return None
    effect = "its drafts may be accepted less" if draft else "quality may drop"
    role = "draft model" if draft else "model"
    return f"warning: -c {n_ctx} is above the {role}'s training context ({shape.n_ctx_train}): {effect}"


def pair_warnings(target: ModelShape, draft: ModelShape | None, n_ctx: int) -> list[str]:
    """The warnings a pair (or a target alone) deserves before it is loaded: a context above a
    model's training context, a draft larger than its target."""
    lines = [ctx_warning(target, n_ctx)]
    if draft is not None:
        # The draft's own line only when the target's is not said already (one line is enough).
        lines += [None if lines[0] else ctx_warning(draft, n_ctx, draft=True), larger_draft_warning(target, draft)]
    return [line for line in lines if line]


# --- the target split over RPC servers (fit --rpc) ----------------------------------------------
@dataclass(frozen=True)
class SplitDevice:
    """One device the target's offloaded layers are split over: a local GPU or an RPC server's."""

    name: str
    free: int
    layers: int = 0  # of the target's, in this split
    bytes: int = 0  # their weights and KV cache
    output: bool = False  # it holds the output layer (the last device, when every layer is offloaded)

    @property
    def fits(self) -> bool:
        return self.bytes <= self.free


@dataclass(frozen=True)
class RpcSplit:
    devices: tuple[SplitDevice, ...]  # local GPUs first, then the servers', as --tensor-split counts them
    offloaded: int  # target layers on these devices (-ngl)
    local_bytes: int  # what stays on this machine's RAM/GPU besides: other layers, the draft, logits, overhead
    suggested: tuple[int, ...] | None  # a --tensor-split (layers per device) that fits, or None when none does

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)


def layers_by_share(n_layers: int, shares: tuple[float, ...]) -> list[int]:
    """How llama.cpp deals `n_layers` offloaded layers to devices by `shares` (cumulative
    proportions, each layer to the device whose cumulative share it falls under)."""
    total = sum(shares)
    bounds, acc = [], 0.0
    for s in shares:
        acc += s / total
        bounds.append(acc)
    counts = [0] * len(shares)
    for i in range(n_layers):
        position = i / n_layers
        counts[next((d for d, b in enumerate(bounds) if position < b), len(shares) - 1)] += 1
    return counts


def rpc_split(est: Estimate, devices: list[tuple[str, int]], ngl: int, shares: tuple[float, ...] | None = None) -> RpcSplit:
    """The target's offloaded layers (-ngl) over `devices` ((name, free bytes), in llama.cpp's
    order: the RPC servers', then local GPUs), by `shares` (--tensor-split; None: by free
    memory, as llama.cpp does). As llama.cpp, -ngl -1 (or more than the layers) offloads the
    output layer too, dealt last. Weights are charged evenly per layer, the output layer as one
    more (the header gives no finer split); the KV cache to the blocks. Compute buffers are not
    counted (leave some room); the rest of the estimate stays local. `suggested`: layers per
    device that fit, in proportion to free memory and capped by each device's room."""
    n_layer = est.target.n_layer
    with_output = ngl < 0 or ngl > n_layer
    slots = n_layer + 1 if with_output else ngl  # llama.cpp's act_gpu_layers
    per_weights = est.weights_target / (n_layer + 1)
    per_block = per_weights + est.kv_target / max(1, n_layer)
    frees = [free for _, free in devices]

    def charge(counts: list[int]) -> list[int]:
        out = [round(n * per_block) for n in counts]
        if with_output and counts:  # the last slot dealt is the output layer: no KV, weights only
            last = max(d for d, n in enumerate(counts) if n) if any(counts) else len(counts) - 1
            out[last] -= round(per_block - per_weights)
        return out

    counts = layers_by_share(slots, shares if shares is not None else tuple(max(f, 1) for f in frees))
    owner = max((d for d, n in enumerate(counts) if n), default=-1) if with_output else -1
    split = tuple(
        SplitDevice(name, free, n - (d == owner), b, d == owner)
        for d, ((name, free), n, b) in enumerate(zip(devices, counts, charge(counts)))
    )
    local = est.total - sum(d.bytes for d in split)
    rooms = [int(f // per_block) if per_block else slots for f in frees]
    suggested = None
    if sum(rooms) >= slots:
        want = layers_by_share(slots, tuple(max(f, 1) for f in frees))
        take = [min(w, r) for w, r in zip(want, rooms)]
        short = slots - sum(take)
        for d in sorted(range(len(take)), key=lambda d: rooms[d] - take[d], reverse=True):  # the rest where room is left
            extra = min(short, rooms[d] - take[d])
            take[d] += extra
            short -= extra
        suggested = tuple(take)
    return RpcSplit(split, min(slots, n_layer), local, suggested)
