#!/bin/sh
# Install specli from this checkout with the extras given (default: demo), into the Python
# environment whose `python` is first on PATH, with llama-cpp-python built as
# scripts/cmake-args.sh asks, plus any CMAKE_ARGS of your own (e.g. -DGGML_CUDA=on).
# llama-cpp-python is compiled again only when the one installed is not built that way (a wheel
# from pip's cache, built with other flags): the README's two commands in order compile it once.
set -e
cd "$(dirname "$0")/.."
own="${CMAKE_ARGS:-}"
CMAKE_ARGS="$(sh scripts/cmake-args.sh)${own:+ $own}"
export CMAKE_ARGS
if [ -n "$own" ]; then  # flags of your own, which no cached wheel can be checked for: built here
    python -m pip install --no-cache-dir llama-cpp-python==0.3.36
fi
python -m pip install ".[${1:-demo}]"
if ! python scripts/build-ok.py; then
    python -m pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
    python scripts/build-ok.py
fi
