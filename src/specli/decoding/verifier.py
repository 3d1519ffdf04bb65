"""Verification: which drafted tokens the target accepts, and the token it adds. Acceptance is
decided here and nowhere else (tests/test_layout.py holds it).

Terms. A step drafts d1..dk after the context; the target's pass over [last, d1..dk] gives k+1
rows, row i for the token after context + d[:i] (row k: the bonus position). A verdict is
(n_accepted, tokens): the agreeing prefix d1..dj, then one token of the target's own, so one pass
yields j + 1 tokens.
- Greedy (temperature 0): d(i+1) is accepted while it equals the argmax of row i (after the
  repetition penalty, when one is set: TargetRows); the target's own token is row j's argmax.
  Each emitted token is the target's greedy choice given everything before it.
- Sampled (Leviathan et al. 2023, Chen et al. 2023; p the target's distribution, q the draft's):
  d(i+1) is accepted with probability min(1, p_i(d)/q_i(d)) (u*q < p, strict, float64); at the
  first rejection a token is drawn from normalize(max(0, p_i - q_i)), and after a full accept
  from p_k. Every emitted token is then distributed exactly as the target's own sample,
  whatever q is. A drafter without a distribution (lookup) has q one-hot on its token.
- Tree (greedy): each branch as a chain; the longest accepted branch wins (branches.py).

p and q both come from sampling.distribution(), llama.cpp's default sampler chain: "the target
sampling alone" means what it means with llama.cpp.

`verify` is the one entry point (SequenceStep.commit calls it); the others are its parts, kept
callable for the tests that check them on their own. A constraint's masks (one bitmask row of the
allowed tokens per position) apply here, to every row read: greedy takes the masked argmax,
sampling the masked and renormalised p, so every verdict is the constrained target's
(docs/constraints.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from specli.decoding.sampling import Dist, SamplingParams, distribution, penalized_row, penalty_history, sample, transforms

if TYPE_CHECKING:
    from specli.decoding.branches import TokenTree

# A residual with less mass than this is rounding noise between p and q, not a distribution:
# sampling it would emit an arbitrary token. The probability of reaching it at all is the
# residual's mass (the total variation distance of p and q), so falling back to p changes the
# output distribution by at most this much.
_RESIDUAL_MIN_MASS = 1e-10


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft.

    n_accepted: how many leading draft tokens the target agreed with (0..k).
    tokens: what the step emits: the accepted drafts then the target's own token (n_accepted + 1).
    branch: a tree's accepted branch (its index in the tree's paths); 0 for a chain.
    """

    n_accepted: int
    tokens: list[int]
    branch: int = 0


def verify(
    rows: np.ndarray, draft: Sequence[int], context: list[int], sampling: SamplingParams, rng: np.random.Generator | None,
    *, q_rows: Sequence[Dist] | None = None, tree: TokenTree | None = None, masks: np.ndarray | None = None,
) -> Verdict:
    """The verdict on one sequence's part of a pass: `rows` are the target's logits for [last,
    *draft] (a tree: for [last, *tree.tokens]), `context` the prompt and output so far (its last
    token is `last`), q_rows the distributions the draft was sampled from (None: greedy drafts,
    lookup). Greedy: exact match against the argmax; sampling: rejection sampling against p; a
    tree (greedy only): the longest accepted branch. `masks`: a constraint's allowed tokens at
    each position (bitmask rows, 32 tokens an int32 word; None: unconstrained; not with a tree)."""
    penalized = transforms(sampling, context)  # (a bias or a penalty changes the argmax: rows see their history)
    if tree is not None:
        assert sampling.greedy, "tree passes are greedy only"
        if not penalized:
            return verify_tree(rows, tree)
        return verify_tree(rows, tree, lambda node_rows, branch: TargetRows(node_rows, sampling, context, branch, row=penalized_row))
    if sampling.greedy:
        return verify_greedy(TargetRows(rows, sampling, context, draft, row=penalized_row) if penalized else rows, draft, masks)
    return verify_sampled(TargetRows(rows, sampling, context, draft, masks=masks), q_rows, draft, rng)


class TargetRows:
    """The target's rows for each position of a pass, computed only when read: its
    distributions p (`row=distribution`, for rejection sampling), or its logits after the
    repetition penalty (`row=penalized_row`, for greedy verification).

    Row i is for the token after context + draft[:i]; its repetition penalty sees exactly that
    history, as plain decoding would have. Verification stops at the first rejected draft, so
    later rows are usually never computed.
    """

    def __init__(self, logits_tgt: np.ndarray, sampling: SamplingParams, context: list[int], draft: list[int], row=distribution,
                 masks: np.ndarray | None = None):
        self._logits = logits_tgt
        self._sampling = sampling
        self._context = context
        self._draft = draft
        self._row = row  # (logits, sampling, history) -> the row
        self._masks = masks  # a constraint's allowed tokens per row (forbidden logits become -inf first)

    def __len__(self) -> int:
        return len(self._draft) + 1

    def __getitem__(self, i: int) -> Dist | np.ndarray:
        logits = self._logits[i] if self._masks is None else masked(self._logits[i], self._masks[i])
        return self._row(logits, self._sampling, penalty_history(self._sampling, self._context, self._draft[:i]))


def allowed(mask: np.ndarray, token: int) -> bool:
    """Whether a bitmask row (32 tokens an int32 word, token t at bit t % 32 of word t // 32)
    allows `token`."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def masked(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A copy of `logits` with every token the bitmask row forbids at -inf."""
    ok = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")[: logits.shape[-1]].astype(bool)
    return np.where(ok, logits, np.float32(-np.inf))


def masked_argmax(logits: np.ndarray, mask: np.ndarray | None) -> int:
    """The argmax among the tokens `mask` allows (the plain argmax when it is allowed: the same
    token, without masking the row)."""
    choice = int(np.argmax(logits))
    if mask is None or allowed(mask, choice):
        return choice
    return int(np.argmax(masked(logits, mask)))


def verify_greedy(logits_tgt: np.ndarray | Sequence[np.ndarray], draft: Sequence[int], masks: np.ndarray | None = None) -> Verdict:
    """Longest agreeing prefix of `draft` under the target's argmax, plus the target's token.

    Needs logits_tgt: len(draft) + 1 rows of n_vocab (an array, or any sequence of rows, which
    may compute them when read).
    """
    k = len(draft)
    assert len(logits_tgt) == k + 1, (len(logits_tgt), k)
    # Row by row up to the first disagreement: rows after it are never read (an argmax over
    # a 262k-token row is ~20 us of host time a row).
    n_accepted = 0
    choice = masked_argmax(logits_tgt[0], None if masks is None else masks[0])
    while n_accepted < k and choice == draft[n_accepted]:
        n_accepted += 1
        choice = masked_argmax(logits_tgt[n_accepted], None if masks is None else masks[n_accepted])
    return Verdict(n_accepted, [int(t) for t in draft[:n_accepted]] + [choice])


# --- verification ---------------------------------------------------------------------------
def verify_sampled(
    p_rows: Sequence[np.ndarray | Dist], q_rows: Sequence[np.ndarray | Dist] | None, draft: Sequence[int], rng: np.random.Generator
) -> Verdict:
    """Speculative sampling's accept/reject step: accepted drafts + one token from the target.

    Needs p_rows, k+1 rows (an array or any sequence of rows; a row is a Dist or a dense row of
    V): row i = the target's probabilities for the token after context + draft[:i] (so row k is
    the bonus position), each from `distribution()` with that history. q_rows, k rows: row i =
    the distribution draft[i] was sampled from; None when the drafter has no distribution
    (prompt lookup), which means q_i is one-hot on draft[i].
    Returns Verdict(n_accepted, tokens) with tokens = draft[:n_accepted] + [one emitted token].
    """
    k = len(draft)
    assert len(p_rows) == k + 1, (len(p_rows), k)
    assert q_rows is None or len(q_rows) == k, (len(q_rows), k)
    for i, x in enumerate(draft):
        x = int(x)
        p_i = p_rows[i]  # rows are read in order, once, and only up to the first rejection,
        p_x = float(p_i[x])  # so p_rows may compute them lazily
        q_x = 1.0 if q_rows is None else float(q_rows[i][x])
        # accept with probability min(1, p/q): u < p/q, written u*q < p so that q = 0 cannot divide
        if rng.random() * q_x < p_x:
            continue
        residual = _residual(p_i, None if q_rows is None else q_rows[i], x)
        return Verdict(i, [int(t) for t in draft[:i]] + [sample(residual, rng)])
    return Verdict(k, [int(t) for t in draft] + [sample(p_rows[k], rng)])


def _residual(p: np.ndarray | Dist, q: np.ndarray | Dist | None, x: int) -> np.ndarray | Dist:
    """normalize(max(0, p - q)), where the rejected token is resampled from (unnormalized is
    fine: `sample` divides by the total). One-hot q on x: p without x.

    When the residual has (almost) no mass, p and q differ only by rounding and a rejection was
    (almost) impossible; p itself is then the right answer up to that negligible mass.
    """
    if isinstance(p, Dist):  # the residual is 0 wherever p is: only p's support is computed
        if q is None:
            kept = np.where(p.ids == x, 0.0, p.probs)
        else:
            kept = np.maximum(p.probs - (q.at(p.ids) if isinstance(q, Dist) else np.asarray(q)[p.ids]), 0.0)
        return p if kept.sum() <= _RESIDUAL_MIN_MASS else Dist(p.ids, kept, p.n_vocab)
    if isinstance(q, Dist):
        q = np.asarray(q)
    if q is None:
        residual = np.array(p, dtype=np.float64)
        residual[x] = 0.0
    else:
        residual = np.maximum(np.asarray(p, dtype=np.float64) - q, 0.0)
    if residual.sum() <= _RESIDUAL_MIN_MASS:
        return np.asarray(p, dtype=np.float64)
    return residual


def verify_tree(rows: np.ndarray | Sequence[np.ndarray], tree: TokenTree, row_of=None) -> Verdict:
    """Greedy verification of every branch: rows[0] is the root's (the pass's `last`), rows[1 + i]
    node i's. The branch whose agreeing prefix is longest wins (the first such on a tie); its
    verdict is the one a pass over that branch alone gives, with `branch` its index in tree.paths. `row_of(node_rows, branch)`: the
    rows as verify_greedy reads them (e.g. with a repetition penalty), default the rows."""
    best: Verdict | None = None
    for b, path in enumerate(tree.paths or ((),)):
        node_rows = [rows[0]] + [rows[1 + i] for i in path]
        draft = [tree.tokens[i] for i in path]
        verdict = verify_greedy(row_of(node_rows, draft) if row_of else node_rows, draft)
        if best is None or verdict.n_accepted > best.n_accepted:
            best = Verdict(verdict.n_accepted, verdict.tokens, b)
    assert best is not None
    return best
