"""On a GPU build of llama-cpp-python: full offload, partial splits and `fit`'s device query.

Skipped unless llama.cpp sees a GPU device (an RPC build offloads, to servers, without one); benchmarks/gpu_check.sh
builds one and runs these with `-m gpu`. The no-GPU run of that script is checked here too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import llama_cpp
import pytest

from fixtures.cli import specli
from specli.llama.devices import backend_devices

ROOT = Path(__file__).resolve().parents[1]
# A GPU device, not just offload support: an RPC-enabled build supports offload (to RPC
# servers) without any GPU.
HAS_GPU = bool(llama_cpp.llama_supports_gpu_offload()) and any(d.kind in ("gpu", "igpu") for d in backend_devices())
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no GPU device (llama.cpp's device list has none)")
PROMPT = "Once upon a time"


def run_json(pair, *flags: str) -> dict:
    target, draft = pair
    result = specli("run", "-m", str(target), "-d", str(draft), "-n", "24", "--temp", "0", "--json", "-q",
                    "-c", "256", *flags, PROMPT, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.gpu
@needs_gpu
def test_full_offload_of_both_models_matches_the_cpu_run(pair_identical):
    cpu = run_json(pair_identical, "-ngl", "0", "-ngld", "0")
    gpu = run_json(pair_identical, "-ngl", "-1", "-ngld", "-1")
    # F32 weights: GPU kernels round differently, so the greedy paths may part at a near-tie;
    # up to there they agree, and the first tokens always do (the Gemma margin's reasoning).
    n = min(len(cpu["token_ids"]), len(gpu["token_ids"]))
    assert n >= 8
    assert gpu["token_ids"][:8] == cpu["token_ids"][:8]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ngl, ngld", [("1", "0"), ("0", "-1"), ("2", "1")])
def test_partial_splits_run(pair_perturbed, ngl, ngld):
    out = run_json(pair_perturbed, "-ngl", ngl, "-ngld", ngld)
    assert len(out["token_ids"]) == 24


@pytest.mark.gpu
@needs_gpu
def test_fit_sees_the_real_device(pair_identical):
    result = specli("fit", "-m", str(pair_identical[0]), "-d", str(pair_identical[1]), "--json")
    assert result.returncode == 0, result.stderr
    memory = json.loads(result.stdout)["memory"]
    assert memory["kind"] == "gpu", memory
    assert memory["total"] > 0 and 0 <= memory["free"] <= memory["total"]
    smi = shutil.which("nvidia-smi")
    if smi:  # llama.cpp's figure is the driver's, give or take what the driver reserves
        mib = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout.split()
        assert any(abs(memory["total"] - float(m) * 2**20) <= 0.1 * float(m) * 2**20 for m in mib), (memory, mib)


@pytest.mark.slow
def test_gpu_check_script_runs_its_no_gpu_flow(tmp_path):
    """The script itself, in the mode CI gets: the CPU build, a tiny pair, one round."""
    out = tmp_path / "results"
    env = {**os.environ, "SPECLI_GPU_CHECK_FORCE_CPU": "1", "SPECLI_GPU_CHECK_TINY": "1",
           "WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    env.pop("OUT", None)
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)],
                            capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no NVIDIA GPU" in result.stderr
    summary = (out / "summary.txt").read_text()
    assert "mode: cpu" in summary and "bench target-only vs draft model" in summary
    assert json.loads((out / "bench-synthetic.json").read_text())
