"""Name resolution: a -m/-d value, a registry name or a Hugging Face name to a local GGUF.

A value that looks like a path is a path; a Hugging Face name (`user/repo:QUANT`,
`user/repo/file.gguf`) is found in, or downloaded to, the Hugging Face cache by models/hub.py;
anything else is a registry name (registry.py), whose sources are found offline: hf sources in
the Hugging Face cache only, package sources assembled by embedded.py. A registry source is
never downloaded here: that is `specli pull NAME`.
"""

from __future__ import annotations

import os
from pathlib import Path

from specli.errors import RegistryError
from specli.models.embedded import SourceStatus, package_status, resolve_package
from specli.models.registry import ModelSource, Registry, RegistryEntry

# A "(or: hf download ...)" alternative longer than this would bury the `specli pull` hint.
_SHORT_COMMAND = 120


def resolve_source(source: ModelSource) -> Path:
    """Return the local path of a source's GGUF (the first part of a split one), offline.

    package sources: import the module and call its assemble(), which writes the file under
    ~/.cache on first call. hf sources: look in the Hugging Face cache only; every part must be
    there (llama.cpp opens the first part and finds the others beside it). Raises
    RegistryError saying how to get the file when it is missing; never downloads.
    """
    if source.package:
        return resolve_package(source.package)
    if source.hf_repo and source.hf_files:
        return _resolve_hf(source)
    raise RegistryError("model source has neither package nor hf_repo + hf_file")


def _resolve_hf(source: ModelSource) -> Path:
    # Imported here: only hf sources need it, and the import is not free.
    from specli.models.hub import cached_path

    found: list[str] = []
    missing: list[str] = []
    for filename in source.hf_files:
        cached = cached_path(source.hf_repo, filename)  # (None too for a repo whose ref is damaged)
        if cached is not None:
            found.append(cached)
        else:
            missing.append(filename)
    if missing:
        what = (
            "is not downloaded"
            if len(missing) == len(source.hf_files)
            else (f"is only partly downloaded (missing {', '.join(missing)})")
        )
        raise RegistryError(f"model {source.hf_repo}/{source.hf_files[0]} {what}; {_how_to_get(source)}")
    # Not resolved: the snapshot path is a symlink whose siblings are the other parts, while
    # its target in blobs/ has a hash for a name and no siblings llama.cpp could find.
    return Path(found[0])


def _how_to_get(source: ModelSource) -> str:
    """'get it with: specli pull NAME (or: hf download ...)', the hf command only when short."""
    pull, hf = source.pull_command, source.download_command
    if not pull:
        return f"get it with: {hf}"
    if len(hf or "") <= _SHORT_COMMAND:
        return f"get it with: {pull} (or: {hf})"
    return f"get it with: {pull}"


def looks_like_path(arg: str) -> bool:
    """True when a -m value names a file rather than a registry entry or a Hugging Face name
    (`user/repo:QUANT`, `user/repo/file.gguf`: see models/hub.py); a file on disk wins, and so
    does a name whose first part is a folder here."""
    from specli.models.hub import parse_hf_ref

    if os.path.exists(arg):
        return True
    # A mistyped path under a local folder (models/nope/x.gguf) stays a path: never a download.
    if parse_hf_ref(arg) is not None and not os.path.isdir(arg.split("/", 1)[0]):
        return False
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    return (
        any(sep in arg for sep in separators)
        or arg.lower().endswith(".gguf")
        or os.path.exists(arg)
    )


def resolve_model_arg(arg: str, registry: Registry, download: bool = True) -> tuple[Path, RegistryEntry | None]:
    """Resolve a CLI -m value: a GGUF path, or a registry name.

    A value with a path separator, a .gguf ending, or naming something on disk is a path: it
    comes back as a Path (with ~ expanded) and None, unchecked; the model loader reports a bad
    file. A Hugging Face name (`user/repo:QUANT`, `user/repo/file.gguf`) comes from the local
    Hugging Face cache, else is downloaded once when `download` is True (models/hub.py), and
    None. Anything else is looked up in `registry`; returns its target's local path and the
    entry. Raises RegistryError for an unknown name or a target that is not available locally.
    """
    from specli.models.hub import parse_hf_ref, resolve_hf_ref

    if looks_like_path(arg):
        return Path(arg).expanduser(), None
    ref = parse_hf_ref(arg)
    if ref is not None:
        return resolve_hf_ref(ref, download=download), None
    entry = registry.get(arg)
    return resolve_source(entry.target), entry


def draft_entry(arg: str, registry: Registry) -> RegistryEntry | None:
    """The registry pair a -d value names by its draft model, or None (a path, or anything else
    resolve_model_arg understands). A pair's name means the pair: as -d, its draft model; an
    entry drafted by prompt lookup has none, so its name means its (only) model."""
    if looks_like_path(arg):
        return None
    entry = registry.entries.get(arg)
    return entry if entry is not None and entry.draft is not None else None


def resolve_draft_arg(arg: str, registry: Registry) -> tuple[Path, RegistryEntry | None]:
    """Resolve a CLI -d value: a pair's name gives that pair's draft file (see draft_entry),
    anything else resolves as a -m value (resolve_model_arg)."""
    entry = draft_entry(arg, registry)
    if entry is not None:
        return resolve_source(entry.draft), entry
    return resolve_model_arg(arg, registry)


# --- offline availability (for `specli models` and `specli fit`) ------------------------------


def source_status(source: ModelSource) -> SourceStatus:
    """Check offline whether `source` is available locally; never downloads or assembles.

    A package source counts when its module imports and its assembled file exists; else an hf
    source counts when every part is in the Hugging Face cache.
    """
    if source.package:
        status = package_status(source.package)
        if status.downloaded or not (source.hf_repo and source.hf_files):
            return status
    if source.hf_repo and source.hf_files:
        return _hf_status(source)
    return SourceStatus(False, None, "no source")


def _hf_status(source: ModelSource) -> SourceStatus:
    """Every part of an hf source looked up in the local Hugging Face cache."""
    from specli.models.hub import cached_path

    found: list[str] = []
    for filename in source.hf_files:
        cached = cached_path(source.hf_repo, filename)  # (None too for a repo whose ref is damaged)
        if cached is not None:
            found.append(cached)
    n = len(source.hf_files)
    if len(found) == n:
        return SourceStatus(True, Path(found[0]), "in the Hugging Face cache")
    if found:
        return SourceStatus(False, None, f"{len(found)} of {n} parts in the Hugging Face cache")
    return SourceStatus(False, None, "not downloaded")
