"""llama.cpp's n-gram drafters, ported to specli's drafter protocol for replays (replay.py).

Read from the llama.cpp that llama-cpp-python 0.3.36 vendors: `common/ngram-map.cpp`
(`common_ngram_simple_draft`, `common_ngram_map_draft`/`_accept` with key_only),
`common/ngram-mod.{h,cpp}` and `common/speculative.cpp` (`impl_ngram_mod`), with their
defaults. docs/lookup.md says what each does. They let a replay charge native's own passes
from the same cost table as specli's, and spec_bench.py checks them against the real binaries:
on the same text a port must draft and have accepted what the binary's log says.

Each drafter gets the context (prompt and output so far, its newest token last, as specli's
drafters do; llama.cpp passes that token apart as `id_last`), and proposes its draft, which the
loop cuts to the tokens left (`dp.n_max`), as llama-speculative-simple does.

Left out: ngram-map-k's 2^18-slot hash is kept exactly (first writer wins, collisions
included), but ngram-mod's 4M-slot table is a dict keyed by the n-gram itself (no collisions)
and never reaches its reset at a quarter full: neither changes anything on texts of a few
thousand tokens.
"""

from __future__ import annotations

from typing import Sequence

from specli.decoding.drafters import Drafter, Proposal

HASH_SLOTS = 1 << 18  # COMMON_NGRAM_HASH_MAP_SIZE
LCG_FACTOR = 2654435761
MASK32 = 0xFFFFFFFF


def _hash(tokens: Sequence[int], start: int, n: int) -> int:
    h = 0
    for i in range(n):
        h = (h * LCG_FACTOR + tokens[start + i]) & MASK32
    return h % HASH_SLOTS


class _Native(Drafter):
    name = "native"

    def update(self, n_drafted: int, n_accepted: int) -> None:
        pass


class NgramSimple(_Native):
    """`--spec-type ngram-simple`: the latest earlier occurrence of the last size_n tokens,
    and up to size_m tokens after it, if at least size_n exist."""

    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.n, self.m = size_n, size_m
        self._tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}

    def begin(self, prompt: Sequence[int], *args) -> None:
        self._tokens, self._starts = [], {}

    def _index(self, tokens: Sequence[int]) -> None:
        known = len(self._tokens)
        if len(tokens) < known or list(tokens[:known]) != self._tokens:
            self._tokens, self._starts, known = [], {}, 0
        self._tokens.extend(tokens[known:])
        n = self.n
        for j in range(max(known - n + 1, 0), len(self._tokens) - n + 1):
            self._starts.setdefault(tuple(self._tokens[j : j + n]), []).append(j)

    def propose(self, context: Sequence[int], n_max: int, judge=None) -> Proposal:
        tokens, n, m = context[:-1], self.n, self.m  # tokens: the context but its newest token
        cur_len = len(tokens)
        self._index(tokens)
        if cur_len <= n + m + 1:
            return Proposal([], source=self.name)
        pattern = tuple(tokens[cur_len - n + 1 :]) + (context[-1],)
        # The latest start j in 1 .. cur_len - n - 1 (the scan goes backwards, skipping j = 0).
        match = 0
        for j in reversed(self._starts.get(pattern, ())):
            if 1 <= j <= cur_len - n - 1:
                match = j
                break
        if match == 0:
            return Proposal([], source=self.name)
        copy_max = min(m, cur_len - (match + n))
        if copy_max < n:
            return Proposal([], source=self.name)
        draft = list(tokens[match + n : match + n + copy_max])
        return Proposal(draft[:n_max], source=self.name)


class NgramMapK(_Native):
    """`--spec-type ngram-map-k`: the key's position from a hash of n-grams (first writer wins),
    else the latest unhashed one; per key, a draft of min(size_m, accepted at its last draft)."""

    name = "ngram-map-k"

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.n, self.m = size_n, size_m
        self.begin([])

    def begin(self, prompt: Sequence[int], *args) -> None:
        # llama.cpp's begin() gets the prompt but its last token (prompt_tgt).
        self.size_last_begin = max(len(prompt) - 1, 0)
        self.key_map: dict[int, int] = {}
        self.key_map_last_idx = 0
        self.keys: dict[tuple[int, ...], int] = {}  # key -> n_accepted of its value 0
        self._last_key: tuple[int, ...] | None = None

    def propose(self, context: Sequence[int], n_max: int, judge=None) -> Proposal:
        self._last_key = None
        inp, n, m = context[:-1], self.n, self.m
        cur_len = len(inp)
        if cur_len < 2 * n + m:
            return Proposal([], source=self.name)
        key = tuple(inp[cur_len - n + 1 :]) + (context[-1],)
        match_pos = 0
        idx_key = self.key_map.get(_hash(key, 0, n), 0)
        if idx_key != 0 and idx_key < cur_len - n - m - 1 and tuple(inp[idx_key : idx_key + n]) == key:
            match_pos = idx_key
        begin = self.size_last_begin
        if match_pos == 0 and begin > n + m + 1:
            for j in range(begin - n - m - 1, self.key_map_last_idx, -1):
                if tuple(inp[j : j + n]) == key:
                    match_pos = j
                    break
        if match_pos == 0:
            for j in range(cur_len - n - m - 1, max(begin, self.key_map_last_idx), -1):
                if tuple(inp[j : j + n]) == key:
                    match_pos = j
                    break
        # New n-grams into the hash, in the same order (the latest first; first writer wins).
        ranges = []
        if begin > n + m + 1:
            ranges.append(range(begin - n - m - 1, self.key_map_last_idx, -1))
        ranges.append(range(cur_len - n - m - 1, max(begin, self.key_map_last_idx), -1))
        for span in ranges:
            for j in span:
                self.key_map.setdefault(_hash(inp, j, n), j)
        self.key_map_last_idx = max(cur_len - n - m - 1, self.key_map_last_idx)
        if match_pos == 0:
            return Proposal([], source=self.name)
        n_accepted = self.keys.setdefault(key, m)
        self._last_key = key
        draft = list(inp[match_pos + n : match_pos + n + min(m, n_accepted)])
        return Proposal(draft[:n_max], source=self.name)

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if self._last_key is not None:
            self.keys[self._last_key] = n_accepted


class NgramMod(_Native):
    """`--spec-type ngram-mod`: a table of n_match-gram -> the token after it (the latest
    wins), drafts chained token by token, n_min to n_max of them or none; the table is reset
    after 5 drafts in a row with under a quarter accepted."""

    name = "ngram-mod"

    def __init__(self, n_match: int = 24, n_max: int = 64, n_min: int = 48):
        self.n, self.n_max, self.n_min = n_match, n_max, n_min
        self.begin([])

    def begin(self, prompt: Sequence[int], *args) -> None:
        tokens = list(prompt[:-1])  # llama.cpp's begin() gets the prompt but its last token
        self.table: dict[tuple[int, ...], int] = {}
        self.i_last, self.n_draft_last, self.n_low = 0, 0, 0
        n = self.n
        if len(tokens) >= n:
            for i in range(len(tokens) - n):
                self.table[tuple(tokens[i : i + n])] = tokens[i + n]
            self.i_last = len(tokens) - n

    def propose(self, context: Sequence[int], n_max: int, judge=None) -> Proposal:
        self.n_draft_last = 0
        prompt, n = context[:-1], self.n
        cur_len = len(prompt)
        if cur_len < n:
            return Proposal([], source=self.name)
        if self.i_last + 32 < cur_len:
            for i in range(self.i_last, cur_len - n):
                self.table[tuple(prompt[i : i + n])] = prompt[i + n]
            self.i_last = cur_len - n
        result = list(prompt[cur_len - n + 1 :]) + [context[-1]]
        for i in range(self.n_max):
            token = self.table.get(tuple(result[i : i + n]))
            if token is None:
                if i < self.n_min:
                    return Proposal([], source=self.name)
                break
            result.append(token)
        draft = result[n:]
        self.n_draft_last = len(draft)
        return Proposal(draft[:n_max], source=self.name)

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if self.n_draft_last > 0:
            if n_accepted / self.n_draft_last < 0.25:
                self.n_low += 1
                if self.n_low >= 5:
                    self.table, self.n_low, self.i_last = {}, 0, 0
            else:
                self.n_low = 0


PORTS = {cls.name: cls for cls in (NgramSimple, NgramMapK, NgramMod)}
