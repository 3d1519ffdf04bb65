"""GGUF headers that lie: the bounded reader, the checks made before llama.cpp sees a file, and
property tests that mutate a real (fixture) header. Never a hang, a traceback or an abort:
a result, or one line and exit 2."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures import synthetic
from specli import gguf as header
from specli.errors import ModelFileError
from specli.models import fit

U32, I32, F32, STR, ARR, U64 = 4, 5, 6, 8, 9, 10


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hdr") / "base.gguf"
    return synthetic.make_model(path, n_layer=2, n_embd=64, n_head=4, n_head_kv=2)


def layout(data: bytes) -> tuple[dict[str, tuple[int, int, int]], int]:
    """key -> (type, value offset, value end) of each metadata pair; and where the pairs end."""
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    pos, out = 24, {}
    for _ in range(n_kv):
        key, pos = header._read_string(data, pos)
        vtype = struct.unpack_from("<I", data, pos)[0]
        _, end = header._read_value(data, pos + 4, vtype, key)
        out[key] = (vtype, pos + 4, end)
        pos = end
    return out, pos


def set_scalar(data: bytes, key: str, value, vtype: int | None = None) -> bytes:
    """A copy with `key`'s 4-byte value (and optionally its type: u32/i32/f32) replaced in place."""
    lay, _ = layout(data)
    old_type, off, end = lay[key]
    assert end - off == 4, key
    out = bytearray(data)
    vtype = old_type if vtype is None else vtype
    struct.pack_into("<I", out, off - 4, vtype)
    struct.pack_into(header._SCALARS[vtype], out, off, value)
    return bytes(out)


def encode_kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def string_payload(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def add_pairs(data: bytes, pairs: list[bytes]) -> bytes:
    """A copy with extra metadata pairs after the last one, plus a padding string that keeps the
    tensor data where the tensor table says it is (a shift by a multiple of the alignment, 32)."""
    _, end = layout(data)
    extra = b"".join(pairs)
    pad_key = "general.test_padding"
    base_len = len(encode_kv(pad_key, STR, string_payload("")))
    pad = (-(len(extra) + base_len)) % 32
    extra += encode_kv(pad_key, STR, string_payload("x" * pad))
    n_kv = struct.unpack_from("<Q", data, 16)[0] + len(pairs) + 1
    return data[:16] + struct.pack("<Q", n_kv) + data[24:end] + extra + data[end:]


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def specli(*args: str, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "specli", *args], capture_output=True, text=True, timeout=timeout)


def one_line_exit_2(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specli: error: "), result.stderr[-2000:]
    return lines[0]


# --- the reader: bounded and validating ------------------------------------------------------------
def test_the_fixture_header_is_fine(base):
    meta = header.check_model_header(base)
    assert meta["llama.block_count"] == 2


@pytest.mark.parametrize("name, make, fragment", [
    ("four bytes", lambda d: b"GGUF", "truncated"),
    ("empty", lambda d: b"", "empty"),
    ("cut in the pairs", lambda d: d[:100], "truncated"),
    ("block_count 0", lambda d: set_scalar(d, "llama.block_count", 0), "block_count is 0"),
    ("block_count 2^31", lambda d: set_scalar(d, "llama.block_count", 2**31), "1 to 512 layers"),
    ("block_count 1e8", lambda d: set_scalar(d, "llama.block_count", 10**8), "1 to 512 layers"),
    ("negative heads", lambda d: set_scalar(d, "llama.attention.head_count_kv", -2, I32), "head_count_kv is -2"),
    ("negative size", lambda d: set_scalar(d, "llama.embedding_length", -64, I32), "embedding_length is -64"),
    ("float count", lambda d: set_scalar(d, "llama.attention.head_count", 4.0, F32), "head_count is 4.0"),
    ("string count", lambda d: add_pairs(d, [encode_kv("llama.expert_count", STR, string_payload("8"))]), "expert_count is '8'"),
    ("nested arrays", lambda d: add_pairs(d, [encode_kv("general.x", ARR, struct.pack("<IQ", ARR, 10**6))]), "array of arrays"),
    ("array past the end", lambda d: add_pairs(d, [encode_kv("general.x", ARR, struct.pack("<IQ", U32, 2**60))]), "past the end"),
    ("string past the end", lambda d: add_pairs(d, [encode_kv("general.x", STR, struct.pack("<Q", 2**62))]), "past the end"),
    ("unknown type", lambda d: add_pairs(d, [encode_kv("general.x", 77, b"\0" * 8)]), "unknown value type 77"),
    ("2^64 pairs", lambda d: d[:16] + struct.pack("<Q", 2**64 - 1) + d[24:], "metadata pairs"),
    ("duplicate key", lambda d: add_pairs(d, [encode_kv("llama.block_count", U32, struct.pack("<I", 2))]), "twice"),
    ("too many experts", lambda d: add_pairs(d, [encode_kv("llama.expert_count", U32, struct.pack("<I", 5000))]), "at most 1024"),
    ("experts without any used", lambda d: add_pairs(d, [encode_kv("llama.expert_count", U32, struct.pack("<I", 8))]), "expert_used_count"),
    ("unknown rope scaling", lambda d: add_pairs(d, [encode_kv("llama.rope.scaling.type", STR, string_payload("bogus"))]), "rope.scaling.type"),
])
def test_lying_headers_are_one_clear_error(base, tmp_path, name, make, fragment):
    path = write(tmp_path, "bad.gguf", make(base.read_bytes()))
    started = time.monotonic()
    with pytest.raises(ModelFileError) as info:
        fit.shape_from_file(path)
    assert time.monotonic() - started < 2
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_per_layer_arrays_longer_than_the_layers_are_refused():
    meta = {"general.architecture": "x", "x.block_count": 2, "x.attention.head_count": [4, 4, 4]}
    with pytest.raises(ModelFileError, match="more entries than the 2 layers"):
        header.check_metadata(meta, "m")


# --- through the CLI: exit 2, one line, at once -----------------------------------------------------
def test_fit_refuses_lies_instead_of_hanging_or_saying_fits(base, tmp_path):
    data = base.read_bytes()
    # A 480-byte file whose block_count is 1e8 (the old reader built 1e8-entry lists for minutes).
    tiny = set_scalar(data, "llama.block_count", 10**8)[:480]
    for name, blob, fragment in [
        ("tiny.gguf", tiny, "truncated"),
        ("neg.gguf", set_scalar(data, "llama.attention.head_count_kv", -8, I32), "head_count_kv is -8"),
        ("four.gguf", b"GGUF", "truncated"),
    ]:
        started = time.monotonic()
        line = one_line_exit_2(specli("fit", "-m", str(write(tmp_path, name, blob)), "--json"))
        assert fragment in line and time.monotonic() - started < 30
    for value in ("inf", "nan", "-1"):
        line = one_line_exit_2(specli("fit", "-m", str(base), "--overhead-gb", value))
        assert "--overhead-gb" in line


@pytest.mark.slow
@pytest.mark.parametrize("key, value", [("llama.block_count", 0), ("llama.block_count", 2**31)])
def test_headers_that_abort_llama_cpp_are_refused_before_it_loads(base, tmp_path, key, value):
    """llama.cpp asserts on these (SIGABRT, exit 134 with a gdb dump): specli checks first."""
    path = write(tmp_path, "abort.gguf", set_scalar(base.read_bytes(), key, value))
    line = one_line_exit_2(specli("run", "-m", str(path), "--max-tokens", "1", "hi"))
    assert "block_count" in line


# --- property tests: mutate a real header ------------------------------------------------------------
FACT_KEYS = ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
             "llama.attention.head_count_kv", "llama.feed_forward_length", "llama.context_length",
             "llama.rope.dimension_count", "llama.vocab_size"]
EDGE = [0, 1, 2, 3, 511, 512, 513, 2**31 - 1, 2**31, 2**32 - 1, 10**8]


@st.composite
def fact_mutations(draw):
    """Set one model fact to an edge or random value, possibly retyped (u32, i32, f32)."""
    key = draw(st.sampled_from(FACT_KEYS))
    vtype = draw(st.sampled_from([U32, U32, I32, F32]))
    if vtype == F32:
        value = draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
    elif vtype == I32:
        value = draw(st.integers(-(2**31), 2**31 - 1))
    else:
        value = draw(st.one_of(st.sampled_from(EDGE), st.integers(0, 2**32 - 1)))
    return ("fact", key, vtype, value)


ADDED_KEYS = ["llama.expert_count", "llama.expert_used_count", "llama.expert_group_count",
              "llama.expert_group_used_count", "llama.nextn_predict_layers", "llama.attention.key_length",
              "llama.attention.sliding_window"]


@st.composite
def added_facts(draw):
    """Add a fact the fixture lacks (experts, RoPE scaling, ...), keeping the tensor data in place."""
    if draw(st.integers(0, 4)) == 0:
        return ("add", "llama.rope.scaling.type", STR, draw(st.sampled_from(["none", "linear", "yarn", "bogus", ""])))
    key = draw(st.sampled_from(ADDED_KEYS))
    return ("add", key, U32, draw(st.one_of(st.sampled_from([0, 1, 2, 8, 1024, 1025, 2**32 - 1]), st.integers(0, 64))))


@st.composite
def byte_mutations(draw, header_end: int):
    """Overwrite a few bytes somewhere in the header, or cut the file short."""
    if draw(st.booleans()):
        return ("cut", draw(st.integers(0, header_end + 64)))
    at = draw(st.integers(0, header_end - 1))
    return ("bytes", at, draw(st.binary(min_size=1, max_size=8)))


def mutate(data: bytes, mutation) -> bytes:
    kind = mutation[0]
    if kind == "fact":
        _, key, vtype, value = mutation
        return set_scalar(data, key, value, vtype)
    if kind == "add":
        _, key, vtype, value = mutation
        payload = string_payload(value) if vtype == STR else struct.pack(header._SCALARS[vtype], value)
        return add_pairs(data, [encode_kv(key, vtype, payload)])
    if kind == "cut":
        return data[: mutation[1]]
    _, at, blob = mutation
    return data[:at] + blob + data[at + len(blob):]


_BYTES: dict[Path, bytes] = {}


def base_bytes_of(base: Path) -> bytes:
    """The fixture's bytes, read once (not a fixture: hypothesis would print them on failure)."""
    if base not in _BYTES:
        _BYTES[base] = base.read_bytes()
    return _BYTES[base]


def _header_end(path: Path) -> int:
    return layout(path.read_bytes())[1]


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_reader_on_mutated_headers_gives_a_result_or_one_clear_error(base, tmp_path, data):
    base_bytes = base_bytes_of(base)
    end = _header_end(base)
    mutations = data.draw(st.lists(st.one_of(fact_mutations(), added_facts(), byte_mutations(end)), min_size=1, max_size=3))
    blob = base_bytes
    for m in mutations:
        try:
            blob = mutate(blob, m)
        except (KeyError, struct.error, AssertionError, UnicodeDecodeError, header._Corrupt):
            pass  # an earlier mutation moved the pairs: that one no longer applies
    path = write(tmp_path, "m.gguf", blob)
    try:
        shape = fit.shape_from_file(path)
    except ModelFileError as err:
        assert "\n" not in str(err) and str(err)
        return
    # A result: arithmetic that makes sense.
    assert 1 <= shape.n_layer <= 512 and all(h >= 0 for h in shape.n_head_kv)
    assert shape.head_dim_k >= 0 and shape.head_dim_v >= 0 and shape.n_vocab >= 0
    est = fit.estimate(shape, None, n_ctx=4096)
    assert est.total >= est.weights_target >= 0 and est.kv_target >= 0


LOADER = textwrap.dedent("""
    import sys
    from specli.errors import SpecliError
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend
    init_backend()
    for path in sys.argv[1:]:
        print("loading", path, flush=True)
        try:
            model = LlamaModel(path, n_ctx=64, n_threads=1)
            model.close()
            print("loaded", flush=True)
        except SpecliError as err:
            assert err.exit_code == 2, err
            assert "\\n" not in str(err), err
            print("refused:", err, flush=True)
""")


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("SPECLI_FUZZ_EXAMPLES", "6")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.lists(st.one_of(fact_mutations(), added_facts()), min_size=1, max_size=2), min_size=16, max_size=16))
def test_llama_cpp_never_aborts_on_mutated_facts(base, tmp_path, mutations):
    """Each mutated file is loaded by llama.cpp in one child process: it loads, or specli (or
    llama.cpp's own error report) refuses it; the process never aborts (exit 134) or hangs."""
    base_bytes = base_bytes_of(base)
    paths = []
    for i, group in enumerate(mutations):
        blob = base_bytes
        for m in group:
            try:
                blob = mutate(blob, m)
            except AssertionError:  # a fact retyped by the mutation before: skip this one
                pass
        paths.append(str(write(tmp_path, f"f{i}.gguf", blob)))
    result = subprocess.run([sys.executable, "-c", LOADER, *paths], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (mutations, result.returncode, result.stdout[-1500:], result.stderr[-1500:])
    assert result.stdout.count("loading") == len(paths)
    assert "Traceback" not in result.stderr
