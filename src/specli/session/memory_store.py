"""`--memory persist`: a token memory kept between runs, one file per tokenizer in the cache folder.

The file is `memory-<fingerprint>.tmem` (TokenMemory.to_bytes's checked binary form), where the
fingerprint is a hash of the target's vocabulary (tokenizer_fingerprint: its type, special
tokens and every token's text), so that every model sharing a tokenizer shares one memory and
no other model ever reads it. A run loads it at start (MemoryFile.open) and, after each finished
generation, adds it and saves (MemoryFile.remember): under an exclusive lock on
`memory-<fingerprint>.tmem.lock` beside it, the file is read again and only this run's new
documents are added to what it holds then (concurrent runs never lose each other's), bounded
(MAX_BYTES of file: PERSIST_BOUND tokens, the oldest documents out first), and written to a
temporary file created with mode 0600 (it holds the user's text) renamed over it.

A damaged, foreign (another tokenizer's fingerprint) or oversized file is ignored: one line for
stderr, and the run never writes that file. A save that cannot be made (the lock held too long,
a full disk) only costs the next runs this run's text.

The folder is the caller's (session/loading.py's cache_dir): this module imports nothing of the
session's.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import time
from pathlib import Path
from typing import Sequence

from specli.decoding.memory import MAX_TOKENS_LIMIT, MemoryFileError, TokenMemory
from specli.files import ExclusiveLock, LockBusy, write_bytes_atomically

MAX_BYTES = 64 << 20  # the most a memory file holds (and the most read of one)
# The latest million tokens (4-8 MB of file): its index (56 bytes a token) builds in 0.1-0.3 s at
# start; a bigger memory would make every run start slower than one without it.
PERSIST_BOUND = min(MAX_TOKENS_LIMIT, 1_000_000)
MEMORY_FILES = "memory-*.tmem"
MEMORY_TEMPORARY = ".memory-*.tmp"  # a save that did not finish
SAVE_WAIT_S = 30.0  # how long a save waits for another run's lock
FINGERPRINT_PREFIX = "vocab-sha256:"


def tokenizer_fingerprint(model) -> str:
    """A name for the target's tokenizer: a hash of its vocabulary type, size, special tokens
    and every token's text (`model`: a LlamaModel, or anything with vocab_info() and token_text)."""
    info = model.vocab_info()
    h = hashlib.sha256()
    h.update(struct.pack("<qqqq?", info.vocab_type, info.n_tokens, info.bos, info.eos, info.add_bos))
    for token in range(info.n_tokens):
        text = model.token_text(token)
        h.update(struct.pack("<I", len(text)))
        h.update(text)
    return FINGERPRINT_PREFIX + h.hexdigest()


def memory_path(folder: Path, fingerprint: str) -> Path:
    """The memory file of a tokenizer in `folder`."""
    digest = hashlib.sha256(fingerprint.encode("utf-8")).hexdigest()
    return folder / f"memory-{digest[:24]}.tmem"


def read_memory_file(path: Path, fingerprint: str | None) -> TokenMemory | None:
    """The memory saved at `path` (None: there is none), bounded to PERSIST_BOUND tokens.
    Raises MemoryFileError saying why it cannot be used (damaged, foreign, oversized, not a
    regular file, unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as err:
        raise MemoryFileError(f"it cannot be read ({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MemoryFileError("it is not a regular file")
        if st.st_size > MAX_BYTES:
            raise MemoryFileError(f"it is {st.st_size:,} bytes, more than {MAX_BYTES:,}")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except OSError as err:
        raise MemoryFileError(f"it cannot be read ({err.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise MemoryFileError(f"it is more than {MAX_BYTES:,} bytes")
    return TokenMemory.from_bytes(data, fingerprint=fingerprint, max_tokens=PERSIST_BOUND, limit=PERSIST_BOUND)


def write_memory_file(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, atomically, the new file mode 0600 (it holds the user's text)."""
    write_bytes_atomically(path, data, mode=0o600)


class MemoryFile:
    """The persisted memory of one tokenizer for one run: `memory` (what the drafters copy
    from, and add to), the file, and how much of the memory is saved. Documents added to the
    memory by anyone (MemoryFile.remember, or a server's or batch's drafters) are this run's
    to save: `save` writes those added since the last save."""

    def __init__(self, path: Path, fingerprint: str, memory: TokenMemory, *, usable: bool = True, notice: str | None = None):
        self.path = path
        self.fingerprint = fingerprint
        self.memory = memory
        self.usable = usable  # False: the file was ignored; this run never writes it
        self.notice = notice  # one line for stderr when the file was ignored
        self._saved = memory.n_added  # memory.n_added at the last save (what the file holds)

    @property
    def has_pending(self) -> bool:
        """Whether documents were added since the last save (and the file is this run's to write)."""
        return self.usable and self.memory.n_added != self._saved

    @property
    def pending(self) -> list[list[int]]:
        """This run's documents not yet saved (those the memory still holds)."""
        return self.memory.added_since(self._saved)

    @classmethod
    def open(cls, folder: Path, fingerprint: str, vocab_size: int | None = None) -> "MemoryFile":
        """The memory saved in `folder` for this tokenizer, or an empty one (with a notice when a
        file there is ignored). Never raises for what the file holds."""
        path = memory_path(folder, fingerprint)
        fresh = TokenMemory(fingerprint, max_tokens=PERSIST_BOUND, vocab_size=vocab_size)
        try:
            saved = read_memory_file(path, fingerprint)
            if saved is not None and vocab_size is not None and saved.vocab_size not in (None, vocab_size):
                raise MemoryFileError(f"it was made for a vocabulary of {saved.vocab_size} tokens, not {vocab_size}")
        except MemoryFileError as err:
            return cls(path, fingerprint, fresh, usable=False,
                       notice=f"specli: ignored the token memory {path} ({err}); this run neither uses nor saves it")
        return cls(path, fingerprint, saved if saved is not None else fresh)

    def remember(self, tokens: Sequence[int]) -> str | None:
        """A finished generation (prompt + output): into the memory, and saved. Returns a line
        for stderr when it could not be saved."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return None
        self.memory.add(tokens)
        return self.save()

    def save(self) -> str | None:
        """Add this run's unsaved documents to the file (see the module docstring). Returns a
        line for stderr when they could not be saved (they stay pending for the next save)."""
        if not self.has_pending:
            return None
        lock = ExclusiveLock(self.path.with_name(self.path.name + ".lock"))
        deadline = time.monotonic() + SAVE_WAIT_S
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    lock.acquire()
                    break
                except LockBusy as busy:
                    if time.monotonic() > deadline:
                        return f"specli: the token memory {self.path} stayed locked by another run ({busy}); this text was not saved"
                    time.sleep(0.02)
        except OSError as err:
            return f"specli: the token memory {self.path} cannot be saved ({err.strerror or err})"
        try:
            try:
                merged = read_memory_file(self.path, self.fingerprint)
            except MemoryFileError as err:
                self.usable = False
                return f"specli: ignored the token memory {self.path} ({err}); this run does not save it"
            if merged is None:
                merged = TokenMemory(self.fingerprint, max_tokens=PERSIST_BOUND, vocab_size=self.memory.vocab_size)
            upto = self.memory.n_added
            try:
                merged.extend(self.pending)
            except ValueError as err:  # (token ids outside the saved vocabulary)
                self.usable = False
                return f"specli: ignored the token memory {self.path} ({err}); this run does not save it"
            write_memory_file(self.path, merged.to_bytes())
            self._saved = upto
            return None
        except OSError as err:
            return f"specli: the token memory {self.path} cannot be saved ({err.strerror or err})"
        finally:
            lock.release()


def memory_rows(paths: Sequence[Path], now: float) -> list[dict]:
    """`specli cache`'s rows for memory files: fingerprint, size, tokens, documents, age (or why
    a file is ignored)."""
    out = []
    for path in paths:
        row: dict = {"file": str(path), "kind": "token-memory"}
        try:
            st = path.stat()
            row.update(bytes=st.st_size, saved_at=st.st_mtime, age_s=max(0.0, now - st.st_mtime))
            saved = read_memory_file(path, None)
        except (OSError, MemoryFileError) as err:
            row["ignored"] = str(err.strerror if isinstance(err, OSError) else err)
            out.append(row)
            continue
        if saved is None:
            continue
        if memory_path(path.parent, saved.fingerprint) != path:  # (what a run for its tokenizer would not read)
            row["ignored"] = f"it holds the memory of tokenizer {saved.fingerprint!r}, whose file is another"
            out.append(row)
            continue
        row.update(fingerprint=saved.fingerprint, tokens=saved.n_tokens, documents=saved.n_documents)
        out.append(row)
    return out
