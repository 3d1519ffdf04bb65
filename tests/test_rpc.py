"""The target split over llama.cpp RPC servers (--rpc): two servers on 127.0.0.1 (tests/fixtures/
rpc.py: the RPC-enabled llama-cpp-python's own server) hold some of its layers, this machine
the rest. Needs llama-cpp-python built with -DGGML_RPC=on (the README's test command)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

try:
    import httpx2 as httpx  # the HTTP library of openai 3.x
except ImportError:  # openai 1.x and 2.x use httpx
    import httpx

from fixtures import synthetic
from fixtures.cli import popen
from fixtures.rpc import free_port, rpc_servers

N_LAYER = 4


def specli(*args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specli", *args], capture_output=True, text=True, timeout=timeout, env=env)


def serve_over_rpc(target, endpoint: str, log, *options: str) -> subprocess.Popen:
    """`specli serve` of the target with 3 layers on one RPC server, stderr to `log`."""
    with open(log, "w") as err:
        return popen(
            [sys.executable, "-m", "specli", "serve", "-m", str(target), "--target-only", "-c", "4096", "--threads", "1", "-ngl", "3",
             "--rpc", endpoint, *options, "--port", "0"], stdout=subprocess.DEVNULL, stderr=err,
        )


def listening_url(proc: subprocess.Popen, log, deadline_s: float = 120) -> str:
    """The URL a `specli serve` prints once it listens (an assertion if it exits or takes too long)."""
    deadline = time.monotonic() + deadline_s
    while not (found := re.search(r"listening on (http://[\d.]+:\d+)", log.read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return found.group(1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 4-layer F32 pair: -ngl 3 leaves one block (and the output) here, three go remote."""
    return synthetic.make_pair(tmp_path_factory.mktemp("rpc-pair"), "perturbed", seed=5, noise=0.05, n_layer=N_LAYER)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with rpc_servers(2, log_dir=tmp_path_factory.mktemp("rpc-logs")) as started:
        yield [endpoint for endpoint, _ in started]


def run_json(target, *args) -> dict:
    result = specli("run", "-m", str(target), "--temperature", "0", "-n", "40", "-c", "256", "--threads", "1", "--json", "-q", *args,
                    "a b c d e f g a b c d e f g a b c")  # (repeats: lookup drafts)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_llama_cpp_python_has_rpc():
    """The other tests need it; say how to get it, once, rather than fail obscurely."""
    import llama_cpp

    assert llama_cpp.llama_supports_rpc(), (
        "llama-cpp-python was built without RPC: CMAKE_ARGS=-DGGML_RPC=on pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36"
    )


@pytest.mark.parametrize("drafting", [["--target-only"], ["--lookup", "--draft-max", "4"], ["-md", "DRAFT", "--draft-max", "3"]],
                         ids=["target-only", "lookup", "draft-model"])
def test_a_split_target_gives_the_all_local_output(pair, servers, drafting):
    target, draft = pair
    drafting = [str(draft) if a == "DRAFT" else a for a in drafting]
    local = run_json(target, *drafting)
    split = run_json(target, *drafting, "-ngl", "3", "--rpc", ",".join(servers), "--tensor-split", "2,1")
    # F32 weights, the same CPU kernels on both sides of the wire: token for token.
    assert split["token_ids"] == local["token_ids"] and split["text"] == local["text"]
    if drafting[0] != "--target-only":
        assert split["stats"]["drafted"] > 0


def test_the_draft_model_can_go_remote_too(pair, servers):
    target, draft = pair
    local = run_json(target, "-md", str(draft), "--draft-max", "3")
    remote = run_json(target, "-md", str(draft), "--draft-max", "3", "--rpc", servers[0], "--draft-rpc")
    assert remote["token_ids"] == local["token_ids"]


def test_nobody_listening_is_one_line_and_exit_2(pair):
    target, _ = pair
    t0 = time.monotonic()
    result = specli("run", "-m", str(target), "--rpc", f"127.0.0.1:{free_port()}", "-n", "4", "hi", timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the RPC server" in lines[0], result.stderr
    assert time.monotonic() - t0 < 60  # (the deadline of the call itself: it did not hang)


@pytest.mark.parametrize("args, says", [
    (["--rpc", "nohost"], "HOST:PORT"),
    (["--rpc", "127.0.0.1:0"], "HOST:PORT"),
    (["--tensor-split", "1,1"], "only applies with --rpc"),
    (["--draft-rpc"], "only applies with --rpc"),
    (["--rpc", "127.0.0.1:1", "--tensor-split", "1,x"], "--tensor-split"),
])
def test_bad_rpc_options_are_refused_before_loading(pair, args, says):
    target, _ = pair
    result = specli("run", "-m", str(target), *args, "-n", "4", "hi", timeout=60)
    assert result.returncode == 2 and says in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_a_split_with_the_wrong_number_of_shares_is_refused(pair, servers):
    target, _ = pair
    result = specli("run", "-m", str(target), "--rpc", ",".join(servers), "--tensor-split", "1,1,1", "-ngl", "3", "-n", "4", "hi")
    assert result.returncode == 2 and "2 devices" in result.stderr, result.stderr


def test_without_rpc_in_the_build_it_says_how_to_reinstall(pair):
    target, _ = pair
    code = (
        "import sys, llama_cpp; llama_cpp.llama_supports_rpc = lambda: False\n"
        "from specli.cli.app import main\n"
        f"sys.argv = ['specli', 'run', '-m', {str(target)!r}, '--rpc', '127.0.0.1:50052', '-n', '4', 'hi']; main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "CMAKE_ARGS" in result.stderr and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.slow
def test_a_server_killed_mid_generation_is_one_line_exit_1_and_the_text_so_far_is_kept(pair, tmp_path):
    target, _ = pair
    with rpc_servers(1, log_dir=tmp_path) as started:
        endpoint, server = started[0]
        proc = popen(
            [sys.executable, "-m", "specli", "run", "-m", str(target), "--target-only", "--temperature", "0", "-n", "5000", "-c", "4096",
             "--threads", "1", "-q", "-ngl", "3", "--rpc", endpoint, "Once upon a time"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        first = proc.stdout.read(8)  # the generation streams: text is coming through the server
        server.send_signal(signal.SIGKILL)
        rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specli: error:") and "RPC" in lines[0], err
    assert len(first + rest) >= 8  # what was streamed before the loss stays on stdout


@pytest.mark.parametrize("command", ["run", "fit"])
def test_a_peer_that_accepts_and_never_answers_is_one_line_exit_1(pair, command):
    import socket

    target, _ = pair
    with socket.socket() as silent:  # listening: the kernel completes the connection, nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        args = ["-n", "4", "hi"] if command == "run" else []
        result = specli(command, "-m", str(target), "--rpc", endpoint, "--rpc-timeout", "1", *args, timeout=60)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{endpoint} accepted the connection but did not answer within 1 s" in lines[0], result.stderr


def test_ctrl_c_while_a_silent_peer_is_asked_for_its_handshake_is_one_line_exit_130(pair):
    import socket

    target, _ = pair
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        proc = popen([sys.executable, "-m", "specli", "run", "-m", str(target), "--rpc", endpoint,
                                 "--rpc-timeout", "600", "-n", "4", "hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            silent.settimeout(60)
            conn, _ = silent.accept()  # specli is connected ...
            with conn:
                conn.settimeout(60)
                assert conn.recv(1) == bytes([14])  # ... and has asked for the handshake (HELLO)
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err
    # one line, not none (was: Typer's silent exit 130, which "no second line" let through)
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and endpoint in lines[0], err


def stalled_run(target, endpoint: str, *extra: str) -> subprocess.Popen:
    return popen(
        [sys.executable, "-m", "specli", "run", "-m", str(target), "--target-only", "--temperature", "0", "-n", "5000", "-c", "4096",
         "--threads", "1", "-q", "-ngl", "3", "--rpc", endpoint, *extra, "Once upon a time"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["timeout", "ctrl-c"])
def test_a_server_that_stops_answering_mid_generation_ends_the_run(pair, tmp_path, how):
    # SIGSTOP: the server's machine froze, or the route dropped; its connection stays open.
    target, _ = pair
    with rpc_servers(1, log_dir=tmp_path) as started:
        endpoint, server = started[0]
        proc = stalled_run(target, endpoint, "--rpc-timeout", "2" if how == "timeout" else "600")
        first = proc.stdout.read(8)  # the generation streams: text is coming through the server
        server.send_signal(signal.SIGSTOP)
        try:
            if how == "ctrl-c":  # the first lets the pass finish (it never does); a second leaves
                time.sleep(1)
                proc.send_signal(signal.SIGINT)
                time.sleep(0.5)
                proc.send_signal(signal.SIGINT)
            rest, err = proc.communicate(timeout=60)
        finally:
            server.send_signal(signal.SIGCONT)
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, err
    if how == "timeout":
        assert proc.returncode == 1 and lines[0].startswith("specli: error: no answer from the RPC server(s) at " + endpoint), err
        assert "a pass has waited 2 s" in lines[0]
    else:
        assert proc.returncode == 130 and "interrupted" in lines[0] and endpoint in lines[0], err
    assert len(first + rest) >= 8  # what was streamed before the stall stays on stdout


@pytest.mark.slow
def test_serve_over_a_server_that_stops_answering_says_503_then_stops(pair, tmp_path):
    target, _ = pair
    log = tmp_path / "serve.stderr"
    with rpc_servers(1, log_dir=tmp_path) as started:
        endpoint, server = started[0]
        proc = serve_over_rpc(target, endpoint, log, "--rpc-timeout", "2")
        try:
            url = listening_url(proc, log)
            deadline = time.monotonic() + 120
            chunks: list[bytes] = []

            def stream() -> None:
                body = {"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "stream": True}
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                    for chunk in response.iter_bytes():
                        chunks.append(chunk)

            streamer = threading.Thread(target=stream, daemon=True)
            streamer.start()
            while len(chunks) < 3:  # text is coming through the server
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            server.send_signal(signal.SIGSTOP)
            while (health := httpx.get(f"{url}/health", timeout=30)).status_code == 200:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert health.status_code == 503 and f"no answer from the RPC server(s) at {endpoint}" in health.json()["error"]
            try:  # a new request, within the 2 s the server answers before it leaves
                later = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
                assert later.status_code == 503 and "no answer from the RPC server" in later.text, later.text
            except httpx.TransportError:  # (a slow test machine: it had left already)
                assert proc.poll() is not None
            assert proc.wait(60) == 1
            streamer.join(30)
        finally:
            server.send_signal(signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert b"no answer from the RPC server" in b"".join(chunks)  # the stream was told, not cut
    lines = log.read_text().strip().splitlines()
    assert lines[-1].startswith("specli: error: no answer from the RPC server(s) at " + endpoint), lines


@pytest.mark.slow
def test_one_sigterm_stops_serve_within_seconds_while_a_server_is_stalled(pair, tmp_path):
    """What docker stop, systemd and Kubernetes send: one SIGTERM, then a SIGKILL 10-30 s later.
    The pass waiting on the stalled server cannot be interrupted, so serve answers every request
    (503 naming the server; an error event ends the open stream) and leaves without it, exit
    130 (was: exit only when --rpc-timeout's default 60 s ran out, the queued request a plain
    text 500 after 5 s, the stream cut)."""
    target, _ = pair
    log = tmp_path / "serve.stderr"
    with rpc_servers(1, log_dir=tmp_path) as started:
        endpoint, server = started[0]
        proc = serve_over_rpc(target, endpoint, log)
        try:
            url = listening_url(proc, log)
            deadline = time.monotonic() + 120
            chunks: list[bytes] = []
            queued: list = []

            def stream() -> None:
                body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": True}
                try:
                    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                        for chunk in response.iter_bytes():
                            chunks.append(chunk)
                except httpx.TransportError:  # (cut: the checks below say so)
                    pass

            def wait_in_queue() -> None:
                queued.append(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120))

            streamer = threading.Thread(target=stream, daemon=True)
            streamer.start()
            while len(chunks) < 3:  # text is coming through the server
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            server.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            waiter = threading.Thread(target=wait_in_queue, daemon=True)
            waiter.start()
            while httpx.get(f"{url}/health", timeout=30).json().get("queued") != 1:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            time.sleep(max(0.0, stopped + 1 - time.monotonic()))
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(15)  # within seconds, not --rpc-timeout's 60 (a generous bound)
            streamer.join(30)
            waiter.join(30)
        finally:
            server.send_signal(signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert code == 130, log.read_text()
    (response,) = queued
    assert response.status_code == 503 and response.headers["content-type"].startswith("application/json"), response.text
    assert endpoint in response.json()["error"]["message"]
    events = [json.loads(line[len("data: ") :]) for line in b"".join(chunks).decode().splitlines() if line.startswith("data: {")]
    assert "error" in events[-1] and endpoint in events[-1]["error"]["message"], events[-2:]  # the stream was told, not cut
    err = log.read_text()
    assert "Traceback" not in err and "Ctrl-C again" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("specli: interrupted") and endpoint in lines[-1], lines


# --- fit --rpc's arithmetic (pure) -----------------------------------------------------------------
def test_layers_are_dealt_as_llama_cpp_deals_them():
    from specli.models.fit import layers_by_share

    assert layers_by_share(10, (1, 1)) == [5, 5]
    assert layers_by_share(10, (3, 1)) == [8, 2]  # cumulative bounds 0.75, 1.0: layers 0-7, then 8-9
    assert layers_by_share(3, (0, 1, 0)) == [0, 3, 0]


def test_a_split_that_does_not_fit_gets_one_that_does():
    from specli.models import fit

    GB = fit.GB
    shape = fit.ModelShape("t", weight_bytes=41 * GB, n_head_kv=(8,) * 40, head_dim_k=128, head_dim_v=128, n_vocab=32000, origin="test")
    est = fit.estimate(shape, None, n_ctx=4096, overhead=2 * GB)
    per_block = est.weights_target / 41 + est.kv_target / 40
    # -ngl -1: 40 blocks and the output layer, 41 slots. Room for 30 and for 12: an even split
    # overfills the small one.
    devices = [("big", int(30.5 * per_block)), ("small", int(12.5 * per_block))]
    even = fit.rpc_split(est, devices, -1, (1, 1))
    assert [(d.layers, d.output) for d in even.devices] == [(21, False), (19, True)] and not even.fits
    assert even.offloaded == 40 and even.suggested is not None and sum(even.suggested) == 41
    fixed = fit.rpc_split(est, devices, -1, tuple(float(n) for n in even.suggested))
    assert fixed.fits and [d.layers + d.output for d in fixed.devices] == list(even.suggested)
    assert fixed.local_bytes == est.total - sum(d.bytes for d in fixed.devices)
    # Not enough room anywhere for all 41: no suggestion.
    assert fit.rpc_split(est, [("a", int(10 * per_block)), ("b", int(10 * per_block))], -1).suggested is None
    # -ngl 30: thirty blocks, no output layer, the rest stays here.
    fewer = fit.rpc_split(est, devices, 30)
    assert fewer.offloaded == 30 and sum(d.layers for d in fewer.devices) == 30 and not any(d.output for d in fewer.devices)


def test_fit_counts_the_servers_memory(pair, servers):
    target, _ = pair
    result = specli("fit", "-m", str(target), "--rpc", ",".join(servers), "-c", "256", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [d["name"].split(" ")[0] for d in out["devices"]] == servers  # (no local GPU here)
    assert all(d["free"] > 0 for d in out["devices"]) and out["fits"]
    assert sum(d["layers"] for d in out["devices"]) == out["ngl"] == N_LAYER
    human = specli("fit", "-m", str(target), "--rpc", ",".join(servers), "-c", "256", "-ngl", "3", "--tensor-split", "1,2")
    assert human.returncode == 0 and "3 of 4 layers offloaded" in human.stdout and servers[1] in human.stdout, human.stderr
