#!/usr/bin/env bash
# Build the native llama.cpp binaries that benchmarks/bench.py compares specli against,
# with llama.cpp's RPC backend (-DGGML_RPC=ON: the tools take --rpc HOST:PORT) and its RPC server.
#
# Usage: benchmarks/build_native.sh [DIR]        (default DIR=/tmp/specli-native)
#
# The llama-cpp-python sdist vendors the exact llama.cpp that specli binds
# (vendor/llama.cpp), so building from it gives a like-for-like yardstick.
# Everything goes under DIR, outside the repo; nothing is installed.
# Idempotent: re-running skips the download/unpack when DIR/src exists and the
# build when all binaries already exist; otherwise only the missing ones are built. A build
# directory configured without RPC (an earlier version of this script) is reconfigured and every
# binary rebuilt: GGML_RPC adds a public compile definition to ggml, so all of them change.
#
# Env overrides: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default 2),
#                LLAMA_SRC (an already unpacked sdist directory to copy from),
#                ARCH_FLAGS (compiler flags instead of ggml's -march=native; default on a CPU
#                that reports AMX: "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
#                as docs/install.md builds llama-cpp-python there: this llama.cpp's AMX
#                kernels die with SIGILL on such machines, ggml-org/llama.cpp#26954).
#                Build specli's llama-cpp-python with the same flags for a like-for-like yardstick.
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
# llama-server (tools/server): the yardstick for `specli serve` (bench.py serve, memory, completion).
# ggml-rpc-server (tools/rpc): llama.cpp's rpc-server (docs/rpc.md, bench.py rpc);
# this llama.cpp names the binary ggml-rpc-server, so an `rpc-server` link to it is made too.
TARGETS=(ggml-rpc-server llama-speculative-simple llama-bench llama-completion llama-server)

missing_targets() {
    local t
    for t in "${TARGETS[@]}"; do
        [[ -x "$BIN/$t" ]] || echo "$t"
    done
}

rpc_configured() {
    grep -q '^GGML_RPC:BOOL=ON$' "$LLAMA/build/CMakeCache.txt" 2>/dev/null
}

# Present while a full rebuild is unfinished (an interrupted one leaves the old binaries in
# place, and the cache already says ON): the next run rebuilds everything again.
PENDING="$LLAMA/build/specli-rebuild-pending"

all_built() {
    rpc_configured && [[ ! -e "$PENDING" ]] && [[ -z "$(missing_targets)" ]]
}

link_rpc_server() {
    ln -sfn ggml-rpc-server "$BIN/rpc-server"
}

mkdir -p "$DIR"

if all_built; then
    link_rpc_server
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
if [[ -z "${ARCH_FLAGS:-}" ]] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    ARCH_FLAGS="-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
arch_args=()
if [[ -n "${ARCH_FLAGS:-}" ]]; then
    echo "compiler flags: $ARCH_FLAGS"
    arch_args=(-DGGML_NATIVE=OFF "-DCMAKE_C_FLAGS=$ARCH_FLAGS" "-DCMAKE_CXX_FLAGS=$ARCH_FLAGS")
fi
# Decided before configuring: afterwards the cache says ON either way.
rebuild_all=0
if [[ -f build/CMakeCache.txt ]] && ! rpc_configured; then
    echo "build/ was configured without RPC: reconfiguring with -DGGML_RPC=ON and rebuilding every binary"
    rebuild_all=1
fi
[[ -e "$PENDING" ]] && rebuild_all=1
# CURL/OpenSSL off: the benchmark only reads local files, and it avoids extra system deps.
# LLAMA_BUILD_SERVER is on by default in a standalone build (needed for llama-server).
# Web UI off: by default the server build downloads prebuilt UI assets from Hugging Face
# (LLAMA_USE_PREBUILT_UI) or runs npm (LLAMA_BUILD_UI); the benchmark only needs the HTTP API,
# and the build must work offline. The server then embeds an empty UI table.
# RPC on: the tools' --rpc, and tools/rpc (CPU only here: add the machine's GPU flag for a real
# helper machine, e.g. -DGGML_CUDA=ON).
cmake -B build -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_RPC=ON "${arch_args[@]}"
# Only the missing targets: a re-run after adding a target does not re-link the others.
if ((rebuild_all)); then
    touch "$PENDING"
    todo=("${TARGETS[@]}")
else
    mapfile -t todo < <(missing_targets)
fi
echo "building: ${todo[*]}"
cmake --build build -j"$JOBS" --target "${todo[@]}"
rm -f "$PENDING"

all_built || { echo "build finished but some binaries are missing in $BIN" >&2; exit 1; }
link_rpc_server
echo "native binaries ready in $BIN"
