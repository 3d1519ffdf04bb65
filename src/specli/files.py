"""Writing files so that a crash never leaves half of one (batch output, the policy cache), and
the lock that keeps two `batch` runs from writing one output."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Iterable


def write_atomically(path: Path, lines: Iterable[str]) -> None:
    """Replace `path` with `lines` so that a crash leaves either the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
