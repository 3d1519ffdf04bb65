"""Writing files so that a crash never leaves half of one (batch output, the policy cache), the
lock that keeps two `batch` runs from writing one output, and reading inputs with a size limit
(a prompt or an input file named /dev/zero must not fill the memory)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterable, Iterator

from specli.errors import UsageError

# Prompts and input files (`run -`, `batch INPUT`, `bench --prompts`) are read up to this many
# bytes; the variable raises (or lowers) it.
MAX_INPUT_ENV = "SPECLI_MAX_INPUT_BYTES"
DEFAULT_MAX_INPUT_BYTES = 64 << 20
_READ_CHUNK = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"


def max_input_bytes() -> int:
    """The input size limit: $SPECLI_MAX_INPUT_BYTES, else 64 MiB. UsageError when it is not
    a whole number >= 1."""
    text = os.environ.get(MAX_INPUT_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_INPUT_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{MAX_INPUT_ENV} must be a whole number of bytes >= 1, got {text!r}")
    return value


@contextlib.contextmanager
def open_to_read(path: Path) -> Iterator[tuple[IO[bytes], os.stat_result]]:
    """`path` opened for binary reading, with what fstat says of it, so that the caller can
    refuse a device or a directory before reading: opening never waits on a FIFO (O_NONBLOCK).
    OSError when it cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        yield handle, os.fstat(fd)


def kind_of(mode: int) -> str | None:
    """What a file of this st_mode is, in words, when it is no regular file ("a directory",
    "a FIFO (named pipe)", "a character device", ...); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


class NotRegularFile(Exception):
    """`path` is a directory, FIFO, device or socket (`kind` says which, in words): refused
    before a byte of it is read."""

    def __init__(self, path: str | os.PathLike, kind: str):
        super().__init__(f"{path} is not a regular file: it is {kind}")
        self.path, self.kind = path, kind


@contextlib.contextmanager
def open_regular(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """`path` (links followed) opened for binary reading if it is a regular file; else
    NotRegularFile, before it is opened: stat never waits, while opening a FIFO waits for a
    writer for ever, and a socket cannot be opened at all. What was opened is checked again
    (fstat), in case the path was swapped meanwhile. OSError when it cannot be opened."""
    kind = kind_of(os.stat(path).st_mode)
    if kind:
        raise NotRegularFile(path, kind)
    with open_to_read(Path(path)) as (handle, info):
        kind = kind_of(info.st_mode)
        if kind:
            raise NotRegularFile(path, kind)
        yield handle


def read_limited(handle: IO[bytes], what: str) -> bytes:
    """All of `handle` (a binary stream), refusing to read past max_input_bytes(): UsageError
    naming `what`, the limit and how to raise it. Reads in chunks, so memory follows the input."""
    limit = max_input_bytes()
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = handle.read(min(_READ_CHUNK, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise input_limit_error(what, limit)


def input_limit_error(what: str, limit: int) -> UsageError:
    """The error for input past max_input_bytes(): names `what`, the limit and how to raise it."""
    return UsageError(
        f"{what} is larger than the input limit of {_describe_size(limit)}; "
        f"raise it with {MAX_INPUT_ENV}=BYTES (e.g. {MAX_INPUT_ENV}={limit * 4}) if this is really your input"
    )


def strip_bom(data: bytes) -> bytes:
    """`data` without a leading UTF-8 byte-order mark (editors on Windows write one)."""
    return data[len(UTF8_BOM) :] if data.startswith(UTF8_BOM) else data


def _describe_size(n_bytes: int) -> str:
    if n_bytes >= 1 << 20 and n_bytes % (1 << 20) == 0:
        return f"{n_bytes >> 20} MiB ({n_bytes} bytes)"
    return f"{n_bytes} bytes"


def write_atomically(path: str | os.PathLike, lines: Iterable[str], *, mode: int | None = None) -> Path:
    """Replace `path` with `lines` so that a crash leaves either the old file or the new one.
    A symlink stays a link (its target is replaced); the file keeps its permission bits, a new
    one gets the umask's (`mode` overrides). A device or FIFO (/dev/null, /dev/stdout) is
    written in place: a temporary file renamed over it would replace the device node itself.
    Returns the path really written."""
    path = Path(os.path.realpath(path))
    if os.path.exists(path) and not path.is_file():
        with os.fdopen(open_in_place(path), "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line + "\n")
        return path
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    _replace_with(path, data, _mode_of(path) if mode is None else mode)
    return path


def write_bytes_atomically(path: str | os.PathLike, data: bytes, *, mode: int = 0o600) -> None:
    """Replace the regular file `path` with `data` (a crash leaves the old file or the new one),
    the new file created with `mode` (default 0600: nobody else may read it)."""
    _replace_with(Path(path), data, mode)


def _replace_with(path: Path, data: bytes, mode: int) -> None:
    """A temporary file beside `path` with `data` and `mode`, synced, renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # (mkstemp: mode 0600)
    try:
        if hasattr(os, "fchmod"):  # not on Windows
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# FIFOs that check_writable found a reader on, by (device, inode), each opened for writing and
# kept open until the write (open_in_place hands it over): a reader such as `cat FIFO` ends at
# the first writer's close, so a probe that closed at once would leave no reader for the write.
_held_fifos: dict[tuple[int, int], int] = {}


def open_in_place(path: str | os.PathLike) -> int:
    """A file descriptor for writing the FIFO, device or socket `path` in place, got without
    waiting: a FIFO with no reader is OSError(ENXIO) saying so at once (a plain open waits for a
    reader for ever, and Ctrl-C is then all that ends it). A FIFO that check_writable opened is
    handed over. Once open, writes block again: they wait for a slow reader instead of failing."""
    try:
        info: os.stat_result | None = os.stat(path)
    except OSError:
        info = None
    if info is not None and (info.st_dev, info.st_ino) in _held_fifos:
        return _held_fifos.pop((info.st_dev, info.st_ino))
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, os.O_WRONLY | nonblock)
    except OSError as err:
        if err.errno == errno.ENXIO and info is not None and (stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode)):
            why = "it is a FIFO (named pipe) with no reader" if stat.S_ISFIFO(info.st_mode) else "it is a socket, not a file"
            raise OSError(errno.ENXIO, why, str(path)) from None
        raise
    if nonblock:
        os.set_blocking(fd, True)
    return fd


def check_writable(path: str | os.PathLike, what: str, *, folder_too: bool = False) -> None:
    """UsageError (one line, naming `what`, the path and the reason) unless `path` can be written,
    found out before a run spends its time: an existing regular file is opened for writing
    (nothing is written, nothing truncated, the mtime stays); a missing one, or with `folder_too`
    (outputs replaced through a temporary file or locked beside it) any, is tried by creating and
    removing a temporary file in its folder. A symlink is followed. A FIFO must have a reader
    (it is opened without waiting, and held open for the write: see open_in_place); a socket is
    refused; devices are left to the write itself (/dev/null is a fine place for a summary)."""
    real = Path(os.path.realpath(path))
    if real.is_dir():
        raise UsageError(f"cannot write {what} {path}: it is a directory; give a file name")
    if not real.parent.is_dir():
        raise UsageError(f"cannot write {what} {path}: folder {real.parent} does not exist")
    exists = os.path.lexists(real)
    if exists and (real.is_fifo() or real.is_socket()):
        try:
            fd = open_in_place(real)
        except OSError as err:
            hint = "start what reads it first, or give a file name" if err.errno == errno.ENXIO and real.is_fifo() else "give a file name"
            raise UsageError(f"cannot write {what} {path}: {err.strerror or err}; {hint}") from None
        info = os.fstat(fd)
        _held_fifos[(info.st_dev, info.st_ino)] = fd  # (named twice: the same descriptor, put back)
    if exists and real.is_file():
        try:
            os.close(os.open(real, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NONBLOCK", 0)))
        except OSError as err:
            raise UsageError(f"cannot write {what} {path}: {err.strerror} (check its permissions, or pick another file)") from None
    if not exists or folder_too:
        try:
            fd, probe = tempfile.mkstemp(prefix=".specli-write-check-", dir=real.parent)
        except OSError as err:
            raise UsageError(
                f"cannot write {what} {path}: nothing can be created in folder {real.parent} ({err.strerror}); "
                "pick a writable folder"
            ) from None
        os.close(fd)
        os.unlink(probe)


def _mode_of(path: Path) -> int:
    """The permission bits `path` has, or those a new file gets under the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def replace_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through write_atomically: a failure (a full disk, a folder where
    nothing can be created) leaves the earlier file as it was. Returns the path really written.
    Raises OSError."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # write_atomically ends every line with a newline itself
    return write_atomically(path, lines)


class LockBusy(Exception):
    """Another process holds the lock; `pid` is its process id when it recorded one."""

    def __init__(self, lock_path: Path, pid: int | None):
        super().__init__(f"{lock_path} is held" + (f" by PID {pid}" if pid else ""))
        self.lock_path = lock_path
        self.pid = pid


class ExclusiveLock:
    """An OS advisory lock held through a lock file, for as long as one command runs.

    POSIX: flock(2) on `path`, which records the holder's PID and is removed on release. The
    kernel drops the lock when the holder dies, even by SIGKILL: the file it leaves behind is
    taken over by the next run. Without fcntl (Windows) the `filelock` package locks instead.
    `supported` is False where the file system has no locks (the run goes on unlocked).
    """

    def __init__(self, path: Path):
        self.path = path
        self.supported = True
        self._fd: int | None = None
        self._fallback = None

    def acquire(self) -> "ExclusiveLock":
        """Take the lock at once or raise LockBusy; OSError when the lock file cannot be made."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            return self._acquire_filelock()
        for _ in range(100):  # more than one round only when a holder removes the file meanwhile
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    pid = _read_pid(fd)
                    os.close(fd)
                    raise LockBusy(self.path, pid) from None
                os.close(fd)  # no locks on this file system (ENOLCK, EOPNOTSUPP, ...)
                self.supported = False
                _remove_if_empty(self.path)
                return self
            # Ours only if it is still the file at `path`: a holder that was releasing may have
            # removed it between our open and our flock.
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                current = False
            if current:
                self._fd = fd
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return self
            os.close(fd)
        raise LockBusy(self.path, None)

    def _acquire_filelock(self) -> "ExclusiveLock":
        import filelock

        lock = filelock.FileLock(str(self.path), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise LockBusy(self.path, None) from None
        self._fallback = lock
        return self

    def release(self) -> None:
        """Remove the lock file and drop the lock (removing first: whoever opened the file
        meanwhile finds it gone once it gets the lock, and tries again)."""
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None
        if self._fallback is not None:
            self._fallback.release()
            self._fallback = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
        return int(text) if text else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _remove_if_empty(path: Path) -> None:
    try:
        if os.stat(path).st_size == 0:
            os.unlink(path)
    except OSError:
        pass
