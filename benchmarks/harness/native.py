"""Processes: the one place that starts and stops servers (`specli serve`, native llama.cpp's
`llama-server`; RPC servers come from tests/fixtures/rpc.py), runs the one-shot tools (`specli
run`, `llama-speculative-simple`, `llama-bench`, `llama-completion`) and reads their output,
and runs such jobs in interleaved rounds. benchmarks/build_native.sh builds the native tools
from the llama.cpp that llama-cpp-python vendors.

    with native.serving(native.llama_server_cmd(target, "--spec-type", "ngram-mod"), "native", work) as srv:
        data = srv.post("/infill", body)          # or srv.complete(prompt, 64): the openai client

A server listens on a free 127.0.0.1 port, is ready once GET /health answers 200, and is always
stopped (SIGTERM, then SIGKILL). `Server.post` times nothing; `Server.complete` times its request.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from harness.common import log

NATIVE_BIN = Path(os.environ.get("LLAMA_CPP_BIN", "/tmp/specli-native/src/vendor/llama.cpp/build/bin"))
READY_TIMEOUT_S = 300.0  # a 1.5B model loading on a busy 2-core machine
REQUEST_TIMEOUT_S = 900.0
PORT = "{port}"  # the placeholder a command line gets its port through
NO_DRAFT_KEY = 1024  # an ngram-simple key longer than any context: llama-speculative-simple never drafts
NATIVE_PLAIN = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_DRAFT_KEY), "--spec-ngram-simple-size-m", "1")


class ServerError(RuntimeError):
    """A server or tool that did not start, died, failed or printed what could not be read: one line."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specli_cmd() -> list[str]:
    """`specli` as installed, else this Python's `-m specli`."""
    exe = shutil.which("specli")
    return [exe] if exe else [sys.executable, "-m", "specli"]


def binary(name: str, native_bin: Path = NATIVE_BIN) -> Path:
    """A native tool, or ServerError saying how to build it."""
    path = Path(native_bin) / name
    if not os.access(path, os.X_OK):
        raise ServerError(f"no {name} in {native_bin}: build it with benchmarks/build_native.sh (or set LLAMA_CPP_BIN)")
    return path


def specli_serve_cmd(target: Path, *args: str, threads: int = 2, ctx: int = 4096, parallel: int = 1) -> list[str]:
    """`specli serve` on `target` with `args` (its drafting options), `parallel` slots of `ctx` each."""
    return [*specli_cmd(), "serve", "-m", str(target), *args, "-c", str(ctx), "--threads", str(threads),
            "--parallel", str(parallel), "--host", "127.0.0.1", "--port", PORT]


def llama_server_cmd(target: Path, *args: str, threads: int = 2, ctx: int = 4096, parallel: int = 1,
                     native_bin: Path = NATIVE_BIN) -> list[str]:
    """`llama-server` on `target` with `args` (its speculative options); it splits -c over its
    slots, so it gets parallel x ctx: each slot then has specli's per-sequence context."""
    return [str(binary("llama-server", native_bin)), "-m", str(target), *args, "-c", str(ctx * parallel), "-np", str(parallel),
            "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", PORT]


class Server:
    """One server process. `cmd` holds PORT where the port goes; `label` names it in logs and
    errors; its stdout and stderr go to `log_path` (the command line first)."""

    def __init__(self, cmd: Sequence[str], label: str, log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.cmd = [part.replace(PORT, str(self.port)) for part in cmd]
        self.label, self.log_path, self.env = label, Path(log_path), env
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.model_id = ""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = READY_TIMEOUT_S) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self._log.write((" ".join(self.cmd) + "\n\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
        deadline = time.monotonic() + timeout
        while True:  # GET /health until 200 (both answer 503, or refuse, while loading)
            if self.proc.poll() is not None:
                raise ServerError(f"{self.label} exited with code {self.proc.returncode} before it was ready; "
                                  f"its log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise ServerError(f"{self.label} not ready after {timeout:.0f} s; its log: {self.log_path}")
            time.sleep(0.25)
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
            with urllib.request.urlopen(self.base + "/v1/models", timeout=30) as r:
                self.model_id = json.load(r)["data"][0]["id"]
        return self

    def post(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        """POST a JSON body, the JSON answer back; ServerError (status and body) otherwise."""
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.label}: HTTP {e.code} from {path}: {e.read()[:500]!r}") from None

    def complete(self, prompt: str, max_tokens: int, *, chat: bool = False, stream: bool = False, **extra) -> dict:
        """One greedy request through the openai client, as an application sends it: /v1/completions,
        or /v1/chat/completions with `chat` (`prompt` the user's turn); `extra` goes in the body.
        Streamed, the time to the first text (the stream read to its end); else the text, token
        counts and the server's `timings` (drafted, accepted, prompt and generation ms)."""
        import openai

        client = openai.OpenAI(base_url=self.base + "/v1", api_key="-", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        kw = dict(model=self.model_id or "default", max_tokens=max_tokens, temperature=0, stream=stream, extra_body=extra or None)
        t0 = time.perf_counter()
        try:
            if chat:
                out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
            else:
                out = client.completions.create(prompt=prompt, **kw)
            if stream:
                first = None
                for chunk in out:
                    c = chunk.choices[0] if chunk.choices else None
                    if first is None and c is not None and ((c.delta.content if chat else c.text) or ""):
                        first = time.perf_counter() - t0
                return {"ttft_s": first}
        except openai.APIError as err:
            raise ServerError(f"{self.label}: {err}") from None
        wall, d = time.perf_counter() - t0, out.model_dump()
        t, choice = d.get("timings") or {}, d["choices"][0]
        tokens, accepted = d["usage"]["completion_tokens"], int(t.get("draft_n_accepted") or 0)
        return {"text": choice["message"]["content"] if chat else choice["text"], "tokens": tokens, "accepted": accepted,
                "drafted": int(t.get("draft_n") or 0), "passes": tokens - accepted, "cache_n": int(t.get("cache_n") or 0),
                "prompt_ms": float(t.get("prompt_ms") or 0), "predicted_ms": float(t.get("predicted_ms") or 0),
                "speculative": d.get("speculative"), "finish": choice.get("finish_reason"), "wall_s": wall}

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
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def serving(cmd: Sequence[str], label: str, work: Path, env: dict | None = None, *, fresh_cache: bool = True) -> Iterator[Server]:
    """A started server, stopped on the way out whatever happened. A specli server gets a cache
    folder of its own (`fresh_cache`): nothing another run measured steers `--draft-max auto`."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    if fresh_cache and env is None:
        env = dict(os.environ, SPECLI_CACHE_DIR=tempfile.mkdtemp(prefix="cache-", dir=work))
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in label)
    server = Server(cmd, label, work / f"{safe}.log", env)
    try:
        yield server.start()
    finally:
        server.stop()


def timed(fn: Callable[[], dict]) -> tuple[dict, float]:
    """fn()'s answer and the wall seconds it took."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# --- one-shot tools ----------------------------------------------------------------------------
def specli_run_cmd(model: Path, *mode: str, prompt: str, max_tokens: int, threads: int, ctx: int = 4096) -> list[str]:
    """`specli run`, greedy, its figures as JSON; `mode` its drafting options."""
    return [*specli_cmd(), "run", "-m", str(model), *mode, "--temperature", "0", "--json", "--quiet",
            "--max-tokens", str(max_tokens), "--threads", str(threads), "-c", str(ctx), prompt]


def spec_simple_cmd(model: Path, *spec: str, prompt_file: Path, max_tokens: int, threads: int, ctx: int = 4096,
                    native_bin: Path = NATIVE_BIN) -> list[str]:
    """`llama-speculative-simple`, greedy, asked for max_tokens + 1 with its debug log (-lv 5): it
    overshoots -n (its last pass verifies an untruncated draft), so its run is timed up to the
    first pass that reaches max_tokens, from the per-pass lines (`spec_simple_figures`)."""
    return [str(binary("llama-speculative-simple", native_bin)), "-m", str(model), *spec, "-f", str(prompt_file),
            "-n", str(max_tokens + 1), "--temp", "0", "-t", str(threads), "-c", str(ctx), "-lv", "5"]


def llama_bench_cmd(model: Path, *, max_tokens: int, threads: int, depth: int = 0, reps: int = 3, native_bin: Path = NATIVE_BIN) -> list[str]:
    """`llama-bench` text generation at context depth `depth` (attention over a longer context costs more)."""
    return [str(binary("llama-bench", native_bin)), "-m", str(model), "-p", "0", "-n", str(max_tokens), "-d", str(depth),
            "-t", str(threads), "-r", str(reps), "-o", "json"]


def prompt_file(folder: Path, name: str, text: str) -> Path:
    """`text` where a native tool reads it (-f), which drops one trailing newline: given one more."""
    path = Path(folder) / f"{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def _search(pattern: str, text: str, what: str) -> re.Match:
    m = re.search(pattern, text, re.MULTILINE)
    if m is None:
        raise ServerError(f"no {what} in the output:\n{text[-1500:]}")
    return m


TS = r"^(\d+)\.(\d+)\.(\d+)\.(\d+) "  # llama.cpp's log time stamp, minutes.seconds.millis.micros


def _log_time(m: re.Match) -> float:
    minutes, seconds, millis, micros = (int(g) for g in m.groups()[:4])
    return minutes * 60 + seconds + millis / 1e3 + micros / 1e6


def spec_simple_figures(err: str, max_tokens: int) -> dict:
    """Tokens, seconds, drafted, accepted and passes of llama-speculative-simple's log (-lv 5) up to
    the first pass that reaches max_tokens (each logs 'accepted A/D draft tokens' after emitting
    A + 1); the clock starts where its own does, at the 'decoded' line's time less its seconds."""
    dec = _search(TS + r"I decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err, "'decoded' line")
    start, cut = _log_time(dec) - float(dec.group(6)), _log_time(dec)
    tokens = drafted = accepted = passes = 0
    for m in re.finditer(TS + r"D accepted (\d+)/(\d+) draft tokens", err, re.MULTILINE):
        a, d = int(m.group(5)), int(m.group(6))
        tokens, drafted, accepted, passes, cut = tokens + a + 1, drafted + d, accepted + a, passes + 1, _log_time(m)
        if tokens >= max_tokens:
            break
    if passes == 0:
        raise ServerError(f"no per-pass 'accepted' lines (-lv 5):\n{err[-1500:]}")
    return {"tokens": tokens, "tps": tokens / (cut - start) if cut > start else None, "drafted": drafted, "accepted": accepted, "passes": passes}


def generated_text(stdout: str, prompt: str) -> str | None:
    """The continuation in a native tool's stdout, which echoes the prompt first."""
    at = stdout.rfind(prompt[-60:])
    return None if at < 0 else stdout[at + len(prompt[-60:]) :].removesuffix("\n\n")


@dataclass
class Job:
    """One process of a round: `key` names it in the results, `kind` says how to read it
    (specli, spec-simple, llama-bench, completion)."""

    key: tuple
    kind: str
    cmd: list[str]
    prompt: str = ""  # spec-simple: the prompt, to find the generated text after it
    max_tokens: int = 0  # spec-simple: where its run is cut
    env: dict = field(default_factory=dict)


def execute(job: Job) -> dict:
    """Run one job: its figures (tps, tokens, drafted, accepted, passes, text)."""
    with tempfile.TemporaryDirectory(prefix="specli-cache-") as cache:  # (specli: an empty policy cache each run)
        proc = subprocess.run(job.cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                              timeout=900, env={**os.environ, "SPECLI_CACHE_DIR": cache, **job.env})
    if proc.returncode != 0:
        raise ServerError(f"exit {proc.returncode}: {' '.join(job.cmd[:6])} ...\n{(proc.stderr or proc.stdout)[-1500:]}")
    if job.kind == "specli":
        out = json.loads(proc.stdout)
        st = out["stats"]
        return {"tps": st["tokens_per_s"], "tokens": out["n_tokens"], "decided": st["decided"], "drafted": st["drafted"],
                "accepted": st["accepted"], "passes": st["target_passes"], "text": out["text"]}
    if job.kind == "spec-simple":
        return {**spec_simple_figures(proc.stderr, job.max_tokens), "text": generated_text(proc.stdout, job.prompt)}
    if job.kind == "llama-bench":
        tg = next(r for r in json.loads(proc.stdout) if r["n_prompt"] == 0)
        return {"tps": tg["avg_ts"], "tokens": tg["n_gen"]}
    m = _search(r"eval time\s*=\s*[\d.]+ ms /\s*(\d+) runs.*?([\d.]+) tokens per second", proc.stderr, "'eval time' line")
    return {"tps": float(m.group(2)), "tokens": int(m.group(1))}  # llama-completion: decode compute only


def rounds(jobs: list[Job], n_rounds: int, before: Callable[[Job], None] | None = None) -> tuple[list[dict], list[str]]:
    """Every job once a round, each round starting further along the list (so a slow spell of the
    machine hits every configuration alike); `before(job)` runs first (e.g. to set a delay). A job
    that fails is logged and left out: one crash costs its cell, not the run."""
    results, failures = [], []
    for rnd in range(n_rounds):
        shift = rnd * len(jobs) // n_rounds
        for i, job in enumerate(jobs[shift:] + jobs[:shift]):
            if before is not None:
                before(job)
            t0 = time.perf_counter()
            try:
                results.append({"key": job.key, "round": rnd, **execute(job)})
            except (ServerError, subprocess.TimeoutExpired, ValueError, KeyError, StopIteration) as err:
                failures.append(f"round {rnd + 1} {'/'.join(map(str, job.key))}: {str(err).strip()}")
                log(f"[{rnd + 1}/{n_rounds} {i + 1}/{len(jobs)}] {'/'.join(map(str, job.key))}: FAILED {str(err).strip().splitlines()[0][:150]}")
                continue
            tps = results[-1]["tps"]
            log(f"[{rnd + 1}/{n_rounds} {i + 1}/{len(jobs)}] {'/'.join(map(str, job.key))}: "
                f"{'-' if tps is None else f'{tps:.1f}'} tok/s ({time.perf_counter() - t0:.1f} s)")
    return results, failures
