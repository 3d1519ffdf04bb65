"""The only package that talks to llama_cpp: models, contexts, chat templates, devices, draft/target compatibility."""
