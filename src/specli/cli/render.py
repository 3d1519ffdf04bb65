"""What a person sees: the streamed text on stdout and live stats on stderr.

This module only renders; it gets the engine's steps and stats and never drives generation.
stdout carries the generated text and nothing else. stderr carries a live status line (only on
a terminal) and a one-line summary (unless --quiet).
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from typing import Callable, TextIO

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from specli.decoding.generation import Generation, Step
from specli.decoding.stats import Stats

ACCEPTED_SGR, RESET_SGR = "\x1b[36m", "\x1b[39m"  # --show-accept: text from accepted drafts in cyan
LOW_ACCEPTANCE = 0.5  # below this, drafting likely costs more than it saves


def color_allowed(stream: TextIO) -> bool:
    """Colour only for a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    return stream.isatty() and "NO_COLOR" not in os.environ


class TextOutput:
    """Writes generated text to stdout as it is accepted, optionally colouring drafted text."""

    def __init__(self, stream: TextIO, *, show_accept: bool):
        self.stream = stream
        self.colour = show_accept and color_allowed(stream)

    def write(self, step: Step) -> None:
        if self.colour and step.text_drafted:
            # Raw SGR codes around the raw text: tabs and carriage returns stay as generated.
            self.stream.write(ACCEPTED_SGR + step.text_drafted + RESET_SGR + step.text_own)
        else:
            self.stream.write(step.text)
        self.stream.flush()

    def write_text(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def status_text(stats: Stats, *, with_drafting: bool) -> Text:
    """The live line: speed, acceptance, tokens per target pass, where the time goes."""
    tps = stats.tokens_per_s
    line = Text()
    line.append(f"{stats.n_tokens} tokens", style="bold")
    line.append(f"  {tps:.1f} tok/s" if tps else "  - tok/s")
    if with_drafting:
        rate = stats.acceptance_rate
        line.append("  accepted ")
        line.append(f"{rate:.0%}" if rate is not None else "-", style=_rate_style(rate))
        line.append(f" ({stats.accepted}/{stats.drafted})")
        if stats.mean_tokens_per_pass:
            # Each number beside its unit: "0.5 drafted →" read like a count of drafted tokens.
            line.append(f"  drafted/pass {stats.mean_draft_length:.1f}  tok/pass {stats.mean_tokens_per_pass:.2f}")
        line.append(f"  draft {stats.draft_s:.2f}s / verify {stats.verify_s:.2f}s", style="dim")
    return line


def _rate_style(rate: float | None) -> str:
    if rate is None:
        return ""
    return "green" if rate >= 0.7 else ("yellow" if rate >= LOW_ACCEPTANCE else "red")


class LiveStatus:
    """A status line on stderr, redrawn at most `fps` times a second, only on a terminal.

    When stdout is the same terminal, the text and the status share the screen: the status is
    drawn on the line below the text's cursor and erased before more text is written.
    """

    def __init__(self, err: TextIO, out: TextIO, *, enabled: bool, fps: float = 8.0):
        self.err = err
        self.enabled = enabled and err.isatty()
        self.shared = self.enabled and _same_terminal(out, err)
        self._console = Console(file=err, highlight=False, soft_wrap=True)
        self._interval = 1.0 / fps
        self._last = 0.0
        self._shown = False
        self._rendered = ""
        self._column = 0  # where the text cursor is, in cells (shared mode)

    def note_text(self, text: str) -> None:
        """Follow the text cursor's column (shared mode) through the text just written.

        A terminal that has just filled its last column waits to wrap until the next character;
        moving the cursor then would make that character overwrite the last one. So while the
        column equals the width, the status is not drawn.
        """
        if not self.shared:
            return
        width = self._console.width
        for char in text:
            if char == "\n" or char == "\r":
                self._column = 0
                continue
            if self._column >= width:
                self._column = 0
            if char == "\t":
                self._column = min(width, (self._column // 8 + 1) * 8)
            else:
                self._column += cell_len(char)

    def clear(self) -> None:
        """Erase the status (before text is written, and at the end)."""
        if self._shown:
            # Shared: erase from the text cursor to the end of the screen (the status line below).
            self.err.write("\x1b[J" if self.shared else "\r\x1b[2K")
            self.err.flush()
            self._shown = False

    def show(self, make_line: Callable[[], Text]) -> None:
        """Draw the line `make_line` builds: built and rendered at most `fps` times a second,
        redrawn as is in between (building a Rich line at every step cost about 40 us a step,
        on models that step in one or two milliseconds)."""
        if not self.enabled or (self.shared and self._column >= self._console.width):
            return
        now = time.monotonic()
        if now - self._last >= self._interval or not self._rendered:
            self._last = now
            width = max(10, self._console.width - 1)  # never wrap: a wrapped line cannot be erased
            line = make_line()
            line.truncate(width)
            self._rendered = self._render(line)
        elif self._shown:
            return
        if self.shared:
            # IND then RI makes sure a line exists below (scrolling if needed) without moving
            # the column; save the cursor, draw below, restore it so the text continues in place.
            self.err.write("\x1bD\x1bM\x1b7\x1bD\r\x1b[2K" + self._rendered + "\x1b8")
        else:
            self.err.write("\r\x1b[2K" + self._rendered)
        self.err.flush()
        self._shown = True

    def _render(self, line: Text) -> str:
        with self._console.capture() as capture:
            self._console.print(line, end="")
        return capture.get()


def _same_terminal(a: TextIO, b: TextIO) -> bool:
    try:
        return a.isatty() and b.isatty() and os.ttyname(a.fileno()) == os.ttyname(b.fileno())
    except (OSError, ValueError):
        return False


SUMMARY_SEP = " · "
SUMMARY_WIDTH = 100  # where the summary breaks when stderr is not a terminal (a log, a pipe)


def terminal_width(stream: TextIO) -> int | None:
    """The width of the terminal `stream` writes to, or None when it is not a terminal or does
    not know its size (a new pty reports 0 columns)."""
    try:
        return (os.get_terminal_size(stream.fileno()).columns or None) if stream.isatty() else None
    except (OSError, ValueError, AttributeError):
        return None


def summary_line(
    stats: Stats, *, stop_reason: str | None, with_drafting: bool, verbose: bool = False,
    width: int | None = None, extra: tuple[str, ...] = (),
) -> str:
    """The summary printed to stderr at the end of a run: the essentials (tokens, time, tok/s,
    acceptance, tokens per pass, then `extra`, then the stop reason), about 80 characters.
    The details (counts, draft/verify and prompt times) follow on the same line when `width`
    (a terminal's) holds it all, else on a line of their own with `verbose`, else not at all.
    Lines longer than `width` (None: SUMMARY_WIDTH) break between segments, never in a word
    (an 80-column terminal wrapped the old 170-character line mid-word)."""
    essentials = [f"{stats.n_tokens} tokens in {stats.generation_s:.2f}s"]
    essentials.append(f"{stats.tokens_per_s:.1f} tok/s" if stats.tokens_per_s else "- tok/s")
    details = []
    if with_drafting:
        rate = stats.acceptance_rate
        essentials.append(f"accepted {rate:.0%}" if rate is not None else "nothing drafted")
        if stats.drafted and stats.mean_tokens_per_pass:
            essentials.append(f"{stats.mean_tokens_per_pass:.2f} tok/pass")
            details.append(f"{stats.accepted} of {stats.drafted} drafts accepted")
            details.append(f"drafted/pass {stats.mean_draft_length:.1f}")
        if stats.target_passes:
            # Plain decoding takes one target pass per token: what drafting saved, in passes.
            essentials.append(f"{stats.target_passes} passes ({max(0, stats.n_tokens - stats.target_passes)} saved)")
        details.append(f"draft {stats.draft_s:.2f}s, verify {stats.verify_s:.2f}s")
    essentials.extend(extra)
    essentials.append(f"stop: {stop_reason}")
    details.append(f"prompt {stats.prompt_tokens} tokens in {stats.prompt_s:.2f}s")
    if width is not None and len(SUMMARY_SEP.join(essentials + details)) <= width:
        return SUMMARY_SEP.join(essentials + details)
    wrap_at = width if width is not None else SUMMARY_WIDTH
    lines = [_fit(essentials, wrap_at)]
    if verbose:
        lines.append(_fit(details, wrap_at))
    return "\n".join(lines)


def _fit(parts: list[str], width: int) -> str:
    """Join `parts` with SUMMARY_SEP, breaking lines between parts (and inside a part only at
    spaces) so that no line is longer than `width`."""
    width = max(width, 20)
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(SUMMARY_SEP) + len(part) <= width:
            lines[-1] += SUMMARY_SEP + part
        else:
            lines.extend(textwrap.wrap(part, width, break_long_words=False, break_on_hyphens=False) or [""])
    return "\n".join(lines)


def low_acceptance_warning(stats: Stats, *, lookup: bool, adaptive: bool = False) -> str | None:
    """The seed guide's advice when drafting mostly fails, or None."""
    rate = stats.acceptance_rate
    if rate is None or rate >= LOW_ACCEPTANCE or stats.drafted < 8:
        return None
    shorter = "--draft-max auto already drafted less where drafts failed" if adaptive else "reduce --draft-max (or use --draft-max auto)"
    advice = (
        f"{shorter}, or use a draft model (-d); lookup drafts only pay where the output repeats the input"
        if lookup
        else f"{shorter}, or pick a better-matched draft model"
    )
    return f"warning: only {rate:.0%} of drafted tokens were accepted (below {LOW_ACCEPTANCE:.0%}); {advice}"


def stderr_console() -> Console:
    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


def stream_generation(
    gen: Generation,
    out: TextIO,
    err: TextIO,
    *,
    show_text: bool,
    live: bool,
    show_accept: bool,
    with_drafting: bool,
    trace: TextIO | None = None,
) -> bool:
    """Run `gen` to the end, streaming its text to `out` (if show_text) and a live status line
    to `err` (if live and a terminal); to `trace` (--verbose) a line for each pass that verified
    several branches (--branches). Returns True when Ctrl-C stopped it (text so far kept)."""
    status = LiveStatus(err, out, enabled=live)
    text_out = TextOutput(out, show_accept=show_accept)
    printed = 0
    interrupted = False
    trees: list[int] = []  # the widths of the tree passes
    try:
        for step in gen:
            status.clear()
            if show_text:
                printed += len(step.text)  # counted first: a Ctrl-C mid-write must not print it twice
                text_out.write(step)
                status.note_text(step.text)
            status.show(lambda: status_text(gen.stats, with_drafting=with_drafting))
            if trace is not None and step.n_branches > 1:
                trees.append(step.width)
                print(f"specli: tree pass after {len(gen.token_ids) - len(step.tokens)} tokens: {step.n_branches} branches "
                      f"in a pass of {step.width} tokens, {step.n_accepted} accepted", file=trace)
    except KeyboardInterrupt:
        gen.interrupt()
        interrupted = True
    status.clear()
    if trees:
        print(f"specli: {len(trees)} of {gen.stats.target_passes} passes verified several branches "
              f"(mean {sum(trees) / len(trees):.1f} tokens a pass)", file=trace)
    if show_text:
        text_out.write_text(gen.text[printed:])  # text held back for an incomplete character
        if gen.text and not gen.text.endswith("\n") and out.isatty():
            text_out.write_text("\n")  # leave the shell prompt on a line of its own
    return interrupted
