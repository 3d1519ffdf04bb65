"""Token memory: what specli has read and written before, for drafting what it writes next.

A TokenMemory holds earlier token sequences of ONE tokenizer (prompts and outputs, one
document each) and answers one question: where has the end of the current context occurred
before, and what followed it there? `lookup(context, max_len)` finds the longest match of the
context's last tokens among the stored tokens (at least `min_match` of them; a match never
crosses a document's boundary) and returns the continuations that followed it, each with how
many stored places agree on it (its count) and its match length, ranked by count, then match
length, then recency. MemoryDrafter (memory_drafter.py) drafts from the best of them.

The index: hashed n-grams over fixed key lengths, in sorted numpy arrays.

For each key length n in `key_lengths` (3, 4, 6, 8, 12, 16, 32 by default), every place p (a
token that has a document's n earlier tokens before it) is indexed by a 64-bit polynomial
hash of those n tokens: one uint64 per place, the hash's top 40 bits above the place's offset
(24 bits), the whole array sorted. A lookup hashes the context's last n tokens for each n,
longest first, and finds the places whose key hashes alike with one `searchsorted` (their
offsets come out in order, so the latest places are the end of the range); the latest
MAX_PLACES of them are checked token by token (a hash collision is dropped there) and their
match measured back up to MATCH_CAP tokens. The first key length with a checked place wins.

Why this index rather than a suffix automaton or a suffix array:
- Latency. A lookup is a fixed, small number of numpy calls (two segments x seven key lengths
  of one searchsorted each, then one gather over at most 64 x 64 tokens), whatever the store
  holds: 0.03-0.05 ms median, under 0.2 ms at the 99th percentile, in a store of 1,000,000
  tokens on a shared 2-core machine (docs/memory.md). A suffix
  array over the reversed tokens finds the exact longest match too, but by a binary search
  whose every step compares token slices in Python (about 60 steps per lookup); a suffix
  automaton needs a state per token in Python objects (hundreds of bytes each) or a
  hand-written array version, and is updated token by token in Python.
- Build cost in numpy. Hashes of every place for all key lengths are 32 vectorised passes and
  seven sorts: 0.1-0.3 s for 1,000,000 tokens, done rarely (below); adding a document then
  re-indexes only the recent segment (1.5 ms median). Suffix arrays need prefix doubling (six
  or more sorts of pairs, plus rank bookkeeping) for the same tokens, and a rebuild or a
  second structure for every addition.
- What it gives up: the match is key-granular (the places looked at are those of the longest
  KEY length that matches; their matches are then measured exactly, up to MATCH_CAP), and it
  costs 8 bytes per token per key length (56 bytes a token with the default seven, about 60 MB
  for 1,000,000 tokens) against a suffix array's 4-8. The tokens themselves (4 bytes each)
  are what persists (`to_bytes`); the index is rebuilt on load.

Growth and the size bound: the index is two segments, the main one and a recent one holding
what was added since the main one was built. Adding a document appends its tokens; the next
lookup (or `index()`) rebuilds only the recent segment, unless it has grown past a sixteenth
of the main one (or past RECENT_MIN), or evicted documents leave too much dead weight, when
everything is rebuilt. The store keeps at most `max_tokens` tokens: the oldest documents go
first (a document longer than the bound keeps its last `max_tokens` tokens); evicted places
are skipped by lookups until the next full rebuild drops them.

Pure Python and numpy. `to_bytes()` / `from_bytes()` give a checked binary form; this module
writes no files itself. Little-endian throughout:
  header (48 bytes): magic b"SPCLTMEM", format version (u16, 1), min_match (u16), fingerprint
    length in bytes (u32, at most MAX_FINGERPRINT), max_tokens (u64), vocab_size (u64, 0: not
    given), documents (u64), tokens (u64);
  the fingerprint (UTF-8), each document's length (u32 each), the tokens (i32 each);
  a 16-byte BLAKE2b digest of everything before it.
On load the magic, version, ranges, the exact size the counts imply (before anything large is
read), the digest, the fingerprint (against the caller's), the document lengths (each >= 1,
adding up to the tokens) and the token ids (0 .. vocab_size - 1) are checked; anything wrong
raises MemoryFileError.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from specli.errors import SpecliError

MASK = (1 << 64) - 1
POS_BITS = 24  # a place's offset in its segment, below its key's hash
POS_MASK = (1 << POS_BITS) - 1
HASH_TOP = 1 << (64 - POS_BITS)  # hashes keep their top 64 - POS_BITS bits
MAX_TOKENS_LIMIT = 1 << 23  # the largest bound a store may have (offsets stay within POS_BITS)
BASE = 0x100000001B3  # the polynomial's base (odd)
MIX = 0x9E3779B97F4A7C15  # a final multiply spreads every token over the hash's top bits
DEFAULT_KEYS = (3, 4, 6, 8, 12, 16, 32)
MAX_KEY = 32
_POW = [pow(BASE, j, 1 << 64) for j in range(MAX_KEY)]
_POW_NP = [np.uint64(p) for p in _POW]
_U = {k: np.uint64(k) for k in (29, 31, POS_BITS)}


class MemoryFileError(SpecliError):
    """A saved token memory that cannot be used: damaged, truncated, oversized, of another
    format version, or made for another tokenizer."""


@dataclass(frozen=True)
class Candidate:
    """A continuation found in memory: `tokens` followed the match at `count` stored places
    (each place's continuation up to max_len tokens, cut at its document's end), whose longest
    match with the end of the context is `match` tokens."""

    tokens: tuple[int, ...]
    count: int
    match: int


@dataclass
class _Segment:
    start: int  # buffer index of its first token (a document's start)
    end: int
    index: dict[int, np.ndarray]  # key length -> sorted (hash top bits << POS_BITS | offset)


def _mix_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> _U[31])
    h = h * np.uint64(MIX)
    return h ^ (h >> _U[29])


def _mix(h: int) -> int:
    h ^= h >> 31
    h = (h * MIX) & MASK
    return h ^ (h >> 29)


class TokenMemory:
    """Earlier token sequences of one tokenizer, searchable by the end of a context (see the
    module docstring). `fingerprint` names the tokenizer (any string the caller derives from
    it); `vocab_size`, when known, bounds the token ids accepted."""

    MATCH_CAP = 64  # matches are measured this far back at most
    MAX_PLACES = 64  # the latest places of a key that are looked at
    MAX_CONTINUATION = 256  # the longest continuation returned
    RECENT_MIN = 32_768  # the recent segment grows to this, or a sixteenth of the main one
    RECENT_SHARE = 16

    def __init__(self, fingerprint: str = "", *, max_tokens: int = 1_000_000, min_match: int = 3,
                 vocab_size: int | None = None, key_lengths: Sequence[int] = DEFAULT_KEYS):
        if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens must be 1 .. {MAX_TOKENS_LIMIT}, got {max_tokens}")
        if not 1 <= min_match <= MAX_KEY:
            raise ValueError(f"min_match must be 1 .. {MAX_KEY}, got {min_match}")
        if vocab_size is not None and not 1 <= vocab_size <= 2**31:
            raise ValueError(f"vocab_size must be 1 .. 2**31, got {vocab_size}")
        if not isinstance(fingerprint, str):
            raise TypeError("fingerprint must be a string")
        self.fingerprint = fingerprint
        self.max_tokens = int(max_tokens)
        self.min_match = int(min_match)
        self.vocab_size = vocab_size
        keys = sorted({int(k) for k in key_lengths if min_match <= k <= MAX_KEY} | {self.min_match})
        self.key_lengths = tuple(keys)
        self._keyset = frozenset(keys)
        self._longest_key = keys[-1]
        self._ar = np.arange(1, self.MATCH_CAP + 1, dtype=np.int64)
        self.clear()

    # ------------------------------------------------------------------------------------
    # contents

    def clear(self) -> None:
        self._buf = np.zeros(1024, dtype=np.int32)
        self._n = 0  # tokens in the buffer (live and evicted)
        self._starts: list[int] = []  # buffer index where each document starts (evicted ones too)
        self._first = 0  # the oldest live document
        self._main: _Segment | None = None
        self._recent: _Segment | None = None
        self._indexed = 0  # the buffer is indexed up to here
        self._starts_np = np.zeros(0, dtype=np.int64)  # live documents' starts (with the end after)
        self.n_added = 0  # documents added since the memory was made or cleared (evicted ones too)

    @property
    def n_tokens(self) -> int:
        """Tokens held (live: evicted ones excluded)."""
        return self._n - self._live_start

    @property
    def n_documents(self) -> int:
        return len(self._starts) - self._first

    def __len__(self) -> int:
        return self.n_tokens

    @property
    def _live_start(self) -> int:
        return self._starts[self._first] if self._first < len(self._starts) else self._n

    def documents(self) -> list[list[int]]:
        """The live documents, oldest first."""
        bounds = self._starts[self._first :] + [self._n]
        return [self._buf[a:b].tolist() for a, b in zip(bounds, bounds[1:])]

    def added_since(self, n_added: int) -> list[list[int]]:
        """The documents added after the n_added-th that are still held, oldest first (what a
        caller that saw n_added documents has not seen)."""
        n = min(max(self.n_added - n_added, 0), self.n_documents)
        if n == 0:
            return []
        bounds = self._starts[len(self._starts) - n :] + [self._n]
        return [self._buf[a:b].tolist() for a, b in zip(bounds, bounds[1:])]

    def _check_tokens(self, tokens: Iterable[int]) -> np.ndarray:
        arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
        if arr.size == 0:
            return np.zeros(0, dtype=np.int32)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError("a document is a flat sequence of integer token ids")
        hi = self.vocab_size if self.vocab_size is not None else 2**31
        if int(arr.min()) < 0 or int(arr.max()) >= hi:
            raise ValueError(f"token ids must be 0 .. {hi - 1}")
        return arr.astype(np.int32)

    def add(self, tokens: Iterable[int]) -> None:
        """Store one document (its tokens are matched only among themselves and other documents,
        never across the boundary); the oldest documents go while more than max_tokens are held.
        Indexing happens at the next lookup, or `index()`."""
        arr = self._check_tokens(tokens)
        if arr.size == 0:
            return
        if arr.size > self.max_tokens:
            arr = arr[-self.max_tokens :]
        need = self._n + arr.size
        if need > self._buf.size:
            grown = np.zeros(max(need, 2 * self._buf.size), dtype=np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : need] = arr
        self._starts.append(self._n)
        self._n = need
        self.n_added += 1
        while self._n - self._live_start > self.max_tokens:
            self._first += 1
        if self._live_start > self.max_tokens:  # (many adds and no lookup: bound the buffer too)
            self._compact()
            self._main = self._recent = None
            self._indexed = -1

    def extend(self, documents: Iterable[Iterable[int]]) -> None:
        """add() each document, in order."""
        for doc in documents:
            self.add(doc)

    # ------------------------------------------------------------------------------------
    # the index

    def index(self) -> None:
        """Bring the index up to date with what was added (lookup does it when needed; a caller
        may do it at a moment when the time does not matter, e.g. after a generation)."""
        if self._indexed == self._n:
            return
        live = self._live_start
        main_size = self._main.end - live if self._main is not None else 0
        dead = live
        recent = self._n - (self._main.end if self._main is not None else 0)
        if (self._main is None or live >= self._main.end or dead > max(self.RECENT_MIN, self.n_tokens // 4)
                or recent > max(self.RECENT_MIN, main_size // self.RECENT_SHARE)):
            self._rebuild_all()
        else:
            self._recent = self._build(self._main.end, self._n)
        self._indexed = self._n
        self._starts_np = np.array(self._starts[self._first :] + [self._n], dtype=np.int64)

    def _compact(self) -> None:
        """Drop evicted tokens from the buffer (the index must then be rebuilt)."""
        live = self._live_start
        if live > 0:
            kept = self._buf[live : self._n].copy()
            self._buf = np.zeros(max(1024, 2 * kept.size), dtype=np.int32)
            self._buf[: kept.size] = kept
            self._starts = [s - live for s in self._starts[self._first :]]
            self._first = 0
            self._n = kept.size

    def _rebuild_all(self) -> None:
        """Drop evicted tokens and index everything as the main segment."""
        self._compact()
        self._main = self._build(0, self._n) if self._n else None
        self._recent = None

    def _build(self, start: int, end: int) -> _Segment:
        """The index of buffer[start:end] (whole live documents)."""
        size = end - start
        assert 0 < size <= POS_MASK + 1
        starts = np.array([s for s in self._starts[self._first :] if start <= s < end] + [end], dtype=np.int64)
        offset = np.arange(size, dtype=np.int64) - np.repeat(starts[:-1] - start, np.diff(starts))
        values = self._buf[start:end].astype(np.uint64) + np.uint64(1)
        h = np.zeros(size, dtype=np.uint64)
        index: dict[int, np.ndarray] = {}
        for j in range(1, self._longest_key + 1):
            if j < size:
                # h[p] = sum over i = 1..j of (token[p - i] + 1) * BASE^(i - 1), mod 2^64
                h[j:] += values[:-j] * _POW_NP[j - 1]
            if j in self._keyset:
                places = np.flatnonzero(offset >= j)
                keys = (_mix_np(h[places]) >> _U[POS_BITS]) << _U[POS_BITS]
                keys |= places.astype(np.uint64)
                keys.sort()
                index[j] = keys
        return _Segment(start, end, index)

    # ------------------------------------------------------------------------------------
    # lookup

    def lookup(self, context: Sequence[int], max_len: int) -> list[Candidate]:
        """The continuations (up to max_len tokens each) that followed the longest match of the
        end of `context` (see the module docstring), best first; [] without a match of at
        least min_match tokens."""
        if max_len <= 0:
            return []
        self.index()
        if self._main is None:
            return []
        tail = [int(t) for t in context[-self.MATCH_CAP :]]
        m = len(tail)
        if m < self.key_lengths[0]:
            return []
        query: dict[int, int] = {}
        h = 0
        for j in range(1, min(m, self._longest_key) + 1):
            h = (h + (tail[-j] + 1) * _POW[j - 1]) & MASK
            if j in self._keyset:
                query[j] = _mix(h) >> POS_BITS
        reversed_tail: np.ndarray | None = None
        for n in reversed(self.key_lengths):
            if n > m:
                continue
            places = self._places(n, query[n])
            if places is None:
                continue
            if reversed_tail is None:
                reversed_tail = np.array(tail[::-1], dtype=np.int64)
            doc = np.searchsorted(self._starts_np, places, side="right") - 1
            match = self._match(places, self._starts_np[doc], reversed_tail)
            found = match >= n  # (a hash collision matches less)
            if found.any():
                return self._continuations(places[found], match[found], self._starts_np[doc[found] + 1], max_len)
        return []

    def _places(self, n: int, key: int) -> np.ndarray | None:
        """The latest MAX_PLACES live places whose key of length n hashes to `key`, oldest
        first (buffer indices), or None."""
        lo_key = key << POS_BITS
        found: list[np.ndarray] = []
        need = self.MAX_PLACES
        live = self._live_start
        for segment in (self._recent, self._main):
            if segment is None or need <= 0:
                continue
            keys = segment.index[n]
            if key + 1 < HASH_TOP:
                lo, hi = np.searchsorted(keys, np.array([lo_key, (key + 1) << POS_BITS], dtype=np.uint64))
            else:
                lo, hi = int(np.searchsorted(keys, np.uint64(lo_key))), keys.size
            if hi <= lo:
                continue
            at = (keys[max(lo, hi - need) : hi] & np.uint64(POS_MASK)).astype(np.int64) + segment.start
            if at[0] < live:
                at = at[at >= live]
            need -= at.size
            found.append(at)
        found = [a for a in found if a.size]
        if not found:
            return None
        return found[0] if len(found) == 1 else np.concatenate(found[::-1])

    def _match(self, places: np.ndarray, doc_starts: np.ndarray, reversed_tail: np.ndarray) -> np.ndarray:
        """How many tokens before each place equal the context's last ones (within the place's
        document, up to MATCH_CAP)."""
        cap = min(self.MATCH_CAP, reversed_tail.size)
        back = places[:, None] - self._ar[None, :cap]
        inside = back >= doc_starts[:, None]
        same = (self._buf[np.maximum(back, 0)] == reversed_tail[None, :cap]) & inside
        return np.where(same.all(axis=1), cap, same.argmin(axis=1))

    def _continuations(self, places: np.ndarray, match: np.ndarray, doc_ends: np.ndarray, max_len: int) -> list[Candidate]:
        max_len = min(max_len, self.MAX_CONTINUATION)
        lengths = np.minimum(doc_ends - places, max_len).tolist()
        ahead = np.minimum(places[:, None] + np.arange(max_len, dtype=np.int64)[None, :], self._n - 1)
        rows = self._buf[ahead].tolist()
        groups: dict[tuple[int, ...], list[int]] = {}
        for row, length, mm, place in zip(rows, lengths, match.tolist(), places.tolist()):
            key = tuple(row[:length])
            group = groups.get(key)
            if group is None:
                groups[key] = [1, mm, place]
            else:
                group[0] += 1
                group[1] = max(group[1], mm)
                group[2] = max(group[2], place)
        ranked = sorted(groups.items(), key=lambda kv: (-kv[1][0], -kv[1][1], -kv[1][2]))
        return [Candidate(tokens, count, mm) for tokens, (count, mm, _) in ranked]

    # ------------------------------------------------------------------------------------
    # the binary form

    MAGIC = b"SPCLTMEM"
    VERSION = 1
    _HEADER = struct.Struct("<8sHHIQQQQ")  # magic, version, min_match, fingerprint bytes, max_tokens, vocab_size (0: not given), documents, tokens
    MAX_FINGERPRINT = 4096  # bytes
    _DIGEST = 16

    def to_bytes(self) -> bytes:
        """The live documents, with what from_bytes checks: magic, format version, tokenizer
        fingerprint, the bound, counts, and a digest of it all (little-endian throughout)."""
        fp = self.fingerprint.encode("utf-8")
        if len(fp) > self.MAX_FINGERPRINT:
            raise ValueError(f"a fingerprint is at most {self.MAX_FINGERPRINT} bytes of UTF-8")
        bounds = self._starts[self._first :] + [self._n]
        lengths = np.diff(np.array(bounds, dtype=np.int64)).astype("<u4")
        tokens = self._buf[self._live_start : self._n].astype("<i4")
        head = self._HEADER.pack(self.MAGIC, self.VERSION, self.min_match, len(fp), self.max_tokens,
                                 self.vocab_size or 0, lengths.size, tokens.size)
        body = b"".join((head, fp, lengths.tobytes(), tokens.tobytes()))
        return body + hashlib.blake2b(body, digest_size=self._DIGEST).digest()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, fingerprint: str | None = None,
                   max_tokens: int | None = None, limit: int = MAX_TOKENS_LIMIT) -> "TokenMemory":
        """A memory from to_bytes()'s form. `fingerprint`: the tokenizer it must have been made
        for (None: any); `max_tokens`: the bound to hold it to (None: the saved one; a smaller
        one drops the oldest documents); `limit`: the most tokens accepted at all. Raises
        MemoryFileError for anything wrong, before building anything large."""
        data = bytes(data)
        head = cls._HEADER
        if len(data) < head.size + cls._DIGEST:
            raise MemoryFileError(f"not a token memory: {len(data)} bytes is shorter than its header")
        magic, version, min_match, fp_len, saved_max, vocab_size, n_docs, n_tokens = head.unpack_from(data)
        if magic != cls.MAGIC:
            raise MemoryFileError("not a token memory (wrong magic)")
        if version != cls.VERSION:
            raise MemoryFileError(f"token memory format version {version}; this specli reads version {cls.VERSION}")
        if fp_len > cls.MAX_FINGERPRINT:
            raise MemoryFileError(f"token memory fingerprint of {fp_len} bytes (at most {cls.MAX_FINGERPRINT})")
        if not 1 <= saved_max <= MAX_TOKENS_LIMIT or not 1 <= min_match <= MAX_KEY or vocab_size > 2**31:
            raise MemoryFileError("token memory header out of range (bound, minimum match or vocabulary size)")
        if n_tokens > min(limit, saved_max):
            raise MemoryFileError(f"token memory of {n_tokens} tokens: more than {min(limit, saved_max)} allowed")
        if n_docs > n_tokens:
            raise MemoryFileError(f"token memory counts disagree: {n_docs} documents, {n_tokens} tokens")
        expected = head.size + fp_len + 4 * n_docs + 4 * n_tokens + cls._DIGEST
        if len(data) != expected:
            raise MemoryFileError(f"token memory of {len(data)} bytes; its header says {expected} (truncated or damaged)")
        body, digest = data[: -cls._DIGEST], data[-cls._DIGEST :]
        if hashlib.blake2b(body, digest_size=cls._DIGEST).digest() != digest:
            raise MemoryFileError("token memory damaged (its digest does not match)")
        at = head.size
        try:
            saved_fp = data[at : at + fp_len].decode("utf-8")
        except UnicodeDecodeError:
            raise MemoryFileError("token memory fingerprint is not UTF-8") from None
        if fingerprint is not None and saved_fp != fingerprint:
            raise MemoryFileError(f"token memory made for another tokenizer ({saved_fp!r}, not {fingerprint!r})")
        at += fp_len
        lengths = np.frombuffer(data, dtype="<u4", count=n_docs, offset=at).astype(np.int64)
        at += 4 * n_docs
        tokens = np.frombuffer(data, dtype="<i4", count=n_tokens, offset=at)
        if (n_docs and int(lengths.min()) < 1) or int(lengths.sum()) != n_tokens:
            raise MemoryFileError("token memory counts disagree: document lengths do not add up to its tokens")
        if n_tokens and (int(tokens.min()) < 0 or vocab_size and int(tokens.max()) >= vocab_size):
            raise MemoryFileError("token memory holds token ids outside its vocabulary")
        bound = saved_max if max_tokens is None else max_tokens
        out = cls(saved_fp, max_tokens=bound, min_match=min_match, vocab_size=vocab_size or None)
        # (all at once: one buffer, the oldest dropped to the bound, one index at first use)
        ends = np.cumsum(lengths)
        keep = 0
        while keep < n_docs and n_tokens - (ends[keep - 1] if keep else 0) > bound:
            keep += 1
        first_token = int(ends[keep - 1]) if keep else 0
        if keep == n_docs and n_docs:  # (only a bound below the newest document's length)
            keep, first_token = n_docs - 1, n_tokens - bound
        kept = tokens[first_token:].astype(np.int32)
        out._buf = np.zeros(max(1024, kept.size), dtype=np.int32)
        out._buf[: kept.size] = kept
        out._n = kept.size
        out._starts = [0] + [int(e) - first_token for e in ends[keep:-1]] if kept.size else []
        return out
