"""Tests of the synthetic GGUF fixtures (tests/fixtures/synthetic.py), read back with gguf's GGUFReader.

Loading the files in llama.cpp is tested through the engine; here only the gguf package and the
module's numpy reference forward pass are used.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from fixtures import synthetic as S  # noqa: E402  (after the importorskip)


def read_fields(path: Path) -> dict[str, object]:
    """Return every metadata key of a GGUF file as a Python value (lists for arrays)."""
    reader = gguf.GGUFReader(str(path))
    out: dict[str, object] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        is_array = field.types[0] == gguf.GGUFValueType.ARRAY
        elem_type = field.types[-1]
        values = []
        for idx in field.data:
            part = field.parts[idx]
            if elem_type == gguf.GGUFValueType.STRING:
                values.append(bytes(part).decode("utf-8"))
            else:
                values.append(part[0].item())
        out[name] = values if is_array else values[0]
    return out


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Return {name: array} of a GGUF file (numpy shape = ggml ne reversed)."""
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}


# --- vocabulary ---------------------------------------------------------------------------------


def test_base_vocab_layout() -> None:
    vocab = S.build_vocab()
    assert 500 <= len(vocab) <= 1100
    assert vocab.tokens[:3] == ("<unk>", "<s>", "</s>")
    assert (vocab.unk_id, vocab.bos_id, vocab.eos_id) == (0, 1, 2)
    assert vocab.add_bos and not vocab.add_eos
    assert vocab.tokens[3:259] == tuple(f"<0x{b:02X}>" for b in range(256))
    assert set(vocab.types[3:259]) == {S.TOKEN_BYTE}
    assert len(set(vocab.tokens)) == len(vocab)
    # Word pieces exist together with every prefix (the SPM merge path to the whole word).
    for word in ("\u2581the", "\u2581model", "\u2581tokens"):
        for end in range(2, len(word) + 1):
            vocab.id_of(word[:end])
    # Higher rank = higher score, so common pieces merge first.
    assert vocab.scores[vocab.id_of("\u2581the")] > vocab.scores[vocab.id_of("\u2581tokens")]


def _texts_differ_from(a: S.Vocab, b: S.Vocab, start: int = 5) -> bool:
    n = min(len(a), len(b))
    return any(a.tokens[i] != b.tokens[i] for i in range(start, n))


def test_vocab_variants_break_exactly_one_rule() -> None:
    base = S.build_vocab()
    renamed, shuffled = S.build_vocab("renamed"), S.build_vocab("shuffled")
    small, padded, eos = S.build_vocab("small"), S.build_vocab("padded"), S.build_vocab("eos")
    assert len(renamed) == len(base) and _texts_differ_from(renamed, base)
    assert len(shuffled) == len(base) and _texts_differ_from(shuffled, base)
    assert sorted(shuffled.tokens) == sorted(base.tokens)
    assert len(base) - len(small) > 128
    assert 0 < len(padded) - len(base) <= 128 and not _texts_differ_from(padded, base)
    assert eos.eos_id != base.eos_id and not _texts_differ_from(eos, base)
    assert eos.tokens[eos.eos_id] == "<eos2>" and eos.types[eos.eos_id] == S.TOKEN_CONTROL
    with pytest.raises(ValueError):
        S.build_vocab("nope")


# --- single models -------------------------------------------------------------------------------


def test_make_model_is_deterministic(tmp_path: Path) -> None:
    a = S.make_model(tmp_path / "a.gguf", seed=7)
    b = S.make_model(tmp_path / "b.gguf", seed=7)
    c = S.make_model(tmp_path / "c.gguf", seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size < 20 * 1024 * 1024
    assert not list(tmp_path.glob("*.tmp*"))  # the temp file was renamed into place


def test_make_model_metadata_and_tensors(tmp_path: Path) -> None:
    path = S.make_model(tmp_path / "m.gguf", seed=0, n_layer=3, n_embd=64, n_head=4, n_head_kv=2,
                        n_ff=96, n_ctx_train=2048)
    vocab = S.build_vocab()
    f = read_fields(path)
    assert f["general.architecture"] == "llama"
    assert f["llama.block_count"] == 3
    assert f["llama.embedding_length"] == 64
    assert f["llama.feed_forward_length"] == 96
    assert f["llama.attention.head_count"] == 4
    assert f["llama.attention.head_count_kv"] == 2
    assert f["llama.context_length"] == 2048
    assert f["llama.rope.dimension_count"] == 16
    assert f["tokenizer.ggml.model"] == "llama"
    assert f["tokenizer.ggml.tokens"] == list(vocab.tokens)
    assert f["tokenizer.ggml.token_type"] == list(vocab.types)
    assert len(f["tokenizer.ggml.scores"]) == len(vocab)
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert f["tokenizer.ggml.add_bos_token"] is True
    assert f["tokenizer.ggml.add_eos_token"] is False
    t = read_tensors(path)
    assert t["token_embd.weight"].shape == (len(vocab), 64)
    assert t["output.weight"].shape == (len(vocab), 64)
    assert t["blk.2.attn_k.weight"].shape == (32, 64)  # 2 kv heads x 16
    assert t["blk.2.ffn_down.weight"].shape == (64, 96)
    assert "blk.3.attn_q.weight" not in t
    assert all(np.isfinite(a).all() for a in t.values())


def test_f16_keeps_vectors_f32(tmp_path: Path) -> None:
    path = S.make_model(tmp_path / "h.gguf", seed=0, dtype="f16")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    with pytest.raises(ValueError):
        S.make_model(tmp_path / "x.gguf", dtype="q4_0")


def test_reference_logits_are_sharp_and_generation_varies(tmp_path: Path) -> None:
    path = S.make_model(tmp_path / "m.gguf", seed=0)
    n_vocab = len(S.build_vocab())
    tokens = [1] + np.random.default_rng(0).integers(3, n_vocab, size=63).tolist()
    logits = S.reference_logits(path, tokens)
    assert logits.shape == (64, n_vocab) and np.isfinite(logits).all()
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > 1.0
    generated = S.greedy_path(path, tokens[:4], 24)
    assert len(set(generated)) >= 6  # not one token forever


# --- pairs ---------------------------------------------------------------------------------------


def test_identical_pair_has_equal_tensors(tmp_path: Path) -> None:
    target, draft = S.make_pair(tmp_path, "identical", seed=3)
    assert target != draft
    t, d = read_tensors(target), read_tensors(draft)
    assert t.keys() == d.keys()
    assert all(np.array_equal(t[k], d[k]) for k in t)


def test_perturbed_pair_agreement_falls_with_noise(tmp_path: Path) -> None:
    tokens = [1] + np.random.default_rng(1).integers(3, 1000, size=47).tolist()
    agreement = {}
    for noise in (0.0, 0.01, 0.3):
        target, draft = S.make_pair(tmp_path, "perturbed", seed=0, noise=noise)
        tokens_of = [read_fields(p)["tokenizer.ggml.tokens"] for p in (target, draft)]
        assert tokens_of[0] == tokens_of[1]
        agreement[noise] = S.measure_agreement(target, draft, tokens)
    assert agreement[0.0] == 1.0
    assert agreement[0.01] > 0.8
    assert agreement[0.3] < 0.5
    # The same seed and noise give the same draft bytes.
    _, again = S.make_pair(tmp_path / "again", "perturbed", seed=0, noise=0.3)
    assert again.read_bytes() == draft.read_bytes()


def test_truncated_pair_keeps_first_blocks(tmp_path: Path) -> None:
    target, draft = S.make_pair(tmp_path, "truncated", seed=0, n_layer=3, draft_layers=2)
    assert read_fields(draft)["llama.block_count"] == 2
    t, d = read_tensors(target), read_tensors(draft)
    assert not any(k.startswith("blk.2.") for k in d)
    assert all(np.array_equal(t[k], d[k]) for k in d)
    with pytest.raises(ValueError):
        S.make_pair(tmp_path, "truncated", n_layer=2, draft_layers=3)


def test_incompatible_drafts(tmp_path: Path) -> None:
    base = read_fields(S.make_model(tmp_path / "t.gguf", seed=0))
    eos = read_fields(S.make_incompatible_draft(tmp_path, "eos"))
    small = read_fields(S.make_incompatible_draft(tmp_path, "small"))
    renamed = read_fields(S.make_incompatible_draft(tmp_path, "renamed"))
    assert eos["tokenizer.ggml.eos_token_id"] != base["tokenizer.ggml.eos_token_id"]
    assert len(base["tokenizer.ggml.tokens"]) - len(small["tokenizer.ggml.tokens"]) > 128
    assert renamed["tokenizer.ggml.tokens"] != base["tokenizer.ggml.tokens"]
    assert renamed["tokenizer.ggml.tokens"][:5] == base["tokenizer.ggml.tokens"][:5]


def test_cost_pair_target_extends_draft(tmp_path: Path) -> None:
    shape = dict(n_embd=64, n_head=4, n_head_kv=2, n_ff=128, extra_layers=2, dtype="f32")
    target, draft = S.make_cost_pair(tmp_path, seed=0, extra_scale=0.0, **shape)
    t, d = read_tensors(target), read_tensors(draft)
    assert read_fields(target)["llama.block_count"] == 3
    assert all(np.array_equal(t[k], d[k]) for k in d)
    assert not t["blk.1.ffn_down.weight"].any()  # scale 0: the extra blocks add nothing
    tokens = [1] + list(range(300, 340))
    assert S.measure_agreement(target, draft, tokens) == 1.0
    # Asking for an agreement calibrates a positive scale, recorded in the file name.
    target2, _ = S.make_cost_pair(tmp_path / "cal", seed=0, agreement=0.6, **shape)
    assert "-x0-" not in target2.name and "-x" in target2.name


def test_recurrent_model_metadata(tmp_path: Path) -> None:
    path = S.make_recurrent_model(tmp_path / "mamba.gguf", seed=0)
    again = S.make_recurrent_model(tmp_path / "mamba2.gguf", seed=0)
    assert path.read_bytes() == again.read_bytes()
    f = read_fields(path)
    assert f["general.architecture"] == "mamba"
    assert f["mamba.ssm.inner_size"] == 2 * f["mamba.embedding_length"]
    assert f["tokenizer.ggml.tokens"] == list(S.build_vocab().tokens)
