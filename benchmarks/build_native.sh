#!/usr/bin/env bash
# Build the native llama.cpp binaries that benchmarks/bench_lookup.py compares specli against.
#
# Usage: benchmarks/build_native.sh [DIR]        (default DIR=/tmp/specli-native)
#
# The llama-cpp-python sdist vendors the exact llama.cpp that specli binds
# (vendor/llama.cpp), so building from it gives a like-for-like yardstick.
# Everything goes under DIR, outside the repo; nothing is installed.
# Idempotent: re-running skips the download/unpack when DIR/src exists and the
# build when all binaries already exist; otherwise only the missing ones are built.
#
# Env overrides: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default 2),
#                LLAMA_SRC (an already unpacked sdist directory to copy from).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${1:-/tmp/specli-native}"
JOBS="${JOBS:-2}"
SRC="$DIR/src"
LLAMA="$SRC/vendor/llama.cpp"
BIN="$LLAMA/build/bin"
# llama-completion: a same-prompt plain-decoding cross-check (takes -t/-f, prints its decode
# "eval time" rate). llama-simple is not built: it prints a speed, but it cannot set threads
# and its timed loop includes the prompt's decode.
# llama-server (tools/server): the yardstick for `specli serve` (benchmarks/serve_vs_native.py).
TARGETS=(llama-speculative-simple llama-bench llama-completion llama-server)

missing_targets() {
    local t
    for t in "${TARGETS[@]}"; do
        [[ -x "$BIN/$t" ]] || echo "$t"
    done
}

all_built() {
    [[ -z "$(missing_targets)" ]]
}

mkdir -p "$DIR"

if all_built; then
    echo "native binaries already built in $BIN (delete them to rebuild)"
    exit 0
fi

if [[ ! -f "$LLAMA/CMakeLists.txt" ]]; then
    if [[ -n "${LLAMA_SRC:-}" && -f "$LLAMA_SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
        echo "copying unpacked sdist from $LLAMA_SRC"
        rm -rf "$SRC"
        cp -a "$LLAMA_SRC" "$SRC"
    else
        dl="$DIR/download"
        tarball="$dl/llama_cpp_python-$VERSION.tar.gz"
        mkdir -p "$dl"
        if [[ ! -f "$tarball" ]]; then
            echo "downloading llama-cpp-python==$VERSION sdist"
            # --no-binary for this package only: with ':all:' pip also builds the sdist's
            # build backend dependencies from source just to read its metadata (slow).
            python -m pip download --no-deps --no-binary llama-cpp-python -d "$dl" \
                "llama-cpp-python==$VERSION"
        fi
        rm -rf "$DIR/unpack" && mkdir -p "$DIR/unpack"
        tar -xzf "$tarball" -C "$DIR/unpack"
        rm -rf "$SRC"
        mv "$DIR/unpack/llama_cpp_python-$VERSION" "$SRC"
        rmdir "$DIR/unpack"
    fi
fi

cd "$LLAMA"
# CURL/OpenSSL off: the benchmark only reads local files, and it avoids extra system deps.
# LLAMA_BUILD_SERVER is on by default in a standalone build (needed for llama-server).
# Web UI off: by default the server build downloads prebuilt UI assets from Hugging Face
# (LLAMA_USE_PREBUILT_UI) or runs npm (LLAMA_BUILD_UI); the benchmark only needs the HTTP API,
# and the build must work offline. The server then embeds an empty UI table.
cmake -B build -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
# Only the missing targets: a re-run after adding a target does not re-link the others.
mapfile -t todo < <(missing_targets)
echo "building: ${todo[*]}"
cmake --build build -j"$JOBS" --target "${todo[@]}"

all_built || { echo "build finished but some binaries are missing in $BIN" >&2; exit 1; }
echo "native binaries ready in $BIN"
