#!/usr/bin/env bash
# What benchmarks/gpu_check.sh needs on a GPU machine with no network (such as the device tool's),
# fetched here where pip works, into one folder to carry there (default .gpu/, git-ignored):
#   - llama-cpp-python 0.3.36's sdist, trimmed from 77 MB to about 9 MB (without llama.cpp's
#     vocabulary files, docs, web UI, benches, tests and git history, none of which the build
#     reads), since the device tool carries at most 64 MiB;
#   - the pure-Python wheels such a machine's image lacks (device/KINDS.md lists what it has):
#     gguf (the synthetic pairs) and diskcache (imported by llama_cpp).
# Then, on the device tool: run benchmarks/gpu_check.sh with carry [".gpu"].
#
# Usage: benchmarks/gpu_bundle.sh [DEST]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.gpu}"
PY="${PYTHON:-python3}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST"

"$PY" -m pip download -q --no-deps --no-binary :all: -d "$TMP" llama-cpp-python==0.3.36
tar -xzf "$TMP/llama_cpp_python-0.3.36.tar.gz" -C "$TMP"
SDIST="$TMP/llama_cpp_python-0.3.36"
rm -rf "$SDIST/.git" "$SDIST/vendor/llama.cpp/"{models,docs,media,benches,tests,tools/ui}
tar -czf "$DEST/llama_cpp_python-0.3.36.tar.gz.part" -C "$TMP" llama_cpp_python-0.3.36
mv "$DEST/llama_cpp_python-0.3.36.tar.gz.part" "$DEST/llama_cpp_python-0.3.36.tar.gz"

# py3-none-any wheels: whichever Python the GPU machine has
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" "gguf>=0.10" "diskcache>=5.6"

du -sh "$DEST" >&2
echo "ready: carry \"$(realpath --relative-to="$ROOT" "$DEST" 2>/dev/null || echo "$DEST")\" and run: bash benchmarks/gpu_check.sh" >&2
