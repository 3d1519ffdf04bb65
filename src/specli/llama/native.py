"""llama.cpp's process-wide state: backend initialisation, its native log, and Ctrl-C during
native calls. Every other module of this package goes through these helpers."""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import sys
import threading
import time

import llama_cpp

# --- native log -------------------------------------------------------------------------------
# llama.cpp logs every tensor it loads. We keep its log quiet unless asked, but remember the
# last lines so that a failed load can say why. The ctypes callback must stay referenced for the
# life of the process: llama.cpp keeps the raw pointer (a collected callback means a call into
# freed memory).
_LOG_LEVEL_ERROR = 4
_recent_log: collections.deque[tuple[int, str]] = collections.deque(maxlen=64)
_log_lock = threading.Lock()
_verbose = False
_backend_ready = False


def _on_native_log(level: int, text: bytes | None, _user_data: ctypes.c_void_p) -> None:
    line = (text or b"").decode("utf-8", errors="replace")
    with _log_lock:
        _recent_log.append((level, line))
    if _verbose:
        try:
            os.write(2, text or b"")
        except OSError:  # stderr closed or full: the log is not worth failing for
            pass


_log_callback = llama_cpp.llama_log_callback(_on_native_log)


def clear_native_log() -> None:
    """Forget the lines logged so far (before a load whose failure they would explain)."""
    with _log_lock:
        _recent_log.clear()


def last_native_error() -> str | None:
    """The last error line llama.cpp logged (used to explain a failed load), or None."""
    with _log_lock:
        for level, line in reversed(_recent_log):
            if level == _LOG_LEVEL_ERROR and line.strip():
                return line.strip()
    return None


# --- Ctrl-C inside native calls ---------------------------------------------------------------
# llama.cpp calls back into Python (the log above, the load's progress below) while it loads or
# decodes. Python runs a SIGINT handler at the next Python instruction, which is then inside such
# a callback: a KeyboardInterrupt raised there cannot cross the C frames; ctypes prints it and
# drops it, and the load goes on. So while a native call that may call back runs (`with
# native:`), specli's SIGINT handler only records the request; the load's progress callback then
# cancels the load, and KeyboardInterrupt is raised once the call returns. Outside such calls the
# handler is Python's own (KeyboardInterrupt at once). Entering and leaving costs two integer
# updates: it sits around every decode.
_interrupt_requested = False
_native_depth = 0


_terminated = False  # a SIGTERM came: commands that would go on after a Ctrl-C (chat) stop


def _on_sigint(signum, frame) -> None:
    global _interrupt_requested, _terminated
    _terminated = _terminated or signum == signal.SIGTERM
    if _native_depth:
        _interrupt_requested = True
    else:
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt


def _install_sigint_handler() -> None:
    """Take over SIGINT, only where it has Python's default handler (a program that set its
    own keeps it) and only from the main thread (the only one that may); and SIGTERM (what
    `kill`, `timeout` and `docker stop` send) where nothing handles it, so that it ends a
    generation as Ctrl-C does, keeping what was produced (`serve` installs its own later)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigint)


def terminated() -> bool:
    """True once a SIGTERM was handled as an interruption (chat then leaves, not only the reply)."""
    return _terminated


def interrupt_requested() -> bool:
    """True when a Ctrl-C came during the current `with native:` block (then to be undone)."""
    return _interrupt_requested


def _on_load_progress(_progress: float, _user_data: ctypes.c_void_p) -> bool:
    return not _interrupt_requested  # False cancels the load


# For llama_model_params.progress_callback: cancels a load on Ctrl-C.
progress_callback = llama_cpp.llama_progress_callback(_on_load_progress)


class _NativeCall:
    """`with native:` around a native call that may call back into Python: a Ctrl-C during
    it comes out as KeyboardInterrupt when the outermost such block is left."""

    def __enter__(self) -> None:
        global _native_depth
        _native_depth += 1

    def __exit__(self, *exc: object) -> None:
        global _native_depth, _interrupt_requested
        _native_depth -= 1
        if _interrupt_requested and not _native_depth:
            _interrupt_requested = False
            raise KeyboardInterrupt


native = _NativeCall()

_pass_since: float | None = None  # when the decode running now began


class _Pass(_NativeCall):
    """`with native_pass:` around a llama_decode, or the read of its logits (which waits for
    it): `native`, and the time it began, which the RPC watchdog (rpc.py) reads: a pass that
    waits on a silent server never returns."""

    def __enter__(self) -> None:
        global _pass_since
        _pass_since = time.monotonic()
        super().__enter__()

    def __exit__(self, *exc: object) -> None:
        global _pass_since
        _pass_since = None
        super().__exit__(*exc)


native_pass = _Pass()


def pass_running_since() -> float | None:
    """time.monotonic() when the running decode began; None between decodes."""
    return _pass_since


def init_backend(*, verbose: bool = False) -> None:
    """Initialise llama.cpp once per process; `verbose` lets its native log through to stderr."""
    global _backend_ready, _verbose
    _verbose = verbose
    if not _backend_ready:
        _install_sigint_handler()
        with native:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
        _backend_ready = True


def ensure_backend() -> None:
    """init_backend() unless done already, keeping the verbosity chosen then."""
    init_backend(verbose=_verbose)


_amx_warned = False


def warn_about_amx() -> None:
    """Once per process, one line on stderr when this llama.cpp was built with its AMX kernels
    (a -march=native build on a CPU that reports AMX): those of llama-cpp-python 0.3.36 die with
    SIGILL at the first batch of a quantized model on such machines (seen here on an Intel
    Xeon VM; ggml-org/llama.cpp#26954), and without them llama.cpp's other kernels run 30x
    slower in that build. docs/install.md builds it without AMX. SPECLI_AMX=1 silences it."""
    global _amx_warned
    if _amx_warned or os.environ.get("SPECLI_AMX") == "1":
        return
    _amx_warned = True
    if b"AMX_INT8 = 1" in (llama_cpp.llama_print_system_info() or b""):
        print("specli: warning: llama-cpp-python was built with llama.cpp's AMX kernels, which crash (SIGILL) on many "
              "machines; rebuild it without them: see docs/install.md (SPECLI_AMX=1 hides this)", file=sys.stderr, flush=True)


# --- ggml's own libraries ---------------------------------------------------------------------
def ggml_library(stem: str):
    """The ctypes handle of one of the ggml libraries llama_cpp loaded ("libggml",
    "libggml-base"): the very copy libllama uses. The wheel ships each under several names
    (libggml.so, .so.0, .so.0.25.3) as separate files, and loading another name than the one
    libllama was linked against gives a second copy with its own globals (its own device
    registry, its own abort callback). On Linux the mapped file is read from /proc/self/maps;
    elsewhere the SONAME-like name is preferred. None when no such library exists."""
    from pathlib import Path

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                name = os.path.basename(path)
                if name.startswith(stem + ".so") and os.path.dirname(path) == str(lib_dir):
                    return ctypes.CDLL(path)
    except OSError:
        pass
    candidates = sorted(lib_dir.glob(f"{stem}.so.*"), key=lambda p: len(p.name)) + sorted(lib_dir.glob(f"{stem}.so"))
    candidates += sorted(lib_dir.glob(f"{stem}*.dylib")) + sorted(lib_dir.glob(f"{stem.removeprefix('lib')}.dll"))
    return ctypes.CDLL(str(candidates[0])) if candidates else None
