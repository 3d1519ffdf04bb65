"""The machine as llama.cpp sees it: its backend devices (for `specli fit`) and the thread count."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass


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


def backend_devices() -> list[BackendDevice]:
    """llama.cpp's own device list (ggml_backend_dev_*), or [] when it cannot be queried.

    llama-cpp-python does not bind these functions, so they are called from libggml through
    ctypes; the library sits beside libllama in llama_cpp/lib. Never raises.
    """
    try:
        ensure_backend()
        lib = ggml_library("libggml")  # (the copy libllama uses: it holds the device registry)
        if lib is None:
            return []
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
            fn.restype = ctypes.c_char_p
            fn.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_memory.restype = None
        lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        devices = []
        for i in range(int(lib.ggml_backend_dev_count())):
            dev = lib.ggml_backend_dev_get(i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            devices.append(BackendDevice(
                name=(lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
                description=(lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
                kind=_DEVICE_KINDS.get(int(lib.ggml_backend_dev_type(dev)), "other"),
                free=int(free.value),
                total=int(total.value),
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
