#!/usr/bin/env bash
# llama.cpp's own server tests (tools/server/tests/unit in the sources llama-cpp-python vendors)
# against the native llama-server and against `specli serve`, on the same local models, then
# which tests each passes (benchmarks/llama_server_compare.py). No model hub: every model the
# tests ask for is replaced by MODEL (benchmarks/llama_server_shim.py), so the tests that assert
# a hub model's exact text fail on both and drop out of the comparison.
#
# Usage: benchmarks/llama_server_suite.sh OUT_DIR [FILE...]   (default files: the issue's eleven)
# Env: NATIVE_DIR (benchmarks/build_native.sh's DIR, default /tmp/specli-native),
#      MODEL, DRAFT (default: the Qwen pair of scripts/get-qwen-pair.sh under ~/.cache/specli-real-pair),
#      TEST_PYTHON (a Python with the tests' requirements.txt: pytest, openai, requests, wget, ...).
set -euo pipefail
OUT="${1:?usage: llama_server_suite.sh OUT_DIR [FILE...]}"
shift
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(basic chat_completion completion ctx_shift ignore_eos infill metrics security tokenize template speculative)
HERE="$(cd "$(dirname "$0")" && pwd)"
NATIVE_DIR="${NATIVE_DIR:-/tmp/specli-native}"
PAIR="$HOME/.cache/specli-real-pair"
export SHIM_MODEL="${MODEL:-$PAIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
export SHIM_DRAFT="${DRAFT:-$PAIR/qwen2.5-coder-0.5b-instruct.gguf}"
export SHIM_NATIVE="$NATIVE_DIR/src/vendor/llama.cpp/build/bin/llama-server"
export SHIM_PYTHON="${SHIM_PYTHON:-$(command -v python3)}"
export PYTHONPATH="$HERE/../src${PYTHONPATH:+:$PYTHONPATH}"
export LLAMA_SERVER_BIN_PATH="$HERE/llama_server_shim.py"
TESTS="$NATIVE_DIR/src/vendor/llama.cpp/tools/server/tests"
TEST_PYTHON="${TEST_PYTHON:-python3}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
for backend in native specli; do
    for f in "${FILES[@]}"; do
        echo "== $backend $f" >&2
        (cd "$TESTS" && SHIM_BACKEND=$backend "$TEST_PYTHON" -m pytest "unit/test_$f.py" -q -p no:cacheprovider \
            --junitxml="$OUT/$backend-$f.xml" > "$OUT/$backend-$f.log" 2>&1) || true
        tail -n 1 "$OUT/$backend-$f.log" >&2
    done
done
"$SHIM_PYTHON" "$HERE/llama_server_compare.py" "$OUT"
