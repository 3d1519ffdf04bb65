#!/bin/sh
# Install specli from this checkout with the extras given (default: demo), into the Python
# environment whose `python` is first on PATH, with llama-cpp-python built as
# scripts/cmake-args.sh asks. llama-cpp-python is compiled again only when the one pip installed
# is not built that way (a wheel from pip's cache, built with other flags): running the README's
# two commands in order compiles it once.
set -e
cd "$(dirname "$0")/.."
CMAKE_ARGS="$(sh scripts/cmake-args.sh)"
export CMAKE_ARGS
python -m pip install ".[${1:-demo}]"
if ! python scripts/build-ok.py; then
    python -m pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
    python scripts/build-ok.py
fi
