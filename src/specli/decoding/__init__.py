"""Speculative decoding: the request and its generation, the step and its loop, the verifier,
drafters, sampling, the -n auto policy, stats and text (docs/life-of-a-step.md)."""
