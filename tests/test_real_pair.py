"""On the real instruct pair: Qwen2.5-Coder 1.5B Instruct Q4_K_M (target) and 0.5B (draft),
one tokenizer, Qwen's ChatML template (scripts/get-qwen-pair.sh fetches them; the `qwen_pair`
fixture skips these tests with one line where they are absent; CI fetches them).

- The model's own chat template renders the very text and tokens llama-server renders.
- Greedy output with every drafter is the target's: each emitted token within the near-tie
  margin of the target's argmax recomputed one token at a time (README "Limits").
- Sampling (T > 0) with the draft model keeps the target's law for the first token.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fixtures.helpers import greedy_gaps
from specli.decoding.drafters import DraftModelDrafter, HybridDrafter, PromptLookupDrafter
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.memory import TokenMemory
from specli.decoding.memory_drafter import MemoryDrafter
from specli.decoding.sampling import SamplingParams, probabilities
from specli.decoding.step import SpeculativeDecoder
from specli.llama.conversation import encode_conversation
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend
from specli.session.chat import choose_formatter
from stats_check import chi_square_p_value

pytestmark = [pytest.mark.real_pair, pytest.mark.slow]

LOGIT_MARGIN = 0.5  # as test_gemma.py: batched passes round a quantized model's logits differently
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# What llama-server (the llama.cpp this release vendors, /apply-template) renders for these
# messages with this GGUF's template, checked on 2026-12-03; the tokens are llama.cpp's own
# tokenization of that text with its special tokens parsed.
RENDERED = [
    ([{"role": "user", "content": "Hello there"}],
     f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
     "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"),
]

CODE = """Add type hints to this function and keep everything else as it is:

def merge(left, right):
    out = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out
"""


@pytest.fixture(scope="module")
def pair(qwen_pair):
    init_backend()
    target = LlamaModel(qwen_pair[0], n_ctx=1024, n_threads=2)
    draft = LlamaModel(qwen_pair[1], n_ctx=1024, n_threads=2)
    yield target, draft
    target.close(), draft.close()


def chat_ids(model: LlamaModel, messages: list[dict]) -> list[int]:
    formatter, _ = choose_formatter(model, None)
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    return encode_conversation(model, formatter, system, messages[1:] if system else messages)


@pytest.mark.parametrize("case", range(len(RENDERED)))
def test_the_models_template_renders_what_llama_server_renders(pair, case):
    target, _ = pair
    messages, expected = RENDERED[case]
    formatter, notice = choose_formatter(target, None)
    assert notice is None and formatter.name == "model"
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    assert formatter.render(system, messages[1:] if system else messages) == expected
    assert chat_ids(target, messages) == target.tokenize(expected, add_bos=False, parse_special=True)


def drafters(draft: LlamaModel) -> dict:
    return {
        "draft 1": (lambda: DraftModelDrafter(draft), 1),
        "draft 4": (lambda: DraftModelDrafter(draft), 4),
        "draft auto": (lambda: DraftModelDrafter(draft), "auto"),
        "lookup auto": (PromptLookupDrafter, "auto"),
        "lookup 8": (PromptLookupDrafter, 8),
        "hybrid auto": (lambda: HybridDrafter(PromptLookupDrafter(), DraftModelDrafter(draft)), "auto"),
        "memory auto": (lambda: MemoryDrafter(TokenMemory("test")), "auto"),
    }


@pytest.mark.parametrize("name", list(drafters(None)))
def test_greedy_output_is_the_targets_with_every_drafter(pair, name, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLI_CACHE_DIR", str(tmp_path))
    target, draft = pair
    ids = chat_ids(target, [{"role": "user", "content": CODE}])
    make, n_draft = drafters(draft)[name]
    drafter = make()
    if name.startswith("memory"):
        # A memory holding this very answer, cut short and then changed: it must not change the output.
        reference = generate(SpeculativeDecoder(target, None, 0), Request(ids, max_tokens=48)).run().token_ids
        drafter.memory.add([*ids, *reference[:20], *reversed(reference[20:])])
    gen = generate(SpeculativeDecoder(target, drafter, n_draft), Request(ids, max_tokens=48)).run()
    assert len(gen.token_ids) == 48 or gen.stop_reason == "eos"
    if not name.endswith("auto"):
        assert gen.stats.drafted > 0  # (auto may rightly draft little on this CPU)
    gaps = greedy_gaps(target, ids, gen.token_ids)
    assert gaps.max() <= LOGIT_MARGIN, (name, gaps.max())


def test_sampling_with_the_draft_model_keeps_the_targets_law_for_the_first_token(pair):
    """The first token of a sampled reply (T 1.0, top-k 8), drafted by the 0.5B at N=3 and
    verified by rejection sampling: its counts over seeded runs fit the target's own law."""
    target, draft = pair
    sampling = SamplingParams(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0, seed=None)
    ids = chat_ids(target, [{"role": "user", "content": "Name one colour. Answer with one word."}])
    target.reset()
    law_row = probabilities(target.eval(ids, logits="last")[-1], sampling, ids).copy()
    law = {int(t): float(law_row[t]) for t in np.flatnonzero(law_row)}
    assert max(law.values()) < 0.95  # (a first token the model is not sure of, or the test says nothing)
    draws, counts, drafted = 300, Counter(), 0
    for seed in range(draws):  # (the prompt stays cached: each run's first pass is [last, d1, d2, d3])
        params = SamplingParams(**{**sampling.__dict__, "seed": seed})
        # (two tokens: a pass drafts at most the tokens still to make beyond its own)
        gen = generate(SpeculativeDecoder(target, DraftModelDrafter(draft), 3, params), Request(ids, max_tokens=2)).run()
        counts[gen.token_ids[0] if gen.token_ids else -1] += 1
        drafted += gen.stats.drafted
    assert drafted > 0
    assert chi_square_p_value(counts, law, draws) > 1e-3, (counts.most_common(5), sorted(law.items(), key=lambda kv: -kv[1])[:5])
