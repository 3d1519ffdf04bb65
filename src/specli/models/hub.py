"""Hugging Face model names: `user/repo:QUANT` and `user/repo/file.gguf`, as llama.cpp's -hf.

A name resolves from the local Hugging Face cache first, with no network: the file form through
try_to_load_from_cache, the quant form by scanning the cached snapshot's files. Only what is not
cached is looked up on the hub (HfApi.list_repo_files for the quant form) and downloaded with
hf_hub_download (its progress bar, its cache). Every failure is one line saying what to do.
huggingface_hub is imported inside the functions (as `huggingface_hub.X`, so that tests can
replace X): only hub names need it, and the import is not free.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from specli.errors import RegistryError, SpecliError, UsageError
from specli.files import NotRegularFile, open_regular

# A repo id as the hub allows it ("org/name"), then ":QUANT" or "/path/in/repo.gguf".
_REPO = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
_QUANT_FORM = re.compile(rf"({_REPO}):([A-Za-z0-9][A-Za-z0-9_.-]*)")
_FILE_FORM = re.compile(rf"({_REPO})/((?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+\.gguf)", re.IGNORECASE)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HfRef:
    """A Hugging Face model name: a repo and either a quantization or a file in it."""

    repo: str
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else f"{self.repo}/{self.file}"


def parse_hf_ref(arg: str) -> HfRef | None:
    """`user/repo:QUANT` or `user/repo/file.gguf` as an HfRef; None for anything else.

    Only the syntax: a value naming an existing local file is a path (names.looks_like_path
    checks that first), so `models/x/y.gguf` on disk stays a file.
    """
    if arg.startswith((".", "~", "/")) or "\\" in arg or ".." in arg.split("/"):
        return None
    match = _QUANT_FORM.fullmatch(arg)
    if match:
        return HfRef(match.group(1), quant=match.group(2))
    match = _FILE_FORM.fullmatch(arg)
    if match:
        return HfRef(match.group(1), file=match.group(2))
    return None


# --- choosing files -------------------------------------------------------------------------------


def _split_parts(name: str) -> tuple[str, ...]:
    """Every part of a split GGUF named by one of them (first first); (name,) when not split."""
    match = _SPLIT.search(name)
    if not match or int(match.group(2)) < 2:
        return (name,)
    count = int(match.group(2))
    stem = name[: match.start()]
    return tuple(f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))


def _gguf_models(files: list[str]) -> list[tuple[str, ...]]:
    """The models among a repo's files: each a tuple of its parts, first part first. mmproj
    files (vision projectors) are no language model, as llama.cpp's -hf skips them too."""
    files = sorted(f for f in files if f.lower().endswith(".gguf"))
    present = set(files)
    models: dict[tuple[str, ...], None] = {}
    for f in files:
        if os.path.basename(f).lower().startswith("mmproj"):
            continue
        parts = _split_parts(f)
        if all(p in present for p in parts):  # an incomplete split set is no usable model
            models[parts] = None
    return list(models)


def _quant_re(quant: str) -> re.Pattern:
    # Case-insensitive, and not inside a longer quant name: Q4_K does not match Q4_K_M, Q4_0
    # does not match IQ4_0 (without the bounds Q4_K would be ambiguous in every K-quant repo).
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)


def _describe(models: list[tuple[str, ...]]) -> str:
    names = [m[0] + (f" (+{len(m) - 1} parts)" if len(m) > 1 else "") for m in models]
    return ", ".join(names) if names else "no GGUF files"


def pick_quant(ref: HfRef, files: list[str], where: str) -> tuple[str, ...] | None:
    """The parts of the one model in `files` whose path names ref.quant; None when none does;
    RegistryError listing the candidates when several do. `where` says whose listing it is."""
    models = _gguf_models(files)
    pattern = _quant_re(ref.quant or "")
    found = [m for m in models if pattern.search(m[0])]
    if len(found) > 1:
        raise RegistryError(
            f"{ref} is ambiguous: {len(found)} GGUF files in {where} name {ref.quant}: {_describe(found)}; "
            f"name one as {ref.repo}/FILE.gguf"
        )
    return found[0] if found else None


def _no_quant(ref: HfRef, files: list[str], where: str) -> RegistryError:
    return RegistryError(
        f"{ref.repo} has no GGUF file named with {ref.quant} ({where} has: {_describe(_gguf_models(files))}); "
        f"use {ref.repo}:QUANT with one of those, or {ref.repo}/FILE.gguf"
    )


# --- the local cache (no network) -------------------------------------------------------------


def cached_path(repo: str, filename: str) -> str | None:
    """The file's path in the local Hugging Face cache, or None (no network). A repo whose ref
    is damaged counts as not cached (see _commit): the hub client would read the ref as text,
    and a UnicodeDecodeError would end a whole listing."""
    import huggingface_hub

    if _main_ref(repo).exists() and _commit(_main_ref(repo)) is None:
        return None
    cached = huggingface_hub.try_to_load_from_cache(repo_id=repo, filename=filename)
    # Besides None it may return a "known not to exist" marker: not a path either.
    return cached if isinstance(cached, str) and os.path.isfile(cached) else None


def _main_ref(repo: str) -> Path:
    """Where the Hugging Face cache records the commit of the repo's main revision."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "refs" / "main"


def cached_snapshot(repo: str) -> Path | None:
    """The cached snapshot folder of the repo's main revision (what try_to_load_from_cache
    reads), or None when the repo is not cached."""
    ref = _main_ref(repo)
    commit = _commit(ref)
    snapshot = ref.parent.parent / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


_reported_refs: set[str] = set()  # damaged refs already named on stderr (one line each)


def _commit(ref: Path) -> str | None:
    """The commit a cache's ref names, or None when there is no such ref or it is damaged: only
    a regular file is read (a FIFO would block), a few bytes of it, and only a hexadecimal
    commit name is taken (one like "/" or "../.." would lead the listing out of the cache). A
    damaged ref is named on stderr once, with why it is skipped: the repo then looks absent,
    and the user could not tell why."""
    try:
        with open_regular(ref) as handle:
            text = handle.read(128).decode("ascii").strip()
    except FileNotFoundError:
        return None
    except NotRegularFile as err:
        return _skip_ref(ref, f"it is {err.kind}")
    except OSError as err:
        return _skip_ref(ref, f"it cannot be read ({err.strerror or err})")
    except UnicodeDecodeError:
        return _skip_ref(ref, "it is not text (it should hold a commit hash)")
    if not re.fullmatch(r"[0-9a-f]{7,64}", text):
        shown = text if len(text) <= 40 else text[:37] + "..."
        return _skip_ref(ref, f"{shown!r} is not a commit hash")
    return text


def _skip_ref(ref: Path, why: str) -> None:
    if str(ref) not in _reported_refs:
        _reported_refs.add(str(ref))
        print(f"specli: warning: skipped the Hugging Face cache ref {ref}: {why}; "
              "the repo counts as not downloaded (delete the ref; specli pull then fetches the repo again)", file=sys.stderr)
    return None


def cached_files(repo: str) -> list[str]:
    """Paths (relative, '/'-separated) of the files in the repo's cached snapshot."""
    snapshot = cached_snapshot(repo)
    if snapshot is None:
        return []
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def cached_ggufs() -> list[tuple[str, str, int]]:
    """(repo, file, bytes) of every GGUF model in the local Hugging Face cache (main revision),
    first parts only with the size of all parts; for `specli models`. No network."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE)
    out = []
    for folder in sorted(root.glob("models--*--*")) if root.is_dir() else []:
        repo = folder.name[len("models--"):].replace("--", "/", 1)
        snapshot = cached_snapshot(repo)
        if snapshot is None:
            continue
        for parts in _gguf_models(cached_files(repo)):
            size = sum((snapshot / p).stat().st_size for p in parts)
            out.append((repo, parts[0], size))
    return out


def ref_files(ref: HfRef, *, remote: bool) -> tuple[tuple[str, ...], bool]:
    """(the repo files of `ref`, first part first; whether they are all cached).

    The file form needs no listing. The quant form is chosen among the cached snapshot's files;
    only when none matches there and `remote` is True is the repo listed on the hub.
    """
    if ref.file is not None:
        parts = _split_parts(ref.file)
        return parts, all(cached_path(ref.repo, p) for p in parts)
    local = cached_files(ref.repo)
    found = pick_quant(ref, local, "the local cache")
    if found is not None:
        return found, True
    if not remote:
        raise RegistryError(f"{ref} is not downloaded; get it with: specli pull {ref}")
    files = list_repo_files(ref.repo)
    found = pick_quant(ref, files, ref.repo)
    if found is None:
        raise _no_quant(ref, files, ref.repo)
    return found, False


def list_repo_files(repo: str) -> list[str]:
    """The repo's files, from the hub (network); one-line SpecliError on failure."""
    import huggingface_hub

    check_reachable(f"list the files of {repo}")
    try:
        return list(huggingface_hub.HfApi().list_repo_files(repo))
    except Exception as exc:  # (Ctrl-C is no Exception)
        raise hub_error(exc, repo, None) from exc


# --- downloading -----------------------------------------------------------------------------------


class Fetched:
    """One file made local: its path, and whether it was already there."""

    def __init__(self, path: str, was_cached: bool, size: int):
        self.path, self.was_cached, self.size = path, was_cached, size


def is_offline() -> bool:
    """HF_HUB_OFFLINE (as huggingface_hub itself reads it, once at import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _access_hint(repo: str) -> str:
    """How to get access to a gated or private repo."""
    return (f"accept its licence on https://huggingface.co/{repo} and log in "
            "(`hf auth login`, or set HF_TOKEN to a token that has access)")


def hub_error(exc: BaseException, repo: str, filename: str | None, file_hint: str = "") -> SpecliError:
    """One-line SpecliError (exit 1: the hub, the network or the disk failed us) for a hub error.
    `file_hint` says where the missing file's name came from ("check hf_file in models.toml")."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    what = f"{repo}/{filename}" if filename else f"the file list of {repo}"
    if isinstance(exc, LocalEntryNotFoundError) and isinstance(exc.__cause__, HfHubHTTPError):
        # The library reports a failed HEAD (a 403, a 5xx) as "not in the cache"; the cause says why.
        exc = exc.__cause__
    status = getattr(getattr(exc, "response", None), "status_code", None)
    # Order matters: GatedRepoError is a RepositoryNotFoundError, both are HfHubHTTPErrors.
    if isinstance(exc, GatedRepoError):
        return SpecliError(f"{repo} is gated: {_access_hint(repo)}; then run specli pull again")
    if isinstance(exc, RepositoryNotFoundError) or status in (401, 403):
        return SpecliError(f"no access to {repo} (HTTP {status}): it does not exist, or it is private or gated: {_access_hint(repo)}")
    if isinstance(exc, RemoteEntryNotFoundError):
        hint = file_hint or "check the file name"
        return SpecliError(f"{repo} has no file {filename} (HTTP 404): {hint} against https://huggingface.co/{repo}/tree/main")
    if isinstance(exc, RevisionNotFoundError):
        return SpecliError(f"{repo} has no revision main (HTTP {status})")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)) or _is_connection_error(exc):
        if is_offline():
            return SpecliError(f"{what} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: unset it to download")
        return SpecliError(f"cannot reach {constants.ENDPOINT} to download {what}, and it is not in the cache: check the connection (or HF_ENDPOINT, the proxy)")
    if isinstance(exc, HfHubHTTPError):
        return SpecliError(f"downloading {what} failed: HTTP {status}")
    reason = " ".join(str(exc).split()) or type(exc).__name__  # library messages span lines
    return SpecliError(f"downloading {what} failed: {reason}")


def _is_connection_error(exc: BaseException) -> bool:
    # httpx is huggingface_hub's transport; matched by name so that no transport is imported here.
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    return bool(names & {"ConnectError", "ConnectTimeout", "TimeoutException", "ReadTimeout", "RemoteProtocolError"})


# How long a download waits for the hub's host name to resolve before leaving it to the
# client (which then retries as it does for any network error).
RESOLVE_WAIT_S = 10.0


def _direct_endpoint() -> tuple[str, str, int] | None:
    """(scheme, host, port) of the hub (HF_ENDPOINT) when specli reaches it itself; None when a
    proxy stands between (it resolves and connects for us), or the URL has no host or a bad port
    (the client reports those)."""
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    parts = urlsplit(constants.ENDPOINT)
    host = parts.hostname
    if not host:
        return None
    proxies = urllib.request.getproxies()  # as httpx (the hub's transport) finds them: the variables, or the system's
    if (proxies.get(parts.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host):
        return None
    try:
        return parts.scheme, host, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


@functools.lru_cache(maxsize=None)
def unresolvable_endpoint() -> tuple[str, str] | None:
    """(host, reason) when the hub's host name does not resolve, i.e. no network or no DNS;
    None when it resolves, when a proxy resolves it for us, or when the answer takes longer than
    RESOLVE_WAIT_S. Without this, huggingface_hub retries a failed lookup 5 times over 24 s,
    printing a line each time, before it gives up."""
    import socket
    import threading

    direct = _direct_endpoint()
    if direct is None:
        return None
    _, host, port = direct
    found: dict = {}

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            found["error"] = err.strerror or str(err)
        except (OSError, UnicodeError):
            pass

    thread = threading.Thread(target=resolve, name="specli-resolve", daemon=True)
    thread.start()
    thread.join(RESOLVE_WAIT_S)
    return (host, found["error"]) if "error" in found else None


def hub_timeout() -> float:
    """Seconds the hub gets to answer the first request of a download (SPECLI_HUB_TIMEOUT, for
    a slow link; 15 by default)."""
    try:
        seconds = float(os.environ.get("SPECLI_HUB_TIMEOUT", "") or 15)
    except ValueError:
        seconds = 15.0
    return seconds if 0 < seconds < 3600 else 15.0


@functools.lru_cache(maxsize=None)
def silent_endpoint() -> str | None:
    """Why the hub cannot answer, when a first request shows it: the connection is refused, or
    the hub accepts it and says nothing for hub_timeout() seconds; None when it answers (with
    any status: the client reports those), when a proxy stands between, or when the answer is
    unclear (TLS, a bad URL: the client reports those too). Without this, the client retries a
    refused or silent hub 5 times over minutes."""
    import http.client
    import socket

    direct = _direct_endpoint()
    if direct is None or direct[0] not in ("http", "https"):
        return None
    scheme, host, port = direct
    kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    connection = kind(host, port, timeout=hub_timeout())
    try:
        connection.request("HEAD", "/", headers={"User-Agent": "specli"})
        connection.getresponse()
    except ConnectionRefusedError:
        return f"{host}:{port} refuses connections"
    except (socket.timeout, TimeoutError):
        return f"{host}:{port} did not answer within {hub_timeout():g} s (SPECLI_HUB_TIMEOUT sets the wait)"
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        connection.close()
    return None


def check_reachable(what: str) -> None:
    """Raise the one-line offline error before any network call that cannot succeed."""
    if is_offline():
        raise SpecliError(f"cannot {what}: it is not in the Hugging Face cache and HF_HUB_OFFLINE is set: unset it to download")
    unresolved = unresolvable_endpoint()
    if unresolved is not None:
        host, reason = unresolved
        raise SpecliError(
            f"no network: the hub's host {host} does not resolve ({reason}), so specli cannot {what}, and it is "
            "not in the cache; check the connection (or HF_ENDPOINT, the proxy), or download the file elsewhere "
            "and pass it with -m PATH (HF_HUB_OFFLINE=1 uses only what is cached)"
        )
    silent = silent_endpoint()
    if silent is not None:
        raise SpecliError(f"cannot reach the hub: {silent}, so specli cannot {what}, and it is not in the cache; check the connection (or HF_ENDPOINT, the proxy)")


def fetch_file(repo: str, filename: str, file_hint: str = "") -> Fetched:
    """Download one file into the Hugging Face cache (resumes, skips what is there); raises SpecliError."""
    import huggingface_hub

    ref = _main_ref(repo)
    if os.path.lexists(ref) and _commit(ref) is None:  # (the client reads it as text: a FIFO would hang it)
        raise SpecliError(f"cannot download {repo}/{filename}: the Hugging Face cache ref {ref} is damaged; delete it, then run again")
    before = cached_path(repo, filename)
    if before is None and not is_offline():
        check_reachable(f"download {repo}/{filename}")
    try:
        # No token argument: the library reads HF_TOKEN or the `hf auth login` token itself.
        path = huggingface_hub.hf_hub_download(repo_id=repo, filename=filename)
    except Exception as exc:  # (Ctrl-C is no Exception: it stays an interruption)
        raise hub_error(exc, repo, filename, file_hint) from exc
    return Fetched(path, was_cached=before is not None and os.path.realpath(before) == os.path.realpath(path),
                   size=os.path.getsize(path))


def resolve_hf_ref(ref: HfRef, *, download: bool = True) -> Path:
    """The local path of `ref`'s GGUF (first part of a split one): from the cache when there,
    else (download=True) fetched on first use, with the hub's progress bar on stderr."""
    files, cached = ref_files(ref, remote=download)
    if not cached:
        if not download:
            raise RegistryError(f"{ref} is not downloaded; get it with: specli pull {ref}")
        check_reachable(f"download {ref}")  # offline: one line, not an announced download that fails
        print(f"specli: {ref} is not in the Hugging Face cache: downloading it (once)", file=sys.stderr, flush=True)
    paths = [fetch_file(ref.repo, f) if not cached else Fetched(cached_path(ref.repo, f) or "", True, 0) for f in files]
    path = paths[0].path
    if not path or not os.path.isfile(path):
        raise UsageError(f"{ref}: the cached file {files[0]} is missing; get it again with: specli pull {ref}")
    # Not resolved: the snapshot path is a symlink whose siblings are the other parts.
    return Path(path)
