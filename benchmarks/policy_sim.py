#!/usr/bin/env python3
"""`-n auto`'s choices on a simulated clock: tok/s that depend only on the drafts chosen.

On this machine two runs of the same configuration differ by 5-10%, more than most changes to
the policy are worth, so `specli bench` cannot tell such changes apart. Here every model pass is
charged the time a pass of its size takes (measured once at start: the median of 5 timings per
size, the draft model's scaled by --draft-scale to its cost inside the loop), the policy and the
drafters read that simulated clock, and tok/s = tokens / simulated seconds. The text is the real
one (greedy decoding through the real engine, models and drafters); only the clock is modelled,
so one run prints noise-free ratios: auto against each fixed N on the seven bench scenarios.

Left out on purpose: specli's own Python time (profile_loop.py measures it) and the slowdown of
a target pass right after a draft pass (--after-draft adds it). --noise gives the policy's
clock a slow drift and jitter like a shared machine's, while tok/s still counts the true costs:
how much a noisy clock costs the choices.

Usage:
  python benchmarks/policy_sim.py --pair /tmp/specli-cost-pairs/a70 [--ns 3,5,8] [--noise 0.1]
  python benchmarks/policy_sim.py --lookup                # Gemma 3 270M with prompt lookup
  ... --costs a70-costs.json   # measure once, then compare policy changes on the same costs
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Sequence

from bench_lookup import default_model

import specli.decoding.drafters as drafters_module
import specli.decoding.engine as engine_module
from specli.session.bench import BUILTIN_PROMPTS, token_budget
from specli.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specli.decoding.engine import SpeculativeDecoder
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.modes import DraftLength

LONGEST = 70  # pass sizes measured; longer passes are charged proportionally


def pass_times(model: LlamaModel, depth: int = 200) -> list[float]:
    """[0, T(1), ..., T(LONGEST)]: median seconds of a pass over n tokens at `depth`, made
    non-decreasing (a dip is noise)."""
    context = model.tokenize("hello world " * depth, add_bos=True)[:depth]
    model.reset()
    model.eval(context, logits="none")
    samples: dict[int, list[float]] = {n: [] for n in range(1, LONGEST + 1)}
    for _ in range(5):
        for n in samples:
            t0 = time.perf_counter()
            model.eval(context[5 : 5 + n], logits="all")
            samples[n].append(time.perf_counter() - t0)
            model.truncate(depth)
    model.reset()
    out = [0.0]
    for n in range(1, LONGEST + 1):
        out.append(max(sorted(samples[n])[2], out[-1]))
    return out


class SimulatedClock:
    """Charges each model pass its tabled time; `now` is what the engine and drafters read."""

    def __init__(self, noise: float, after_draft_s: float, reuse_saving_s: dict[str, float] | None = None):
        self.now = 0.0  # the clock the policy sees (with --noise)
        self.true_s = 0.0  # what the passes of the current generation really cost
        self.noise = noise
        self.after_draft_s = after_draft_s
        self.rng = random.Random(0)
        self._drift = 0.0
        self._last = ""
        self.reuse_saving_s = reuse_saving_s or {}
        self._previous_size: dict[str, int] = {}  # per model: the size of its last pass
        self.counting = True  # False while a drafter takes in the prompt

    def reseed(self, key: str) -> None:
        self.rng.seed(key)
        self._drift = 0.0
        self.true_s = 0.0

    def charge(self, seconds: float, who: str, n_tokens: int = 0) -> None:
        if n_tokens and self._previous_size.get(who) == n_tokens:
            # llama.cpp reuses the previous pass's compute graph when the shape is the same.
            seconds = max(seconds - self.reuse_saving_s.get(who, 0.0), 0.0)
        self._previous_size[who] = n_tokens
        if who == "target" and self._last == "draft":
            seconds += self.after_draft_s
        self._last = who
        if self.counting:
            self.true_s += seconds
        seen = seconds
        if self.noise:
            # A slow drift (other tenants) with a small jitter and rare spikes.
            self._drift = 0.995 * self._drift + self.rng.gauss(0, self.noise * math.sqrt(1 - 0.995**2))
            seen *= math.exp(self._drift + abs(self.rng.gauss(0, 0.04))) * (1.5 if self.rng.random() < 0.01 else 1.0)
        self.now += seen

    def install(self, model: LlamaModel, table: Sequence[float], who: str, scale: float = 1.0) -> None:
        real_eval = model.eval

        def timed_eval(tokens, *, logits="last"):
            n = len(tokens)
            if n and logits != "none":  # logits="none" is the prompt, outside generation time
                seconds = table[min(n, LONGEST)] * (n / LONGEST if n > LONGEST else 1.0) * scale
                self.charge(seconds, who, n)
            return real_eval(tokens, logits=logits)

        model.eval = timed_eval  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, help="a folder from make_cost_pairs.py (*target*.gguf, *draft*.gguf)")
    parser.add_argument("--lookup", action="store_true", help="Gemma 3 270M with prompt lookup instead")
    parser.add_argument("--ns", default="2,3,5,8,12", help="fixed N to compare with (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeat", type=int, default=1, help="rounds (useful with --noise or a temperature)")
    parser.add_argument("--noise", type=float, default=0.0, help="drift of the policy's clock (0.1 = 10%%)")
    parser.add_argument("--draft-scale", type=float, default=0.55,
                        help="draft pass cost in the loop / in isolation (0.55 measured on the synthetic pairs)")
    parser.add_argument("--after-draft", type=float, default=0.0, help="ms added to a target pass after a draft pass")
    parser.add_argument("--reuse-saving", default="0,0", metavar="TARGET_MS,DRAFT_MS",
                        help="what a pass of the same size as the model's previous one saves (llama.cpp reuses its "
                        "compute graph; the pass times are measured without that); a70 target 0.37, draft 0.06")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--costs", type=Path, help="JSON file of pass times: read if it exists, else measured and written "
                        "(the same costs for runs that compare versions of the policy)")  # fmt: skip
    args = parser.parse_args()
    if not args.lookup and args.pair is None:
        parser.error("give --pair DIR or --lookup")
    init_backend()
    if args.lookup:
        target, draft = LlamaModel(default_model(), n_ctx=4096, n_threads=args.threads), None
    else:
        target = LlamaModel(next(args.pair.glob("*target*.gguf")), n_ctx=4096, n_threads=args.threads)
        draft = LlamaModel(next(args.pair.glob("*draft*.gguf")), n_ctx=4096, n_threads=args.threads)
    if args.costs is not None and args.costs.exists():
        tables = json.loads(args.costs.read_text())
    else:
        print("measuring pass times ...", file=sys.stderr)
        tables = {"target": pass_times(target), "draft": pass_times(draft) if draft is not None else None}
        if args.costs is not None:
            args.costs.write_text(json.dumps(tables))
    saving_tgt, saving_dft = (float(x) / 1000 for x in args.reuse_saving.split(","))
    clock = SimulatedClock(args.noise, args.after_draft / 1000, {"target": saving_tgt, "draft": saving_dft})
    clock.install(target, tables["target"], "target")
    if draft is not None:
        clock.install(draft, tables["draft"], "draft", args.draft_scale)
        real_begin = DraftModelDrafter.begin

        def begin(self, *a, **k):  # the drafter's prompt pass is not generation time
            clock.counting = False
            try:
                return real_begin(self, *a, **k)
            finally:
                clock.counting = True

        DraftModelDrafter.begin = begin  # type: ignore[method-assign]
    # (no CPU time on a simulated clock: the policy sees no contention)
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock.now, process_time=lambda: 0.0)
    engine_module.time = fake_time  # type: ignore[attr-defined]
    drafters_module.time = fake_time  # type: ignore[attr-defined]

    def make_drafter():
        return PromptLookupDrafter() if draft is None else DraftModelDrafter(draft)

    sampling = GREEDY if args.temperature == 0 else SamplingParams(temperature=args.temperature, seed=0)
    configs: dict[str, SpeculativeDecoder] = {"plain": SpeculativeDecoder(target, None, 0, sampling)}
    configs["auto"] = SpeculativeDecoder(target, make_drafter(), DraftLength.auto(), sampling)
    for n in args.ns.split(","):
        configs[f"N={n}"] = SpeculativeDecoder(target, make_drafter(), int(n), sampling)
    rates: dict[tuple[str, str], list[float]] = {}
    drafts: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(args.repeat):
        for prompt in BUILTIN_PROMPTS:
            ids = target.tokenize(prompt.text, add_bos=True)
            for name, decoder in configs.items():
                if not sampling.greedy:
                    decoder.sampling = SamplingParams(temperature=args.temperature, seed=round_)
                clock.reseed(f"{prompt.name}/{round_}")
                gen = decoder.generate(ids, max_tokens=token_budget(prompt, args.max_tokens)).run()
                rates.setdefault((prompt.name, name), []).append(len(gen.token_ids) / clock.true_s)
                drafts[name].append(gen.stats.mean_draft_length or 0.0)
    names = list(configs)
    fixed = [n for n in names if n.startswith("N=")]
    print(f"{'scenario':18}" + "".join(f"{n:>8}" for n in names) + "   auto / best fixed")
    speedups: dict[str, list[float]] = {n: [] for n in names}
    worst = 9.0
    for prompt in BUILTIN_PROMPTS:
        mean = {n: sum(rates[(prompt.name, n)]) / args.repeat for n in names}
        best = max(mean[n] for n in fixed)
        worst = min(worst, mean["auto"] / best)
        for n in names:
            speedups[n].append(mean[n] / mean["plain"])
        print(f"{prompt.scenario:18}" + "".join(f"{mean[n] / mean['plain']:7.2f}x" for n in names)
              + f"   {mean['auto'] / best:.2f}")  # fmt: skip
    print(f"{'geometric mean':18}" + "".join(f"{statistics.geometric_mean(speedups[n]):7.2f}x" for n in names))
    print(f"{'drafts per pass':18}" + "".join(f"{sum(drafts[n]) / len(drafts[n]):8.1f}" for n in names))
    print(f"auto: {worst:.2f} of the best fixed N in its worst scenario")
    return 0


if __name__ == "__main__":
    sys.exit(main())
