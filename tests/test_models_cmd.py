"""`specli models` and `specli fit` through a real subprocess: offline, JSON shapes, exit codes."""

from __future__ import annotations

import json

import pytest

from fixtures import synthetic
from fixtures.cli import assert_one_line_error, specli
from specli.models.registry import load_registry


@pytest.fixture()
def empty_hf_cache(tmp_path):
    """An empty Hugging Face cache and no network: every hf source must read 'not downloaded'."""
    return {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}


def test_models_json_lists_every_entry_offline(empty_hf_cache):
    result = specli("models", "--json", env=empty_hf_cache)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    registry = load_registry()
    assert [r["name"] for r in rows] == list(registry.entries)
    by_name = {r["name"]: r for r in rows}
    gemma = by_name[registry.default_name]
    assert gemma["default"] and gemma["draft"] == "lookup" and gemma["n_speculative"] == 16
    assert gemma["target"]["size_bytes"] == 253_113_024
    llama = by_name["llama-3.1-70b"]
    assert llama["acceptance"] == [0.70, 0.80] and llama["n_speculative"] == 5
    assert llama["target"]["downloaded"] is False and llama["draft"]["downloaded"] is False
    assert llama["draft"]["hf_files"] == ["Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf"]
    assert by_name["mistral-large"]["target"]["size_bytes"] is None


@pytest.mark.gemma
def test_models_sees_the_assembled_demo_model(gemma_path, empty_hf_cache):
    rows = json.loads(specli("models", "--json", env=empty_hf_cache).stdout)
    gemma = next(r for r in rows if r["default"])
    assert gemma["target"]["downloaded"] is True and gemma["target"]["path"] == str(gemma_path)


def test_models_table_for_humans(empty_hf_cache):
    result = specli("models", env=empty_hf_cache)
    assert result.returncode == 0, result.stderr
    for name in load_registry().entries:
        assert name in result.stdout
    assert "42.50 GB" in result.stdout and "lookup" in result.stdout


def test_fit_local_pair_reads_headers(tmp_path):
    target, draft = synthetic.make_pair(tmp_path, "perturbed", seed=1)
    result = specli("fit", "-m", str(target), "-d", str(draft), "-c", "1000", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["fits"] is True and out["ctx_allocated"] == 1024
    assert out["target"]["origin"] == "GGUF header"
    assert out["bytes"]["weights_target"] == target.stat().st_size
    b = out["bytes"]
    parts = ("weights_target", "weights_draft", "kv_target", "kv_draft", "logits_target", "logits_draft", "overhead")
    assert b["total"] == sum(b[k] for k in parts)
    assert out["memory"]["source"]


def test_fit_table_and_exit_0_for_the_default_model():
    result = specli("fit")
    assert result.returncode == 0, result.stderr
    assert "fits" in result.stdout and "flat formula" in result.stdout and "KV cache" in result.stdout


def test_fit_exit_3_when_it_cannot_fit(empty_hf_cache):
    # 70B + 8B with a million-token context: ~460 GB of KV cache alone.
    result = specli("fit", "-m", "llama-3.1-70b", "-c", "1000000", env=empty_hf_cache)
    assert result.returncode == 3, result.stderr
    # stderr: only the warning that a million tokens is past Llama 3.1's training context.
    assert "does not fit" in result.stdout
    assert result.stderr == "warning: -c 1000000 is above the model's training context (131072): quality may drop\n"
    as_json = specli("fit", "-m", "llama-3.1-70b", "-c", "1000000", "--json", env=empty_hf_cache)
    assert as_json.returncode == 3
    out = json.loads(as_json.stdout)
    assert out["fits"] is False and out["target"]["origin"] == "models.toml"
    for s in out["suggestions"]:
        assert s["command"]


def test_fit_suggests_a_smaller_context():
    # The default model fits at a normal context; at 4M tokens only a smaller context helps.
    result = specli("fit", "-c", "4000000", "--overhead-gb", "0", "--json")
    if result.returncode == 0:
        pytest.skip("this machine holds 300 GB of KV cache")
    out = json.loads(result.stdout)
    ctx = [s for s in out["suggestions"] if s["kind"] == "ctx"]
    assert ctx and "specli run" in ctx[0]["command"] and " -c " in ctx[0]["command"]


@pytest.mark.parametrize("args, fragment", [
    (("--kv-type", "q2"), "--kv-type"),
    (("-c", "4"), "Invalid value for '-c' / '--ctx'"),
    (("--lookup", "-d", "x.gguf"), "not both"),
    (("-m", "no-such-model"), "unknown model"),
    (("-m", "/nonexistent/m.gguf"), "not found"),
    (("--n-draft", "0"), "--n-draft"),
    (("--draft-max", "0"), "Invalid value for '--draft-max'"),
    # fit generates nothing: llama.cpp's -n (tokens to generate) is refused, not taken as N.
    (("-n", "5"), "No such option: -n"),
    (("-m", "mistral-large"), "size_bytes"),
])
def test_fit_bad_input_is_one_line_exit_2(args, fragment, empty_hf_cache):
    assert_one_line_error(specli("fit", *args, env=empty_hf_cache), 2, fragment)
