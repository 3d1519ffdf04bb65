"""Errors a user can act on.

Every failure that reaches the CLI is a SpecliError: one line naming the problem and the fix,
and the exit code the CLI returns (2 = bad usage or input, 1 = runtime failure; 130 is Ctrl-C).
"""

from __future__ import annotations

from typing import Callable

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # Ctrl-C (the shell's 128 + SIGINT)


class SpecliError(Exception):
    """A failure with a one-line, user-facing message and an exit code."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(SpecliError):
    """Bad options or input: the user must change what they typed."""

    exit_code = EXIT_USAGE


class SettingError(UsageError):
    """A setting the core refuses, named by its field (top_k, n_ctx): each front end names it
    its own way (the CLI by its option, --top-k) with `worded`."""

    def __init__(self, setting: str, message: Callable[[str], str]):
        super().__init__(message(setting))
        self.setting = setting
        self._message = message  # the message, given the name to call the setting by

    def worded(self, name: str) -> str:
        return self._message(name)


class ModelFileError(UsageError):
    """A model file that is missing, unreadable or not a valid GGUF."""


class IncompatibleDraftError(UsageError):
    """A draft model whose vocabulary does not match the target's."""


class RegistryError(UsageError):
    """A broken models.toml or an unknown model name."""
