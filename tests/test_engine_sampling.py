"""Speculative sampling on generated models: the output distribution is the target's.

For the first two generated tokens the exact target law is computable: P(t1, t2) =
p(t1 | prompt) * p(t2 | prompt, t1), each from the target's logits (one token at a time) through
`probabilities`. Many seeded speculative runs must fit that law (Pearson chi-square).

Power, measured with these fixtures and draw counts: the same check applied to a deliberately
biased verifier (rejected drafts resampled from p instead of normalize(max(0, p - q)), a classic
bug that over-weights the draft's favourites) gives p-values far below the threshold (see
test_the_check_catches_a_biased_verifier), so a wrong implementation fails this file.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from conftest import load
from fixtures import synthetic
from specli.decoding import verifier
from specli.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.sampling import SamplingParams, probabilities, sample
from specli.decoding.step import SpeculativeDecoder
from specli.decoding.verifier import Verdict, verify_greedy, verify_sampled
from stats_check import chi_square_p_value

# Flat enough that several tokens matter at each step; the llama.cpp stages all active.
SAMPLING = SamplingParams(temperature=1.0, top_k=6, top_p=0.98, min_p=0.02, seed=None)
DRAWS = 1500
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def flat_pair(fixture_dir):
    """A pair with soft logits (logit_std 2): the draft agrees often but not always."""
    target, draft = synthetic.make_pair(fixture_dir, "perturbed", seed=11, noise=0.3, logit_std=2.0)
    model_tgt, model_dft = load(target), load(draft)
    yield model_tgt, model_dft
    model_tgt.close(), model_dft.close()


def exact_two_token_law(model_tgt, prompt: list[int]) -> dict[tuple[int, int], float]:
    law = {}
    model_tgt.reset()
    p1 = probabilities(model_tgt.eval(prompt, logits="last")[-1], SAMPLING, prompt).copy()
    for t1 in np.flatnonzero(p1):
        model_tgt.truncate(len(prompt))
        p2 = probabilities(model_tgt.eval([int(t1)], logits="last")[-1], SAMPLING, prompt + [int(t1)])
        for t2 in np.flatnonzero(p2):
            law[(int(t1), int(t2))] = float(p1[t1] * p2[t2])
    return law


def sample_two_tokens(model_tgt, drafter, prompt, n_draft: int, draws: int) -> tuple[Counter, tuple[int, int]]:
    """Counts of the first two tokens over `draws` seeds, and (drafted, accepted) in total."""
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(draws):
        params = SamplingParams(**{**SAMPLING.__dict__, "seed": seed})
        gen = generate(SpeculativeDecoder(model_tgt, drafter, n_draft, params), Request(prompt, max_tokens=2)).run()
        if len(gen.token_ids) == 2:
            counts[tuple(gen.token_ids)] += 1
        else:  # an end-of-generation token came first: its own cell
            counts[(gen.token_ids[0] if gen.token_ids else -1, -1)] += 1
        drafted += gen.stats.drafted
        accepted += gen.stats.accepted
    return counts, (drafted, accepted)


def fold_eos(law: dict, model_tgt) -> dict:
    """Outcomes that stop at an end-of-generation token, as sample_two_tokens records them."""
    folded: dict = {}
    for (t1, t2), prob in law.items():
        key = (-1, -1) if model_tgt.is_eog(t1) else ((t1, -1) if model_tgt.is_eog(t2) else (t1, t2))
        folded[key] = folded.get(key, 0.0) + prob
    return folded


def test_draft_model_sampling_matches_the_target_law(flat_pair):
    model_tgt, model_dft = flat_pair
    prompt = model_tgt.tokenize("Once upon a time")
    law = fold_eos(exact_two_token_law(model_tgt, prompt), model_tgt)
    counts, (drafted, accepted) = sample_two_tokens(model_tgt, DraftModelDrafter(model_dft), prompt, 3, DRAWS)
    assert 0.2 < accepted / drafted < 0.95  # drafts are both accepted and rejected
    assert set(counts) <= {cell for cell, prob in law.items() if prob > 0}
    assert chi_square_p_value(counts, law, DRAWS) > SIGNIFICANCE


def test_lookup_sampling_matches_the_target_law(flat_pair):
    model_tgt, _ = flat_pair
    # The prompt repeats a stretch followed by the target's own likely continuation, so lookup
    # drafts (that continuation again) are sometimes accepted and sometimes rejected.
    head = model_tgt.tokenize("red green blue")
    likely = generate(SpeculativeDecoder(model_tgt, None, 0), Request(head, max_tokens=2)).run().token_ids
    prompt = head + likely + head[1:]
    law = fold_eos(exact_two_token_law(model_tgt, prompt), model_tgt)
    counts, (drafted, accepted) = sample_two_tokens(model_tgt, PromptLookupDrafter(ngram_max=3, ngram_min=1), prompt, 2, DRAWS)
    assert drafted >= DRAWS and 0 < accepted < drafted  # one-hot q: accepts and rejections
    assert chi_square_p_value(counts, law, DRAWS) > SIGNIFICANCE
    print(f"lookup acceptance at temperature 1: {accepted / drafted:.2f}")


def test_the_check_catches_a_biased_verifier(flat_pair, monkeypatch):
    def biased(p_rows, q_rows, draft, rng):
        for i, x in enumerate(draft):
            q_x = 1.0 if q_rows is None else float(q_rows[i][x])
            if rng.random() * q_x < float(p_rows[i][x]):
                continue
            return Verdict(i, list(draft[:i]) + [sample(np.asarray(p_rows[i], dtype=np.float64), rng)])
        return Verdict(len(draft), list(draft) + [sample(np.asarray(p_rows[len(draft)]), rng)])

    model_tgt, model_dft = flat_pair
    prompt = model_tgt.tokenize("Once upon a time")
    law = fold_eos(exact_two_token_law(model_tgt, prompt), model_tgt)
    monkeypatch.setattr(verifier, "verify_sampled", biased)
    counts, _ = sample_two_tokens(model_tgt, DraftModelDrafter(model_dft), prompt, 3, DRAWS)
    p_value = chi_square_p_value(counts, law, DRAWS)
    print(f"biased verifier: p-value {p_value:.2e}")
    assert p_value < SIGNIFICANCE


def test_same_seed_same_output_and_the_seed_is_reported(flat_pair):
    model_tgt, model_dft = flat_pair
    prompt = model_tgt.tokenize("The quick brown fox")
    runs = [
        generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 4, SamplingParams(seed=42)), Request(prompt, max_tokens=30)).run()
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].seed == 42
    fresh = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 4, SamplingParams()), Request(prompt, max_tokens=30)).run()
    replay = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 4, SamplingParams(seed=fresh.seed)), Request(prompt, max_tokens=30)).run()
    assert replay.token_ids == fresh.token_ids


def test_temperature_zero_through_the_sampling_path_is_greedy():
    rng = np.random.default_rng(0)
    zero = SamplingParams(temperature=0.0)
    for _ in range(200):
        logits = rng.normal(size=(4, 50)).astype(np.float32)
        draft = [int(t) for t in rng.integers(0, 50, size=3)]
        draft[0] = int(np.argmax(logits[0]))  # make some prefixes agree
        p_rows = [probabilities(row, zero) for row in logits]
        assert verify_sampled(p_rows, None, draft, rng) == verify_greedy(logits, draft)
