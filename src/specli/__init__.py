"""specli: speculative decoding for local GGUF models on top of llama.cpp."""

__version__ = "0.1.0"
