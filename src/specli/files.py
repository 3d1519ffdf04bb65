"""Writing files so that a crash never leaves half of one (batch output, the policy cache)."""

from __future__ import annotations

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
