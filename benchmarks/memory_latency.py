#!/usr/bin/env python3
"""Latency of TokenMemory (src/specli/decoding/memory.py): building a store, adding a document
to it, and lookups in it, median and max in microseconds.

The store: --tokens tokens (default 1,000,000) in documents of 200-800 tokens, drawn from a
Zipf-like law over a 262,144-token vocabulary (Gemma's size), a quarter of the documents
repeating a template with a few tokens changed (the repeated workloads memory is for, and
keys with many places). Lookups, --lookups of each kind (default 2000), max_len 16:
  random    64 random tokens of the same law (mostly short or no matches),
  repeated  the 64 tokens before a random place of a stored document (a long match; in a
            template, many places agree),
  mixed     48 random tokens then 16 of a stored document (a match of about 16).
Usage: python benchmarks/memory_latency.py [--tokens 1000000] [--lookups 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from specli.decoding.memory import TokenMemory  # noqa: E402

VOCAB = 262_144


def documents(n_tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    docs, total = [], 0
    templates = [rng.zipf(1.3, size=600) % VOCAB for _ in range(8)]
    while total < n_tokens:
        size = int(rng.integers(200, 800))
        if rng.random() < 0.25:
            doc = templates[int(rng.integers(len(templates)))][:size].copy()
            changed = rng.integers(0, doc.size, size=max(1, doc.size // 40))
            doc[changed] = rng.zipf(1.3, size=changed.size) % VOCAB
        else:
            doc = rng.zipf(1.3, size=size) % VOCAB
        docs.append(doc.astype(np.int32))
        total += doc.size
    return docs


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def summary(name: str, seconds: list[float], extra: str = "") -> None:
    us = [s * 1e6 for s in seconds]
    print(f"{name:<10} n={len(us):>5}  median {statistics.median(us):8.1f} us  "
          f"p99 {sorted(us)[int(0.99 * (len(us) - 1))]:8.1f} us  max {max(us):8.1f} us  {extra}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    docs = documents(args.tokens, rng)
    memory = TokenMemory("bench", max_tokens=args.tokens, vocab_size=VOCAB)
    t = time.perf_counter()
    memory.extend(docs)
    t_add_all = time.perf_counter() - t
    t_build = timed(memory.index)
    index_bytes = sum(a.nbytes for seg in (memory._main, memory._recent) if seg is not None for a in seg.index.values())
    print(f"store: {memory.n_tokens} tokens in {memory.n_documents} documents; key lengths {memory.key_lengths}; "
          f"index {index_bytes / 1e6:.0f} MB, tokens {memory._buf.nbytes / 1e6:.0f} MB (buffer)")
    print(f"extend (copy in) {t_add_all * 1e3:.0f} ms, first index (full build) {t_build * 1e3:.0f} ms")

    kinds: dict[str, list[list[int]]] = {"random": [], "repeated": [], "mixed": []}
    for _ in range(args.lookups):
        kinds["random"].append((rng.zipf(1.3, size=64) % VOCAB).tolist())
        doc = docs[int(rng.integers(len(docs)))]
        at = int(rng.integers(64, doc.size))
        kinds["repeated"].append(doc[at - 64 : at].tolist())
        at = int(rng.integers(16, doc.size))
        kinds["mixed"].append((rng.zipf(1.3, size=48) % VOCAB).tolist() + doc[at - 16 : at].tolist())
    for _ in range(50):  # warm-up
        memory.lookup(kinds["repeated"][0], 16)
    for kind, contexts in kinds.items():
        seconds, found, places = [], 0, 0
        for ctx in contexts:
            t = time.perf_counter()
            out = memory.lookup(ctx, 16)
            seconds.append(time.perf_counter() - t)
            found += bool(out)
            places += sum(c.count for c in out)
        summary(kind, seconds, f"(a match {found}/{len(contexts)}, {places / max(found, 1):.1f} places each)")

    # Adding: one document to the full store, then the index brought up to date (the recent
    # segment, or now and then everything), as a front end would after each generation.
    add_s, index_s = [], []
    for doc in documents(200 * 500, rng)[:200]:
        add_s.append(timed(memory.add, doc))
        index_s.append(timed(memory.index))
    summary("add", add_s)
    summary("index", index_s, "(after each add: the recent segment, sometimes all)")
    blob = memory.to_bytes()
    t_dump = timed(memory.to_bytes)
    t_load = timed(lambda: TokenMemory.from_bytes(blob, fingerprint="bench").index())
    print(f"to_bytes {t_dump * 1e3:.0f} ms ({len(blob) / 1e6:.1f} MB), from_bytes + index {t_load * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
