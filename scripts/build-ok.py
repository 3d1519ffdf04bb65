"""Exit 0 when the installed llama-cpp-python is built as scripts/cmake-args.sh asks: with
llama.cpp's RPC backend (--rpc and its tests), and without llama.cpp's AMX kernels (they crash
with SIGILL on many machines: docs/install.md). The README's test command rebuilds
llama-cpp-python only when this fails, so a machine where the first command built it compiles
it once."""

import sys

try:
    import llama_cpp
except Exception as err:  # (not installed, or built for another CPU)
    print(f"build-ok: llama-cpp-python does not import ({type(err).__name__}): rebuilding it", file=sys.stderr)
    sys.exit(1)
missing = []
if not llama_cpp.llama_supports_rpc():
    missing.append("it lacks llama.cpp's RPC backend")
if b"AMX_INT8 = 1" in (llama_cpp.llama_print_system_info() or b""):
    missing.append("it has llama.cpp's AMX kernels")
if missing:
    print(f"build-ok: the installed llama-cpp-python is not built as scripts/cmake-args.sh asks ({'; '.join(missing)}): rebuilding it", file=sys.stderr)
sys.exit(1 if missing else 0)
