"""Token Recycling: drafts from the target's own candidates, with no draft model and no match.

Every verification pass computes the target's full rows; a greedy check reads one token of
each and throws the rest away. Token Recycling (Luo et al. 2024) keeps, per token id t, the
target's top-k next tokens the last time t was the input of a position whose row the target
computed, in an adjacency table of vocab x k ids (updated from every pass; kept across
requests). A draft then follows the table from the newest token: t -> M[t][0] -> M[that][0]
... The paper verifies a static tree of such branches in one pass; specli verifies one chain,
so only the chain is drafted here (`branch="deep"`: a cheap variant that prefers a candidate
the table can continue from).

The table is bounded (vocab x k int32: 8 MiB for Gemma's 262k vocabulary at k = 8, and with
`probs` as many float16 probabilities, 4 MiB) and pure numpy (Proposal comes from drafters.py).
Like every drafter it cannot change the output, only the speed: the target verifies each draft.
Whether it pays, measured: docs/memory.md.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specli.decoding.drafters import Drafter, PromptLookupDrafter, Proposal
from specli.decoding.policy import FIXED, DraftJudge
from specli.decoding.sampling import GREEDY, SamplingParams

RECYCLING = "recycling"  # Proposal.source of a recycled draft, and the judge's source name for it
UNKNOWN = -1  # a table entry never observed


class RecyclingTable:
    """Per token id, the target's top-k next tokens (best first) when it last saw that token.

    `observe` writes the rows of positions the target computed; `chain` follows the best
    candidates from a token. Ids outside [0, vocab_size) are refused by `observe` (ValueError:
    a row from another vocabulary would poison the table) and unknown to `chain`."""

    def __init__(self, vocab_size: int, k: int = 8, probs: bool = False):
        if vocab_size <= 0 or k <= 0:
            raise ValueError("a recycling table needs a positive vocabulary size and k")
        self.vocab_size = int(vocab_size)
        self.k = int(k)
        self.rows = np.full((self.vocab_size, self.k), UNKNOWN, dtype=np.int32)
        # The target's probability of each candidate when observed (NaN: not given), or None.
        self.probs = np.full((self.vocab_size, self.k), np.nan, dtype=np.float16) if probs else None

    def copy(self) -> "RecyclingTable":
        out = RecyclingTable.__new__(RecyclingTable)
        out.vocab_size, out.k, out.rows = self.vocab_size, self.k, self.rows.copy()
        out.probs = None if self.probs is None else self.probs.copy()
        return out

    @property
    def known(self) -> int:
        """Token ids with a row observed."""
        return int(np.count_nonzero(self.rows[:, 0] != UNKNOWN))

    def observe(self, input_tokens: Sequence[int], topk_rows: np.ndarray | Sequence[Sequence[int]],
                topk_probs: np.ndarray | None = None) -> None:
        """Row i of `topk_rows` (ids, best first; at most k used, fewer padded as unknown) is
        the target's top candidates after input_tokens[i] in its context; `topk_probs`, their
        probabilities (kept when the table has `probs`). The latest occurrence of a token in the
        batch wins, as the latest pass overwrites earlier ones."""
        tokens = np.asarray(input_tokens, dtype=np.int64).reshape(-1)
        rows = np.asarray(topk_rows, dtype=np.int64)
        if rows.ndim != 2 or rows.shape[0] != tokens.size:
            raise ValueError(f"observe needs one row of candidates per input token ({tokens.size}), got shape {rows.shape}")
        if tokens.size == 0:
            return
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise ValueError("an input token is outside the vocabulary")
        if rows.size and (rows.min() < UNKNOWN or rows.max() >= self.vocab_size):
            raise ValueError("a candidate is outside the vocabulary")
        width = min(self.k, rows.shape[1])
        # (numpy does not promise which of repeated indices an assignment keeps: keep the last)
        uniq, first_in_reversed = np.unique(tokens[::-1], return_index=True)
        last = tokens.size - 1 - first_in_reversed
        self.rows[uniq, :width] = rows[last, :width]
        self.rows[uniq, width:] = UNKNOWN
        if self.probs is not None:
            self.probs[uniq] = np.nan
            if topk_probs is not None:
                probs = np.asarray(topk_probs, dtype=np.float32)
                if probs.shape[0] != tokens.size or probs.ndim != 2:
                    raise ValueError("observe needs one row of probabilities per input token")
                cols = min(width, probs.shape[1])
                self.probs[uniq, :cols] = probs[last, :cols]

    def candidates(self, token: int) -> list[int]:
        """The known candidates after `token`, best first ([] for an unknown token)."""
        if not 0 <= token < self.vocab_size:
            return []
        row = self.rows[token]
        return [int(t) for t in row if t != UNKNOWN]

    def chain(self, token: int, n: int, branch: str = "top", min_prob: float = 0.0) -> list[int]:
        """Up to n tokens from `token` on, each the best candidate after the one before;
        stops at a token without a row, and with min_prob > 0 (a table with `probs`) at a
        candidate the target gave less than that when it was observed. branch="deep": at each
        step the best-ranked candidate that itself has a row (so the chain goes on), else the
        best one."""
        out: list[int] = []
        rows, vocab, probs = self.rows, self.vocab_size, self.probs
        if min_prob > 0 and probs is None:
            raise ValueError("min_prob needs a table with probs")
        t = int(token)
        while len(out) < n and 0 <= t < vocab:
            row = rows[t]
            col = 0
            if row[0] == UNKNOWN:
                break
            if branch == "deep" and len(out) + 1 < n and rows[row[0], 0] == UNKNOWN:
                for i in range(1, self.k):
                    if row[i] == UNKNOWN:
                        break
                    if rows[row[i], 0] != UNKNOWN:
                        col = i
                        break
            if min_prob > 0 and not probs[t, col] >= min_prob:  # (NaN: not known, not enough)
                break
            t = int(row[col])
            out.append(t)
        return out


class RecyclingDrafter(Drafter):
    """Prompt lookup in the context first (when `lookup` is given), else a chain from the
    RecyclingTable, sized by the judge under the source "recycling".

    The caller feeds the table (`observe`) with the rows of every pass; the drafter only reads
    it, so one table may serve many requests (the paper's hot start) or be fresh per request."""

    name = RECYCLING

    def __init__(self, table: RecyclingTable, lookup: PromptLookupDrafter | None = None, branch: str = "top",
                 min_prob: float = 0.0):
        if branch not in ("top", "deep"):
            raise ValueError(f"unknown branch rule {branch!r}")
        self.table = table
        self.lookup = lookup
        self.branch = branch
        self.min_prob = min_prob  # draft only candidates the target gave this much (a table with probs)
        self.last_source: str | None = None  # the source of the latest non-empty proposal

    def begin(self, prompt: Sequence[int], sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None,
              request: object | None = None) -> None:
        if self.lookup is not None:
            self.lookup.begin(prompt, sampling, rng, request)
        self.last_source = None

    def observe(self, input_tokens: Sequence[int], topk_rows, topk_probs=None) -> None:
        self.table.observe(input_tokens, topk_rows, topk_probs)

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        if self.lookup is not None:
            proposal = self.lookup.propose(context, n_max, judge)
            if proposal.tokens or n_max <= 0:
                self.last_source = proposal.source if proposal.tokens else None
                return proposal
        self.last_source = None
        if n_max <= 0 or not context:
            return Proposal([], source=RECYCLING)
        chain = self.table.chain(int(context[-1]), n_max, self.branch, self.min_prob)
        if not chain:
            return Proposal([], source=RECYCLING)
        n = judge.limit(RECYCLING, n_max, len(context), cap=len(chain))
        self.last_source = RECYCLING if n > 0 else None
        return Proposal(chain[: max(n, 0)], source=RECYCLING)

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if self.lookup is not None:
            self.lookup.update(n_drafted, n_accepted)  # (the next context shows lookup what happened)
