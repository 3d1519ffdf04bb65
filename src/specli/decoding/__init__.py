"""The speculative loop and its pure parts: engine, parallel runner, drafters, verification, sampling, stats, text."""
