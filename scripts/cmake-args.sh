#!/bin/sh
# The CMake arguments to build llama-cpp-python with (pip reads them from CMAKE_ARGS): llama.cpp's
# RPC backend (--rpc), and on a CPU that reports AMX every instruction set it has but AMX, whose
# kernels in llama-cpp-python 0.3.36 die with SIGILL on such machines (docs/install.md).
args="-DGGML_RPC=on"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    flags="-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    args="$args -DGGML_NATIVE=OFF -DCMAKE_C_FLAGS='$flags' -DCMAKE_CXX_FLAGS='$flags'"
fi
printf '%s\n' "$args"
