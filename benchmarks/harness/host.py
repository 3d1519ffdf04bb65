"""Host overhead: specli's loop against native llama.cpp's, and its Python work per step.

Stages:
  yardstick  real processes, --rounds interleaved rounds, the best round counting (other load
             only slows a run): plain decoding on Gemma 3 270M Q4_K_M, `specli run --target-only`
             against `llama-bench` tg at the prompt's depth (-d: attention over a longer context
             costs more; goal >= 0.97) and against native plain decoding of the same prompt
             (llama-speculative-simple with a lookup key that never matches: the loop and clock of
             the native speculative runs); a draft model on the synthetic pairs (`bench.py pairs`),
             specli -md at N and auto against llama-speculative-simple --spec-type draft-simple at
             n-max N and gated at p-min 0.75, each side's speedup over its own plain decoding.
  overhead   no model: the passes are stand-ins handing out synthetic logits (the draft's a noisy
             copy of the target's), their time subtracted, so what is left is the Python side:
             the sampler chain (`distribution`) per row by setting, and the host time per step
             (drafting's q rows, verification, bookkeeping, detokenization) by vocabulary, draft
             length and temperature; --gemma N adds N real rows of Gemma, --baseline-src another
             checkout's chain in the same rounds. Medians [min .. max] over interleaved rounds.
             On a GPU, where a pass over k+1 tokens costs about one, this is what limits a step.
  profile    cProfile of one warm generation per configuration on Gemma: the share of its time
             inside llama_decode, and the top Python functions by own time.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from harness import models, native, synthetic
from harness.common import DEFAULT_OUT, HERE, log, table, write_json
from specli.decoding.generation import Request
from specli.decoding.loop import generate

P_MIN = 0.75


# --- yardstick ---------------------------------------------------------------------------------
def yardstick(args) -> None:
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend

    gemma = models.gemma().target
    texts = {name: (HERE.parent / "prompts" / f"{name}.txt").read_text(encoding="utf-8") for name in args.prompts.split(",")}
    work = Path(args.out) / "host"
    files = {name: native.prompt_file(work / "prompts", name, text) for name, text in texts.items()}
    init_backend()
    model = LlamaModel(gemma, n_ctx=2048)
    depth = {name: len(model.tokenize(text, add_bos=model.vocab_info().add_bos)) for name, text in texts.items()}
    model.close()
    m, t = args.max_tokens, args.threads

    def specli(target, mode, name):
        return native.specli_run_cmd(target, *mode, prompt=texts[name], max_tokens=m, threads=t)

    def spec_simple(key, target, spec, name):
        return native.Job(key, "spec-simple", native.spec_simple_cmd(target, *spec, prompt_file=files[name], max_tokens=m, threads=t),
                          texts[name], m)

    jobs = []
    for name in texts:
        at = ("gemma", name)
        jobs += [native.Job((*at, "llama-bench"), "llama-bench", native.llama_bench_cmd(gemma, max_tokens=m, threads=t, depth=depth[name])),
                 native.Job((*at, "specli plain"), "specli", specli(gemma, ["--target-only"], name)),
                 spec_simple((*at, "native plain"), gemma, native.NATIVE_PLAIN, name)]
    n, name = args.n, next(iter(texts))
    for label in [p for p in args.pairs.split(",") if p]:
        pair, at = synthetic.cost_pair(label), (label, name)
        draft_simple = ["-md", str(pair.draft), "--spec-type", "draft-simple"]
        jobs += [native.Job((*at, "specli plain"), "specli", specli(pair.target, ["--target-only"], name)),
                 native.Job((*at, f"specli N={n}"), "specli", specli(pair.target, ["-md", str(pair.draft), "--draft-max", str(n)], name)),
                 native.Job((*at, "specli auto"), "specli", specli(pair.target, ["-md", str(pair.draft)], name)),
                 spec_simple((*at, "native plain"), pair.target, native.NATIVE_PLAIN, name),
                 spec_simple((*at, f"native N={n}"), pair.target, [*draft_simple, "--spec-draft-n-max", str(n)], name),
                 spec_simple((*at, f"native p-min {P_MIN}"), pair.target, [*draft_simple, "--spec-draft-n-max", "16",
                                                                           "--spec-draft-p-min", str(P_MIN)], name)]
    results, failures = native.rounds(jobs, args.rounds)
    best: dict[tuple, dict] = {}
    for r in results:
        if r["tps"] and (r["key"] not in best or r["tps"] > best[r["key"]]["tps"]):
            best[r["key"]] = r

    def tps(*key):
        return best[key]["tps"] if key in best else None

    def ratio(a, b=1.0, spec=".2f"):
        return format(a / b, spec) if a and b else "-"

    def acc(*key):
        r = best.get(key)
        return f"{r['accepted'] / r['drafted']:.0%}" if r and r.get("drafted") else "-"

    table(["prompt (tokens)", "specli --target-only", "native plain", "llama-bench -d", "specli / llama-bench", "specli / native plain"],
          [[f"{p} ({depth[p]})", *[ratio(tps("gemma", p, c), spec=".1f") for c in ("specli plain", "native plain", "llama-bench")],
            ratio(tps("gemma", p, "specli plain"), tps("gemma", p, "llama-bench")), ratio(tps("gemma", p, "specli plain"), tps("gemma", p, "native plain"))] for p in texts],
          title=f"Plain decoding, Gemma 3 270M Q4_K_M, {m} tokens, -t {t}, best of {args.rounds} round(s), tok/s")
    rows = []
    for label in [p for p in args.pairs.split(",") if p]:
        at = (label, name)
        sp = {c: (tps(*at, c) or 0) / (tps(*at, "specli plain") or float("inf")) for c in (f"specli N={n}", "specli auto")}
        nat = {c: (tps(*at, c) or 0) / (tps(*at, "native plain") or float("inf")) for c in (f"native N={n}", f"native p-min {P_MIN}")}
        rows.append([label, *[f"{v:.2f}x ({acc(*at, c)})" for c, v in {**sp, **nat}.items()],
                     ratio(sp[f"specli N={n}"], nat[f"native N={n}"]), ratio(sp["specli auto"], max(nat.values()))])
    table(["pair", f"specli N={n}", "specli auto", f"native n-max {n}", f"native p-min {P_MIN}", "ratio at N", "auto / best native"], rows,
          title=f"Draft models ({name}): speedup over each side's own plain decoding (acceptance)")
    for failure in failures:
        print(f"FAILED: {failure.splitlines()[0][:300]}")
    write_json(work / "yardstick.json", {"settings": vars(args), "runs": [{**r, "key": list(r["key"])} for r in results]})


# --- overhead ----------------------------------------------------------------------------------
def logit_pool(n_vocab: int, n_rows: int, seed: int = 0) -> np.ndarray:
    """Rows shaped like an LLM's: a gaussian body and a few tokens well above it; more of them
    than the CPU caches hold, as logits fresh from llama.cpp are."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((n_rows, n_vocab)) * 2.0).astype(np.float32)
    for row in rows:
        row[rng.integers(n_vocab, size=4)] += rng.uniform(4, 12, size=4).astype(np.float32)
    return rows


class FakeModel:
    """What the decoder and DraftModelDrafter use of LlamaModel; a context always gets the same
    row of the pool (plus the draft's noise). Time inside is counted in eval_s."""

    def __init__(self, pool: np.ndarray, noise: np.ndarray | None = None):
        self.pool, self.noise, self.n_vocab = pool, noise, pool.shape[1]
        self.n_ctx, self.n_batch, self.cached, self.synced_new, self.eval_s = 1 << 20, 512, [], 0, 0.0

    def eval(self, tokens, *, logits="last"):
        t0 = time.perf_counter()
        start = len(self.cached)
        self.cached.extend(tokens)
        n = {"all": len(tokens), "last": min(1, len(tokens)), "none": 0}[logits] if isinstance(logits, str) else logits
        out = np.empty((n, self.n_vocab), dtype=np.float32)
        for j in range(n):
            i = start + len(tokens) - n + j
            key = hash(tuple(self.cached[max(0, i - 2) : i + 1])) % self.pool.shape[0]
            out[j] = self.pool[key] + (0 if self.noise is None else self.noise[key % self.noise.shape[0]])
        self.eval_s += time.perf_counter() - t0
        return out

    def sync(self, context):
        common = next((i for i, (a, b) in enumerate(zip(self.cached, context)) if a != b), min(len(self.cached), len(context)))
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


def gemma_rows(n_rows: int) -> np.ndarray:
    """Real rows: Gemma 3 270M continuing five kinds of text at the default chain (a model's row
    holds more of its mass on its best few tokens than a synthetic one)."""
    from specli.decoding.sampling import SamplingParams, distribution, make_rng, sample
    from specli.llama.model import LlamaModel

    model, rng, rows = LlamaModel(models.gemma().target, n_ctx=1024), make_rng(0), []
    for prompt in ("def fibonacci(n):\n", "Once upon a time, in a village by the sea,", "Shopping list:\n1. eggs\n2. milk\n3.",
                   "The capital of France is Paris. The capital of Germany is", '{"name": "Alice", "age": 30, "city":'):
        model.truncate(0)
        context = model.tokenize(prompt)
        logits = model.eval(context)[-1]
        for _ in range(-(-n_rows // 5)):
            rows.append(np.array(logits))
            context.append(sample(distribution(logits, SamplingParams(), context), rng))
            logits = model.eval(context[-1:])[-1]
    return np.stack(rows[:n_rows])


def baseline_chain(src: str):
    """Another checkout's row function (`distribution`, or `probabilities` before it); SRC its src/."""
    spec = importlib.util.spec_from_file_location("baseline_sampling", f"{src}/specli/decoding/sampling.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    chain = getattr(module, "distribution", None) or module.probabilities
    return lambda row, params: chain(row, module.SamplingParams(**dataclasses.asdict(params)))


def overhead(args) -> None:
    from specli.decoding.drafters import DraftModelDrafter
    from specli.decoding.sampling import GREEDY, SamplingParams, distribution
    from specli.decoding.step import SpeculativeDecoder

    settings = {"default (k40 p0.95 m0.05 T0.8)": SamplingParams(), "min-p off": SamplingParams(min_p=0.0),
                "top-k off": SamplingParams(top_k=0), "greedy": GREEDY}
    chains = {"": distribution, **({", baseline": baseline_chain(args.baseline_src)} if args.baseline_src else {})}
    pools = [(v, logit_pool(v, args.rows)) for v in args.vocab] + ([("gemma", gemma_rows(args.gemma))] if args.gemma else [])
    row_ms: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        log(f"rows: round {r + 1}/{args.rounds}")
        for vocab, pool in pools:
            for (name, params), (version, chain) in ((s, c) for s in settings.items() for c in chains.items()):
                n = len(pool) if vocab == "gemma" else min(args.reps, 8 if name == "top-k off" else len(pool))
                t0 = time.perf_counter()
                for i in range(n):
                    chain(pool[i % len(pool)], params)
                row_ms.setdefault((vocab, name + version), []).append((time.perf_counter() - t0) / n * 1e3)
    step_ms: dict[tuple, list[float]] = {}
    for vocab in args.vocab:
        pool, noise = logit_pool(vocab, args.rows), (np.random.default_rng(1).standard_normal((8, vocab)) * 0.5).astype(np.float32)
        for r in range(args.rounds):
            log(f"steps: vocab {vocab}, round {r + 1}/{args.rounds}")
            for k, temp in ((k, t) for k in args.draft for t in args.temperature):
                target, draft = FakeModel(pool), FakeModel(pool, noise)
                sampling = GREEDY if temp == 0 else SamplingParams(temperature=temp, seed=r)
                steps = iter(generate(SpeculativeDecoder(target, DraftModelDrafter(draft), k, sampling), Request([1, 2, 3, 4], max_tokens=10**9)))
                next(steps)  # the first step does one-off work
                target.eval_s = draft.eval_s = 0.0
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    next(steps)
                host = time.perf_counter() - t0 - target.eval_s - draft.eval_s
                step_ms.setdefault((vocab, k, temp), []).append(host / args.steps * 1e3)

    def cell(ts):
        return f"{statistics.median(ts):.3f} [{min(ts):.3f} .. {max(ts):.3f}]"

    table(["vocab", "setting", "ms per row"], [[*k, cell(v)] for k, v in row_ms.items()], title="sampler chain, median [min .. max] over rounds")
    table(["vocab", "draft", "temperature", "host ms per step"], [[*k, cell(v)] for k, v in step_ms.items()],
          title="host work per step outside the passes")
    write_json(Path(args.out) / "host" / "overhead.json", {"rows": [[*k, v] for k, v in row_ms.items()], "steps": [[*k, v] for k, v in step_ms.items()]})


# --- profile -----------------------------------------------------------------------------------
def profile(args) -> None:
    import cProfile
    import pstats

    from specli.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
    from specli.decoding.step import SpeculativeDecoder
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend

    init_backend()
    path = models.gemma().target
    target, draft = (LlamaModel(path, n_ctx=4096, n_threads=args.threads) for _ in range(2))  # itself as draft: all accepted
    ids = target.tokenize((HERE.parent / "prompts" / "code-typehints.txt").read_text(encoding="utf-8"), add_bos=True)
    for label, drafter, n in (("target-only", None, 0), ("lookup -n 16", PromptLookupDrafter(), 16), ("lookup -n auto", PromptLookupDrafter(), "auto"),
                              ("draft model (itself) -n 4", DraftModelDrafter(draft), 4)):
        decoder = SpeculativeDecoder(target, drafter, n)
        generate(decoder, Request(ids, max_tokens=8)).run()  # warm-up
        prof = cProfile.Profile()
        gen = prof.runcall(lambda: generate(decoder, Request(ids, max_tokens=args.max_tokens)).run())  # noqa: B023 (called at once)
        own = {(f.split("/")[-1], name): tt for (f, _, name), (_, _, tt, _, _) in pstats.Stats(prof).stats.items()}
        decode = sum(tt for (_, name), tt in own.items() if name == "_decode_chunk") / (gen.stats.generation_s + gen.stats.prompt_s)
        print(f"{label}: {gen.stats.tokens_per_s:.1f} tok/s, {gen.stats.target_passes} target passes; llama_decode {decode:.1%} of the time")
        for (f, name), tt in sorted(((k, v) for k, v in own.items() if k[1] != "_decode_chunk"), key=lambda kv: -kv[1])[: args.top]:
            print(f"    {tt * 1000:7.1f} ms  {f}:{name}")


def add_arguments(ap) -> None:
    ap.add_argument("stage", choices=["yardstick", "overhead", "profile"])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (overhead: 5 is what section 7 used)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="code-typehints,story-retell,answer-passage", help="yardstick: benchmarks/prompts names")
    ap.add_argument("--pairs", default="a50,a70,a90", help="yardstick: synthetic pairs for the draft-model rows ('' for none)")
    ap.add_argument("--n", type=int, default=5, help="yardstick: the fixed draft length, both sides")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32_000, 131_072, 262_144], help="overhead")
    ap.add_argument("--draft", type=int, nargs="+", default=[1, 4, 8, 16], help="overhead: draft lengths")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8], help="overhead")
    ap.add_argument("--rows", type=int, default=64, help="overhead: distinct logit rows cycled (64 x 262k x 4 B = 64 MiB)")
    ap.add_argument("--reps", type=int, default=64, help="overhead: rows timed per setting per round")
    ap.add_argument("--steps", type=int, default=40, help="overhead: steps timed per cell per round")
    ap.add_argument("--gemma", type=int, default=0, metavar="N", help="overhead: also N real rows of Gemma")
    ap.add_argument("--baseline-src", metavar="SRC", help="overhead: also another checkout's sampler chain (its src/)")
    ap.add_argument("--top", type=int, default=6, help="profile: Python functions shown")
    ap.add_argument("--out", default=str(DEFAULT_OUT))


def main(args) -> int:
    {"yardstick": yardstick, "overhead": overhead, "profile": profile}[args.stage](args)
    return 0
