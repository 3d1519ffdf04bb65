"""`specli fit` arithmetic: the GGUF header reader, KV cache sizes checked by hand and against
what llama.cpp allocates, the guide's worked example, and the fit/no-fit suggestions."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest

from fixtures import synthetic
from fixtures.helpers import context_for_kv, measure_kv_cache_bytes
from specli import gguf as header
from specli.errors import ModelFileError, UsageError
from specli.llama.devices import backend_devices
from specli.models import fit
from specli.models.registry import load_registry

MIB = 1024 * 1024


def registry_pair(name: str) -> tuple[fit.ModelShape, fit.ModelShape]:
    entry = load_registry().get(name)
    return fit.shape_from_facts(entry.target, name), fit.shape_from_facts(entry.draft, name + " draft")


# --- KV arithmetic by hand ------------------------------------------------------------------


def test_llama_70b_and_8b_gqa_kv_by_hand():
    big, small = registry_pair("llama-3.1-70b")
    # 80 layers x 8 KV heads x (128 + 128) x 2 bytes = 327,680 bytes per position.
    assert big.kv_bytes_per_cell("f16") == 80 * 8 * 256 * 2 == 327_680
    assert big.kv_bytes(4096, "f16") == 4096 * 327_680 == 1_342_177_280
    # 32 layers x 8 x 256 x 2 = 131,072 bytes per position.
    assert small.kv_bytes(4096, "f16") == 4096 * 131_072
    # q8_0: a 1024-element row is 32 blocks of 34 bytes; q4_0: 32 blocks of 18 bytes.
    assert big.kv_bytes_per_cell("q8_0") == 80 * 2 * 32 * 34
    assert big.kv_bytes_per_cell("q4_0") == 80 * 2 * 32 * 18
    # llama.cpp pads the context to a multiple of 256.
    assert big.kv_bytes(4000, "f16") == big.kv_bytes(4096, "f16")
    assert fit.padded_ctx(4097) == 4352 and fit.padded_ctx(256) == 256


def test_per_layer_heads_and_recurrent_layers():
    # A hybrid: attention on layers 0 and 2 only (head_count_kv 0 marks recurrent layers).
    meta = {
        "general.architecture": "jamba", "jamba.block_count": 4, "jamba.embedding_length": 512,
        "jamba.attention.head_count": 8, "jamba.attention.head_count_kv": [2, 0, 4, 0],
        "jamba.ssm.state_size": 16, "jamba.vocab_size": 1000,
    }
    shape = fit.shape_from_metadata(meta, 10**9, "hybrid")
    # head size n_embd / n_head = 64; (2 + 4) heads x (64 + 64) x 2 bytes.
    assert shape.kv_bytes_per_cell("f16") == (2 + 4) * 128 * 2
    mamba = {"general.architecture": "mamba", "mamba.block_count": 4, "mamba.embedding_length": 256,
             "mamba.ssm.state_size": 16, "tokenizer.ggml.tokens": header.LongArray(5000)}
    pure = fit.shape_from_metadata(mamba, 10**8, "mamba")
    assert pure.kv_bytes(4096, "f16") == 0 and pure.n_vocab == 5000


def test_quantized_kv_needs_whole_blocks_per_head(small_model):
    # llama.cpp refuses a q8_0/q4_0 cache when the head size is not a multiple of 32.
    shape = fit.shape_from_file(small_model)
    assert fit.kv_type_problem(shape, "q8_0") and fit.kv_type_problem(shape, "f16") is None


def test_key_and_value_lengths_from_metadata():
    meta = {"general.architecture": "x", "x.block_count": 2, "x.embedding_length": 1024,
            "x.attention.head_count": 16, "x.attention.head_count_kv": 4,
            "x.attention.key_length": 192, "x.attention.value_length": 128, "x.vocab_size": 10}
    shape = fit.shape_from_metadata(meta, 1, "x")
    assert shape.kv_bytes_per_cell("f16") == 2 * 4 * (192 + 128) * 2


# --- the header reader and llama.cpp's own allocation ---------------------------------------


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "small.gguf"
    return synthetic.make_model(path, n_layer=3, n_embd=64, n_head=4, n_head_kv=2)


def test_reader_agrees_with_the_gguf_package(small_model):
    import gguf

    ours = header.read_gguf_metadata(small_model)
    reader = gguf.GGUFReader(small_model)
    theirs = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        if isinstance(value, header.LongArray):
            assert value.length == len(theirs[key])
        elif isinstance(value, float):
            assert value == pytest.approx(theirs[key])
        elif isinstance(value, list) and value and isinstance(value[0], float):
            assert value == pytest.approx(theirs[key])
        else:
            assert value == theirs[key], key


def test_synthetic_fixture_kv_matches_llama_cpp(small_model):
    shape = fit.shape_from_file(small_model)
    # 3 layers x 2 KV heads x (16 + 16) x 2 bytes = 384 bytes per position.
    assert shape.kv_bytes_per_cell("f16") == 3 * 2 * 32 * 2
    assert shape.weight_bytes == small_model.stat().st_size
    for n_ctx, kv_type in ((512, "f16"), (1000, "f16"), (2048, "f16")):
        measured = measure_kv_cache_bytes(small_model, n_ctx=n_ctx, kv_type=kv_type)
        assert shape.kv_bytes(n_ctx, kv_type) == pytest.approx(measured, rel=0.10)


@pytest.mark.gemma
def test_gemma_kv_matches_llama_cpp_with_its_sliding_window(gemma_path):
    shape = fit.shape_from_file(gemma_path)
    assert (shape.n_layer, set(shape.n_head_kv), shape.head_dim_k, shape.n_swa) == (18, {1}, 256, 512)
    # swa_full: the sliding-window layers get the whole context too. 18 x 1 x 512 x 2 bytes.
    assert shape.kv_bytes(4096, "f16") == 4096 * 18 * 512 * 2 == 72 * MIB
    for n_ctx, kv_type in ((1000, "f16"), (4096, "f16"), (4096, "q8_0"), (2048, "q4_0")):
        measured = measure_kv_cache_bytes(gemma_path, n_ctx=n_ctx, kv_type=kv_type)
        assert shape.kv_bytes(n_ctx, kv_type) == pytest.approx(measured, rel=0.10)
    # The facts models.toml records give the same answer offline.
    facts = fit.shape_from_facts(load_registry().get("gemma3-270m").target, "gemma")
    assert facts.kv_bytes(4096, "f16") == shape.kv_bytes(4096, "f16")
    assert facts.weight_bytes == shape.weight_bytes and facts.n_vocab == shape.n_vocab


def test_reader_rejects_non_gguf_and_truncated_files(tmp_path, small_model):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ModelFileError, match="not a GGUF"):
        header.read_gguf_metadata(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small_model.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="truncated"):
        header.read_gguf_metadata(cut)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<I", 1) + b"\0" * 16)
    with pytest.raises(ModelFileError, match="version 1"):
        header.read_gguf_metadata(old)


# --- the guide's example and the verdict ----------------------------------------------------


def test_guide_example_from_registry_facts():
    """42 GB (70B Q4_K_M) + 5 GB (8B Q4_K_M) + KV 4 GB + 2 GB = 53 GB: the KV of both models
    is about 4 GB at a context of 8704 tokens (458,752 bytes per position, f16)."""
    big, small = registry_pair("llama-3.1-70b")
    ctx = context_for_kv([big, small], 4 * fit.GB)
    assert ctx == 8704
    est = fit.estimate(big, small, n_ctx=ctx)
    assert est.kv_target + est.kv_draft == 8704 * 458_752 == pytest.approx(4 * fit.GB, rel=0.01)
    assert est.flat / fit.GB == pytest.approx(53, abs=0.5)
    # The exact figure adds only the logits buffers: (5+1) x 128256 x 4 and 128256 x 4 bytes.
    assert est.total - est.flat == 6 * 128_256 * 4 + 128_256 * 4


def gpu(free_gb: float, ram_gb: float = 64) -> fit.DeviceMemory:
    return fit.DeviceMemory("gpu", "test GPU", int(free_gb * fit.GB), int(free_gb * fit.GB),
                      int(ram_gb * fit.GB), int(ram_gb * fit.GB), "test")


def test_split_context_and_quant_suggestions_fit():
    big, small = registry_pair("llama-3.1-70b")
    est = fit.estimate(big, small, n_ctx=4096)
    memory = gpu(24)
    assert not fit.fits(fit.place(est, memory), memory)
    tn, dn = fit.layer_split(est, memory)
    assert dn == 32 and 0 < tn < 80
    assert fit.fits(fit.place(est, memory, tn, dn), memory)
    assert not fit.fits(fit.place(est, memory, tn + 1, dn), memory)
    # A 60 GB GPU holds the pair at 4096 but not at 64k; the largest context is in between.
    roomy = gpu(60)
    ctx = fit.max_context(big, small, roomy, kv_type="f16", draft_length=5, overhead=2 * fit.GB, limit=65536)
    assert ctx is not None and 4096 < ctx < 65536 and ctx % 256 == 0
    over = fit.estimate(big, small, n_ctx=ctx + 256)
    assert not fit.fits(fit.place(over, roomy), roomy)
    # In 45 GB of RAM only a lighter quantization of the 70B fits.
    ram = fit.DeviceMemory("ram", "RAM", 45 * fit.GB, 45 * fit.GB, 45 * fit.GB, 45 * fit.GB, "test")
    name, smaller = fit.smaller_quant(big, small, ram, n_ctx=4096, kv_type="f16", draft_length=5,
                                      overhead=2 * fit.GB, ngl=-1, draft_ngl=-1)
    assert name == "Q3_K_M" and smaller.weight_bytes < big.weight_bytes


def test_q4_k_m_is_about_057_of_q8_0():
    assert fit.BITS_PER_WEIGHT["Q4_K_M"] / fit.BITS_PER_WEIGHT["Q8_0"] == pytest.approx(0.57, abs=0.01)
    assert fit.quant_from_name("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert fit.quant_from_name("Phi-3-mini-4k-instruct.Q4_K_M.gguf") == "Q4_K_M"
    assert fit.quant_from_name("model.gguf") is None


def test_nvidia_smi_parsing_and_device_choice():
    gpus = fit.parse_nvidia_smi("NVIDIA GeForce RTX 4090, 24564, 23000\nNVIDIA A100-SXM4-80GB, 81920, 80000\n")
    assert gpus == [("NVIDIA GeForce RTX 4090", 23000 * MIB, 24564 * MIB), ("NVIDIA A100-SXM4-80GB", 80000 * MIB, 81920 * MIB)]
    assert fit._pick_device(gpus, None) == 1
    assert fit._pick_device(gpus, "0") == 0 and fit._pick_device(gpus, "4090") == 0
    with pytest.raises(UsageError, match="matches no GPU"):
        fit._pick_device(gpus, "h100")


def test_memory_detection_reports_its_source():
    memory = fit.detect_memory(query_devices=backend_devices)
    assert memory.kind in {"gpu", "unified", "ram"} and memory.total > 0 and memory.source


def test_memory_detection_takes_the_device_list_it_is_handed(monkeypatch):
    # fit imports nothing of specli.llama: the caller hands it llama.cpp's device query.
    monkeypatch.setattr(fit.platform, "system", lambda: "Linux")
    cpu = SimpleNamespace(name="CPU", description="x86", kind="cpu", free=MIB, total=2 * MIB)
    gpus = [SimpleNamespace(name=f"CUDA{i}", description="H200", kind="gpu", free=free, total=140 * fit.GB)
            for i, free in enumerate((90 * fit.GB, 120 * fit.GB))]
    memory = fit.detect_memory(None, lambda: [cpu, *gpus])
    assert (memory.kind, memory.name, memory.free, memory.source) == ("gpu", "CUDA1 (H200)", 120 * fit.GB, "llama.cpp device query")
    assert memory.others == ("CUDA0 (H200)",)
    assert fit.detect_memory("0", lambda: gpus).name == "CUDA0 (H200)"


def test_missing_facts_name_the_download():
    entry = load_registry().get("mistral-large")
    with pytest.raises(UsageError, match="size_bytes.*hf download"):
        fit.shape_from_facts(entry.target, "mistral-large")
