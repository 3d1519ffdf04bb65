"""`specli bench`: measure what speculative decoding gets on this machine, pair and prompts.

Registers on the shared Typer `app`; cli.py imports this module once.
"""

from __future__ import annotations

from .cli import app  # noqa: F401
