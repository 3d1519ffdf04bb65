"""Which model files: the registry (models.toml), the Hugging Face cache and pull, GGUF headers, fit."""
