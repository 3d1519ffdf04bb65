"""Small random-weight GGUF models for tests and benchmarks.

Everything here is built in code: a SentencePiece-style ("llama" tokenizer model) vocabulary of
about 1000 tokens with byte fallback, llama-architecture weights drawn from numpy's
``Generator(seed)``, and the file written with the ``gguf`` package. The ``gguf`` package is a
test/benchmark dependency, not a runtime one, so it is imported inside the functions that need it.

What the fixtures are for:

* exactness tests of speculative decoding: logits are *sharp* (large top-1/top-2 gaps), so a
  greedy argmax does not flip between a batched k-token decode and one-token-at-a-time decoding;
* acceptance/rejection tests: draft models that share the target's vocabulary and agree with it
  fully (identical copy), partly (perturbed copy, truncated copy) or to a tunable degree;
* compatibility checks: drafts whose vocabulary or EOS id differs from the target's;
* CPU benchmarks: a target that costs about 8x the draft per token (``make_cost_pair``);
* refusing recurrent targets: a tiny Mamba model (``make_recurrent_model``).

``reference_logits`` is a plain-numpy forward pass of the llama models written here; it lets tests
measure sharpness and draft/target agreement without llama.cpp.

Public API::

    build_vocab(variant="base") -> Vocab
    make_model(path, *, seed=0, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
               n_ctx_train=4096, dtype="f32", vocab="base", logit_std=10.0, ...) -> Path
    make_pair(directory, kind="perturbed", *, seed=0, noise=0.05, draft_layers=1,
              dtype="f32", vocab="base", **shape) -> tuple[Path, Path]
    make_incompatible_draft(directory, variant, *, seed=0, **shape) -> Path
    make_cost_pair(directory, *, seed=0, agreement=None, extra_scale=None, ...)
        -> tuple[Path, Path]
    make_recurrent_model(path, *, seed=0, ...) -> Path
    reference_logits(path, tokens) -> np.ndarray
    measure_agreement(target_path, draft_path, tokens) -> float
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - typing only
    import gguf

__all__ = [
    "TOKEN_NORMAL",
    "TOKEN_UNKNOWN",
    "TOKEN_CONTROL",
    "TOKEN_UNUSED",
    "TOKEN_BYTE",
    "Vocab",
    "ModelSpec",
    "build_vocab",
    "make_model",
    "make_pair",
    "VOCAB_VARIANTS",
    "PAIR_KINDS",
    "random_weights",
    "write_llama_gguf",
    "load_llama",
    "make_incompatible_draft",
    "make_cost_pair",
    "make_recurrent_model",
    "reference_logits",
    "greedy_path",
    "measure_agreement",
]

# Token types as gguf stores them (llama.cpp's LLAMA_TOKEN_TYPE_*).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# --------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------

# Common English words; each becomes the piece "▁word". Order = frequency rank = SPM score.
_WORDS = """
the of and to a in is that for it as was with be by on not he i this are or his from at which
but have an they you were her she there one all we their been has when who will more no if out
so said what up its about into than them can only other new some could time these two may then
do first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go
came right used take three himself few house use during without again place around however home
small found thought went say part once general high upon school every don does got united left
number course war until always away something fact though water less public put think almost
hand word words text data code file model token tokens speed fast slow test value true false
none return def class import print
""".split()

# Word-internal pieces (no leading space) so unknown words still merge into a few pieces.
_SUBWORDS = """
s es ed ing er ers ly tion tions ment ness able al ic ive ous est ful less ity en ize ise ted ting
re un in dis pre con com ex pro th he an on at or ar st nd ou it is te ve ll nt ea ha hi wa ng
""".split()

_PUNCT = list(".,;:!?'\"()[]{}-_/\\*&%$#@+=<>|~`^")
_LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    chr(c) for c in range(ord("A"), ord("Z") + 1)
]
_DIGITS = [str(d) for d in range(10)]


@dataclass(frozen=True)
class Vocab:
    """A complete SPM vocabulary: token texts, scores and types plus the special ids.

    ``tokens[i]`` is the text of id ``i``; every text is unique (llama.cpp asserts it).
    """

    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 0
    add_bos: bool = True
    add_eos: bool = False

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.scores) == len(self.types)):
            raise ValueError("tokens, scores and types must have the same length")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("token texts must be unique")

    def __len__(self) -> int:
        return len(self.tokens)

    def id_of(self, text: str) -> int:
        """Return the id whose text is exactly ``text`` (KeyError if absent)."""
        return self.tokens.index(text)


def _base_pieces() -> list[str]:
    """Return the normal (non-special, non-byte) pieces of the base vocabulary, best first.

    Every prefix of every piece is included: SPM merges two adjacent symbols only when their
    concatenation is itself a piece, so prefix closure guarantees a merge path to whole words.
    """
    ordered: list[str] = []
    seen: set[str] = set()

    def add(piece: str) -> None:
        if piece and piece not in seen:
            seen.add(piece)
            ordered.append(piece)

    add(SPACE)
    for ch in _LETTERS + _DIGITS + _PUNCT:
        add(ch)
    for word in _WORDS:
        piece = SPACE + word
        for end in range(2, len(piece) + 1):
            add(piece[:end])
    for ch in _LETTERS + _DIGITS + _PUNCT:
        add(SPACE + ch)
    for sub in _SUBWORDS:
        for end in range(1, len(sub) + 1):
            add(sub[:end])
    return ordered


def _assemble(pieces: Sequence[str], extra_controls: Sequence[str] = ()) -> Vocab:
    """Build a Vocab: <unk>, <s>, </s>, 256 byte tokens, ``pieces``, then ``extra_controls``.

    Scores fall with the piece's rank (SPM merges the highest-scoring pair first); specials and
    bytes get 0 as in real SentencePiece conversions.
    """
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(TOKEN_NORMAL)
        scores.append(-float(rank))
    for text in extra_controls:
        tokens.append(text)
        types.append(TOKEN_CONTROL)
        scores.append(0.0)
    return Vocab(tuple(tokens), tuple(scores), tuple(types))


VOCAB_VARIANTS = ("base", "renamed", "shuffled", "small", "padded", "eos")


def build_vocab(variant: str = "base") -> Vocab:
    """Return the synthetic vocabulary or one of its variants (names in ``VOCAB_VARIANTS``).

    * ``base``: the shared vocabulary of all compatible fixtures.
    * ``renamed``: same size, the texts of 5 normal pieces at ids >= 5 replaced: incompatible.
    * ``shuffled``: same size and set of texts, 4 pairs of normal pieces swapped: incompatible.
    * ``small``: 200 pieces fewer (sizes differ by > 128): incompatible.
    * ``padded``: 16 unused tokens appended (sizes differ by <= 128, common ids identical):
      compatible under llama.cpp's rule.
    * ``eos``: an extra control token ``<eos2>`` appended and used as EOS: incompatible (EOS id).
    """
    pieces = _base_pieces()
    if variant == "base":
        return _assemble(pieces)
    if variant == "renamed":
        # Rename pieces far from the specials so only the text comparison can catch it.
        for k, idx in enumerate(range(len(pieces) - 5, len(pieces))):
            pieces[idx] = f"{SPACE}zq{k}x"
        return _assemble(pieces)
    if variant == "shuffled":
        for a, b in ((10, 11), (100, 101), (300, 301), (500, 501)):
            pieces[a], pieces[b] = pieces[b], pieces[a]
        return _assemble(pieces)
    if variant == "small":
        # Drop whole-word pieces from the end; prefixes of kept pieces stay (closure kept).
        return _assemble(pieces[:-200])
    if variant == "padded":
        base = _assemble(pieces)
        extra = tuple(f"<unused{i}>" for i in range(16))
        return replace(
            base,
            tokens=base.tokens + extra,
            scores=base.scores + (0.0,) * 16,
            types=base.types + (TOKEN_UNUSED,) * 16,
        )
    if variant == "eos":
        vocab = _assemble(pieces, extra_controls=("<eos2>",))
        return replace(vocab, eos_id=len(vocab) - 1)
    raise ValueError(f"unknown vocab variant {variant!r}; expected one of {VOCAB_VARIANTS}")


def _resolve_vocab(vocab: Vocab | str) -> Vocab:
    """Accept either a Vocab or the name of a variant; return a Vocab."""
    return build_vocab(vocab) if isinstance(vocab, str) else vocab


# --------------------------------------------------------------------------------------------
# Model shape and weights
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a llama-architecture model (what llama.cpp reads from metadata)."""

    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 4096
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("head dimension must be even (RoPE rotates pairs)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Weight scales. Why these values:
# * q/k: 1/sqrt(n_embd) gives unit-variance q and k, so attention scores ~ N(0, 1) after the
#   1/sqrt(head_dim) scaling: attention is neither uniform nor one-hot, so context matters.
# * attention output / FFN down: each layer adds a vector of about the embedding's size to the
#   residual stream, so later layers and earlier tokens change the prediction (non-degenerate).
# * output head: std logit_std/sqrt(n_embd) gives logits ~ N(0, logit_std^2) (the final RMS norm
#   makes the hidden vector's RMS 1). With ~1000 tokens the top-1/top-2 gap is then ~0.28 *
#   logit_std on average (measured with logit_std 10: mean 2.8, median 2.1, 5th percentile 0.14),
#   far above the batch-vs-sequential noise of llama.cpp on F32 weights: ~2e-5 with an F32 KV
#   cache and flash attention off, ~0.007 with the default F16 KV cache and flash attention.


def _layer_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], float]]:
    """Return {suffix: (numpy shape, init std)} for one transformer block.

    Numpy shapes are ggml's ``ne`` reversed: a ggml {n_embd, n_out} matrix is (n_out, n_embd).
    """
    e, f, kv = spec.n_embd, spec.n_ff, spec.n_head_kv * spec.head_dim
    return {
        "attn_q.weight": ((e, e), 1.0 / math.sqrt(e)),
        "attn_k.weight": ((kv, e), 1.0 / math.sqrt(e)),
        "attn_v.weight": ((kv, e), 1.0 / math.sqrt(e)),
        "attn_output.weight": ((e, e), 1.0 / math.sqrt(e)),
        "ffn_gate.weight": ((f, e), 1.0 / math.sqrt(e)),
        "ffn_up.weight": ((f, e), 1.0 / math.sqrt(e)),
        # silu(g)*u has RMS ~0.5 for unit-variance g, u: the factor 2 restores unit size.
        "ffn_down.weight": ((e, f), 2.0 / math.sqrt(f)),
    }


_NORMS = ("attn_norm.weight", "ffn_norm.weight")


def _rng(seed: int, *stream: int) -> np.random.Generator:
    """Return a Generator for ``seed`` and a sub-stream tag, independent across tags."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *stream])))


def _gauss(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Draw float32 normal values of the given std (float32 keeps files and math small)."""
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _layer_weights(spec: ModelSpec, rng: np.random.Generator, out_scale: float = 1.0):
    """Return one block's tensors keyed by suffix; ``out_scale`` multiplies the two output
    projections (attn_output, ffn_down), i.e. how much the block changes the residual stream."""
    weights: dict[str, np.ndarray] = {}
    for suffix, (shape, std) in _layer_shapes(spec).items():
        if suffix in ("attn_output.weight", "ffn_down.weight"):
            std *= out_scale
        weights[suffix] = _gauss(rng, shape, std)
    for suffix in _NORMS:
        weights[suffix] = np.ones(spec.n_embd, dtype=np.float32)
    return weights


def random_weights(
    spec: ModelSpec, n_vocab: int, seed: int, *, logit_std: float = 10.0
) -> dict[str, np.ndarray]:
    """Return all tensors of a random llama model, keyed by GGUF tensor name.

    Needs the spec, the vocabulary size and a seed; the same inputs give the same arrays. Each
    block draws from its own sub-stream so that block i is the same whatever ``n_layer`` is
    (a truncated copy is then literally the first K blocks of the full model).
    """
    rng = _rng(seed, 0)
    weights = {
        "token_embd.weight": _gauss(rng, (n_vocab, spec.n_embd), 1.0),
        "output_norm.weight": np.ones(spec.n_embd, dtype=np.float32),
        "output.weight": _gauss(rng, (n_vocab, spec.n_embd), logit_std / math.sqrt(spec.n_embd)),
    }
    for i in range(spec.n_layer):
        for suffix, arr in _layer_weights(spec, _rng(seed, 1, i)).items():
            weights[f"blk.{i}.{suffix}"] = arr
    return weights


def perturb(weights: dict[str, np.ndarray], noise: float, seed: int) -> dict[str, np.ndarray]:
    """Return a copy of ``weights`` with Gaussian noise of ``noise`` x each matrix's own RMS added.

    Norm vectors are kept (they are all ones and only rescale). ``noise=0`` returns equal arrays.
    """
    rng = _rng(seed, 2)
    out: dict[str, np.ndarray] = {}
    # Sorted: the noise drawn for each tensor must not depend on the dict's insertion order.
    for name in sorted(weights):
        arr = weights[name]
        if arr.ndim < 2 or noise == 0:
            out[name] = arr.copy()
            continue
        rms = float(np.sqrt(np.mean(arr.astype(np.float64) ** 2)))
        out[name] = (arr + _gauss(rng, arr.shape, noise * rms)).astype(np.float32)
    return out


def truncate(weights: dict[str, np.ndarray], n_layer: int) -> dict[str, np.ndarray]:
    """Return the tensors of the first ``n_layer`` blocks plus embeddings, norm and head."""
    keep = {}
    for name, arr in weights.items():
        if name.startswith("blk.") and int(name.split(".")[1]) >= n_layer:
            continue
        keep[name] = arr
    return keep


# --------------------------------------------------------------------------------------------
# Writing GGUF files
# --------------------------------------------------------------------------------------------

_DTYPES = ("f32", "f16")


def _add_vocab(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    """Write the tokenizer.ggml.* fields of an SPM ("llama") tokenizer."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(vocab.unk_id)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    # SPM prepends "▁" to the text; llama.cpp's default for SPM, written out to be explicit.
    writer.add_add_space_prefix(True)


def _add_tensors(writer: gguf.GGUFWriter, weights: dict[str, np.ndarray], dtype: str) -> None:
    """Add tensors in a fixed order; matrices in ``dtype``, vectors always F32 (as llama.cpp's
    converters do: norms stay F32 and ggml's CPU ops expect that)."""
    np_dtype = np.float16 if dtype == "f16" else np.float32
    for name in _tensor_order(weights):
        arr = weights[name]
        target = np_dtype if arr.ndim >= 2 else np.float32
        writer.add_tensor(name, np.ascontiguousarray(arr.astype(target)))


def _tensor_order(weights: dict[str, np.ndarray]) -> list[str]:
    """Return tensor names in llama.cpp's usual order: globals first, then blocks by index."""

    def key(name: str) -> tuple[int, int, str]:
        if name.startswith("blk."):
            return (1, int(name.split(".")[1]), name)
        return (0, 0, name)

    return sorted(weights, key=key)


def _write(
    path: Path, arch: str, fill_metadata, weights: dict[str, np.ndarray], dtype: str
) -> Path:
    """Write a GGUF file atomically (temp file + rename) and return its path.

    ``fill_metadata(writer)`` adds the key/value pairs; tensors come from ``weights``.
    """
    import gguf

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, not {dtype!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        try:
            fill_metadata(writer)
            writer.add_file_type(
                gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32
            )
            _add_tensors(writer, weights, dtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        # A reader (or a concurrent test) never sees a half-written file under the final name.
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_llama_gguf(
    path: str | Path,
    spec: ModelSpec,
    vocab: Vocab,
    weights: dict[str, np.ndarray],
    *,
    dtype: str = "f32",
    name: str = "specli-synthetic",
) -> Path:
    """Write a llama-architecture GGUF from explicit weights; return the path.

    Needs tensors named as llama.cpp expects (see ``random_weights``) for ``spec.n_layer`` blocks.
    """

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_name(name)
        writer.add_context_length(spec.n_ctx_train)
        writer.add_embedding_length(spec.n_embd)
        writer.add_block_count(spec.n_layer)
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head_kv)
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_rope_freq_base(spec.rope_freq_base)
        writer.add_layer_norm_rms_eps(spec.rms_eps)
        writer.add_vocab_size(len(vocab))
        _add_vocab(writer, vocab)

    return _write(Path(path), "llama", fill, weights, dtype)


# --------------------------------------------------------------------------------------------
# Public constructors
# --------------------------------------------------------------------------------------------


def make_model(
    path: str | Path,
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 4096,
    dtype: str = "f32",
    vocab: Vocab | str = "base",
    logit_std: float = 10.0,
    name: str = "specli-synthetic",
) -> Path:
    """Write a random llama-architecture GGUF to ``path`` and return the path.

    Same arguments give the same bytes. ``vocab`` is a Vocab or a variant name of
    ``build_vocab``. ``logit_std`` sets the spread of the logits: larger means sharper (larger
    top-1/top-2 gaps, more peaked softmax).
    """
    spec = ModelSpec(n_layer, n_embd, n_head, n_head_kv, n_ff, n_ctx_train)
    voc = _resolve_vocab(vocab)
    weights = random_weights(spec, len(voc), seed, logit_std=logit_std)
    return write_llama_gguf(path, spec, voc, weights, dtype=dtype, name=name)


PAIR_KINDS = ("identical", "perturbed", "truncated")


def make_pair(
    directory: str | Path,
    kind: str = "perturbed",
    *,
    seed: int = 0,
    noise: float = 0.05,
    draft_layers: int = 1,
    dtype: str = "f32",
    vocab: Vocab | str = "base",
    logit_std: float = 10.0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 4096,
) -> tuple[Path, Path]:
    """Write a (target, draft) pair sharing one vocabulary into ``directory``; return both paths.

    ``kind``:
    * ``identical``: the draft has the target's exact weights (must be accepted 100%);
    * ``perturbed``: draft = target + Gaussian noise of ``noise`` x each matrix's RMS. Greedy
      agreement measured with the default shape: noise 0 -> 100%, 0.01 -> ~95%, 0.02 -> ~88%,
      0.05 -> ~74%, 0.1 -> ~52%, 0.2 -> ~26%, 0.5 -> ~4%, 1.0 -> ~0.5%;
    * ``truncated``: the draft is the target's first ``draft_layers`` blocks. Every block moves
      the residual stream a lot, so agreement is low: 2 -> 1 layers ~22%, 4 -> 3 ~38%.
    File names encode the parameters, so different pairs can share a directory.
    """
    if kind not in PAIR_KINDS:
        raise ValueError(f"kind must be one of {PAIR_KINDS}, not {kind!r}")
    directory = Path(directory)
    spec = ModelSpec(n_layer, n_embd, n_head, n_head_kv, n_ff, n_ctx_train)
    voc = _resolve_vocab(vocab)
    weights = random_weights(spec, len(voc), seed, logit_std=logit_std)
    stem = f"llama-s{seed}-L{n_layer}-E{n_embd}-{dtype}"
    target = write_llama_gguf(directory / f"{stem}-target.gguf", spec, voc, weights, dtype=dtype)
    if kind == "identical":
        draft_w, draft_spec, tag = weights, spec, "identical"
    elif kind == "perturbed":
        draft_w, draft_spec, tag = perturb(weights, noise, seed), spec, f"noise{noise:g}"
    else:
        if not 1 <= draft_layers <= n_layer:
            raise ValueError("draft_layers must be between 1 and n_layer")
        draft_w = truncate(weights, draft_layers)
        draft_spec, tag = replace(spec, n_layer=draft_layers), f"trunc{draft_layers}"
    draft = write_llama_gguf(
        directory / f"{stem}-draft-{tag}.gguf", draft_spec, voc, draft_w, dtype=dtype,
        name="specli-synthetic-draft",
    )
    return target, draft


def make_incompatible_draft(
    directory: str | Path,
    variant: str,
    *,
    seed: int = 0,
    dtype: str = "f32",
    n_layer: int = 1,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
) -> Path:
    """Write a draft whose vocabulary is ``build_vocab(variant)`` (e.g. "renamed", "small",
    "eos", or "padded" for the compatible case) and return its path."""
    path = Path(directory) / f"llama-s{seed}-vocab-{variant}-{dtype}.gguf"
    return make_model(
        path, seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        n_ff=n_ff, dtype=dtype, vocab=variant, name=f"specli-synthetic-vocab-{variant}",
    )


# --------------------------------------------------------------------------------------------
# Cost-realistic pair
# --------------------------------------------------------------------------------------------

def make_cost_pair(
    directory: str | Path,
    *,
    seed: int = 0,
    agreement: float | None = None,
    extra_scale: float | None = None,
    draft_layers: int = 1,
    extra_layers: int = 8,
    n_embd: int = 512,
    n_head: int = 8,
    n_head_kv: int = 4,
    n_ff: int = 1408,
    n_ctx_train: int = 4096,
    dtype: str = "f16",
    logit_std: float = 10.0,
) -> tuple[Path, Path]:
    """Write a (target, draft) pair whose per-token cost ratio is about 8 and return the paths.

    The draft has ``draft_layers`` blocks; the target is those same blocks followed by
    ``extra_layers`` more, sharing embeddings, final norm and output head. Per token the target
    costs (draft_layers + extra_layers) blocks + head against draft_layers blocks + head: about
    8x with the defaults (9 blocks of ~3M weights + a 0.5M head vs 1 block + head).

    Agreement knob: ``extra_scale`` multiplies the output projections (attn_output, ffn_down) of
    the extra blocks. At 0 the extra blocks add exactly nothing, so the target computes the
    draft's logits (100% agreement at higher cost); growing it lets the extra blocks move the
    residual stream and lowers agreement (about 1.0 -> near-independent models). Alternatively
    pass ``agreement`` (0..1): the scale is then found by bisection on ``reference_logits``
    agreement over a fixed random token sequence (teacher-forced; agreement along a greedy path
    is similar but not identical). Default: agreement 0.8. Calibration costs ~2 s of numpy.

    Measured with the defaults (2 CPU threads, llama.cpp default context): target 1.6-1.9 ms per
    one-token decode, draft 0.16 ms (~10x); target passes over k = 2, 4, 8 tokens ~3.5, 4.4,
    7 ms. Greedy-path agreement for agreement = 0.9, 0.7, 0.5: 0.96, 0.78, 0.45. Files: target
    52 MB, draft 7 MB in F16 (benchmark fixtures, not for the unit tests).
    """
    spec_d = ModelSpec(draft_layers, n_embd, n_head, n_head_kv, n_ff, n_ctx_train)
    spec_t = replace(spec_d, n_layer=draft_layers + extra_layers)
    vocab = build_vocab("base")
    draft_w = random_weights(spec_d, len(vocab), seed, logit_std=logit_std)
    if extra_scale is not None and agreement is not None:
        raise ValueError("pass agreement or extra_scale, not both")
    if extra_scale is None:
        wanted = 0.8 if agreement is None else agreement
        extra_scale = _calibrate_extra_scale(
            spec_d, draft_w, extra_layers, seed, wanted, len(vocab)
        )
    target_w = dict(draft_w)
    target_w.update(_extra_blocks(spec_d, draft_layers, extra_layers, seed, extra_scale))
    directory = Path(directory)
    stem = f"cost-s{seed}-E{n_embd}-F{n_ff}-{dtype}"
    draft = write_llama_gguf(
        directory / f"{stem}-draft-L{draft_layers}.gguf", spec_d, vocab, draft_w, dtype=dtype,
        name="specli-synthetic-cost-draft",
    )
    target = write_llama_gguf(
        directory / f"{stem}-target-L{spec_t.n_layer}-x{extra_scale:.4g}.gguf", spec_t, vocab,
        target_w, dtype=dtype, name="specli-synthetic-cost-target",
    )
    return target, draft


def _extra_blocks(
    spec: ModelSpec, first: int, count: int, seed: int, scale: float
) -> dict[str, np.ndarray]:
    """Return blocks ``first`` .. ``first+count-1`` whose output projections are scaled by
    ``scale`` (their own sub-stream, so the draft's blocks are untouched)."""
    out: dict[str, np.ndarray] = {}
    for i in range(first, first + count):
        for suffix, arr in _layer_weights(spec, _rng(seed, 3, i), out_scale=scale).items():
            out[f"blk.{i}.{suffix}"] = arr
    return out


def _calibrate_extra_scale(
    spec_d: ModelSpec,
    draft_w: dict[str, np.ndarray],
    extra_layers: int,
    seed: int,
    agreement: float,
    n_vocab: int,
) -> float:
    """Return the extra_scale whose teacher-forced agreement is closest to ``agreement``.

    Bisection in log space on a fixed random token sequence; agreement falls as the scale grows.
    """
    if not 0.0 <= agreement <= 1.0:
        raise ValueError("agreement must be in [0, 1]")
    if agreement >= 1.0:
        return 0.0
    tokens = _rng(seed, 4).integers(3, n_vocab, size=64).tolist()
    # The target's first blocks are the draft's: run them once, then only the extra blocks.
    h_draft = _blocks(
        spec_d, draft_w, draft_w["token_embd.weight"][np.asarray(tokens)], range(spec_d.n_layer)
    )
    draft_arg = _head(spec_d, draft_w, h_draft).argmax(axis=1)
    # The extra blocks' weights for scale s are those for scale 1 with the two output
    # projections multiplied by s: draw once, rescale per probe.
    unit = _extra_blocks(spec_d, spec_d.n_layer, extra_layers, seed, 1.0)
    extra = range(spec_d.n_layer, spec_d.n_layer + extra_layers)

    def agree(scale: float) -> float:
        w = dict(draft_w)
        for name, arr in unit.items():
            scaled = name.endswith(("attn_output.weight", "ffn_down.weight"))
            w[name] = arr * np.float32(scale) if scaled else arr
        logits = _head(spec_d, w, _blocks(spec_d, w, h_draft, extra))
        return float(np.mean(logits.argmax(axis=1) == draft_arg))

    lo, hi = -3.0, 0.5  # log10 of the scale
    for _ in range(8):  # 3.5 decades / 2**8: the scale is found to within ~3%
        mid = (lo + hi) / 2
        if agree(10**mid) >= agreement:
            lo = mid
        else:
            hi = mid
    return float(10**lo)


# --------------------------------------------------------------------------------------------
# Recurrent model (Mamba), for refusing recurrent targets
# --------------------------------------------------------------------------------------------


def make_recurrent_model(
    path: str | Path,
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    d_state: int = 16,
    d_conv: int = 4,
    dt_rank: int = 4,
    dtype: str = "f32",
    vocab: Vocab | str = "base",
) -> Path:
    """Write a tiny random Mamba (v1) GGUF with the synthetic vocabulary; return the path.

    llama.cpp loads it as a recurrent model (``llama_model_is_recurrent`` is true). The inner
    size is 2 * n_embd because llama.cpp supports only that expansion factor.
    """
    voc = _resolve_vocab(vocab)
    d_inner = 2 * n_embd
    rng = _rng(seed, 5)
    e = n_embd
    weights: dict[str, np.ndarray] = {
        "token_embd.weight": _gauss(rng, (len(voc), e), 1.0),
        "output_norm.weight": np.ones(e, dtype=np.float32),
        "output.weight": _gauss(rng, (len(voc), e), 8.0 / math.sqrt(e)),
    }
    for i in range(n_layer):
        r = _rng(seed, 6, i)
        blk = {
            "attn_norm.weight": np.ones(e, dtype=np.float32),
            "ssm_in.weight": _gauss(r, (2 * d_inner, e), 1.0 / math.sqrt(e)),
            "ssm_conv1d.weight": _gauss(r, (d_inner, d_conv), 1.0 / math.sqrt(d_conv)),
            "ssm_conv1d.bias": np.zeros(d_inner, dtype=np.float32),
            "ssm_x.weight": _gauss(r, (dt_rank + 2 * d_state, d_inner), 1.0 / math.sqrt(d_inner)),
            "ssm_dt.weight": _gauss(r, (d_inner, dt_rank), 1.0 / math.sqrt(dt_rank)),
            "ssm_dt.bias": np.full(d_inner, -2.0, dtype=np.float32),
            # A = -exp(A_log) with A_log = log(1..d_state), as Mamba initialises (stable decay).
            "ssm_a": -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)),
            "ssm_d": np.ones(d_inner, dtype=np.float32),
            "ssm_out.weight": _gauss(r, (e, d_inner), 1.0 / math.sqrt(d_inner)),
        }
        for suffix, arr in blk.items():
            weights[f"blk.{i}.{suffix}"] = arr

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_name("specli-synthetic-mamba")
        writer.add_context_length(1 << 20)  # recurrent: no positional limit
        writer.add_embedding_length(e)
        writer.add_block_count(n_layer)
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(d_conv)
        writer.add_ssm_inner_size(d_inner)
        writer.add_ssm_state_size(d_state)
        writer.add_ssm_time_step_rank(dt_rank)
        writer.add_layer_norm_rms_eps(1e-5)
        _add_vocab(writer, voc)

    return _write(Path(path), "mamba", fill, weights, dtype)


# --------------------------------------------------------------------------------------------
# Numpy reference forward pass (llama models written by this module)
# --------------------------------------------------------------------------------------------


def load_llama(path: str | Path) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """Read a llama GGUF written by this module; return its spec and float32 tensors."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def scalar(key: str):
        field = reader.fields[key]
        return field.parts[field.data[0]][0].item()

    spec = ModelSpec(
        n_layer=int(scalar("llama.block_count")),
        n_embd=int(scalar("llama.embedding_length")),
        n_head=int(scalar("llama.attention.head_count")),
        n_head_kv=int(scalar("llama.attention.head_count_kv")),
        n_ff=int(scalar("llama.feed_forward_length")),
        n_ctx_train=int(scalar("llama.context_length")),
        rope_freq_base=float(scalar("llama.rope.freq_base")),
        rms_eps=float(scalar("llama.attention.layer_norm_rms_epsilon")),
    )
    weights = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    return spec, weights


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotate consecutive pairs (llama.cpp's "normal" RoPE). x: (n_tok, n_heads, head_dim)."""
    d = x.shape[-1]
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (n_tok, d/2)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def _attention(spec: ModelSpec, w: dict[str, np.ndarray], i: int, x: np.ndarray) -> np.ndarray:
    """Causal grouped-query self-attention of block ``i`` over the whole sequence ``x``."""
    n, hd = x.shape[0], spec.head_dim
    pos = np.arange(n)
    base = spec.rope_freq_base
    q = _rope((x @ w[f"blk.{i}.attn_q.weight"].T).reshape(n, spec.n_head, hd), pos, base)
    k = _rope((x @ w[f"blk.{i}.attn_k.weight"].T).reshape(n, spec.n_head_kv, hd), pos, base)
    v = (x @ w[f"blk.{i}.attn_v.weight"].T).reshape(n, spec.n_head_kv, hd)
    group = spec.n_head // spec.n_head_kv  # query head h reads kv head h // group (as ggml)
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((n, n), dtype=bool))[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    ctx = np.einsum("hqk,khd->qhd", probs, v).reshape(n, spec.n_embd)
    return ctx @ w[f"blk.{i}.attn_output.weight"].T


def _blocks(
    spec: ModelSpec, w: dict[str, np.ndarray], h: np.ndarray, layers: Iterable[int]
) -> np.ndarray:
    """Run blocks ``layers`` over the residual stream ``h`` (n_tokens, n_embd); return the new
    stream. Positions are 0..n_tokens-1."""
    for i in layers:
        h = h + _attention(spec, w, i, _rms_norm(h, w[f"blk.{i}.attn_norm.weight"], spec.rms_eps))
        x = _rms_norm(h, w[f"blk.{i}.ffn_norm.weight"], spec.rms_eps)
        gate = x @ w[f"blk.{i}.ffn_gate.weight"].T
        up = x @ w[f"blk.{i}.ffn_up.weight"].T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{i}.ffn_down.weight"].T
    return h


def _head(spec: ModelSpec, w: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    """Return logits (n_tokens, n_vocab) for the residual stream ``h``."""
    return _rms_norm(h, w["output_norm.weight"], spec.rms_eps) @ w["output.weight"].T


def _forward(
    spec: ModelSpec, w: dict[str, np.ndarray], tokens: Sequence[int], dtype=np.float64
) -> np.ndarray:
    """Return logits (n_tokens, n_vocab) for every position of ``tokens``.

    float64 (default) matches llama.cpp's F32 CPU result to ~1e-5 when llama.cpp runs with an
    F32 KV cache and flash attention off; float32 is faster and is enough for argmax statistics.
    """
    h = w["token_embd.weight"][np.asarray(tokens)].astype(dtype)
    return _head(spec, w, _blocks(spec, w, h, range(spec.n_layer)))


def reference_logits(path: str | Path, tokens: Sequence[int]) -> np.ndarray:
    """Return the logits (len(tokens), n_vocab) a llama GGUF of this module computes for each
    position of ``tokens`` (ids, BOS included if wanted), by a plain numpy forward pass."""
    spec, weights = load_llama(path)
    return _forward(spec, weights, tokens)


def greedy_path(path: str | Path, prompt: Sequence[int], n_new: int) -> list[int]:
    """Return ``n_new`` greedily generated ids after ``prompt`` (numpy reference, no KV cache)."""
    spec, weights = load_llama(path)
    tokens = list(prompt)
    for _ in range(n_new):
        tokens.append(int(_forward(spec, weights, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def measure_agreement(
    target_path: str | Path, draft_path: str | Path, tokens: Iterable[int]
) -> float:
    """Return the fraction of positions of ``tokens`` where draft and target argmax agree
    (teacher-forced on ``tokens``; pass the target's greedy path to get greedy agreement)."""
    toks = list(tokens)
    t = reference_logits(target_path, toks).argmax(axis=1)
    d = reference_logits(draft_path, toks).argmax(axis=1)
    return float(np.mean(t == d))
