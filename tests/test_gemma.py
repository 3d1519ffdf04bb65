"""End-to-end on the real Gemma 3 270M Q4_K_M file, with llama.cpp's default numerics.

Quantized weights and batched passes give logits that differ slightly from one-token-at-a-time
decoding (llama.cpp picks other kernels for batched passes), so exact equality with target-only output is not the
promise here. The promise: every emitted token is the target's greedy choice, up to a small
logit margin, for the logits recomputed one token at a time along the emitted prefix.
"""

from __future__ import annotations

import pytest

from fixtures.helpers import convert, greedy_gaps
from specli.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.step import SpeculativeDecoder
from specli.llama.model import LlamaModel

pytestmark = pytest.mark.gemma

# Largest allowed gap between the best logit and the emitted token's logit. Batched-vs-single
# differences of up to ~0.3 were seen on this file; a wrong token would usually be far below.
LOGIT_MARGIN = 0.5

CODE_PROMPT = '''def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total = total + (value - m) ** 2
    return total / len(values)

# The same two functions, with type hints:
def mean(values: list[float]) -> float:
'''
STORY_PROMPT = "Once upon a time, in a village at the edge of a great forest, there lived"


@pytest.mark.parametrize("prompt", [CODE_PROMPT, STORY_PROMPT], ids=["code", "story"])
def test_lookup_tokens_are_the_targets_greedy_choices(gemma, prompt, record_property):
    ids = gemma.tokenize(prompt)
    reference = generate(SpeculativeDecoder(gemma, None, 0), Request(ids, max_tokens=96)).run()
    gen = generate(SpeculativeDecoder(gemma, PromptLookupDrafter(), 5), Request(ids, max_tokens=96)).run()
    gaps = greedy_gaps(gemma, ids, gen.token_ids)
    divergence = next((i for i, (a, b) in enumerate(zip(gen.token_ids, reference.token_ids)) if a != b), None)
    record_property("max_logit_gap", float(gaps.max()))
    record_property("first_divergence_from_target_only", divergence)
    print(f"max gap {gaps.max():.4f}, tokens with gap > 0: {(gaps > 0).sum()}/{len(gaps)}, "
          f"first divergence from target-only: {divergence}, acceptance {gen.stats.acceptance_rate}")
    assert gen.stats.drafted > 0
    assert gaps.max() <= LOGIT_MARGIN
    # Target-only decoding is exactly its own computation: the prompt in one pass, then one token
    # at a time (where a CPU's batched and one-token passes round apart, that is not the same
    # as a one-token pass for the prompt's last token, which the margin above allows for).
    assert greedy_gaps(gemma, ids, reference.token_ids, prompt_at_once=True).max() == 0.0


def test_lookup_on_code_accepts_most_drafts(gemma):
    ids = gemma.tokenize(CODE_PROMPT)
    gen = generate(SpeculativeDecoder(gemma, PromptLookupDrafter(), 5), Request(ids, max_tokens=64)).run()
    # The rewrite copies the input's code: prompt lookup must find it (measured: see README).
    assert gen.stats.acceptance_rate > 0.5
    assert gen.stats.mean_tokens_per_pass > 2.0


def test_draft_model_on_real_weights(gemma, gemma_path, tmp_path):
    """Gemma F16 as the target, its own Q4_K_M as the draft: a real pair that agrees closely."""
    target_path = convert(gemma_path, tmp_path / "gemma-f16.gguf", "f16")
    model_tgt = LlamaModel(target_path, n_ctx=1024, n_threads=2)
    try:
        ids = model_tgt.tokenize(STORY_PROMPT)
        gen = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(gemma), 4), Request(ids, max_tokens=48)).run()
        gaps = greedy_gaps(model_tgt, ids, gen.token_ids)
        print(f"F16 target + Q4_K_M draft: acceptance {gen.stats.acceptance_rate:.2f}, max gap {gaps.max():.4f}")
        assert gen.stats.acceptance_rate > 0.8
        assert gaps.max() <= LOGIT_MARGIN
    finally:
        model_tgt.close()
