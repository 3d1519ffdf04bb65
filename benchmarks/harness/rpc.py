"""RPC: does speculation pay more as the network between this machine and the target's layers slows?

With the target's layers on RPC servers every target pass pays network round trips, and
verifying k drafted tokens costs about one pass, so the speedup over target-only decoding should
grow with the latency. All on this machine: --servers RPC servers on 127.0.0.1
(tests/fixtures/rpc.py: the RPC-enabled llama-cpp-python's own server, on the CPU), each behind a
TCP proxy in this process that holds every chunk it forwards, each way, for the delay D
(--delays ms; a request and its reply each pay D; chunks are pipelined: latency, not bandwidth;
'direct' = no proxy). The target's layers but --local-layers go to the servers; a draft model
stays local. Per delay and prompt, each a fresh greedy process, interleaved over --rounds:
  gemma  Gemma 3 270M Q4_K_M, `specli run --target-only` and `--lookup`
  a90    the synthetic pair a90, `specli run --target-only` and `-md DRAFT`; natively on the same
         split `llama-completion` (target only: its eval rate), `llama-speculative-simple` never
         drafting, and with `--spec-type draft-simple -devd none` (benchmarks/build_native.sh
         builds them with -DGGML_RPC=ON)
Draft length --draft-max on both sides. Per cell the median tok/s over prompts x rounds [range]
and the speedup over the same setup's target-only run of the same prompt and round (native: the
never-drafting one), and whether each text equals that run's (native: one a prefix of the
other: it overshoots -n). Under 64 tokens the first passes at each new batch size (extra RPC
round trips once per process) swamp the steady state: a smoke test, not a measurement.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import sys
import threading
from pathlib import Path

from harness import models, native, synthetic
from harness.common import DEFAULT_OUT, HERE, ROOT, log, table, write_json

CHUNK = 256 * 1024
BASELINE = {"specli lookup": "specli target-only", "specli draft": "specli target-only", "native draft": "native plain",
            "native completion": "native plain"}


class DelayProxies:
    """127.0.0.1:port_i -> 127.0.0.1:upstream_i, every chunk held `delay_s` each way (read when a
    chunk arrives: set it between runs). One asyncio loop in a background thread."""

    def __init__(self, upstream: list[int]):
        self.delay_s, self.holds = 0.0, {}  # delay -> each chunk's actual hold (s)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rpc-delay-proxy", daemon=True)
        self.thread.start()
        self.servers, self.writers = [], set()
        self.ports = [self._call(self._listen(up)) for up in upstream]

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
        for w in (client_w, up_w):  # ggml's RPC disables Nagle on both ends: so must the proxy
            self.writers.add(w)
            if (sock := w.get_extra_info("socket")) is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(self._pipe(client_r, up_w), self._pipe(up_r, client_w))
        finally:
            for w in (client_w, up_w):
                self.writers.discard(w)
                w.close()

    async def _pipe(self, reader, writer) -> None:
        """reader -> writer, each chunk written `delay` after it was read, in order, reading on meanwhile."""
        queue, loop = asyncio.Queue(), asyncio.get_running_loop()

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
                    if (wait := arrived + delay - loop.time()) > 0:
                        await asyncio.sleep(wait)
                    self.holds.setdefault(delay, []).append(loop.time() - arrived)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pump(), deliver())

    def close(self) -> None:
        async def shutdown() -> None:
            for s in self.servers:
                s.close()
            for w in list(self.writers):
                w.close()

        try:
            self._call(shutdown(), timeout=5)
        except Exception:  # noqa: BLE001  (closing: nothing left to save)
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def layers(path: Path) -> int:
    from specli.gguf import read_gguf_metadata

    meta = read_gguf_metadata(path)
    return int(meta[f"{meta['general.architecture']}.block_count"])


def plan(args, setups: dict, endpoints: dict[str, str], texts: dict, files: dict) -> list[native.Job]:
    m, t, c = args.max_tokens, args.threads, args.ctx
    jobs = []
    for delay in args.delays:
        rpc = ["--rpc", endpoints[delay]]
        for name in texts:
            for setup, pair in setups.items():
                at, ngl = (delay, setup, name), ["-ngl", str(max(layers(pair.target) - args.local_layers, 0))]
                spec = ["--lookup"] if pair.draft is None else ["-md", str(pair.draft)]
                for config, mode in (("specli target-only", ["--target-only"]), (f"specli {'lookup' if pair.draft is None else 'draft'}",
                                                                               [*spec, "--draft-max", str(args.draft_max)])):
                    jobs.append(native.Job((*at, config), "specli", native.specli_run_cmd(pair.target, *mode, *ngl, *rpc, prompt=texts[name],
                                                                                          max_tokens=m, threads=t, ctx=c)))
                if pair.draft is None:
                    continue
                common = [*ngl, "-fit", "off", *rpc]
                if "completion" in args.native:
                    jobs.append(native.Job((*at, "native completion"), "completion", [
                        str(native.binary("llama-completion")), "-m", str(pair.target), "-f", str(files[name]), "-n", str(m), "--temp", "0",
                        "-t", str(t), "-c", str(c), *common, "-no-cnv", "--no-display-prompt"]))
                for kind, spec_args in (("plain", native.NATIVE_PLAIN), ("draft", ["-md", str(pair.draft), "--spec-type", "draft-simple",
                                        "--spec-draft-n-max", str(args.draft_max), "-devd", "none"])):
                    if kind in args.native:
                        jobs.append(native.Job((*at, f"native {kind}"), "spec-simple", native.spec_simple_cmd(
                            pair.target, *spec_args, *common, prompt_file=files[name], max_tokens=m, threads=t, ctx=c), texts[name], m))
    return jobs


def report(results: list[dict], args) -> dict:
    by: dict[tuple, list[dict]] = {}
    for r in results:
        by.setdefault((r["key"][0], r["key"][1], r["key"][3]), []).append(r)
    rows, growth = [], {}
    for (delay, setup, config), rs in by.items():
        base = {(b["key"][2], b["round"]): b for b in by.get((delay, setup, BASELINE.get(config)), [])}
        ratios, same = [], []
        for r in rs:
            if (b := base.get((r["key"][2], r["round"]))) and r["tps"] and b["tps"]:
                ratios.append(r["tps"] / b["tps"])
                if r.get("text") is None or b.get("text") is None:
                    continue
                a, c = r["text"].rstrip(), b["text"].rstrip()
                same.append(a == c or (config.startswith("native") and (a.startswith(c) or c.startswith(a))))
        tps = [r["tps"] for r in rs if r["tps"]]
        drafted = sum(r.get("drafted") or 0 for r in rs)
        rows.append([delay if delay == "direct" else f"{delay} ms", setup, config, cell(tps, ".1f"), cell(ratios, ".2f"),
                     f"{sum(r['accepted'] for r in rs) / drafted:.0%}" if drafted else "-",
                     ("=" if all(same) else f"{same.count(False)} differ") if same else ""])
        if ratios and config != "native completion":
            growth.setdefault(f"{setup} {config}", []).append((delay, statistics.median(ratios)))
    table(["delay", "setup", "configuration", "tok/s, median [range]", "x target-only", "accepted", "text"], rows,
          title=f"over {args.servers} RPC servers behind a delaying proxy, {args.max_tokens} tokens, greedy, -t {args.threads}, "
          f"draft length {args.draft_max}, {args.local_layers} target layers local, {args.rounds} round(s)")
    for name, points in growth.items():
        vals = [v for _, v in points]
        print(f"{name}: " + ", ".join(f"{d}: {v:.2f}x" for d, v in points) + ("  (grows)" if all(b > a for a, b in zip(vals, vals[1:])) else ""))
    return growth


def cell(xs: list[float], fmt: str) -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]" if xs else "-"


def add_arguments(ap) -> None:
    ap.add_argument("--delays", default="0,1,5,20", help="ms held each way, comma list; 'direct' = no proxy")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="the client process's threads")
    ap.add_argument("--local-layers", type=int, default=2, help="target layers kept on this machine")
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prompts", default="code-rename,list-checklist,story-retell", help="benchmarks/prompts names")
    ap.add_argument("--setups", default="gemma,a90")
    ap.add_argument("--native", default="completion,plain,draft", help="native runs on a90 ('' for none)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))


def main(args) -> int:
    import llama_cpp

    if not llama_cpp.llama_supports_rpc():
        raise SystemExit("this llama-cpp-python has no RPC backend: docs/rpc.md (CMAKE_ARGS=\"-DGGML_RPC=on\" pip install ...)")
    args.delays, args.native = args.delays.split(","), [k for k in args.native.split(",") if k]
    setups = {s: models.gemma() if s == "gemma" else synthetic.cost_pair(s) for s in args.setups.split(",")}
    texts = {n: (HERE.parent / "prompts" / f"{n}.txt").read_text(encoding="utf-8") for n in args.prompts.split(",")}
    work = Path(args.out) / "rpc"
    files = {n: native.prompt_file(work / "prompts", n, text) for n, text in texts.items()}
    sys.path.insert(0, str(ROOT / "tests"))  # the fixtures package
    from fixtures.rpc import rpc_servers

    proxies = None
    try:
        with rpc_servers(args.servers, threads=args.server_threads, log_dir=work) as servers:
            direct = [endpoint for endpoint, _ in servers]
            proxies = DelayProxies([int(e.rpartition(":")[2]) for e in direct])
            endpoints = {d: ",".join(direct) if d == "direct" else ",".join(f"127.0.0.1:{p}" for p in proxies.ports) for d in args.delays}
            log(f"servers {', '.join(direct)}; proxies on {proxies.ports}")
            jobs = plan(args, setups, endpoints, texts, files)
            for job in {j.key[1]: j for j in jobs if j.key[3] == "specli target-only"}.values():  # warm-up, not measured
                native.execute(native.Job(job.key, "specli", [*job.cmd[:-1], "Hello"]))

            def delay(job: native.Job) -> None:
                proxies.delay_s = 0.0 if job.key[0] == "direct" else float(job.key[0]) / 1000

            results, failures = native.rounds(jobs, args.rounds, before=delay)
    finally:
        if proxies is not None:
            proxies.close()
    growth = report(results, args)
    held = {d: statistics.median(h) for d, h in proxies.holds.items() if h}
    print("achieved hold per chunk (median): " + ", ".join(f"{d * 1000:g} ms: {h * 1000:.2f} ms" for d, h in sorted(held.items())))
    for failure in failures:
        print(f"FAILED: {failure.splitlines()[0][:300]}")
    write_json(work / "rpc.json", {"settings": vars(args), "growth": growth, "failures": failures, "held_median_s": held,
                                    "runs": [{**r, "key": list(r["key"])} for r in results]})
    return 1 if failures else 0
