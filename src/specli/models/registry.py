"""The model registry: names for target/draft pairs, read from models.toml.

The shipped models.toml is package data of specli.models (see the schema in its header). A
user's own models.toml extends it (user_registry_path): its entries add to the shipped ones or
replace those of the same name, and it may change `default`.
This module loads and checks both, and finds the local file of a model WITHOUT any network
access: downloading is `specli pull NAME` (cli/models.py) or the user's own `hf download ...`.
Every problem is a RegistryError with a one-line message naming the file, line and key.
"""

from __future__ import annotations

import importlib
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

from specli.modes import DraftMode
from specli.errors import RegistryError
from specli.files import open_to_read

REGISTRY_FILE = "models.toml"
# The user's own registry: this variable names it, else the config dir's models.toml if present.
USER_REGISTRY_ENV = "SPECLI_MODELS"
# A "(or: hf download ...)" alternative longer than this would bury the `specli pull` hint.
_SHORT_COMMAND = 120

DEMO_EXTRA_HINT = (
    "the default model needs the demo extra ({reason}): pip install 'specli[demo]', "
    "or from a checkout: pip install '.[demo]'"
)

# Optional integer facts a source may carry, used by `specli fit` while the file is not
# downloaded (it reads a local file's header instead); each must be >= 1.
FACT_KEYS = ("size_bytes", "n_layer", "n_head_kv", "head_dim", "n_ctx_train", "n_vocab")
_SOURCE_KEYS = frozenset(("package", "hf_repo", "hf_file", *FACT_KEYS))
_ENTRY_KEYS = frozenset(("description", "target", "draft", "acceptance", "n_speculative"))
_TOP_KEYS = frozenset(("default", "models"))

# A name must not look like a path, or `-m NAME` would be taken for a file (resolve_model_arg).
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
        raise _toml_error(exc, label) from None
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
        raise _toml_error(exc, label) from None
    return _Checker(text, label).registry(data, path)


def _toml_error(exc: Exception, label: str) -> RegistryError:
    """Turn a TOMLDecodeError into a one-line RegistryError with the line number."""
    message = str(exc)
    # tomllib puts the position in the message: "... (at line 3, column 7)".
    match = re.search(r"\s*\(at line (\d+), column (\d+)\)", message)
    if match:
        line, column = match.groups()
        reason = message[: match.start()] + message[match.end() :]
        return RegistryError(f"{label}:{line}: invalid TOML: {reason.strip()} (column {column})")
    return RegistryError(f"{label}: invalid TOML: {message}")


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
        self.locations = _key_locations(text)

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


# --- line numbers ------------------------------------------------------------------------


def _split_key(key: str) -> tuple[str, ...]:
    """Split a TOML dotted key ('models."qwen-2.5".target') into its parts, unquoted."""
    parts, current, quote = [], "", None
    for char in key:
        if quote:
            if char == quote:
                quote = None
            else:
                current += char
        elif char in "\"'":
            quote = char
        elif char == ".":
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return tuple(parts)


_HEADER_RE = re.compile(r"\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""  # bare, "basic" or 'literal'
_KEY_RE = re.compile(rf"\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")


def _key_locations(text: str) -> dict[tuple[str, ...], int]:
    """Map each table header and key in TOML text to its (first) 1-based line number.

    A light scan, not a parser: it only has to point error messages at the right line, and it
    runs on text tomllib has already accepted.
    """
    locations: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER_RE.match(line)
        if header:
            table = _split_key(header.group(1))
            locations.setdefault(table, number)
            continue
        key = _KEY_RE.match(line)
        if key:
            locations.setdefault((*table, *_split_key(key.group(1))), number)
    return locations


# --- resolving to local files ----------------------------------------------------------------


def resolve_source(source: ModelSource) -> Path:
    """Return the local path of a source's GGUF (the first part of a split one), offline.

    package sources: import the module and call its assemble(), which writes the file under
    ~/.cache on first call. hf sources: look in the Hugging Face cache only; every part must be
    there (llama.cpp opens the first part and finds the others beside it). Raises
    RegistryError saying how to get the file when it is missing; never downloads.
    """
    if source.package:
        return _resolve_package(source.package)
    if source.hf_repo and source.hf_files:
        return _resolve_hf(source)
    raise RegistryError("model source has neither package nor hf_repo + hf_file")


def _resolve_package(module_name: str) -> Path:
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
    either no file or the whole one; a partial file left by an older assembly (the package's
    own assemble() writes in place) is detected by its size or hash and replaced.
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
