"""Greedy verification: which drafted tokens the target agrees with (pure functions on arrays).

Given the target's logits for [last, d1..dk] (k+1 rows) and the draft d1..dk: row i is the
target's prediction for the token after position i, so d(i+1) is accepted while it equals
argmax(row i). At the first disagreement the target's own choice is emitted instead; when all k
are accepted, row k gives a bonus token. Either way one pass yields accepted + 1 tokens, each of
them the target's greedy choice given everything before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft.

    n_accepted: how many leading draft tokens the target agreed with (0..k).
    tokens: what the step emits: the accepted drafts then the target's own token (n_accepted + 1).
    """

    n_accepted: int
    tokens: list[int]


def verify_greedy(logits_tgt: np.ndarray | Sequence[np.ndarray], draft: Sequence[int]) -> Verdict:
    """Longest agreeing prefix of `draft` under the target's argmax, plus the target's token.

    Needs logits_tgt: len(draft) + 1 rows of n_vocab (an array, or any sequence of rows, which
    may compute them when read).
    """
    k = len(draft)
    assert len(logits_tgt) == k + 1, (len(logits_tgt), k)
    # Row by row up to the first disagreement: rows after it are never read (an argmax over
    # a 262k-token row is ~20 us of host time a row).
    n_accepted = 0
    choice = int(np.argmax(logits_tgt[0]))
    while n_accepted < k and choice == draft[n_accepted]:
        n_accepted += 1
        choice = int(np.argmax(logits_tgt[n_accepted]))
    return Verdict(n_accepted, [int(t) for t in draft[:n_accepted]] + [choice])
