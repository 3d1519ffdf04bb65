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
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from specli.errors import SpecliError, UsageError
from specli.llama.devices import device_memory, ggml
from specli.llama.native import ensure_backend, ggml_library

REINSTALL = (
    "this llama-cpp-python was built without RPC; reinstall it with: "
    "CMAKE_ARGS=\"-DGGML_RPC=on\" pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36"
)
CONNECT_TIMEOUT_S = 3.0


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


def check_reachable(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """UsageError unless something accepts a connection at `endpoint` within `timeout`
    (llama.cpp itself would abort the process on a refused connection)."""
    host, _, port = endpoint.partition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as err:
        reason = "timed out" if isinstance(err, (socket.timeout, TimeoutError)) else (err.strerror or str(err))
        raise UsageError(f"cannot reach the RPC server at {endpoint} ({reason}); start rpc-server there (rpc-server -H HOST -p PORT) or fix --rpc") from None


def _ggml() -> ctypes.CDLL:
    lib = ggml()
    if lib is None:
        raise SpecliError(f"cannot find libggml beside {Path(llama_cpp.__file__).parent / 'lib'} (a broken llama-cpp-python install?)")
    return lib


_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_added: dict[str, list[int]] = {}  # endpoint -> its devices (a server is registered once per process)


def add_servers(endpoints: tuple[str, ...]) -> list[RpcDevice]:
    """Connect to each endpoint (checked reachable first) and register its devices; returns
    them in order. Installs the abort handler (module docstring)."""
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
            check_reachable(endpoint)
            install_abort_handler()
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
    try:
        sys.stdout.flush()
    except Exception:
        pass
    hint = " (an RPC server stopped or the network failed; what was written so far is kept)" if _added else ""
    os.write(2, f"specli: error: llama.cpp aborted: {text}{hint}\n".encode())
    os._exit(1)


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
