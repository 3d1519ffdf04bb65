"""`specli cache` as data: what `--draft-max auto` saved in the cache folder (session/loading.py's
cache_dir), read with the same check a run makes, and forgetting it. cli/models.py renders."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from specli.decoding.policy import store as policy_store
from specli.decoding.policy.acceptance import PositionalAcceptance
from specli.errors import SpecliError
from specli.session.loading import cache_dir, read_policy_file
from specli.session.memory_store import MEMORY_FILES, MEMORY_TEMPORARY, memory_rows

POLICY_FILES = "policy-*.json"
TEMPORARY_FILES = ".policy-*.tmp"  # a save that did not finish


def cache_files(folder: Path, *patterns: str) -> list[Path]:
    """The files in the cache folder that match `patterns`, in order; none when there is no such
    folder; SpecliError when it cannot be read (an empty listing would say "0 files" there)."""
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as err:
        raise SpecliError(f"cannot read the cache folder {folder}: {err.strerror or err}; check its permissions (or set SPECLI_CACHE_DIR)") from None
    return [folder / name for name in sorted(names) if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def cache_rows(now: float) -> list[dict]:
    """Every policy file in the cache folder, as a JSON-ready dict: what it is for and what it
    holds, or why it is ignored ("ignored": the same check a run makes); then every token memory
    file of `--memory persist` ("kind": "token-memory", memory_store.memory_rows)."""
    folder = cache_dir()
    return policy_rows(folder) + memory_rows(cache_files(folder, MEMORY_FILES), now)


def policy_rows(folder: Path) -> list[dict]:
    out = []
    for path in cache_files(folder, POLICY_FILES):
        row: dict = {"file": str(path), "kind": "policy"}
        try:
            saved = read_policy_file(path)
        except policy_store.Rejected as err:
            row["ignored"] = str(err)
            out.append(row)
            continue
        if saved is None:
            continue
        sources = {}
        for name, record in saved.sources.items():
            acceptance = PositionalAcceptance(len(record.acceptance))
            for i, (judged, accepted) in enumerate(record.acceptance):
                acceptance.judged[i], acceptance.accepted[i] = judged, accepted
            sources[name] = {
                "draft_token_ms": None if record.t_draft is None else record.t_draft.seconds * 1000,
                "draft_start_ms": None if record.start_s is None else record.start_s.seconds * 1000,
                "acceptance_prior": [round(r, 3) for r in acceptance.rates(len(record.acceptance))],
                "acceptance_weight": [round(j, 3) for j, _ in record.acceptance],
            }
        row.update(
            key=saved.key,
            saved_at=saved.saved_at,
            pass_ms={
                str(n): {"ms": c.seconds * 1000, "samples": c.samples, "measured_at": c.at}
                for n, c in sorted(saved.passes.items())
            },
            context_us_per_token={"one_token_pass": saved.context_one * 1e6, "wide_pass": saved.context_wide * 1e6},
            cpu_per_second=saved.utilization,
            sources=sources,
        )
        out.append(row)
    return out


def clear_cache() -> tuple[Path, int, int]:
    """Remove every policy file and token memory file (and unfinished saves) from the cache
    folder: (the folder, how many policy files, how many memory files were removed). SpecliError
    when one cannot be removed."""
    folder = cache_dir()
    return folder, _remove(cache_files(folder, POLICY_FILES, TEMPORARY_FILES), POLICY_FILES), _remove(
        cache_files(folder, MEMORY_FILES, MEMORY_TEMPORARY), MEMORY_FILES)


def _remove(paths: list[Path], counted: str) -> int:
    """Unlink `paths`; how many of those matching `counted` were removed."""
    removed = 0
    for path in paths:
        try:
            path.unlink()
            removed += fnmatch.fnmatchcase(path.name, counted)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise SpecliError(f"cannot remove {path}: {err.strerror}; check its permissions") from None
    return removed
