"""The model registry: names for target/draft pairs, read from models.toml.

The shipped models.toml is package data of specli.models (see the schema in its header). A
user's own models.toml extends it (user_registry_path): its entries add to the shipped ones or
replace those of the same name, and it may change `default`.
This module loads and checks both, WITHOUT any network access. Finding a model's local file is
names.py (the demo model's assembly: embedded.py); downloading is `specli pull NAME`
(cli/models.py) or the user's own `hf download ...`.
Every problem is a RegistryError with a one-line message naming the file, line and key.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import stat as _stat
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from specli.errors import RegistryError
from specli.files import open_to_read
from specli.models.toml_lines import key_locations, toml_error
from specli.modes import DraftMode

REGISTRY_FILE = "models.toml"
# The user's own registry: this variable names it, else the config dir's models.toml if present.
USER_REGISTRY_ENV = "SPECLI_MODELS"

# Optional integer facts a source may carry, used by `specli fit` while the file is not
# downloaded (it reads a local file's header instead); each must be >= 1.
FACT_KEYS = ("size_bytes", "n_layer", "n_head_kv", "head_dim", "n_ctx_train", "n_vocab")
_SOURCE_KEYS = frozenset(("package", "hf_repo", "hf_file", *FACT_KEYS))
_ENTRY_KEYS = frozenset(("description", "target", "draft", "acceptance", "n_speculative"))
_TOP_KEYS = frozenset(("default", "models"))

# A name must not look like a path, or `-m NAME` would be taken for a file (names.resolve_model_arg).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HF_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class ModelSource:
    """Where one GGUF model comes from, plus optional facts about it.

    package: an importable module whose assemble() returns the GGUF path (the demo model).
    hf_repo / hf_files: a Hugging Face repo and the file(s) in it; a split GGUF lists every
    part, first part first. Facts are None when models.toml does not give them.
    """

    hf_repo: str | None = None
    hf_files: tuple[str, ...] = ()
    package: str | None = None
    size_bytes: int | None = None
    n_layer: int | None = None
    n_head_kv: int | None = None
    head_dim: int | None = None
    n_ctx_train: int | None = None
    n_vocab: int | None = None
    # The registry entry this source belongs to, for `specli pull NAME` hints; not part of what
    # the source *is*, so two sources with the same files still compare equal.
    entry_name: str | None = field(default=None, compare=False)

    @property
    def pull_command(self) -> str | None:
        """`specli pull NAME` for a source read from a registry entry, or None."""
        return f"specli pull {self.entry_name}" if self.entry_name else None

    @property
    def download_command(self) -> str | None:
        """The `hf download` command that fetches every file of this source, or None."""
        if not self.hf_repo:
            return None
        return " ".join(["hf", "download", self.hf_repo, *self.hf_files])


@dataclass(frozen=True)
class RegistryEntry:
    """One named model: a target, and how it is drafted.

    draft is None when lookup is True (prompt lookup drafting needs no draft model).
    acceptance is the expected (low, high) acceptance rate; n_speculative the suggested N.
    """

    name: str
    description: str
    target: ModelSource
    draft: ModelSource | None
    lookup: bool
    acceptance: tuple[float, float] | None
    n_speculative: int | None
    is_default: bool


@dataclass(frozen=True)
class Registry:
    """All entries of a models.toml, in file order, and the default one.

    path: the shipped file; user_path: the user's file merged over it, if any.
    """

    entries: dict[str, RegistryEntry]
    default_name: str
    path: Path | None = None
    user_path: Path | None = None

    @property
    def default(self) -> RegistryEntry:
        """The entry named by `default` in models.toml."""
        return self.entries[self.default_name]

    def get(self, name: str) -> RegistryEntry:
        """Return the entry called `name`; RegistryError listing the known names if none."""
        try:
            return self.entries[name]
        except KeyError:
            known = ", ".join(self.entries)
            where = f"models.toml and {self.user_path}" if self.user_path else "models.toml"
            raise RegistryError(f"unknown model {name!r}; known: {known} (see {where})") from None


# --- loading -------------------------------------------------------------------------------


def load_registry(path: Path | None = None) -> Registry:
    """Read and check a models.toml; with no path, the one shipped with specli.

    The shipped file is looked up as package data first (installed wheel), then at the
    repository root (editable install or checkout). Returns a Registry; raises RegistryError
    naming the file, line and key for a missing file, bad TOML or a schema violation.
    """
    if path is None:
        text, label, path = _read_shipped()
    else:
        path = Path(path)
        text, label = _read_file(path), str(path)
    return parse_registry(text, label, path=path)


# A models.toml is a few kilobytes; a larger file is a wrong path (a log, a disk image).
MAX_REGISTRY_BYTES = 4 << 20


def _read_file(path: Path) -> str:
    """The text of a registry file; RegistryError naming it when unreadable, not a regular
    file (a device such as /dev/zero, a FIFO: never read), over MAX_REGISTRY_BYTES or not UTF-8."""
    try:
        with open_to_read(path) as (handle, info):
            if not _stat.S_ISREG(info.st_mode):
                kind = "a directory" if _stat.S_ISDIR(info.st_mode) else "not a regular file"
                raise RegistryError(f"model registry {path} is {kind}; give the path of a models.toml file")
            if info.st_size > MAX_REGISTRY_BYTES:
                raise RegistryError(f"model registry {path} is {info.st_size} bytes, over the {MAX_REGISTRY_BYTES >> 20} MiB a models.toml may have; check the path")
            data = handle.read(MAX_REGISTRY_BYTES + 1)
    except OSError as exc:
        raise RegistryError(f"cannot read model registry {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_REGISTRY_BYTES:  # it grew meanwhile
        raise RegistryError(f"model registry {path} is over the {MAX_REGISTRY_BYTES >> 20} MiB a models.toml may have; check the path")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise RegistryError(f"{path}: not UTF-8 text") from None


def user_config_dir() -> Path:
    """specli's config directory: $XDG_CONFIG_HOME/specli, else ~/.config/specli."""
    base = os.environ.get("XDG_CONFIG_HOME")
    # The XDG spec says to ignore a relative value.
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "specli"


def user_registry_path(registry_file: str | Path | None = None) -> Path | None:
    """The user's own models.toml, or None when there is none.

    In order: `registry_file` (a --registry option), the SPECLI_MODELS variable, then
    models.toml in the config dir when it exists. A file named explicitly (option or variable)
    must exist; the config dir's is optional.
    """
    if registry_file:
        return Path(registry_file).expanduser()
    from_env = os.environ.get(USER_REGISTRY_ENV)
    if from_env:
        return Path(from_env).expanduser()
    default = user_config_dir() / REGISTRY_FILE
    return default if default.is_file() else None


def load_effective_registry(registry_file: str | Path | None = None) -> Registry:
    """The shipped registry extended by the user's own models.toml (see user_registry_path).

    User entries replace shipped ones of the same name (whole entries, not key by key) and
    come after the others otherwise; the user's `default`, if given, wins. Errors in the user
    file name that file, its line and the key.
    """
    shipped = load_registry()
    user_path = user_registry_path(registry_file)
    if user_path is None:
        return shipped
    return parse_user_registry(_read_file(user_path), str(user_path), shipped, path=user_path)


def parse_user_registry(text: str, label: str, base: Registry, path: Path | None = None) -> Registry:
    """Parse a user's models.toml and merge it over `base`; `label` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise toml_error(exc, label) from None
    return _Checker(text, label).overlay(data, base, path)


def _read_shipped() -> tuple[str, str, Path | None]:
    """Return (text, label, path) of the shipped models.toml (package data of specli.models);
    RegistryError if absent."""
    try:
        resource = importlib.resources.files(__package__).joinpath(REGISTRY_FILE)
        local = Path(str(resource)) if isinstance(resource, Path) else None
        return resource.read_text(encoding="utf-8"), REGISTRY_FILE, local
    except (ModuleNotFoundError, OSError):
        raise RegistryError(f"model registry not found: {__package__}/{REGISTRY_FILE} is missing; reinstall specli") from None


def parse_registry(text: str, label: str = REGISTRY_FILE, path: Path | None = None) -> Registry:
    """Parse models.toml text into a Registry; `label` names the file in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise toml_error(exc, label) from None
    return _Checker(text, label).registry(data, path)


def _show(value: Any) -> str:
    """A TOML-like rendering of a value for error messages ("five", 3, [0.9, 0.6])."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "a table"
    return str(value)


def _is_int(value: Any) -> bool:
    # bool is an int subclass in Python, but `true` is no count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Checker:
    """Checks parsed models.toml data against the schema, naming lines in its errors."""

    def __init__(self, text: str, label: str):
        self.label = label
        self.locations = key_locations(text)

    def fail(self, key: tuple[str, ...], message: str) -> RegistryError:
        """A RegistryError for `key` ('models.x.n_speculative ' + message), with its line."""
        line = self.line_of(key)
        where = f"{self.label}:{line}" if line else self.label
        dotted = ".".join(key)
        return RegistryError(f"{where}: {dotted} {message}" if key else f"{where}: {message}")

    def line_of(self, key: tuple[str, ...]) -> int | None:
        """Line of the key itself, else of its first sub-key, else of its nearest parent."""
        for n in range(len(key), 0, -1):
            prefix = key[:n]
            if prefix in self.locations:
                return self.locations[prefix]
            # A table only ever named in longer headers ([modles.x] for key "modles").
            inner = [line for path, line in self.locations.items() if path[:n] == prefix]
            if inner:
                return min(inner)
        return None

    def unknown_keys(self, table: dict, allowed: frozenset, at: tuple[str, ...], what: str) -> None:
        """Raise for the first key of `table` not in `allowed` (a typo, most likely)."""
        for key in table:
            if key not in allowed:
                raise self.fail(
                    (*at, key),
                    f"is not a known key of {what} (known: {', '.join(sorted(allowed))})",
                )

    def registry(self, data: dict, path: Path | None) -> Registry:
        self.unknown_keys(data, _TOP_KEYS, (), "the registry")
        if "models" not in data:
            raise self.fail((), "missing the [models.NAME] tables")
        models = data["models"]
        if not isinstance(models, dict) or not models:
            raise self.fail(("models",), "must hold at least one [models.NAME] table")
        if "default" not in data:
            raise self.fail((), 'missing default = "NAME" (the model used when none is given)')
        default = data["default"]
        if not isinstance(default, str):
            raise self.fail(("default",), f"must be a model name (a string), got {_show(default)}")
        if default not in models:
            raise self.fail(
                ("default",), f"names unknown model {default!r}; known: {', '.join(models)}"
            )
        entries = {
            name: self.entry(name, table, is_default=(name == default))
            for name, table in models.items()
        }
        return Registry(entries=entries, default_name=default, path=path)

    def overlay(self, data: dict, base: Registry, path: Path | None) -> Registry:
        """A user file over `base`: both keys optional, `default` may name a shipped entry."""
        self.unknown_keys(data, _TOP_KEYS, (), "the registry")
        models = data.get("models", {})
        if not isinstance(models, dict):
            raise self.fail(("models",), "must hold [models.NAME] tables")
        default = data.get("default", base.default_name)
        if not isinstance(default, str):
            raise self.fail(("default",), f"must be a model name (a string), got {_show(default)}")
        known = [*base.entries, *(n for n in models if n not in base.entries)]
        if default not in known:
            raise self.fail(("default",), f"names unknown model {default!r}; known: {', '.join(known)}")
        # Parsed before merging so that every error names the user's file and line.
        mine = {name: self.entry(name, table, is_default=False) for name, table in models.items()}
        merged = {**base.entries, **mine}
        entries = {name: replace(e, is_default=(name == default)) for name, e in merged.items()}
        return Registry(entries=entries, default_name=default, path=base.path, user_path=path)

    def entry(self, name: str, table: Any, is_default: bool) -> RegistryEntry:
        at = ("models", name)
        if not _NAME_RE.fullmatch(name) or name.lower().endswith(".gguf"):
            raise self.fail(
                at,
                "is not a valid model name: use letters, digits, '.', '_', '-' and no .gguf ending",
            )
        if not isinstance(table, dict):
            raise self.fail(at, f"must be a table ([models.{name}]), got {_show(table)}")
        self.unknown_keys(table, _ENTRY_KEYS, at, "a model")
        for required in ("description", "target", "draft"):
            if required not in table:
                raise self.fail((*at, required), "is missing (required)")

        description = table["description"]
        if not isinstance(description, str) or not description.strip():
            raise self.fail(
                (*at, "description"), f"must be a non-empty string, got {_show(description)}"
            )

        target = replace(self.source(table["target"], (*at, "target")), entry_name=name)

        draft_value = table["draft"]
        if draft_value == DraftMode.LOOKUP:
            draft, lookup = None, True
        elif isinstance(draft_value, dict):
            draft, lookup = replace(self.source(draft_value, (*at, "draft")), entry_name=name), False
        else:
            raise self.fail(
                (*at, "draft"),
                f'must be "lookup" or a table like the target, got {_show(draft_value)}',
            )

        acceptance = None
        if "acceptance" in table:
            acceptance = self.acceptance(table["acceptance"], (*at, "acceptance"))

        n_speculative = table.get("n_speculative")
        if n_speculative is not None and not (_is_int(n_speculative) and n_speculative >= 1):
            raise self.fail(
                (*at, "n_speculative"), f"must be an integer >= 1, got {_show(n_speculative)}"
            )

        return RegistryEntry(
            name=name,
            description=description.strip(),
            target=target,
            draft=draft,
            lookup=lookup,
            acceptance=acceptance,
            n_speculative=n_speculative,
            is_default=is_default,
        )

    def acceptance(self, value: Any, at: tuple[str, ...]) -> tuple[float, float]:
        ok = (
            isinstance(value, list)
            and len(value) == 2
            and all(_is_number(v) for v in value)
            and 0 <= value[0] <= value[1] <= 1
        )
        if not ok:
            raise self.fail(
                at, f"must be [low, high] with 0 <= low <= high <= 1, got {_show(value)}"
            )
        return (float(value[0]), float(value[1]))

    def source(self, table: Any, at: tuple[str, ...]) -> ModelSource:
        if not isinstance(table, dict):
            raise self.fail(
                at, f"must be a table (package and/or hf_repo + hf_file), got {_show(table)}"
            )
        self.unknown_keys(table, _SOURCE_KEYS, at, "a model source")

        package = table.get("package")
        if package is not None and not (isinstance(package, str) and package.isidentifier()):
            raise self.fail(
                (*at, "package"), f"must be an importable module name, got {_show(package)}"
            )

        hf_repo = table.get("hf_repo")
        if hf_repo is not None and not (
            isinstance(hf_repo, str) and _HF_REPO_RE.fullmatch(hf_repo)
        ):
            raise self.fail(
                (*at, "hf_repo"), f'must be a Hugging Face repo id "org/name", got {_show(hf_repo)}'
            )

        hf_file = table.get("hf_file")
        files: tuple[str, ...] = ()
        if hf_file is not None:
            raw = [hf_file] if isinstance(hf_file, str) else hf_file
            if not (
                isinstance(raw, list) and raw and all(isinstance(f, str) and f.strip() for f in raw)
            ):
                raise self.fail(
                    (*at, "hf_file"),
                    f"must be a file name or a non-empty list of them, got {_show(hf_file)}",
                )
            files = tuple(raw)

        if (hf_repo is None) != (hf_file is None):
            missing = "hf_file" if hf_file is None else "hf_repo"
            raise self.fail((*at, missing), "is missing (hf_repo and hf_file go together)")
        if package is None and hf_repo is None:
            raise self.fail(at, "needs package or hf_repo + hf_file")

        facts = {}
        for key in FACT_KEYS:
            value = table.get(key)
            if value is not None and not (_is_int(value) and value >= 1):
                raise self.fail((*at, key), f"must be an integer >= 1, got {_show(value)}")
            facts[key] = value

        return ModelSource(hf_repo=hf_repo, hf_files=files, package=package, **facts)
