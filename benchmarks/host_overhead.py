#!/usr/bin/env python3
"""Host work per speculative step: everything outside llama_decode, by vocabulary size, draft
length and temperature, and the per-row cost of the sampler chain (`probabilities`).

No model is loaded: the target's and the draft's passes are stand-ins that hand out synthetic
random logits (the draft's a noisy copy of the target's, so drafts are partly accepted) and
whose own time is subtracted, so the step figure is pure host work: the drafter's sampling (q
rows), verification (p rows, rejection sampling), cache bookkeeping, the Generation's record
and detokenization. On a GPU the passes get cheap and this is what is left.

Rows are cycled from a pool larger than the CPU caches, as logits fresh from llama.cpp are.
Variants are measured interleaved over several rounds; figures are medians with [min .. max]
over the rounds. Table on stdout, progress on stderr.

Usage: python benchmarks/host_overhead.py [--vocab 32000 131072 262144] [--draft 1 4 8 16]
       [--rounds 5] [--rows 64] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from specli.decoding.drafters import DraftModelDrafter
from specli.decoding.engine import SpeculativeDecoder
from specli.decoding.sampling import GREEDY, SamplingParams, probabilities

ROW_SETTINGS = {
    "default (k40 p0.95 m0.05 T0.8)": SamplingParams(),
    "min-p off": SamplingParams(min_p=0.0),
    "top-k off": SamplingParams(top_k=0),
    "greedy": GREEDY,
}


def logit_pool(n_vocab: int, n_rows: int, seed: int = 0) -> np.ndarray:
    """Rows shaped like an LLM's: a gaussian body and a few tokens well above it."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((n_rows, n_vocab)) * 2.0).astype(np.float32)
    for row in rows:
        row[rng.integers(n_vocab, size=4)] += rng.uniform(4, 12, size=4).astype(np.float32)
    return rows


class FakeModel:
    """The part of LlamaModel the decoder and DraftModelDrafter use; logits from a pool keyed
    by the context, so a context always gets the same row. Time inside is counted in eval_s."""

    def __init__(self, pool: np.ndarray, noise: np.ndarray | None = None, n_ctx: int = 1 << 20):
        self.pool, self.noise = pool, noise
        self.n_vocab = pool.shape[1]
        self.n_ctx, self.n_batch = n_ctx, 512
        self.cached: list[int] = []
        self.synced_new = 0
        self.eval_s = 0.0
        self._buf = np.empty((17, self.n_vocab), dtype=np.float32)

    def _row(self, i: int, out: np.ndarray) -> None:
        key = hash(tuple(self.cached[max(0, i - 2) : i + 1])) % self.pool.shape[0]
        out[:] = self.pool[key]
        if self.noise is not None:
            out += self.noise[key % self.noise.shape[0]]

    def eval(self, tokens, *, logits="last"):
        t0 = time.perf_counter()
        start = len(self.cached)
        self.cached.extend(tokens)
        n = len(tokens) if logits == "all" else (1 if logits == "last" and tokens else 0)
        if n > self._buf.shape[0]:
            self._buf = np.empty((n, self.n_vocab), dtype=np.float32)
        out = self._buf[:n]
        for j in range(n):
            self._row(start + len(tokens) - n + j, out[j])
        self.eval_s += time.perf_counter() - t0
        return out

    def sync(self, context):
        common = 0
        for a, b in zip(self.cached, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)
        self.truncate(common)
        self.synced_new = len(context) - common
        return self.eval(list(context[common:]), logits="last")

    def truncate(self, n_keep: int) -> None:
        del self.cached[n_keep:]

    def is_eog(self, token: int) -> bool:
        return False

    def piece(self, token: int) -> bytes:
        return b" t%d" % token


def median_spread(row: dict, key: str) -> str:
    return f"{row[key]:8.3f} [{row['min']:.3f} .. {row['max']:.3f}]"


def bench_rows(vocabs: list[int], n_rows: int, rounds: int, reps: int) -> list[dict]:
    results = []
    for n_vocab in vocabs:
        pool = logit_pool(n_vocab, n_rows)
        times: dict[str, list[float]] = {name: [] for name in ROW_SETTINGS}
        for r in range(rounds):
            print(f"rows: vocab {n_vocab}, round {r + 1}/{rounds}", file=sys.stderr)
            for name, params in ROW_SETTINGS.items():  # interleaved: every setting each round
                n = min(reps, n_rows) if name != "top-k off" else min(reps, 8)
                t0 = time.perf_counter()
                for i in range(n):
                    probabilities(pool[i % n_rows], params)
                times[name].append((time.perf_counter() - t0) / n * 1e3)
        for name, ts in times.items():
            results.append({"vocab": n_vocab, "setting": name, "ms_per_row": float(np.median(ts)), "min": min(ts), "max": max(ts)})
    return results


def bench_steps(vocabs: list[int], drafts: list[int], temps: list[float], n_rows: int, rounds: int, steps: int) -> list[dict]:
    results = []
    for n_vocab in vocabs:
        pool = logit_pool(n_vocab, n_rows)
        noise = (np.random.default_rng(1).standard_normal((8, n_vocab)) * 0.5).astype(np.float32)
        cells = [(k, t) for k in drafts for t in temps]
        times: dict[tuple, list[float]] = {c: [] for c in cells}
        for r in range(rounds):
            print(f"steps: vocab {n_vocab}, round {r + 1}/{rounds}", file=sys.stderr)
            for k, temp in cells:
                target, draft = FakeModel(pool), FakeModel(pool, noise)
                sampling = GREEDY if temp == 0 else SamplingParams(temperature=temp, seed=r)
                decoder = SpeculativeDecoder(target, DraftModelDrafter(draft), k, sampling)
                gen = decoder.generate([1, 2, 3, 4], max_tokens=10**9)
                it = iter(gen)
                next(it)  # the first step includes one-off work
                target.eval_s = draft.eval_s = 0.0
                t0 = time.perf_counter()
                for _ in range(steps):
                    next(it)
                host = time.perf_counter() - t0 - target.eval_s - draft.eval_s
                times[(k, temp)].append(host / steps * 1e3)
        for (k, temp), ts in times.items():
            results.append({"vocab": n_vocab, "draft": k, "temperature": temp, "host_ms_per_step": float(np.median(ts)),
                            "min": min(ts), "max": max(ts)})  # fmt: skip
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32_000, 131_072, 262_144])
    ap.add_argument("--draft", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=64, help="distinct logit rows cycled (64 x 262k x 4 B = 64 MiB)")
    ap.add_argument("--reps", type=int, default=64, help="rows timed per setting per round")
    ap.add_argument("--steps", type=int, default=40, help="steps timed per cell per round")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    rows = bench_rows(args.vocab, args.rows, args.rounds, args.reps)
    print("sampler chain, ms per row (median [min .. max] over rounds)")
    print(f"{'vocab':>8}  {'setting':32} {'ms/row':>30}")
    for r in rows:
        print(f"{r['vocab']:>8}  {r['setting']:32} {median_spread(r, 'ms_per_row'):>30}")
    steps = bench_steps(args.vocab, args.draft, args.temperature, args.rows, args.rounds, args.steps)
    print("\nhost work per step outside the passes, ms (median [min .. max] over rounds)")
    print(f"{'vocab':>8} {'draft':>6} {'temp':>5} {'host ms/step':>30}")
    for s in steps:
        print(f"{s['vocab']:>8} {s['draft']:>6} {s['temperature']:>5} {median_spread(s, 'host_ms_per_step'):>30}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
