"""The sampler chain's shortcuts (min-p first on the raw logits, tie-stable top-k) against the
chain written the obvious way: same kept tokens, same probabilities, for every parameter mix."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from specli.decoding import sampling
from specli.decoding.sampling import SamplingParams, probabilities


def reference(logits: np.ndarray, params: SamplingParams, history: list[int]) -> tuple[np.ndarray, bool]:
    """(probabilities, whether a top-p boundary is within rounding of a cut): the stages in
    llama.cpp's order with full stable sorts (ties to the lower id), float64 but for the
    penalty, which is applied in the logits' dtype as llama.cpp does."""
    x = logits.copy()
    if params.repeat_penalty != 1.0 and params.repeat_last_n > 0:
        for t in {t for t in history[-params.repeat_last_n :] if 0 <= t < len(x)}:
            x[t] = x[t] * x.dtype.type(params.repeat_penalty) if x[t] <= 0 else x[t] / x.dtype.type(params.repeat_penalty)
    x = x.astype(np.float64)
    if params.greedy:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out, False
    order = np.argsort(-x, kind="stable")
    if 0 < params.top_k < len(x):
        order = order[: params.top_k]
    near = False
    if params.top_p < 1:
        w = np.exp(x[order] - x[order[0]])
        cum = np.cumsum(w / w.sum())
        near = bool(np.any(np.abs(cum - params.top_p) < 1e-9))
        order = order[: min(int(np.searchsorted(cum, params.top_p)) + 1, len(order))]
    if params.min_p > 0:
        order = order[x[order] >= x[order[0]] + math.log(params.min_p)]
    out = np.zeros_like(x)
    with np.errstate(over="ignore"):
        w = np.exp((x[order] - x[order[0]]) / params.temperature)
    out[order] = w / w.sum()
    return out, near


# Simple values on purpose: hypothesis then finds ties, equal rows and exact boundaries.
_logit = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 2.0, 0.5, -math.inf]),
    st.floats(-30, 30, allow_nan=False, width=32),
)


@st.composite
def rows(draw):
    n_vocab = draw(st.sampled_from([1, 2, 3, 5, 17, 64, 300]))
    logits = np.array(draw(st.lists(_logit, min_size=n_vocab, max_size=n_vocab)), dtype=np.float32)
    assume(np.isfinite(logits).any())
    return logits


params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.2, 0.8, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 2, 3, 40, 1000]),
    top_p=st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.25, 0.01]),
    min_p=st.sampled_from([0.0, 0.05, 0.1, 0.5, 1e-6]),
    repeat_penalty=st.sampled_from([1.0, 1.1, 0.8, 2.0]),
    repeat_last_n=st.sampled_from([0, 4, 64]),
)


@settings(max_examples=600, deadline=None)
@given(rows(), params_st, st.lists(st.integers(-2, 320), max_size=12))
# Found in CI: logits apart by less than the softmax can tell tie in probability, not in order
# (top-p ordered them by probability, then by id; llama.cpp and the reference by logit).
@example(np.array([0.0, 9.0522945e-32], dtype=np.float32), SamplingParams(temperature=0.2, top_k=0, top_p=0.25, min_p=0.0, repeat_last_n=0), [])
def test_chain_matches_the_reference(logits, params, history):
    got = probabilities(logits, params, history)
    want, near = reference(logits, params, history)
    assume(not near)  # a token exactly at top-p's cut falls either way by rounding (documented)
    assert got.dtype == np.float64 and got.shape == logits.shape
    assert list(np.flatnonzero(got)) == list(np.flatnonzero(want)), params
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12, err_msg=str(params))


@settings(max_examples=300, deadline=None)
@given(rows(), params_st, st.lists(st.integers(0, 300), max_size=12))
def test_min_p_first_equals_the_stages_in_order_bit_for_bit(logits, params, history):
    """Where the shortcut decides, the stages in order give the very same floats."""
    fast = probabilities(logits, params, history)
    original = sampling._min_p_first
    sampling._min_p_first = lambda row, p: None
    try:
        slow = probabilities(logits, params, history)
    finally:
        sampling._min_p_first = original
    np.testing.assert_array_equal(fast, slow, err_msg=str(params))


def test_min_p_first_decides_typical_rows_and_skips_full_vocabulary_top_p():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(50_000) * 2).astype(np.float32)
    logits[[7, 70, 700]] += 12  # a peaked row: three tokens hold nearly all the mass
    for params in (SamplingParams(), SamplingParams(top_k=0)):
        assert sampling._min_p_first(logits, params) is not None, params
        got = probabilities(logits, params)
        assert list(np.flatnonzero(got)) == sorted(np.flatnonzero(reference(logits, params, [])[0]))


@pytest.mark.parametrize("span", [5.0, 12.0], ids=["top-k-within-reach", "total-bounded"])
def test_top_p_cutting_among_few_min_p_survivors_is_decided_exactly(span):
    """Fewer than k tokens pass min-p and top-p cuts among them: its total is over top-k's k.
    Where 40 tokens lie within _TOP_K_NEAR of the best they are found exactly; where fewer,
    the rest of the total is bounded. Either way the result is the stages' in order, bit for bit."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(100_000) * 0.5).astype(np.float32)
    logits[[10, 20, 30]] = [20.0, 17.5, 17.2]  # within ln 20 of the best: min-p keeps 3
    logits[rng.choice(np.arange(100, 100_000), 60, replace=False)] = 20.0 - span  # next in line
    params = SamplingParams(top_p=0.7)  # the best holds 0.72-0.87 of top-k's mass: the cut is at 1
    assert sampling._min_p_first(logits, params) is not None
    got = probabilities(logits, params)
    assert list(np.flatnonzero(got)) == [10]
    original = sampling._min_p_first
    sampling._min_p_first = lambda row, p: None
    try:
        np.testing.assert_array_equal(got, probabilities(logits, params))
    finally:
        sampling._min_p_first = original
    np.testing.assert_allclose(got, reference(logits, params, [])[0], rtol=1e-6, atol=1e-12)


def test_top_p_cut_within_the_bounded_rest_of_the_total_is_left_to_the_stages():
    """37 of top-k's 40 lie just beyond _TOP_K_NEAR: their 0.0075 of the mass moves the cut
    (the best's share is 0.8749 without them, 0.8692 with them; top_p 0.872)."""
    logits = np.zeros(50_000, dtype=np.float32)
    logits[[10, 20, 30]] = [20.0, 17.5, 17.2]
    logits[1000:1100] = 20.0 - 8.5
    params = SamplingParams(top_p=0.872)
    got = probabilities(logits, params)
    assert list(np.flatnonzero(got)) == [10, 20]
    np.testing.assert_allclose(got, reference(logits, params, [])[0], rtol=1e-6, atol=1e-12)


def test_ties_at_the_top_k_boundary_go_to_the_lower_ids():
    logits = np.zeros(10_000, dtype=np.float32)
    logits[[9000, 5, 7000, 3]] = 1.0  # four tied for the best two places
    for min_p in (0.0, 0.5):
        got = probabilities(logits, SamplingParams(top_k=2, top_p=1.0, min_p=min_p, temperature=1.0))
        assert list(np.flatnonzero(got)) == [3, 5]


def test_large_vocabulary_matches_the_reference():
    rng = np.random.default_rng(5)
    for scale in (0.5, 2.0, 6.0):
        logits = (rng.standard_normal(131_072) * scale).astype(np.float32)
        for params in (SamplingParams(), SamplingParams(min_p=0), SamplingParams(top_k=0), SamplingParams(top_k=0, min_p=0.001),
                       SamplingParams(repeat_penalty=1.3), SamplingParams(temperature=0)):
            history = [int(t) for t in rng.integers(0, 131_072, 64)]
            want, near = reference(logits, params, history)
            if near:
                continue
            np.testing.assert_allclose(probabilities(logits, params, history), want, rtol=1e-6, atol=1e-12, err_msg=str(params))
