"""specli serve against llama-server: plain, prompt lookup and a draft model, one and several clients.

Both servers on 127.0.0.1 with the same model, threads and context per sequence, asked the same
requests through the openai client, greedy: the real Qwen2.5-Coder pair by default (chat
completions, benchmarks/texts as user turns), or --model gemma (raw completions of
benchmarks/prompts; no draft model). Modes, specli against llama-server:
  plain   --target-only              no speculation
  lookup  --lookup (--draft-max auto) --spec-type ngram-simple (its defaults: key 12, draft 48)
  draft   -md D (--draft-max auto)   -md D --spec-type draft-simple (--spec-draft-n-max
                                     --native-draft-max, else its default 3; it has no auto)
Per mode and slot count P = min(clients, --max-parallel) both servers are up at once (specli
--parallel P, llama-server -np P with P x the context, which it splits over its slots) and warmed
up; each of --rounds rounds sends each the same requests, the order alternating. Figures: tok/s
per request (one client: completion tokens / request wall time, the prompt included), time to
first text (streamed), aggregate tok/s with C clients (all their tokens / wall time, --requests
each); per cell the median [min-max] over rounds, and specli / llama-server over the per-round
ratios. Each request's text starts with a tag of its own, the same on both sides, so no prompt
cache skips a prefill on one side only (llama-server also gets cache_prompt false, --cache-ram 0).
The one-client greedy texts are compared token for token (llama-server's /tokenize).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import models, native, prompts
from harness.common import DEFAULT_OUT, HERE, log, table, write_json

MODES = ("plain", "lookup", "draft")
SIDES = ("specli", "llama-server")


def spec_args(mode: str, pair: models.Pair, args) -> dict[str, list[str]]:
    if mode == "plain":
        return {"specli": ["--target-only"], "llama-server": []}
    if mode == "lookup":
        return {"specli": ["--lookup"], "llama-server": ["--spec-type", "ngram-simple"]}
    n_max = ["--spec-draft-n-max", str(args.native_draft_max)] if args.native_draft_max else []
    return {"specli": ["-md", str(pair.draft)], "llama-server": ["-md", str(pair.draft), "--spec-type", "draft-simple", *n_max]}


def ask(srv: native.Server, text: str, tag: str, args, chat: bool, stream: bool = False) -> dict:
    extra = {"cache_prompt": False} if srv.label.startswith("llama-server") else {}
    return srv.complete(f"[{tag}]\n{text}", 8 if stream else args.max_tokens, chat=chat, stream=stream, **extra)


def one_client(srv: native.Server, texts: dict[str, str], rnd: int, args, chat: bool) -> tuple[dict, dict]:
    done = {name: ask(srv, text, f"{rnd}.{name}", args, chat) for name, text in texts.items()}
    ttft = [ask(srv, text, f"{rnd}.t.{name}", args, chat, stream=True)["ttft_s"] or float("nan") for name, text in texts.items()]
    figures = {"tok/s per request": statistics.median(r["tokens"] / r["wall_s"] for r in done.values()),
               "TTFT ms": 1000 * statistics.median(ttft),
               "aggregate tok/s": sum(r["tokens"] for r in done.values()) / sum(r["wall_s"] for r in done.values())}
    return figures, done


def many_clients(srv: native.Server, texts: list[str], clients: int, rnd: int, args, chat: bool) -> float:
    """All completion tokens / wall time, `clients` threads each sending --requests requests in turn."""
    start = threading.Barrier(clients + 1)

    def client(i: int) -> int:
        start.wait()
        return sum(ask(srv, texts[(i * args.requests + j) % len(texts)], f"{rnd}.c{clients}.{i}.{j}", args, chat)["tokens"]
                   for j in range(args.requests))

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, i) for i in range(clients)]
        start.wait()
        t0 = time.perf_counter()
        tokens = sum(f.result() for f in futures)
    return tokens / (time.perf_counter() - t0)


def same_tokens(tokenizer: native.Server, a: str, b: str) -> int | None:
    """None where the texts are the same tokens, else the index of the first that differs."""
    ta, tb = (tokenizer.post("/tokenize", {"content": t})["tokens"] for t in (a, b))
    return None if ta == tb else next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))


def run_group(mode, pair, parallel, clients, texts, args, chat, cells, record) -> None:
    with contextlib.ExitStack() as stack:
        cmds = {"specli": native.specli_serve_cmd(pair.target, *spec_args(mode, pair, args)["specli"], threads=args.threads,
                                                  ctx=args.ctx, parallel=parallel),
                "llama-server": [*native.llama_server_cmd(pair.target, *spec_args(mode, pair, args)["llama-server"], threads=args.threads,
                                                          ctx=args.ctx, parallel=parallel), "--cache-ram", "0"]}
        servers = {side: stack.enter_context(native.serving(cmd, f"{side}-{mode}-p{parallel}", Path(args.out) / "serve" / "logs"))
                   for side, cmd in cmds.items() if args.only in ("both", side)}
        for srv in servers.values():
            ask(srv, next(iter(texts.values())), "warm-up", args, chat)
        for rnd in range(args.rounds):
            for side in list(servers)[:: 1 if rnd % 2 == 0 else -1]:
                for c in clients:
                    log(f"[{mode}, {parallel} slot(s)] round {rnd + 1}/{args.rounds} {side}: {c} client(s)")
                    if c > 1:
                        cells.setdefault((mode, "aggregate tok/s", c), {}).setdefault(side, []).append(
                            many_clients(servers[side], list(texts.values()), c, rnd, args, chat))
                        continue
                    figures, done = one_client(servers[side], texts, rnd, args, chat)
                    for figure, value in figures.items():
                        cells.setdefault((mode, figure, 1), {}).setdefault(side, []).append(value)
                    if rnd == 0:
                        record[(mode, side)] = done
        if len(servers) == 2 and 1 in clients:
            a, b = record[(mode, "specli")], record[(mode, "llama-server")]
            record[(mode, "parted")] = {name: same_tokens(servers["llama-server"], a[name]["text"], b[name]["text"]) for name in a}


def cell(values: list[float] | None, fmt: str = ".1f") -> str:
    if not values:
        return "-"
    med = format(statistics.median(values), fmt)
    return med if len(values) == 1 else f"{med} [{min(values):{fmt}}-{max(values):{fmt}}]"


def add_arguments(ap) -> None:
    ap.add_argument("--model", default="qwen", help="qwen (the real pair; chat completions) or gemma (raw completions)")
    ap.add_argument("--modes", default="plain,lookup,draft", help="comma list of plain, lookup, draft")
    ap.add_argument("--clients", default="1,4", help="comma list of client counts (default 1,4)")
    ap.add_argument("--max-parallel", type=int, default=4, help="slots at most: --parallel / -np = min(clients, this)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2, help="requests per client with several clients")
    ap.add_argument("--prompts", type=int, default=6, help="the first N prompts (0: all)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048, help="context per sequence")
    ap.add_argument("--native-draft-max", type=int, help="llama-server -md's --spec-draft-n-max (default its own, 3)")
    ap.add_argument("--only", choices=["both", *SIDES], default="both")
    ap.add_argument("--out", default=str(DEFAULT_OUT))


def main(args) -> int:
    pair = models.by_name(args.model)
    items = prompts.folder(HERE.parent / ("texts" if pair.chat else "prompts"), chat=pair.chat)[: args.prompts or None]
    texts = {i.id: i.messages[0]["content"] if pair.chat else i.prompt for i in items}
    modes = [m for m in args.modes.split(",") if m != "draft" or pair.draft is not None]
    clients = sorted({int(c) for c in args.clients.split(",")})
    cells: dict = {}
    record: dict = {}
    t0 = time.perf_counter()
    for mode in modes:
        groups: dict[int, list[int]] = {}
        for c in clients:
            groups.setdefault(min(c, args.max_parallel), []).append(c)
        for parallel, group in sorted(groups.items()):
            run_group(mode, pair, parallel, group, texts, args, pair.chat, cells, record)
    rows = []
    for (mode, figure, c), sides in cells.items():
        mine, theirs = sides.get("specli"), sides.get("llama-server")
        ratios = [a / b for a, b in zip(mine, theirs) if b] if mine and theirs else None
        rows.append([mode, figure, c, min(c, args.max_parallel), cell(mine, ".0f" if "TTFT" in figure else ".1f"),
                     cell(theirs, ".0f" if "TTFT" in figure else ".1f"), cell(ratios, ".2f")])
    table(["mode", "figure", "clients", "slots", "specli", "llama-server", "specli / llama-server"], rows,
          title=f"specli serve vs llama-server, {pair.name}, {args.max_tokens} tokens, -t {args.threads}, ctx {args.ctx} "
          f"per sequence, {args.rounds} round(s): median [min-max] (TTFT: lower is better)")
    for mode in modes:
        if (mode, "parted") in record:
            parted = {name: at for name, at in record[(mode, "parted")].items() if at is not None}
            print(f"{mode}: greedy texts the same tokens on both sides: {len(record[(mode, 'parted')]) - len(parted)}/"
                  f"{len(record[(mode, 'parted')])}" + "".join(f"; {n} parts at token {at}" for n, at in parted.items()))
        for side in SIDES:
            done = record.get((mode, side), {}).values()
            drafted, accepted = sum(r["drafted"] for r in done), sum(r["accepted"] for r in done)
            if drafted:
                print(f"{mode}: {side} accepted {accepted}/{drafted} drafted tokens ({accepted / drafted:.0%}), one client")
    path = write_json(Path(args.out) / "serve" / f"serve-{pair.name}.json",
                      {"settings": vars(args), "cells": [[*k, v] for k, v in cells.items()],
                       "texts": {f"{m}|{s}": v for (m, s), v in record.items()}})
    log(f"{time.perf_counter() - t0:.0f} s; results: {path}")
    return 0
