"""Log probabilities under speculation (Request.logprobs): each emitted token's entry comes from
the target's own row for its place, the very row plain decoding computes, whichever drafter
proposed the token (an accepted draft's row is its verification row). On F32 fixtures batched
rows equal one-token rows but for float rounding (~1e-5), so the entries equal plain decoding's
to 1e-4; on the real quantized pair, within the batch-numerics margin."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specli.decoding.drafters import DraftModelDrafter, HybridDrafter, PromptLookupDrafter
from specli.decoding.generation import Request, TokenLogprob, token_logprobs
from specli.decoding.loop import generate
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.decoding.step import SpeculativeDecoder
from specli.decoding.stopping import STOP_STRING

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "café 日本 😀 – numbers 1 2 3",
]
MAX_TOKENS = 40
N_TOP = 5


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = np.asarray(row, dtype=np.float64)
    return row - (row.max() + math.log(np.exp(row - row.max()).sum()))


def recomputed(model, prompt: list[int], emitted: list[int]) -> list[np.ndarray]:
    """The target's log-softmax rows for each emitted token, one token per pass (plain decoding)."""
    model.reset()
    model.eval(prompt[:-1], logits="none")
    rows, previous = [], prompt[-1]
    for token in emitted:
        rows.append(log_softmax(model.eval([previous], logits="last")[-1]))
        previous = token
    model.reset()
    return rows


def check_entries(entries: list[TokenLogprob], tokens: list[int], rows: list[np.ndarray], tol: float) -> float:
    """Each entry names its token, gives its row's logprob, and the row's N_TOP best, most likely
    first; returns the largest difference from the rows."""
    assert len(entries) == len(tokens) == len(rows)
    worst = 0.0
    for entry, token, row in zip(entries, tokens, rows):
        assert entry.token == token and entry.logprob <= 0
        worst = max(worst, abs(entry.logprob - row[token]))
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        assert len(entry.top) == N_TOP
        for t, lp in entry.top:
            worst = max(worst, abs(lp - row[t]))
        best = np.sort(row)[::-1][:N_TOP]
        assert np.allclose([lp for _, lp in entry.top], best, atol=tol)
    assert worst <= tol, worst
    return worst


# --- the arithmetic ------------------------------------------------------------------------------------
def test_an_entry_is_the_rows_log_softmax_and_its_best_tokens():
    row = np.array([1.0, 3.0, 3.0, -2.0, 0.5], dtype=np.float32)
    entry = token_logprobs(row, 4, 3)
    expected = log_softmax(row)
    assert entry.token == 4 and entry.logprob == pytest.approx(expected[4], abs=1e-12)
    assert [t for t, _ in entry.top] == [1, 2, 0]  # (a tie goes to the lower id)
    assert [lp for _, lp in entry.top] == pytest.approx([expected[1], expected[2], expected[0]], abs=1e-12)
    assert token_logprobs(row, 0, 0).top == ()
    assert len(token_logprobs(row, 0, 10).top) == 5  # (no more alternatives than tokens)
    assert math.fsum(math.exp(lp) for _, lp in token_logprobs(row, 0, 5).top) == pytest.approx(1.0)


# --- on the F32 fixture pair: exactly plain decoding's ---------------------------------------------------
DRAFTERS = {
    "target-only": lambda draft: (None, 0),
    "lookup": lambda draft: (PromptLookupDrafter(ngram_max=3, ngram_min=1), 4),
    "draft model": lambda draft: (DraftModelDrafter(draft), 4),
    "hybrid": lambda draft: (HybridDrafter(PromptLookupDrafter(ngram_max=3, ngram_min=1), DraftModelDrafter(draft)), "auto"),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_logprobs_with_every_drafter_are_plain_decodings(perturbed, name):
    target, draft = perturbed
    accepted = 0
    for prompt in PROMPTS:
        ids = target.tokenize(prompt)
        drafter, n = DRAFTERS[name](draft)
        gen = generate(SpeculativeDecoder(target, drafter, n), Request(ids, MAX_TOKENS, GREEDY, logprobs=N_TOP)).run()
        accepted += gen.stats.accepted
        check_entries(gen.logprobs, gen.token_ids, recomputed(target, ids, gen.token_ids), tol=1e-4)
        # (greedy on raw logits: the token is its row's most likely)
        assert all(e.top[0][0] == e.token for e in gen.logprobs)
    if name != "target-only":
        assert accepted > 0  # (entries of accepted drafts were checked)


def test_sampled_logprobs_are_the_targets_rows_along_the_sampled_text(perturbed):
    target, draft = perturbed
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    ids = target.tokenize(PROMPTS[0])
    gen = generate(SpeculativeDecoder(target, DraftModelDrafter(draft), 4, sampling), Request(ids, MAX_TOKENS, sampling, seed=7, logprobs=N_TOP)).run()
    assert gen.stats.accepted > 0 and gen.stats.accepted < gen.stats.drafted  # (accepted and resampled tokens both)
    check_entries(gen.logprobs, gen.token_ids, recomputed(target, ids, gen.token_ids), tol=1e-4)


def test_logprobs_are_cut_with_the_tokens_at_a_stop_string_and_at_max_tokens(perturbed):
    target, _ = perturbed
    runs = [(target.tokenize(p), generate(SpeculativeDecoder(target, None, 0), Request(target.tokenize(p), MAX_TOKENS, GREEDY)).run()) for p in PROMPTS]
    ids, full = max(runs, key=lambda run: len(run[1].token_ids))
    assert len(full.token_ids) > 10
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    for drafter, n in ((None, 0), (PromptLookupDrafter(ngram_max=3, ngram_min=1), 6)):
        gen = generate(SpeculativeDecoder(target, drafter, n), Request(ids, MAX_TOKENS, GREEDY, stop=[stop], logprobs=2)).run()
        assert gen.stop_reason == STOP_STRING and len(gen.token_ids) < len(full.token_ids)
        assert len(gen.logprobs) == len(gen.token_ids) and [e.token for e in gen.logprobs] == gen.token_ids
        short = generate(SpeculativeDecoder(target, drafter, n), Request(ids, 7, GREEDY, logprobs=0)).run()
        assert len(short.logprobs) == len(short.token_ids) == 7 and all(e.top == () for e in short.logprobs)
    assert generate(SpeculativeDecoder(target, None, 0), Request(ids, 5, GREEDY)).run().logprobs is None  # (not asked: not computed)


def test_a_tree_pass_gives_each_token_the_row_of_its_branch(pair_perturbed):
    from specli.decoding.memory_drafter import MemoryDrafter
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend
    from test_branches import misleading_memory

    init_backend()
    kw = dict(n_ctx=512, n_threads=2, kv_type="f32", flash_attn="off")
    tree_model, plain = LlamaModel(pair_perturbed[0], branches=4, **kw), LlamaModel(pair_perturbed[0], **kw)
    try:
        trees = 0
        for i, prompt in enumerate(PROMPTS):
            ids = plain.tokenize(prompt)
            plain.reset()
            reference = generate(SpeculativeDecoder(plain, None, 0), Request(ids, MAX_TOKENS, GREEDY, logprobs=N_TOP)).run()
            tree_model.reset()
            gen = generate(SpeculativeDecoder(tree_model, MemoryDrafter(misleading_memory(ids, reference.token_ids, seed=i)), 4),
                           Request(ids, MAX_TOKENS, GREEDY, logprobs=N_TOP))
            for step in gen:
                trees += step.n_branches > 1
            assert gen.token_ids == reference.token_ids
            for a, b in zip(gen.logprobs, reference.logprobs):
                assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert trees
    finally:
        tree_model.close(), plain.close()


# --- on the real pair: within the batch-numerics margin ------------------------------------------------
@pytest.mark.real_pair
@pytest.mark.slow
def test_on_the_real_pair_drafted_logprobs_are_plain_decodings_within_the_margin(qwen_pair):
    from specli.llama.conversation import encode_conversation
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend
    from specli.session.chat import choose_formatter

    init_backend()
    target, draft = LlamaModel(qwen_pair[0], n_ctx=1024, n_threads=2), LlamaModel(qwen_pair[1], n_ctx=1024, n_threads=2)
    try:
        formatter, _ = choose_formatter(target, None)
        ids = encode_conversation(target, formatter, None, [{"role": "user", "content": "Write a Python function that merges two sorted lists."}])
        gen = generate(SpeculativeDecoder(target, DraftModelDrafter(draft), 4), Request(ids, 48, GREEDY, logprobs=N_TOP)).run()
        assert gen.stats.accepted > 10
        rows = recomputed(target, ids, gen.token_ids)
        diffs = np.array([abs(e.logprob - row[t]) for e, t, row in zip(gen.logprobs, gen.token_ids, rows)])
        print(f"|logprob - plain's| over {len(diffs)} tokens: median {np.median(diffs):.2e}, max {diffs.max():.2e}")
        # Batched passes round this Q4_K_M file's logits by up to ~0.3 (NOTES.md): most rows agree to
        # 1e-3, none by more than the near-tie margin
        assert np.median(diffs) <= 1e-3 and diffs.max() <= 0.5
    finally:
        target.close(), draft.close()


def test_post_sampling_entries_are_the_chains_distribution_along_the_text(perturbed):
    from specli.decoding.sampling import distribution, penalty_history

    target, draft = perturbed
    sampling = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.0, presence_penalty=0.5)
    ids = target.tokenize(PROMPTS[1])
    gen = generate(SpeculativeDecoder(target, DraftModelDrafter(draft), 4, sampling),
                   Request(ids, MAX_TOKENS, sampling, seed=5, logprobs=N_TOP, post_sampling=True)).run()
    assert gen.stats.accepted > 0
    target.reset()
    target.eval(ids[:-1], logits="none")
    previous = ids[-1]
    for j, (entry, token) in enumerate(zip(gen.logprobs, gen.token_ids)):
        row = target.eval([previous], logits="last")[-1]
        p = distribution(row, sampling, penalty_history(sampling, ids + gen.token_ids[:j]))
        assert entry.token == token and math.exp(entry.logprob) == pytest.approx(p[token], abs=1e-4)
        best = sorted(((float(q), int(t)) for t, q in zip(p.ids, p.probs)), key=lambda x: (-x[0], x[1]))[:N_TOP]
        assert [t for t, _ in entry.top] == [t for _, t in best]
        previous = token
    target.reset()
