"""Speculative sampling: the output law equals the target's, plus the logits -> probabilities chain.

The proof tests enumerate one verification step exactly from the papers' formulas (draft tokens
drawn from q, accept with min(1, p/q), residual max(0, p - q), bonus from p_k) and check that the
emitted tokens follow p; `verify_sampled` is then checked empirically against that enumeration.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Callable

import numpy as np
import pytest

from specli.decoding.sampling import Dist, SamplingParams, distribution, make_rng, probabilities, sample, sample_from_logits
from specli.decoding.verifier import verify_sampled
from specli.errors import UsageError
from stats_check import chi_square_p_value

Context = tuple[int, ...]
Model = Callable[[Context], np.ndarray]  # context -> distribution over the next token


# --- toy models: random distributions keyed by the context ----------------------------------
class RandomModel:
    """A 'language model' over a tiny vocabulary: a fixed random distribution per context.

    Rows depend on the whole context, so the checks below need no simplification such as
    "the target's rows do not depend on the drafted tokens". sparsity zeroes entries at random
    (as top-k/top-p/min-p do); like = (model, chance) makes a row equal that model's row with the
    given chance (p == q exactly: the degenerate residual); one_hot makes a deterministic
    drafter (prompt lookup).
    """

    def __init__(self, n_vocab: int, seed: int, *, sparsity: float = 0.0, like: tuple[Model, float] | None = None,
                 one_hot: bool = False):
        self.n_vocab = n_vocab
        self.seed = seed
        self.sparsity = sparsity
        self.like = like
        self.one_hot = one_hot
        self.rows: dict[Context, np.ndarray] = {}

    def __call__(self, context: Context) -> np.ndarray:
        if context not in self.rows:
            self.rows[context] = self._new_row(context)
        return self.rows[context]

    def _new_row(self, context: Context) -> np.ndarray:
        # seeded by the context, so a row does not depend on which contexts were asked first
        rng = np.random.default_rng((self.seed, len(context), *context))
        if self.like is not None and rng.random() < self.like[1]:
            return self.like[0](context)
        if self.one_hot:
            row = np.zeros(self.n_vocab)
            row[rng.integers(self.n_vocab)] = 1.0
            return row
        row = rng.dirichlet(np.full(self.n_vocab, rng.uniform(0.3, 2.0)))
        zero = rng.random(self.n_vocab) < self.sparsity
        zero[rng.integers(self.n_vocab)] = False  # keep at least one token
        row[zero] = 0.0
        return row / row.sum()


# --- the papers' formulas, enumerated exactly ------------------------------------------------
def step_law(p: Model, q: Model, context: Context, k: int, *, naive_residual: bool = False) -> dict[Context, float]:
    """Exact law of the tokens one speculative step emits after `context`, drafting k tokens.

    Enumerates every draft path: x_i ~ q_i; accepted with min(1, p_i(x)/q_i(x)); on rejection
    the emitted token ~ normalize(max(0, p_i - q_i)) and the step ends; after k acceptances a
    bonus ~ p_k. naive_residual resamples from p_i instead (a known-wrong variant, to show the
    checks below can fail).
    """
    law: dict[Context, float] = defaultdict(float)

    def emit(prefix: Context, weight: float, dist: np.ndarray) -> None:
        for y in np.flatnonzero(dist):
            law[prefix + (int(y),)] += weight * dist[y]

    def walk(accepted: Context, weight: float) -> None:
        p_i = p(context + accepted)
        if len(accepted) == k:
            emit(accepted, weight, p_i)
            return
        q_i = q(context + accepted)
        residual = p_i if naive_residual else np.maximum(p_i - q_i, 0.0)
        for x in np.flatnonzero(q_i):
            accept = min(1.0, p_i[x] / q_i[x])
            if accept > 0:
                walk(accepted + (int(x),), weight * q_i[x] * accept)
            if accept < 1:  # then p_i(x) < q_i(x), so the residual has mass
                emit(accepted, weight * q_i[x] * (1 - accept), residual / residual.sum())

    walk((), 1.0)
    return law


def first_tokens_law(p: Model, q: Model, k: int, n: int, context: Context = (), **kw) -> dict[Context, float]:
    """Exact law of the first n tokens emitted by repeated speculative steps."""
    if n == 0:
        return {(): 1.0}
    law: dict[Context, float] = defaultdict(float)
    for tokens, weight in step_law(p, q, context, k, **kw).items():
        if len(tokens) >= n:
            law[tokens[:n]] += weight
        else:
            for rest, w in first_tokens_law(p, q, k, n - len(tokens), context + tokens, **kw).items():
                law[tokens + rest] += weight * w
    return law


def target_law(p: Model, n_vocab: int, n: int, context: Context = ()) -> dict[Context, float]:
    """The law of n tokens sampled from the target alone: prod p(y_j | y_<j)."""
    law: dict[Context, float] = {(): 1.0}
    for _ in range(n):
        law = {seq + (y,): w * p(context + seq)[y] for seq, w in law.items() for y in range(n_vocab)}
    return law


def max_gap(a: dict[Context, float], b: dict[Context, float]) -> float:
    return max(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


def random_case(seed: int) -> tuple[RandomModel, RandomModel, int, int]:
    rng = np.random.default_rng(seed)
    n_vocab = int(rng.integers(3, 7))
    k = int(rng.integers(1, 4))
    p = RandomModel(n_vocab, seed * 2 + 1, sparsity=rng.choice([0.0, 0.3]))
    q = RandomModel(n_vocab, seed * 2 + 2, sparsity=rng.choice([0.0, 0.3]), like=(p, rng.choice([0.0, 0.3])))
    return p, q, n_vocab, k


# --- the proof ---------------------------------------------------------------------------------
@pytest.mark.parametrize("block", range(4))
def test_speculative_steps_emit_exactly_the_target_law(block):
    """First token ~ p_0 and first two tokens ~ p_0(x) p_1(y | x), exactly, for 240 random cases.

    The second token comes from the same step (x accepted) or from the next step (x emitted at
    a rejection); both are enumerated. Rows depend on the whole context, so no independence
    simplification is needed.
    """
    for seed in range(block * 60, block * 60 + 60):
        p, q, n_vocab, k = random_case(seed)
        joint = first_tokens_law(p, q, k, 2)
        assert max_gap(joint, target_law(p, n_vocab, 2)) < 1e-12, (seed, n_vocab, k)
        first = defaultdict(float)
        for (x, _), w in joint.items():
            first[(x,)] += w
        assert max_gap(first, target_law(p, n_vocab, 1)) < 1e-12, (seed, n_vocab, k)


def test_three_tokens_across_steps_follow_the_target():
    for seed in range(1000, 1010):
        p, q, n_vocab, k = random_case(seed)
        assert max_gap(first_tokens_law(p, q, k, 3), target_law(p, n_vocab, 3)) < 1e-12, seed


def test_lookup_drafts_one_hot_q_follow_the_target():
    """A deterministic drafter (q one-hot on its guess, whatever the guess) is lossless too."""
    for seed in range(2000, 2060):
        rng = np.random.default_rng(seed)
        n_vocab, k = int(rng.integers(3, 7)), int(rng.integers(1, 4))
        p = RandomModel(n_vocab, seed, sparsity=0.3)
        q = RandomModel(n_vocab, seed + 10_000, one_hot=True)
        assert max_gap(first_tokens_law(p, q, k, 2), target_law(p, n_vocab, 2)) < 1e-12, seed


def test_the_proof_can_fail():
    """Resampling rejections from p instead of the residual is biased: the check above sees it."""
    gaps = [max_gap(first_tokens_law(*random_case(s)[:2], random_case(s)[3], 1, naive_residual=True),
                    target_law(random_case(s)[0], random_case(s)[2], 1)) for s in range(20)]
    assert max(gaps) > 0.01


# --- the implementation against the enumeration -----------------------------------------------
def run_steps(p: Model, q: Model, k: int, draws: int, seed: int, *, lookup: bool) -> Counter:
    """Outcomes of `draws` independent steps after an empty context, drafts sampled from q."""
    rng = np.random.default_rng(seed)
    outcomes: Counter = Counter()
    for _ in range(draws):
        draft: list[int] = []
        q_rows = []
        for _ in range(k):
            q_i = q(tuple(draft))
            draft.append(sample(q_i, rng))
            q_rows.append(q_i)
        p_rows = np.stack([p(tuple(draft[:i])) for i in range(k + 1)])
        verdict = verify_sampled(p_rows, None if lookup else np.stack(q_rows), draft, rng)
        assert verdict.tokens[: verdict.n_accepted] == draft[: verdict.n_accepted]
        assert len(verdict.tokens) == verdict.n_accepted + 1
        outcomes[tuple(verdict.tokens)] += 1
    return outcomes


def assert_matches_law(counts: Counter, law: dict[Context, float], draws: int) -> None:
    assert set(counts) <= {cell for cell, prob in law.items() if prob > 0}, "an impossible outcome happened"
    for cell, prob in law.items():
        sigma = math.sqrt(draws * prob * (1 - prob))
        assert abs(counts.get(cell, 0) - draws * prob) <= 5 * sigma + 1e-9, (cell, counts.get(cell, 0), draws * prob)
    assert chi_square_p_value(counts, law, draws) > 1e-4


@pytest.mark.parametrize("lookup", [False, True], ids=["q-distribution", "q-one-hot"])
def test_verify_sampled_matches_the_enumeration(lookup):
    n_vocab, k, draws = 4, 2, 20_000
    p = RandomModel(n_vocab, 11, sparsity=0.2)
    q = RandomModel(n_vocab, 14, one_hot=True) if lookup else RandomModel(n_vocab, 12, sparsity=0.2)
    if lookup:  # guesses the target may take or refuse (0 < p < 1), else there is nothing to test
        x = int(np.argmax(q(())))
        assert 0 < p(())[x] < 1 and 0 < p((x,))[int(np.argmax(q((x,))))] < 1
    counts = run_steps(p, q, k, draws, seed=5, lookup=lookup)
    assert_matches_law(counts, step_law(p, q, (), k), draws)
    # the same draws are far from the naive-residual law: the test has the power to see that bug
    assert chi_square_p_value(counts, step_law(p, q, (), k, naive_residual=True), draws) < 1e-6


def test_equal_p_and_q_accepts_every_draft():
    for seed in range(200):
        rng = np.random.default_rng(seed)
        k, n_vocab = 4, 6
        p_rows = rng.dirichlet(np.ones(n_vocab), size=k + 1)
        p_rows[:, rng.integers(n_vocab)] = 0.0  # zeros, as after top-k
        p_rows /= p_rows.sum(axis=1, keepdims=True)
        draft = [sample(p_rows[i], rng) for i in range(k)]
        verdict = verify_sampled(p_rows, p_rows[:k].copy(), draft, rng)
        assert verdict.n_accepted == k and verdict.tokens[:k] == draft


def test_same_seed_same_verdict_and_lookup_equals_explicit_one_hot():
    rng = np.random.default_rng(0)
    k, n_vocab = 3, 8
    p_rows = rng.dirichlet(np.ones(n_vocab), size=k + 1)
    q_rows = rng.dirichlet(np.ones(n_vocab), size=k)
    draft = [1, 5, 2]
    one_hot = np.eye(n_vocab)[draft]
    for seed in range(50):
        first = verify_sampled(p_rows, q_rows, draft, np.random.default_rng(seed))
        assert verify_sampled(p_rows, q_rows, draft, np.random.default_rng(seed)) == first
        assert verify_sampled(p_rows, None, draft, np.random.default_rng(seed)) == verify_sampled(
            p_rows, one_hot, draft, np.random.default_rng(seed)
        )


class AlwaysHigh:
    """An rng whose uniform draws are all just below 1: forces any rejection that is possible."""

    def random(self) -> float:
        return 1.0 - 2**-53


def test_rounding_level_residual_falls_back_to_p():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = p.copy()
    q[0] += 1e-13  # the draft's row differs from the target's by rounding only
    q[1] -= 1e-13
    p_rows = np.stack([p, p])
    verdict = verify_sampled(p_rows, q[None, :], [0], AlwaysHigh())
    assert verdict.n_accepted == 0
    assert p[verdict.tokens[0]] > 0  # from p, not from the noise in max(0, p - q)


def test_rejection_never_emits_the_rejected_lookup_token():
    p_rows = np.array([[0.6, 0.4, 0.0], [0.1, 0.2, 0.7]])
    for seed in range(100):
        verdict = verify_sampled(p_rows, None, [1], np.random.default_rng(seed))
        assert verdict.tokens in ([1, 0], [1, 1], [1, 2], [0])


def test_no_draft_samples_from_p():
    verdict = verify_sampled(np.array([[0.0, 1.0, 0.0]]), None, [], np.random.default_rng(0))
    assert (verdict.n_accepted, verdict.tokens) == (0, [1])


@pytest.mark.parametrize("lookup", [False, True], ids=["q-distribution", "q-one-hot"])
def test_sparse_rows_give_the_dense_rows_draws_and_verdicts(lookup):
    """The loop passes Dists (the kept tokens only); every mix of Dist and dense rows draws the
    same drafts and reaches the same verdict from the same generator, residuals included."""
    params = SamplingParams(top_k=20)
    n_vocab, k = 500, 4
    rejected = 0
    for seed in range(150):
        rng = np.random.default_rng(seed)
        target = (rng.standard_normal((k + 1, n_vocab)) * 3).astype(np.float32)
        draft_logits = target[:k] + (rng.standard_normal((k, n_vocab)) * 1.5).astype(np.float32)
        p_sparse = [distribution(row, params) for row in target]
        q_sparse = [distribution(row, params) for row in draft_logits]
        p_dense, q_dense = np.stack([np.asarray(d) for d in p_sparse]), np.stack([np.asarray(d) for d in q_sparse])
        draws = [sample(q, np.random.default_rng(seed)) for q in q_sparse]
        assert draws == [sample(q, np.random.default_rng(seed)) for q in q_dense]
        verdicts = [
            verify_sampled(p, None if lookup else q, draws, np.random.default_rng(seed))
            for p in (p_sparse, p_dense) for q in (q_sparse, q_dense)
        ]
        assert all(v == verdicts[0] for v in verdicts), verdicts
        rejected += verdicts[0].n_accepted < k
    assert rejected > 20  # the residuals were drawn from, not only full accepts


def test_a_dist_reads_as_its_dense_row():
    logits = np.array([0.5, 3.0, -1.0, 2.5, 2.9, -4.0], dtype=np.float32)
    dist = distribution(logits, SamplingParams(top_k=3, top_p=1.0, min_p=0.0))
    dense = probabilities(logits, SamplingParams(top_k=3, top_p=1.0, min_p=0.0))
    assert isinstance(dist, Dist) and list(dist.ids) == [1, 3, 4]
    assert np.array_equal(np.asarray(dist), dense)
    assert [dist[t] for t in range(6)] == list(dense)
    assert np.array_equal(dist.at(np.arange(6)), dense)


# --- sample ------------------------------------------------------------------------------------
def test_sample_follows_probs_and_skips_zeros():
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    rng = np.random.default_rng(3)
    counts = Counter(sample(probs, rng) for _ in range(4000))
    assert set(counts) == {1, 3}
    assert abs(counts[1] - 1000) <= 5 * math.sqrt(4000 * 0.25 * 0.75)
    assert sample(np.array([0.0, 0.0, 2.0]), rng) == 2  # unnormalized is fine


def test_sample_from_logits_returns_its_q():
    logits = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    params = SamplingParams(top_k=2, top_p=1.0, min_p=0.0, temperature=1.0)
    token, q = sample_from_logits(logits, params, [], np.random.default_rng(0))
    assert np.array_equal(q, probabilities(logits, params, []))
    assert token in (1, 2)


# --- probabilities -----------------------------------------------------------------------------
def only(**changes) -> SamplingParams:
    """Every stage off except the ones given (temperature 1 unless given)."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    return SamplingParams(**{**base, **changes})


def softmax(x) -> np.ndarray:
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def dense(n_vocab: int, kept: dict[int, float]) -> np.ndarray:
    out = np.zeros(n_vocab)
    for token, prob in kept.items():
        out[token] = prob
    return out


def test_no_stage_is_plain_softmax():
    logits = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
    np.testing.assert_allclose(probabilities(logits, only(), []), softmax(logits), rtol=1e-12)


def test_top_k_keeps_the_k_largest():
    logits = np.array([1.0, 5.0, 3.0, 4.0, 2.0], dtype=np.float32)
    got = probabilities(logits, only(top_k=2), [])
    e = softmax([5.0, 4.0])
    np.testing.assert_allclose(got, dense(5, {1: e[0], 3: e[1]}), rtol=1e-12)


LOG_P = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)


@pytest.mark.parametrize("top_p, kept", [(0.1, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, kept):
    got = probabilities(LOG_P, only(top_p=top_p), [])
    assert list(np.flatnonzero(got)) == kept
    np.testing.assert_allclose(got[kept], softmax(LOG_P[kept]), rtol=1e-6)


def test_top_p_uses_the_softmax_after_top_k():
    # full-vocabulary mass of token 0 is 0.4 < 0.55, but among the top-2 survivors it is 4/7
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    got = probabilities(logits, only(top_k=2, top_p=0.55), [])
    np.testing.assert_allclose(got, [1.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("min_p, kept", [(0.2, [0, 1, 2]), (0.5, [0, 1]), (0.7, [0])])
def test_min_p_keeps_tokens_within_a_factor_of_the_best(min_p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05: threshold min_p * 0.5
    got = probabilities(LOG_P, only(min_p=min_p), [])
    assert list(np.flatnonzero(got)) == kept


def test_temperature_divides_the_kept_logits():
    logits = np.array([0.0, math.log(2.0)], dtype=np.float64)
    np.testing.assert_allclose(probabilities(logits, only(temperature=0.5), []), [0.2, 0.8], rtol=1e-12)


def test_filters_see_the_untempered_distribution():
    # untempered 0.5/0.3/0.2: top-p 0.75 keeps two; tempered at 2 the top two hold only 0.735
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    got = probabilities(logits, only(top_p=0.75, temperature=2.0), [])
    w = np.sqrt([0.5, 0.3])
    np.testing.assert_allclose(got, [w[0] / w.sum(), w[1] / w.sum(), 0.0], rtol=1e-12)


def test_repetition_penalty_divides_positive_multiplies_negative_once_per_token():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    got = probabilities(logits, only(repeat_penalty=2.0, repeat_last_n=64), [0, 1, 1, 1])
    np.testing.assert_allclose(got, softmax([1.0, -2.0, 0.5, 3.0]), rtol=1e-6)


def test_repetition_penalty_window_is_the_last_n_tokens():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    got = probabilities(logits, only(repeat_penalty=2.0, repeat_last_n=2), [3, 0, 1])
    np.testing.assert_allclose(got, softmax([1.0, -2.0, 0.5, 3.0]), rtol=1e-6)  # 3 is outside
    off = probabilities(logits, only(repeat_penalty=2.0, repeat_last_n=0), [3, 0, 1])
    np.testing.assert_allclose(off, softmax(logits), rtol=1e-6)


def test_repetition_penalty_comes_before_top_k():
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    got = probabilities(logits, only(top_k=1, repeat_penalty=1.5), [0])
    np.testing.assert_allclose(got, [0.0, 1.0, 0.0])


def test_temperature_zero_is_one_hot_on_the_penalised_argmax():
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(probabilities(logits, SamplingParams(temperature=0), []), [1.0, 0.0, 0.0])
    got = probabilities(logits, SamplingParams(temperature=0, repeat_penalty=1.5), [0])
    np.testing.assert_array_equal(got, [0.0, 1.0, 0.0])
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_input_is_never_modified():
    logits = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    before = logits.copy()
    logits.setflags(write=False)  # a write would raise, like into a read-only llama.cpp view
    for params in (SamplingParams(repeat_penalty=1.3), SamplingParams(temperature=0, repeat_penalty=1.3),
                   only(top_p=0.9, min_p=0.1, temperature=0.7)):
        probabilities(logits, params, list(range(0, 1000, 7)))
    np.testing.assert_array_equal(logits, before)


def reference_probabilities(logits: np.ndarray, params: SamplingParams, history: list[int]) -> np.ndarray:
    """The chain written the obvious way: full sorts, no shortcuts (float64 throughout)."""
    x = logits.astype(np.float64)
    for t in set(history[-params.repeat_last_n:]) if params.repeat_last_n > 0 else ():
        x[t] = x[t] * params.repeat_penalty if x[t] <= 0 else x[t] / params.repeat_penalty
    order = np.argsort(-x, kind="stable")
    if params.top_k > 0:
        order = order[: params.top_k]
    if params.top_p < 1:
        cum = np.cumsum(softmax(x[order]))
        order = order[: min(int(np.searchsorted(cum, params.top_p)) + 1, len(order))]
    if params.min_p > 0:
        order = order[x[order] >= x[order[0]] + math.log(params.min_p)]
    out = np.zeros_like(x)
    out[order] = softmax(x[order] / params.temperature)
    return out


@pytest.mark.parametrize("n_vocab", [50, 5000])
def test_matches_a_straightforward_chain(n_vocab):
    rng = np.random.default_rng(n_vocab)
    for _ in range(30):
        logits = (rng.standard_normal(n_vocab) * rng.uniform(0.5, 4)).astype(np.float32)
        params = SamplingParams(
            temperature=float(rng.uniform(0.2, 2.0)),
            top_k=int(rng.choice([0, 1, 5, 40, n_vocab + 1])),
            top_p=float(rng.choice([1.0, 0.5, 0.9, 0.99])),
            min_p=float(rng.choice([0.0, 0.01, 0.1])),
            repeat_penalty=float(rng.choice([1.0, 1.3])),
            repeat_last_n=int(rng.choice([0, 8, 64])),
        )
        history = [int(t) for t in rng.integers(0, n_vocab, 100)]
        np.testing.assert_allclose(
            probabilities(logits, params, history), reference_probabilities(logits, params, history),
            rtol=1e-6, atol=1e-12, err_msg=str(params),
        )


def test_full_size_vocabulary():
    logits = (np.random.default_rng(2).standard_normal(262_144) * 3).astype(np.float32)
    history = list(range(0, 262_144, 4099))
    for params in (SamplingParams(repeat_penalty=1.1), SamplingParams(top_k=0)):
        probs = probabilities(logits, params, history)
        assert probs.dtype == np.float64 and probs.shape == (262_144,)
        assert abs(probs.sum() - 1) < 1e-12
        assert 0 < np.count_nonzero(probs) <= (40 if params.top_k else 262_144)
        assert probs[int(np.argmax(logits))] == probs.max()


# --- parameters --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(repeat_penalty=0.0), "repeat_penalty"),
        (dict(repeat_last_n=-1), "repeat_last_n"),
        (dict(seed=-3), "seed"),
    ],
)
def test_validate_names_the_field_and_the_range(change, field):
    with pytest.raises(UsageError) as info:
        SamplingParams(**change).validate()
    message = str(info.value)
    assert message.startswith(field + " must be") and "\n" not in message
    assert "got" in message


def test_defaults_are_llama_cpps_and_valid():
    params = SamplingParams().validate()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.8, 40, 0.95, 0.05)
    assert (params.repeat_penalty, params.repeat_last_n, params.seed) == (1.0, 64, None)
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=0).validate()
    a, b = make_rng(9), make_rng(9)
    assert a.random() == b.random()
