"""Commands about models rather than generation (`specli models`, `specli fit`).

They register on the shared Typer `app`; cli.py imports this module once.
"""

from __future__ import annotations

from .cli import app  # noqa: F401
