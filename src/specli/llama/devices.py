"""The machine as llama.cpp sees it: its backend devices (for `specli fit`) and the thread count."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache

from specli.llama.native import ensure_backend, ggml_library


@dataclass(frozen=True)
class BackendDevice:
    """One ggml backend device as llama.cpp sees it; memory in bytes."""

    name: str
    description: str
    kind: str  # "cpu", "gpu", "igpu", "accel" or "other"
    free: int
    total: int


_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


@lru_cache(maxsize=None)
def ggml() -> ctypes.CDLL | None:
    """libggml as libllama loaded it (its device and backend registry), with the signatures of
    the functions specli calls there; None when it cannot be found. llama-cpp-python does not
    bind these, so they are called through ctypes (here for fit's device query, in rpc.py for
    the RPC client, in tests/fixtures/rpc.py for a local RPC server)."""
    ensure_backend()  # (libllama and its ggml are loaded)
    lib = ggml_library("libggml")
    if lib is None:
        return None
    p = ctypes.c_void_p
    for name, restype, argtypes in (
        ("ggml_backend_reg_by_name", p, [ctypes.c_char_p]),
        ("ggml_backend_reg_get_proc_address", p, [p, ctypes.c_char_p]),
        ("ggml_backend_register", None, [p]),
        ("ggml_backend_reg_dev_count", ctypes.c_size_t, [p]),
        ("ggml_backend_reg_dev_get", p, [p, ctypes.c_size_t]),
        ("ggml_backend_dev_count", ctypes.c_size_t, []),
        ("ggml_backend_dev_get", p, [ctypes.c_size_t]),
        ("ggml_backend_dev_by_type", p, [ctypes.c_int]),
        ("ggml_backend_dev_type", ctypes.c_int, [p]),
        ("ggml_backend_dev_name", ctypes.c_char_p, [p]),
        ("ggml_backend_dev_description", ctypes.c_char_p, [p]),
        ("ggml_backend_dev_memory", None, [p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def device_memory(handle: int) -> tuple[str, int, int]:
    """(name, free, total) of a device (an RPC server's asks the server). Needs ggml()."""
    lib = ggml()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    return (lib.ggml_backend_dev_name(handle) or b"").decode("utf-8", "replace"), int(free.value), int(total.value)


def backend_devices() -> list[BackendDevice]:
    """llama.cpp's own device list (ggml_backend_dev_*), or [] when it cannot be queried.
    Never raises."""
    try:
        lib = ggml()
        if lib is None:
            return []
        devices = []
        for i in range(int(lib.ggml_backend_dev_count())):
            dev = lib.ggml_backend_dev_get(i)
            name, free, total = device_memory(dev)
            devices.append(BackendDevice(
                name=name,
                description=(lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
                kind=_DEVICE_KINDS.get(int(lib.ggml_backend_dev_type(dev)), "other"),
                free=free,
                total=total,
            ))
        return devices
    except (OSError, AttributeError):  # no such library or symbol in this build
        return []


def default_threads() -> int:
    """Physical cores (llama.cpp's advice for generation), at least 1."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False)
    except Exception:  # psutil cannot tell on some platforms
        cores = None
    return max(1, cores or os.cpu_count() or 1)
