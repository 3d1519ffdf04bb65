"""Where things sit in a TOML text: line numbers for models.toml's one-line error messages."""

from __future__ import annotations

import re

from specli.errors import RegistryError


def toml_error(exc: Exception, label: str) -> RegistryError:
    """Turn a TOMLDecodeError into a one-line RegistryError with the line number."""
    message = str(exc)
    # tomllib puts the position in the message: "... (at line 3, column 7)".
    match = re.search(r"\s*\(at line (\d+), column (\d+)\)", message)
    if match:
        line, column = match.groups()
        reason = message[: match.start()] + message[match.end() :]
        return RegistryError(f"{label}:{line}: invalid TOML: {reason.strip()} (column {column})")
    return RegistryError(f"{label}: invalid TOML: {message}")


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


def key_locations(text: str) -> dict[tuple[str, ...], int]:
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
