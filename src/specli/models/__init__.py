"""Which model files: the registry (models.toml), the Hugging Face cache and pull, fit (on GGUF headers, read by specli.gguf)."""
