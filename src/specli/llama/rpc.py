"""llama.cpp's RPC backend: the target's layers on `rpc-server` processes of other machines.

llama-cpp-python does not bind the RPC client, so it is reached as llama.cpp's own `--rpc` does
(common/arg.cpp): the "RPC" backend of the ggml registry, whose `ggml_backend_rpc_add_server`
(found with ggml_backend_reg_get_proc_address) connects to an endpoint and returns a backend
registry holding that server's devices; registered globally, they are devices like a local GPU.
A model then loads onto the devices it is given (llama_model_params.devices).

RPC is unauthenticated and unencrypted: an rpc-server runs whatever its clients send. Only on
a trusted network (docs/rpc.md).

A lost server makes llama.cpp abort the process (ggml's RPC client has no error path). With
RPC in use, specli takes that abort over (ggml_set_abort_callback): one line naming the cause,
then exit 1; what was already written (streamed text, finished batch records) stays.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from specli.errors import EXIT_INTERRUPTED, SpecliError, UsageError
from specli.llama.devices import device_memory, ggml
from specli.llama.native import ensure_backend, ggml_library, pass_running_since

REINSTALL = (
    "this llama-cpp-python was built without RPC; reinstall it with: "
    "CMAKE_ARGS=\"-DGGML_RPC=on\" pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36"
)
RPC_TIMEOUT_S = 60.0  # --rpc-timeout's default: the wait for a handshake, and for a pass
CONNECT_TIMEOUT_S = 5.0  # ... and for a connection (no more than --rpc-timeout)
INTERRUPT_HINT_S = 2.0  # a pass still running this long after a Ctrl-C: say that a second one leaves
# The handshake of this llama.cpp's RPC client (ggml-rpc.cpp, protocol 7): the HELLO command,
# then the 24 bytes of a client's transport capabilities (none); the server answers with its
# version (major, minor, patch, padding) and its capabilities.
_HELLO, _CAPS, _PROTO_MAJOR = 14, 24, 7


@dataclass(frozen=True)
class RpcDevice:
    endpoint: str
    handle: int  # ggml_backend_dev_t
    name: str
    free: int
    total: int


def parse_endpoints(text: str) -> tuple[str, ...]:
    """`--rpc HOST:PORT[,HOST:PORT...]` as typed; UsageError otherwise. IPv4 addresses and host
    names only: ggml's RPC client splits at the first ':' and connects over IPv4."""
    endpoints = []
    for part in text.split(","):
        part = part.strip()
        host, sep, port = part.partition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or host.startswith("["):
            raise UsageError(f"--rpc takes HOST:PORT[,HOST:PORT...] with an IPv4 address or a host name (e.g. 192.168.1.7:50052), got '{part}'")
        endpoints.append(part)
    if len(set(endpoints)) != len(endpoints):
        raise UsageError("--rpc names the same server twice; give each HOST:PORT once")
    return tuple(endpoints)


def supported() -> bool:
    return bool(llama_cpp.llama_supports_rpc())


def check_supported() -> None:
    if not supported():
        raise UsageError(f"--rpc needs llama.cpp's RPC backend, but {REINSTALL}")


def check_reachable(endpoint: str, timeout: float = RPC_TIMEOUT_S) -> None:
    """Raise unless an rpc-server answers the handshake at `endpoint` within `timeout`: a refused
    connection is a UsageError (llama.cpp itself would abort the process), a peer that accepts
    and says nothing, or answers as something else, a SpecliError (llama.cpp would wait for it
    for ever, deaf to Ctrl-C). The connection is closed after: a server takes the next one."""
    try:
        _check_handshake(endpoint, timeout)
    except KeyboardInterrupt:
        # (Typer would turn it into exit 130 without a word: the line is said here)
        raise SpecliError(f"interrupted while waiting for the RPC server at {endpoint} to answer", exit_code=EXIT_INTERRUPTED) from None


def _check_handshake(endpoint: str, timeout: float) -> None:
    host, _, port = endpoint.partition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=min(timeout, CONNECT_TIMEOUT_S))
        sock.settimeout(timeout)
    except OSError as err:
        reason = "timed out" if isinstance(err, (socket.timeout, TimeoutError)) else (err.strerror or str(err))
        raise UsageError(f"cannot reach the RPC server at {endpoint} ({reason}); start rpc-server there (rpc-server -H HOST -p PORT) or fix --rpc") from None
    with sock:
        try:
            sock.sendall(bytes([_HELLO]) + struct.pack("<Q", _CAPS) + bytes(_CAPS))
            size = struct.unpack("<Q", _receive(sock, 8))[0]
            version = _receive(sock, 4) if size == 4 + _CAPS else b""
        except (socket.timeout, TimeoutError):
            raise SpecliError(
                f"the RPC server at {endpoint} accepted the connection but did not answer within {timeout:g} s (stalled, or busy "
                "with another client: an rpc-server serves one at a time); --rpc-timeout SECONDS waits longer"
            ) from None
        except OSError as err:
            raise SpecliError(f"the RPC server at {endpoint} closed the connection at the handshake ({err.strerror or err}): is it an rpc-server?") from None
    if not version or version[0] != _PROTO_MAJOR:
        theirs = f"protocol {version[0]}.{version[1]}" if version else "no rpc-server handshake"
        raise SpecliError(f"the server at {endpoint} answered with {theirs}; this llama.cpp speaks RPC protocol {_PROTO_MAJOR}.x: run an rpc-server of the same llama.cpp version")


def _receive(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(0, "closed")
        data += chunk
    return data


def _ggml() -> ctypes.CDLL:
    lib = ggml()
    if lib is None:
        raise SpecliError(f"cannot find libggml beside {Path(llama_cpp.__file__).parent / 'lib'} (a broken llama-cpp-python install?)")
    return lib


_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_added: dict[str, list[int]] = {}  # endpoint -> its devices (a server is registered once per process)


def add_servers(endpoints: tuple[str, ...], timeout: float = RPC_TIMEOUT_S) -> list[RpcDevice]:
    """Connect to each endpoint (its handshake checked first, within `timeout`) and register its
    devices; returns them in order. Installs the abort handler (module docstring) and the
    watchdog that ends a pass the servers stop answering (watch())."""
    check_supported()
    ensure_backend()
    lib = _ggml()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    address = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not address:
        raise UsageError(f"--rpc: llama.cpp's RPC backend is missing from this build; {REINSTALL}")
    add = _ADD_SERVER(address)
    for endpoint in endpoints:
        if endpoint not in _added:
            check_reachable(endpoint, timeout)
            install_abort_handler()
            watch(timeout)
            server_reg = add(endpoint.encode())
            if not server_reg:
                raise SpecliError(f"llama.cpp could not add the RPC server at {endpoint}")
            lib.ggml_backend_register(server_reg)
            _added[endpoint] = [lib.ggml_backend_reg_dev_get(server_reg, i) for i in range(lib.ggml_backend_reg_dev_count(server_reg))]
    return [RpcDevice(endpoint, handle, *device_memory(handle)) for endpoint in endpoints for handle in _added[endpoint]]


def local_accelerators() -> list[int]:
    """The local devices llama.cpp's default choice would offload to, in its order: the GPUs,
    else the integrated GPUs (not the CPU, not an RPC server's). For a draft model kept off the
    servers. (llama.cpp also drops a GPU seen twice, by two backends: not done here.)"""
    lib = _ggml()
    remote = {h for handles in _added.values() for h in handles}
    gpus, igpus = [], []
    for i in range(lib.ggml_backend_dev_count()):
        handle = lib.ggml_backend_dev_get(i)
        if handle not in remote:
            kind = lib.ggml_backend_dev_type(handle)
            (gpus if kind == 1 else igpus if kind == 2 else []).append(handle)
    return gpus or igpus


# --- a lost server --------------------------------------------------------------------------------
_ABORT = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_abort_handler = None  # kept referenced: llama.cpp holds the raw pointer


def _on_abort(message: bytes | None) -> None:
    text = (message or b"").decode("utf-8", "replace").strip()
    text = text.split(": ", 1)[-1] if "ggml-rpc" in text else text  # drop the source file:line
    hint = " (an RPC server stopped or the network failed; what was written so far is kept)" if _added else ""
    _leave(1, f"specli: error: llama.cpp aborted: {text}{hint}")


def install_abort_handler() -> None:
    global _abort_handler
    if _abort_handler is None:
        _abort_handler = _ABORT(_on_abort)
        base = ggml_library("libggml-base")
        if base is None:  # (nothing to hook: llama.cpp's own abort message then)
            return
        base.ggml_set_abort_callback.restype = ctypes.c_void_p
        base.ggml_set_abort_callback.argtypes = [_ABORT]
        base.ggml_set_abort_callback(_abort_handler)


# --- a silent server --------------------------------------------------------------------------
# ggml's RPC client waits on its sockets without a timeout: a server that stops answering (a
# frozen machine, a dropped route) leaves the pass waiting for ever, and Ctrl-C cannot end it
# (Python runs signal handlers only when the pass returns). A watchdog thread ends such a pass;
# it hears of a Ctrl-C or SIGTERM through the signal module's wake-up fd, which the C-level
# handler writes at once.
_watch_timeout: float | None = None
_on_stall: list = []  # callables taking the line said (serve answers its requests 503)
STALL_GRACE_S = 2.0  # with such a callable: how long its answers get before the process ends


def on_stall(callback) -> None:
    """Call `callback(reason)` (from the watchdog's thread) when a pass stalls, before leaving."""
    _on_stall.append(callback)


_stop_asked: float | None = None  # when serve was asked to stop (stop_asked())
STOP_WAIT_S = 5.0  # ... how long a pass then still gets before it is not waited for (a slow
# prefill batch over RPC may need seconds; a supervisor's SIGKILL comes 10-30 s after SIGTERM)


def stop_asked() -> None:
    """serve was asked to stop (one SIGTERM or Ctrl-C; called from its signal handler). A pass
    still running STOP_WAIT_S later is not waited for: the on_stall callbacks answer every
    request, then the process leaves (exit 130). What stops serve sends one SIGTERM and a
    SIGKILL 10-30 s later (docker stop, systemd, Kubernetes); a pass waiting on a stalled
    server, which nothing can interrupt, would hold the exit for the whole --rpc-timeout."""
    global _stop_asked
    if _stop_asked is None:
        _stop_asked = time.monotonic()


def _answer_requests(why: str) -> None:
    """The on_stall callbacks told `why`, and STALL_GRACE_S for their answers to go out."""
    for callback in _on_stall:
        try:
            callback(why)
        except Exception:
            pass
    if _on_stall:
        time.sleep(STALL_GRACE_S)


def watch(timeout: float) -> None:
    """Start (once; a later call may only shorten the wait) the watchdog: a pass that has not
    returned after `timeout` s ends the process with one line and exit 1 (130 after a Ctrl-C),
    and so does, at once, a second Ctrl-C (or SIGTERM) during one pass: the first lets the pass
    finish, as without RPC. What was written stays. Ctrl-C is watched only when called from the
    main thread."""
    global _watch_timeout
    first = _watch_timeout is None
    _watch_timeout = timeout if first else min(_watch_timeout, timeout)
    if not first:
        return
    signals = None
    if threading.current_thread() is threading.main_thread():
        signals, wake = os.pipe()
        os.set_blocking(wake, False)
        try:
            signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
        except ValueError:
            os.close(signals)
            os.close(wake)
            signals = None
    threading.Thread(target=_watchdog, args=(signals,), name="specli-rpc-watchdog", daemon=True).start()


def _watchdog(signals: int | None) -> None:
    asked: list[float] = []  # when the Ctrl-Cs during the running pass came
    hinted = False
    pass_of_asked: float | None = None
    while True:
        if signals is None:
            time.sleep(0.25)
        elif select.select([signals], [], [], 0.25)[0]:
            heard = [s for s in os.read(signals, 64) if s in (signal.SIGINT, signal.SIGTERM)]
            if heard and pass_running_since() is not None:
                asked += [time.monotonic()] * len(heard)
        since, now = pass_running_since(), time.monotonic()
        if since != pass_of_asked:  # another pass (or none): Python handles what came before it
            asked, hinted, pass_of_asked = [t for t in asked if since is not None and t >= since], False, since
        if since is None:
            continue
        servers = ", ".join(_added) or "the RPC servers"
        if len(asked) >= 2:
            _leave(130, f"specli: interrupted while waiting for {servers}")
        if _stop_asked is not None and now - max(_stop_asked, since) > STOP_WAIT_S:
            _answer_requests(f"the server is shutting down and a pass still waits for the RPC server(s) at {servers}; send the request again once it is back")
            _leave(130, f"specli: interrupted while waiting for {servers}: serve stopped without that pass, its requests answered 503")
        if asked and not hinted and _stop_asked is None and now - asked[0] > INTERRUPT_HINT_S:
            os.write(2, f"specli: stopping after this pass, which waits for {servers}; Ctrl-C again to leave now\n".encode())
            hinted = True
        if now - since > _watch_timeout:
            why = (f"no answer from the RPC server(s) at {servers}: a pass has waited {_watch_timeout:g} s (a stalled server or "
                   "network, or a pass slower than --rpc-timeout SECONDS allows)")
            _answer_requests(why)
            _leave(130 if asked else 1, f"specli: error: {why}; what was written so far is kept")


def _leave(code: int, line: str) -> None:
    """End the process now, from any thread or a native callback: what stdout holds is flushed,
    `line` goes to stderr."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os.write(2, (line + "\n").encode())
    os._exit(code)
