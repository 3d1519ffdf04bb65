"""Sampling distributions (pure functions on numpy arrays): the one transformation from logits
to a distribution (`distribution()`, or its dense form `probabilities()`: llama.cpp's default
sampler chain, repetition penalty, temperature, top-k, top-p, min-p), greedy choice under the
same penalty, and drawing from a distribution. The target's p and the draft's q both come from
here; verifier.py accepts or rejects drafts with them (speculative sampling).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from specli.errors import SettingError

# Full-vocabulary top-p first tries the most probable few candidates (llama.cpp's adaptive
# top-p does the same with 256): usually their mass already reaches top_p, and sorting 256
# values is far cheaper than sorting the vocabulary.
_TOP_P_FIRST_TRY = 256
_TOP_P_ADAPTIVE_ABOVE = 1024



@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a token; the defaults are llama.cpp's (common/common.h).

    temperature <= 0 means greedy (argmax); top_k = 0, top_p = 1, min_p = 0, repeat_penalty = 1,
    frequency_penalty = presence_penalty = 0 and repeat_last_n = 0 each switch their stage off.
    logit_bias: (token, bias) pairs added to the logits first (-inf forbids a token), ids
    ascending, one pair a token. seed None draws a fresh seed.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (no randomness, verification is exact matching)."""
        return self.temperature <= 0

    @cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (ids, biases) arrays, made once per setting: the bias is added to every
        row verified or drafted, and a request may bias thousands of tokens."""
        ids = np.fromiter((t for t, _ in self.logit_bias), dtype=np.int64, count=len(self.logit_bias))
        return ids, np.fromiter((b for _, b in self.logit_bias), dtype=np.float64, count=len(self.logit_bias))

    @property
    def penalizes(self) -> bool:
        """Whether llama.cpp's penalties stage changes anything (repeat, frequency, presence)."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> "SamplingParams":
        """Raise SettingError naming the first out-of-range field (top_k); else self.

        The `not (a <= x <= b)` form also rejects NaN.
        """
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            _bad("temperature", "a finite number >= 0 (0 = greedy)", self.temperature)
        if not self.top_k >= 0:
            _bad("top_k", "an integer >= 0 (0 = off)", self.top_k)
        if not (0 < self.top_p <= 1):
            _bad("top_p", "in (0, 1] (1 = off)", self.top_p)
        if not (0 <= self.min_p < 1):
            _bad("min_p", "in [0, 1) (0 = off)", self.min_p)
        if not (self.repeat_penalty > 0 and math.isfinite(self.repeat_penalty)):
            _bad("repeat_penalty", "a finite number > 0 (1 = off)", self.repeat_penalty)
        if not self.repeat_last_n >= 0:
            _bad("repeat_last_n", "an integer >= 0 (0 = off)", self.repeat_last_n)
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                _bad(name, "a finite number (0 = off)", getattr(self, name))
        ids = [t for t, _ in self.logit_bias]
        if any(not isinstance(t, int) or t < 0 for t in ids) or ids != sorted(set(ids)):
            _bad("logit_bias", "(token id, bias) pairs, one per token id >= 0, ids ascending", self.logit_bias)
        if any(math.isnan(b) or b == math.inf for _, b in self.logit_bias):
            _bad("logit_bias", "finite biases (or -inf, which forbids a token)", self.logit_bias)
        if self.seed is not None and not self.seed >= 0:
            _bad("seed", "an integer >= 0", self.seed)
        return self


GREEDY = SamplingParams(temperature=0.0)


# SamplingParams' fields as JSON gives them (batch items, server requests), with their types
# (an int is taken where a float is).
JSON_FIELDS = {
    "temperature": float, "top_k": int, "top_p": float, "min_p": float,
    "repeat_penalty": float, "repeat_last_n": int, "seed": int,
    "frequency_penalty": float, "presence_penalty": float,
}


def with_bias(biases: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """A {token: bias} mapping as SamplingParams.logit_bias holds it."""
    return tuple(sorted((int(t), float(b)) for t, b in biases.items()))


def sampling_json(sampling: SamplingParams) -> dict:
    """The sampling settings as run (greedy runs report temperature 0 and nothing random)."""
    fields = asdict(sampling)
    fields.pop("seed")
    bias = fields.pop("logit_bias")
    if bias:  # (a server request's; no command sets one)
        fields["logit_bias"] = {str(t): b if math.isfinite(b) else None for t, b in bias}
    fields["greedy"] = sampling.greedy
    return fields


def _bad(setting: str, valid: str, value: object) -> None:
    raise SettingError(setting, lambda name: f"{name} must be {valid}, got {value}")


def penalty_history(params: SamplingParams, context: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
    """The tokens the penalties look at after context + extra (empty when they are off)."""
    n = params.repeat_last_n
    if not params.penalizes or n == 0:
        return []
    tail = list(context[-n:]) + list(extra)
    return tail[-n:]


def make_rng(seed: int | None) -> np.random.Generator:
    """The random generator for one generation: reproducible when the seed is set."""
    return np.random.default_rng(seed)


# --- logits -> probabilities ----------------------------------------------------------------
class Dist:
    """A distribution over the vocabulary kept as its support: the kept token ids, ascending,
    and their probabilities (float64, aligned; an entry may be 0 where the softmax underflowed).

    `distribution()` returns one per row; verification reads it by token (`dist[x]`) and
    `sample` draws from it without writing or scanning a vocabulary-sized row: after the
    sampler chain a few dozen tokens remain of 128k-262k. `np.asarray(dist)` is the dense row
    that `probabilities()` returns.
    """

    __slots__ = ("ids", "probs", "n_vocab")

    def __init__(self, ids: np.ndarray, probs: np.ndarray, n_vocab: int):
        self.ids, self.probs, self.n_vocab = ids, probs, n_vocab

    def __getitem__(self, token: int) -> float:
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < self.ids.shape[0] and self.ids[i] == token else 0.0

    def at(self, tokens: np.ndarray) -> np.ndarray:
        """The probabilities of several token ids at once (0 outside the support)."""
        pos = np.minimum(np.searchsorted(self.ids, tokens), self.ids.shape[0] - 1)
        return np.where(self.ids[pos] == tokens, self.probs[pos], 0.0)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if copy is False:
            raise ValueError("a Dist has no dense row to share: its dense form is always a new array")
        dense = np.zeros(self.n_vocab, dtype=np.float64)
        dense[self.ids] = self.probs
        return dense if dtype is None else dense.astype(dtype)

    def __repr__(self) -> str:
        return f"Dist({dict(zip(self.ids.tolist(), self.probs.tolist()))}, n_vocab={self.n_vocab})"


def probabilities(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The dense form of `distribution()`: float64 of shape (V,), zero outside the kept tokens."""
    return np.asarray(distribution(logits, params, history))


def distribution(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> Dist:
    """The sampling distribution for one logits row, as llama.cpp's default sampler chain.

    Needs logits of shape (V,) (any float dtype; never modified, so a view of llama.cpp's buffer
    is fine) and history = the context so far (prompt + generated tokens, oldest first, as
    llama-completion feeds the prompt to its sampler: tools/completion/completion.cpp), of which
    the last params.repeat_last_n are penalised. Returns the kept tokens and their
    probabilities (float64, summing to 1) as a `Dist`.

    Stages, in the order of common_params_sampling::samplers (common/common.h) as built by
    common_sampler_init (common/sampling.cpp), src/llama-sampler.cpp:
      1. repetition penalty (llama_sampler_penalties_apply): each distinct token among the last
         repeat_last_n of history once: a logit <= 0 is multiplied by the penalty, a positive one
         divided (computed in the logits' dtype, float32 like llama.cpp).
      2. top-k (llama_sampler_top_k_impl): the k largest logits; k = 0 or k >= V keeps all.
      3. top-p (llama_sampler_top_p_apply): softmax of the survivors' (untempered) logits, sorted
         descending; keep the shortest prefix whose mass is >= top_p (at least one token).
      4. min-p (llama_sampler_min_p_apply): keep logits >= max logit + log(min_p), i.e.
         probability >= min_p * the largest probability.
      5. temperature (llama_sampler_temp_ext_apply, no dynatemp): kept logits / temperature.
      6. softmax (llama_sampler_dist_apply, which then draws; see `sample`).
    temperature <= 0 returns one-hot on the argmax of the penalised logits, which is what
    llama_sampler_temp_impl leaves (every filter keeps the argmax); callers decoding greedily
    should just take the argmax.

    Deviations from llama.cpp: softmax, cumulative mass and thresholds are float64 (llama.cpp:
    float32), so a token exactly at the top-p or min-p boundary may fall the other way. Ties are
    ordered by token id (llama.cpp: whatever its partial sort leaves), so of several tokens tied
    at the top-k boundary the lowest ids survive (llama.cpp: arbitrary); greedy ties go to the
    lowest id. Min-p is applied first on the raw logits where that provably keeps the same
    tokens (`_min_p_first`): one pass instead of a full-vocabulary top-p when top-k is off.
    The logit bias (llama.cpp's logit-bias sampler, ahead of the chain) and the frequency and
    presence penalties (in stage 1) apply where set. Stages off by default in llama.cpp are
    not implemented: the vocabulary's suppress tokens, DRY, top-n-sigma, typical-p, XTC,
    dynamic temperature, mirostat, min_keep (always 0 here).
    """
    row = np.asarray(logits)
    assert row.ndim == 1 and row.shape[0] > 0, row.shape
    n_vocab = row.shape[0]
    row = _penalize(row, params, history)
    if params.greedy:
        return Dist(np.array([int(np.argmax(row))]), np.ones(1), n_vocab)

    kept = _min_p_first(row, params) if params.min_p > 0 else None
    if kept is not None:
        ids, vals = kept
    else:
        ids, vals, is_sorted = _top_k(row, params.top_k)
        if params.top_p < 1:
            ids, vals = _top_p(ids, vals, params.top_p, is_sorted)
        if params.min_p > 0:
            # llama.cpp compares logits, not probabilities: exp(l - max) >= min_p <=> l >= max + log(min_p)
            keep = vals >= vals.max() + math.log(params.min_p)
            ids, vals = ids[keep], vals[keep]

    # Shifted before dividing, so that a tiny temperature (even 1e-310) cannot overflow into
    # inf - inf: the best logit becomes 0, the others fall towards -inf, whose exp is 0.
    with np.errstate(over="ignore"):
        probs = _softmax((vals - vals.max()) / params.temperature)  # summed in the chain's order
    order = np.argsort(ids, kind="stable")  # (linear on ids already ascending)
    return Dist(ids[order], probs[order], n_vocab)


def penalized_row(logits: np.ndarray, params: SamplingParams, context: Sequence[int], extra: Sequence[int] = ()) -> np.ndarray:
    """logits after the repetition penalty for the token after context + extra (greedy path)."""
    return _penalize(logits, params, penalty_history(params, context, extra))


def greedy_choice(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> int:
    """The temperature-0 token: argmax after the repetition penalty (llama.cpp applies it first)."""
    return int(np.argmax(_penalize(logits, params, history)))


# Where a penalised logit leaves float64's range (a penalty as small as 1e-310 or as large as
# 1e310 is valid), it saturates here: far beyond any real logit, yet far enough from float64's
# limit that subtracting two of them cannot overflow.
_PENALIZED_LIMIT = 1e300


def transforms(params: SamplingParams, context: Sequence[int]) -> bool:
    """Whether the logits change before the choice (a logit bias, or penalties with a history):
    greedy verification then reads each row as the chain leaves it."""
    return bool(params.logit_bias) or bool(penalty_history(params, context))


def _penalize(row: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """row with the logit bias, then the penalties applied (llama.cpp's logit-bias sampler, then
    llama_sampler_penalties_apply): a copy when anything changes, else row itself.

    Penalties: each distinct token among the last repeat_last_n of history, seen c times: a
    logit <= 0 multiplied by repeat_penalty, a positive one divided, then c * frequency_penalty
    + presence_penalty subtracted. Computed in the row's dtype (float32, as llama.cpp) unless
    that overflows (a penalty beyond float32's range or so small that it rounds to 0 there):
    then in float64, the row returned as float64, with values past +-_PENALIZED_LIMIT saturated
    (ties among them).
    """
    if params.logit_bias:
        row = _biased(row, *params.bias_arrays)
    if not params.penalizes or params.repeat_last_n <= 0 or len(history) == 0:
        return row
    recent, counts = np.unique(np.asarray(history[-params.repeat_last_n :], dtype=np.int64), return_counts=True)
    # llama.cpp looks candidates up in its token counts, so ids outside the vocabulary never match
    inside = (recent >= 0) & (recent < row.shape[0])
    recent, counts = recent[inside], counts[inside]
    penalty, freq, present = params.repeat_penalty, params.frequency_penalty, params.presence_penalty
    seen = row[recent]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        penalized = _penalties(seen, counts, penalty, freq, present)
        if np.isfinite(penalized).all() or not np.isfinite(seen).all():
            out = row.copy()
            out[recent] = penalized
            return out
        penalized = _penalties(seen.astype(np.float64), counts, penalty, freq, present)
    out = row.astype(np.float64)
    out[recent] = np.clip(np.nan_to_num(penalized, nan=0.0), -_PENALIZED_LIMIT, _PENALIZED_LIMIT)
    return out


def _penalties(seen: np.ndarray, counts: np.ndarray, penalty: float, freq: float, present: float) -> np.ndarray:
    out = seen if penalty == 1.0 else np.where(seen <= 0, seen * seen.dtype.type(penalty), seen / seen.dtype.type(penalty))
    if freq != 0.0 or present != 0.0:
        out = out - (counts * freq + present).astype(seen.dtype)
    return out


def _biased(row: np.ndarray, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """row + the logit bias (ids past the vocabulary ignored; -inf forbids a token)."""
    inside = ids < row.shape[0]
    out = row.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        out[ids[inside]] = out[ids[inside]] + values[inside].astype(row.dtype)
    return out


def _min_p_first(row: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray] | None:
    """The chain's survivors (ids, float64 logits, sorted descending) from the min-p cut alone,
    or None where that cannot decide them (then the stages run in order).

    Every stage keeps a prefix of the same order (descending, ties by id; min-p's threshold
    never splits ties), so the survivors are the shortest of the three prefixes, and min-p's,
    C = {l >= max + log(min_p)}, takes one pass over the raw logits (top-k and top-p keep the
    argmax, so the max is the same). With |C| >= k the k largest are all in C: top-k and top-p
    run on C only, exactly as they would on the row. With |C| < k, top-p would need the
    softmax over all k (or V) survivors of top-k; but the result is C itself whenever C less
    its last token holds under top_p of even C's own mass (a lower bound of that softmax's
    total): then top-p's prefix reaches C's end. The margin keeps float rounding (~1e-15) of
    the full computation from deciding otherwise. Otherwise `_top_k_near` decides most rows;
    where it cannot, and for NaN rows or flat rows with thousands of candidates, the stages
    run in order.
    """
    if row.dtype.kind != "f":
        return None
    best = float(row.max())
    if not math.isfinite(best):
        return None
    threshold = best + math.log(params.min_p)  # float64, as the chain compares
    # A superset in the row's own dtype (one pass, no float64 copy of the row): the nearest
    # float to the threshold rounded down, then the exact float64 test on the few candidates.
    loose = np.nextafter(row.dtype.type(threshold), row.dtype.type(-np.inf))
    ids = np.flatnonzero(row >= loose)
    if ids.shape[0] > _MIN_P_MAX_CANDIDATES:
        return None
    vals = row[ids].astype(np.float64)
    keep = vals >= threshold
    ids, vals = ids[keep], vals[keep]
    order = _descending(vals)  # ids ascending: ties go to the lower id, as everywhere
    ids, vals = ids[order], vals[order]
    n_vocab = row.shape[0]
    k = params.top_k if 0 < params.top_k < n_vocab else n_vocab
    if ids.shape[0] >= k:
        if k == n_vocab:  # no top-k: top-p's softmax is over the row, summed in id order there
            return None
        ids, vals = ids[:k], vals[:k]
        if params.top_p < 1:
            ids, vals = _top_p(ids, vals, params.top_p, True)
        return ids, vals
    if params.top_p < 1 and ids.shape[0] >= 2:
        weights = np.exp(vals - vals[0])
        head = weights[:-1].sum()
        if not head < params.top_p * weights.sum() * (1 - _MIN_P_MARGIN):
            if k < n_vocab:
                return _top_k_near(row, best, k, params.top_p, threshold, ids.shape[0])
            # No top-k: the softmax's total over the row, in float32 (one pass, no float64
            # copy; its relative error is ~1e-6 at most, hence the wider margin)
            with np.errstate(under="ignore"):
                total = float(np.exp(row - row.dtype.type(best)).sum(dtype=np.float64))
            if not head < params.top_p * total * (1 - _MIN_P_MARGIN_ROW):
                return None
    if k == n_vocab and params.top_p >= 1:
        # The chain keeps these in id order (no stage sorted them): so here, so that the
        # softmax sums in the same order and the probabilities are the same to the last bit.
        order = np.argsort(ids, kind="stable")
        ids, vals = ids[order], vals[order]
    return ids, vals


# Beyond this many min-p candidates (a flat row, a tiny min_p) sorting them costs more than
# the stages in order.
_MIN_P_MAX_CANDIDATES = 4096
_MIN_P_MARGIN = 1e-9
_MIN_P_MARGIN_ROW = 1e-5


def _top_k_near(row: np.ndarray, best: float, k: int, top_p: float, threshold: float, n_min_p: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The survivors when fewer than k tokens pass min-p (n_min_p of them) and top-p may cut
    among them: top-p's cut then depends on the softmax total over top-k's k survivors.

    One more pass takes N, the logits within _TOP_K_NEAR of the best. With |N| >= k the k
    largest are in N, and the stages run on them exactly as on the row. With |N| < k all of N
    is in the top k, and the k - |N| others each weigh under exp(-_TOP_K_NEAR) of the best:
    the total is known within that, and where the cut (which min-p limits to the n_min_p
    best) is the same at both ends of that range, it is the cut. None otherwise (too many
    candidates, or a cut within rounding of the bounds): the stages then run in order.
    """
    loose = np.nextafter(row.dtype.type(best - _TOP_K_NEAR), row.dtype.type(-np.inf))
    # Gathering many scattered ids costs more than the stages in order: a strided sample
    # estimates how many there are first.
    if np.count_nonzero(row[::_NEAR_SAMPLE] >= loose) * _NEAR_SAMPLE > _MIN_P_MAX_CANDIDATES // 2:
        return None
    near = np.flatnonzero(row >= loose)
    if near.shape[0] > k:
        near = np.sort(near[_largest(row[near], k)])
    ids, vals = _by_logit(row, near)
    if ids.shape[0] == k:
        ids, vals = _top_p(ids, vals, top_p, True)
        keep = vals >= threshold
        return ids[keep], vals[keep]
    cumulative = np.cumsum(np.exp(vals - vals[0]))
    low = cumulative[-1] * (1 - _MIN_P_MARGIN)
    high = (cumulative[-1] + (k - ids.shape[0]) * math.exp(-_TOP_K_NEAR)) * (1 + _MIN_P_MARGIN)
    # first position whose mass reaches top_p of the total, at either end of the total's range
    cuts = np.searchsorted(cumulative, [top_p * low, top_p * high], side="left")
    cut_low, cut_high = (min(int(c), n_min_p - 1) for c in cuts)
    if cut_low != cut_high:
        return None
    return ids[: cut_low + 1], vals[: cut_low + 1]


# How far below the best logit `_top_k_near` looks: any span is exact (it gives up where it
# cannot decide); this one usually holds k = 40 candidates, and a few hundred, on LLM rows.
_TOP_K_NEAR = 8.0
_NEAR_SAMPLE = 16


def _top_k(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, float64 logits, sorted?) of the k largest; all of them when k is 0 or >= V."""
    n_vocab = row.shape[0]
    if k <= 0 or k >= n_vocab:
        return np.arange(n_vocab), row.astype(np.float64), False
    # sorted here because top-p needs it and k is small: sorting k values costs nothing
    ids, vals = _by_logit(row, np.sort(_largest(row, k)))
    return ids, vals, True


def _by_logit(row: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids (ascending) and their float64 logits, ordered by logit, descending; ties keep the
    lower id first."""
    vals = row[ids].astype(np.float64)
    order = _descending(vals)
    return ids[order], vals[order]


def _largest(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values (unordered). Needs 0 < k < len(values).

    A strided sample's k-th largest value t is a lower bound for the whole array's k-th largest
    (the sample's k values >= t are in the array), so filtering by >= t first leaves about
    k * stride candidates, cutting argpartition's work from V to a few thousand (262,144 logits:
    ~0.5 ms instead of ~3.5 ms).
    """
    n = values.shape[0]
    stride = math.isqrt(n // k)
    candidates = None
    if stride >= 2:
        sample = values[::stride]
        threshold = np.partition(sample, sample.shape[0] - k)[sample.shape[0] - k]
        candidates = np.flatnonzero(values >= threshold)
        if candidates.shape[0] < k:  # only for NaN thresholds; then do it the long way
            candidates = None
    sub = values if candidates is None else values[candidates]
    m = sub.shape[0]
    kth = sub[np.argpartition(sub, m - k)[m - k]]
    # Of the values tied with the k-th largest, the lowest ids (which ones argpartition keeps
    # is arbitrary, and the fast min-p path keeps the lowest: both must keep the same)
    above = np.flatnonzero(sub > kth)
    tied = np.flatnonzero(sub == kth)[: k - above.shape[0]]
    if above.shape[0] + tied.shape[0] != k:  # NaNs: no order to speak of
        chosen = np.argpartition(sub, m - k)[m - k :]
    else:
        chosen = np.concatenate((above, tied))
    return chosen if candidates is None else candidates[chosen]


def _descending(vals: np.ndarray) -> np.ndarray:
    """The order sorting vals descending; stable, so ties keep their order (callers pass ids
    ascending, making ties go to the lower id: deterministic)."""
    return np.argsort(-vals, kind="stable")


def _top_p(ids: np.ndarray, vals: np.ndarray, top_p: float, is_sorted: bool) -> tuple[np.ndarray, np.ndarray]:
    """The shortest most-probable prefix whose softmax mass reaches top_p (sorted descending).

    Needs ids/vals either sorted descending (is_sorted) or the whole vocabulary (ids = arange(V)).
    Full-vocabulary top-p (top_k 0) costs a sort of however many tokens it needs: up to ~20 ms
    on 262,144 flat logits, well under 1 ms on a peaked row.
    """
    probs = _softmax(vals)
    n = probs.shape[0]
    if not is_sorted and n > _TOP_P_ADAPTIVE_ABOVE:
        # adaptive, as llama.cpp: sort only the most probable few; when their mass falls short,
        # try 16 times as many (llama.cpp sorts everything then), up to a full sort
        m = _TOP_P_FIRST_TRY
        while m < n:
            few = np.sort(_largest(vals, m))  # ids is arange(V) here: ascending, for ties
            few = few[_descending(vals[few])]
            cut = _mass_cut(probs[few], top_p)
            if cut is not None:
                return ids[few[:cut]], vals[few[:cut]]
            m *= 16
    # Ordered by logit, as llama.cpp sorts them: two logits apart by less than float64's
    # softmax can tell (e.g. 0 and 1e-31) tie in probability but not in order.
    order = np.arange(n) if is_sorted else _descending(vals)
    cut = _mass_cut(probs[order], top_p)
    keep = order if cut is None else order[:cut]
    return ids[keep], vals[keep]


def _mass_cut(sorted_probs: np.ndarray, top_p: float) -> int | None:
    """How many of the (descending) probs to keep for mass >= top_p; None if they never get there."""
    cumulative = np.cumsum(sorted_probs)
    i = int(np.searchsorted(cumulative, top_p, side="left"))  # first i with cumulative[i] >= top_p
    return i + 1 if i < cumulative.shape[0] else None


def _softmax(vals: np.ndarray) -> np.ndarray:
    """float64 softmax of a non-empty vector (shifted by the max so exp cannot overflow)."""
    weights = np.exp(vals.astype(np.float64, copy=False) - vals.max())
    return weights / weights.sum()


# --- drawing --------------------------------------------------------------------------------
def sample(probs: np.ndarray | Dist, rng: np.random.Generator) -> int:
    """Draw one token id from probs (a Dist, or a dense row of shape (V,); non-negative, not all
    zero; need not sum to 1).

    One uniform draw, inverse CDF over the nonzero entries only, in id order (after top-k there
    are a few dozen of them, so the cumulative sum is tiny): a Dist and its dense row draw the
    same token from the same generator. Never returns a zero-probability token.
    """
    if isinstance(probs, Dist):
        nonzero = probs.probs > 0
        support, weights = probs.ids[nonzero], probs.probs[nonzero]
    else:
        support = np.flatnonzero(probs > 0)  # 10x faster than flatnonzero(probs) on float64
        weights = probs[support]
    assert support.shape[0] > 0, "cannot sample from an all-zero distribution"
    cumulative = np.cumsum(weights, dtype=np.float64)
    target = rng.random() * cumulative[-1]  # in [0, total)
    # first entry whose cumulative mass exceeds the target; min() guards the float edge
    i = int(np.searchsorted(cumulative, target, side="right"))
    return int(support[min(i, support.shape[0] - 1)])


def sample_from_logits(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int], rng: np.random.Generator
) -> tuple[int, Dist]:
    """Draft side: (token, q) where q = distribution(logits, params, history) and token ~ q.

    Keep q: verification (verifier.verify_sampled) needs the distribution each draft token was drawn from.
    """
    q = distribution(logits, params, history)
    return sample(q, rng), q
