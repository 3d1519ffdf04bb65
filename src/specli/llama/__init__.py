"""The only package that talks to llama_cpp: model.py (a model and its context), context.py (several
sequences), templates.py (chat templates), native.py (backend, log, Ctrl-C), devices.py, compat.py."""
