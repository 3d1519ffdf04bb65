"""How a generation stops: its reasons (STOP_*), its stop strings, and the code-completion
limits of llama-server's /infill requests (LineLimits). Generation.record applies them.

The code-completion limits of llama-server's /infill requests, which editors rely on to get a
completion that stops where the code block it completes ends:

- n_indent: the generation ends at the first line (after the cursor's own) that starts with
  less indentation (spaces and tabs) than n_indent; the text is cut before that line's first
  other character (a blank line counts as less indented, as in llama-server). llama.vscode and
  llama.vim send the cursor line's indentation.
- t_max_predict_ms: once that many milliseconds have passed since the first token, the
  generation ends at the next token that holds a newline (kept): a slow completion still ends
  on a whole line.

Generation.record shows each token's text to `after_token`, which says whether and where the
text ends. llama-server checks a line a token or two after its first character came (its
process_token looks at one newline per token); here each line is checked as it comes, so the
text is the same unless the generation ended within those tokens, and no text past the cut is
ever sent, streamed or not.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from specli.errors import SettingError

STOP_EOS = "eos"
STOP_MAX_TOKENS = "max_tokens"
STOP_CONTEXT_FULL = "context_full"
STOP_INTERRUPTED = "interrupted"
STOP_STRING = "stop"  # the text reached one of the generation's stop strings
# An /infill request's limits (LineLimits, below): a line indented less than n_indent, and a
# newline after t_max_predict_ms; like a stop string, each cuts the text where it ends.
STOP_INDENT = "indent"
STOP_TIME_LIMIT = "time_limit"
_CUTTING = (STOP_STRING, STOP_INDENT, STOP_TIME_LIMIT)  # reasons whose cut leaves no held text to flush


def check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    """The stop strings as a tuple; SettingError("stop") for an empty one (it would match at once)."""
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise SettingError("stop", lambda name: f"{name} needs non-empty text (an empty stop string would end every generation at once)")
    return stop


def first_stop(text: str, start: int, stop: Sequence[str]) -> int | None:
    """Where the first stop string to be completed in `text` after position `start` begins
    (None: none is). Scanning end positions in order makes the cut the one a character-by-
    character stream would find, however the text is split into tokens; at one end position
    the longest stop string wins (it begins first)."""
    by_length = sorted(stop, key=len, reverse=True)
    for end in range(start + 1, len(text) + 1):
        for s in by_length:
            if text.endswith(s, 0, end):
                return end - len(s)
    return None


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins a stop string without completing
    it: text that must be held back until what follows shows whether a stop string is there."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


_INDENT = " \t"


class LineLimits:
    """One generation's n_indent and t_max_predict_ms (0 or None: off); stateful, use once."""

    def __init__(self, n_indent: int = 0, t_max_predict_ms: Optional[float] = None, clock: Callable[[], float] = time.perf_counter):
        self.n_indent = n_indent
        self.t_max_s = t_max_predict_ms / 1000 if t_max_predict_ms is not None and t_max_predict_ms > 0 else None
        self._clock = clock
        self._t0: Optional[float] = None  # the first token's time (llama-server: the generation's start)
        self._line: Optional[int] = None  # where the line being checked starts (None: looking for a newline)
        self._scan = 0  # where to look for the next newline

    @property
    def active(self) -> bool:
        return self.n_indent > 0 or self.t_max_s is not None

    def after_token(self, text: str, start: int) -> Optional[tuple[str, int]]:
        """After a token whose text is text[start:] (`text`: all the generation's text so far):
        None to go on, or (stop reason, where the text ends)."""
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        if self.n_indent > 0:
            cut = self._short_line(text)
            if cut is not None:
                return STOP_INDENT, cut
        if self.t_max_s is not None and "\n" in text[start:] and now - self._t0 > self.t_max_s:
            return STOP_TIME_LIMIT, len(text)
        return None

    def _short_line(self, text: str) -> Optional[int]:
        """Where the first line indented less than n_indent starts its text, once known."""
        while True:
            if self._line is None:
                newline = text.find("\n", self._scan)
                if newline < 0:
                    self._scan = len(text)
                    return None
                self._line = newline + 1
            pos = self._line
            while pos < len(text) and text[pos] in _INDENT:
                pos += 1
            if pos == len(text):
                return None  # (only indentation so far: the next token tells)
            if pos - self._line < self.n_indent:
                return pos
            self._line, self._scan = None, pos
