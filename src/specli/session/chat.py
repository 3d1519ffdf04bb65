"""`specli chat`: a multi-turn conversation on one loaded decoder.

Each turn renders the whole conversation (system prompt, history, the new user message, the
opening of the assistant's turn) with the model's chat template, tokenizes it and generates.
Nothing is cached here: the engine reuses the longest common prefix of the target's KV cache
(and the draft model's), so a turn evaluates only what is new since the previous one.

stdout carries the replies and nothing else (each followed by a newline); prompts, notices and
per-turn statistics go to stderr, so `printf 'hi\\n/exit\\n' | specli chat` works in scripts.
"""

from __future__ import annotations

import errno
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, TextIO

from specli.constraints.tools import ToolFormat, tool_format
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.sampling import sampling_json
from specli.decoding.stats import Stats
from specli.errors import UsageError
from specli.files import input_limit_error, max_input_bytes, replace_text
from specli.llama.conversation import encode_conversation
from specli.llama.model import LlamaModel
from specli.llama.native import terminated
from specli.llama.templates import JinjaTemplate, TemplateRenderError, apply_chat_template, builtin_chat_templates
from specli.modes import MAX_DRAFT, DraftLength, DraftMode
from specli.session.loading import Loaded

PLAIN = "plain"  # our fallback format for models without a usable template
# A plain reply ends where the model starts the user's next turn (templates end a turn with an
# end-of-generation token instead).
PLAIN_STOP = ("\nUser:",)

HELP = """commands:
  /help          this help
  /stats         session totals: turns, tokens, acceptance, tokens per target pass
  /n N           draft tokens per step from now on (1..64, or auto)
  /reset         forget the conversation (the system prompt stays) and empty the caches
  /system TEXT   set the system prompt (/system alone shows it)
  /save FILE     write the conversation and settings as JSON
  /exit          leave (so do Ctrl-D, or Ctrl-C at the prompt)
A line ending with a backslash continues on the next line. Ctrl-C during a reply stops it."""


# --- formatting ----------------------------------------------------------------------------------
@dataclass
class Formatter:
    """Turns (system, messages) into the text the model continues.

    template: a llama.cpp template (built-in name or the model's own source), or None for plain
    "User: ...\\nAssistant: ..." turns. name: what to call it in notices and /save. jinja: the
    model's own template rendered in the sandbox (then `template` is unused); owner: the model
    file's name, for errors.
    """

    template: Optional[str]
    name: str
    jinja: Optional[JinjaTemplate] = None
    owner: str = "the model"
    variables: dict = field(default_factory=dict)  # more inputs of a Jinja template (serve --reasoning: enable_thinking)

    def render(self, system: Optional[str], messages: list[dict], *, add_assistant: bool = True, tools: Optional[list[dict]] = None) -> str:
        """The conversation as text, ending with the assistant's opening when add_assistant.
        `tools` (OpenAI's tool objects) and messages holding tool calls or tool results need the
        model's own template (`tool_format`). Raises UsageError when the model's template fails
        on this conversation."""
        if self.jinja is not None:
            try:
                return self.jinja.render(([{"role": "system", "content": system}] if system else []) + list(messages),
                                         add_assistant=add_assistant, tools=tools, variables=self.variables)
            except TemplateRenderError as err:
                raise template_error(self.owner, err) from None
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            raise UsageError(f"the chat template ({self.name}) cannot render tools; they need a model whose own template does (e.g. Qwen 2.5)")
        pairs = ([("system", system)] if system else []) + [(m["role"], m["content"]) for m in messages]
        if self.template is not None:
            text = apply_chat_template(self.template, pairs, add_assistant=add_assistant)
            if text is not None:
                return text
        return render_plain(pairs, add_assistant=add_assistant)

    @property
    def tool_format(self) -> Optional[ToolFormat]:
        """How this template writes tool calls (constraints/tools.py), or None: it writes none
        that specli knows."""
        return tool_format(self.template) if self.jinja is not None else None

    @property
    def stop(self) -> tuple[str, ...]:
        """The stop strings that end a reply in this format."""
        return PLAIN_STOP if self.template is None and self.jinja is None else ()


def render_plain(pairs: list[tuple[str, str]], *, add_assistant: bool) -> str:
    """The fallback format. The assistant's opening ends with "Assistant:" (no space) so that the
    rendered prompt of one turn stays a token prefix of the next turn's (measured on Gemma's and
    the fixtures' tokenizers), which is what lets the KV cache be reused."""
    parts = []
    for role, content in pairs:
        if role == "system":
            parts.append(f"{content}\n\n")
        elif role == "user":
            parts.append(f"User: {content}\n")
        else:
            parts.append(f"Assistant: {content.strip()}\n")
    if add_assistant:
        parts.append("Assistant:")
    return "".join(parts)


def choose_formatter(model: LlamaModel, template_name: Optional[str], *, source: Optional[tuple[str, str]] = None) -> tuple[Formatter, Optional[str]]:
    """The formatter for this session and a one-line notice (or None): the one choice that
    `chat`, and `run`/`batch` with --chat, make.

    --template NAME (a llama.cpp built-in name, already checked with check_template_name before
    the models loaded) wins; else the GGUF's own template, rendered with Jinja in a sandbox; if
    Jinja cannot compile or render it, llama.cpp's own rendering when it recognises the template
    family; else a UsageError naming the problem and --template. A template the sandbox refuses
    is always an error. A model without a template gets plain turns (and a notice).
    """
    if template_name is not None:
        return Formatter(template_name, template_name), None
    own = model.chat_template()
    owner = model.path.name
    if source is not None:  # (serve --chat-template-file: (its path, its text), rendered as the model's own would be)
        owner, own = Path(source[0]).name, source[1]
    if own is None:
        return Formatter(None, PLAIN), (
            f"note: {owner} has no chat template; using plain 'User:/Assistant:' turns "
            "(--template NAME picks one, e.g. chatml)"
        )
    try:
        info = model.vocab_info()
        jinja = JinjaTemplate(own, bos_token=_special_text(model, info.bos), eos_token=_special_text(model, info.eos))
        jinja.render([("user", "hi")])  # fail here, once, rather than on every message
        return Formatter(own, "model", jinja=jinja, owner=owner), None
    except TemplateRenderError as err:
        if not err.unsafe and apply_chat_template(own, [("user", "hi")]) is not None:
            return Formatter(own, "model", owner=owner), (
                f"note: cannot render {owner}'s chat template with Jinja ({err}); using llama.cpp's "
                "built-in rendering of its template family (--template NAME picks another)"
            )
        raise template_error(owner, err) from None


def template_error(owner: str, err: TemplateRenderError) -> UsageError:
    """A model's template that failed, worded with the fix."""
    return UsageError(f"cannot use {owner}'s chat template: {err}; pass --template NAME to use a llama.cpp built-in template instead (e.g. chatml)")


def _special_text(model: LlamaModel, token: int) -> str:
    """The text of a special token (`bos_token` in a template); '' for none (-1)."""
    return model.token_text(token).decode("utf-8", errors="replace") if token >= 0 else ""


def check_template_name(name: str) -> None:
    """Raise UsageError unless `name` is one of llama.cpp's built-in template names."""
    names = builtin_chat_templates()
    if name not in names:
        shown = ", ".join(n for n in ("chatml", "gemma", "llama3", "llama2", "mistral-v7", "phi3") if n in names)
        raise UsageError(f"unknown chat template '{name}'; use a llama.cpp built-in name such as {shown} ({len(names)} known)")


# --- fitting the context -------------------------------------------------------------------------
class MessageTooLong(Exception):
    """The system prompt plus the new message alone do not fit the context."""


def fit_conversation(
    system: Optional[str],
    history: list[dict],
    message: dict,
    tokens_of: Callable[[Optional[str], list[dict]], list[int]],
    n_ctx: int,
    max_tokens: int,
) -> tuple[list[int], int]:
    """Prompt tokens for `history + [message]` that leave room for `max_tokens`, dropping the
    oldest user/assistant pairs of `history` (in place; never the system prompt) as needed.

    Once anything must go, at least half of the pairs go at once (as llama.cpp's context shift
    discards half): the prompt then differs from the cached one from the first dropped message
    on, so this turn re-evaluates the rest, but the next turns extend it and reuse the cache
    again until the context fills up anew. Dropping one pair per turn instead would make every
    following turn re-evaluate nearly the whole context.

    Returns (prompt ids, pairs dropped). When no history is left and the reply still lacks room,
    the prompt is used anyway (the reply then stops when the context is full). Raises
    MessageTooLong, with `history` untouched, when the prompt alone fills the context.
    """
    # Work on a count, not on `history`: a refused message must leave the history as it was.
    dropped = 0
    pairs = len(history) // 2
    while True:
        kept = history[2 * dropped :]
        ids = tokens_of(system, kept + [message])
        if len(ids) + max_tokens <= n_ctx or not kept:
            break
        dropped = dropped + 1 if dropped else max(1, (pairs + 1) // 2)
    if len(ids) >= n_ctx:
        raise MessageTooLong(len(ids))
    del history[: 2 * dropped]
    return ids, dropped


# --- session totals ------------------------------------------------------------------------------
@dataclass
class Totals:
    """Sums over the session's replies (for /stats)."""

    turns: int = 0
    stats: Stats = field(default_factory=Stats)

    def add(self, stats: Stats) -> None:
        self.turns += 1
        self.stats.add(stats)

    def describe(self, *, with_drafting: bool) -> str:
        """A few lines for /stats; the speedup is labelled for what it is."""
        s = self.stats
        lines = [f"turns: {self.turns}, generated tokens: {s.n_tokens}"
                 + (f" ({s.tokens_per_s:.1f} tok/s)" if s.tokens_per_s is not None else ""),
                 f"prompt tokens: {s.prompt_tokens - s.prompt_reused} evaluated, {s.prompt_reused} reused from the cache"]
        if not with_drafting:
            lines.append("drafting: off (--target-only): 1 token per target pass")
            return "\n".join(lines)
        rate = f"{s.acceptance_rate:.0%}" if s.acceptance_rate is not None else "-"
        lines.append(f"drafted: {s.drafted}, accepted: {s.accepted} (acceptance {rate})")
        if s.target_passes:
            per_pass = s.mean_tokens_per_pass
            lines.append(f"mean tokens per target pass: {per_pass:.2f}")
            lines.append(
                f"speedup estimate: {per_pass:.2f}x (= tokens per target pass; an upper bound that "
                "ignores the draft's cost and the extra cost of wider target passes; compare with "
                "--target-only for a measurement)"
            )
        return "\n".join(lines)


# --- input ---------------------------------------------------------------------------------------
MESSAGE_WHAT = "a chat message on stdin"


class LineReader:
    """Reads the user's lines: readline-backed input() on a terminal, plain lines from a pipe.

    read(prompt) returns the line without its newline, or None at end of input. Prompts are
    shown only on a terminal, and never on stdout unless stdout is that terminal. A line longer
    than `limit` bytes (default: the input limit, files.max_input_bytes()) is a UsageError, and
    no more of it is read: `specli chat < /dev/zero` stops there instead of reading forever. So
    is a piped line that is not UTF-8 text (binary input would otherwise be answered line by
    line, for ever).
    """

    def __init__(self, stdin: TextIO, stdout: TextIO, stderr: TextIO, *, limit: Optional[int] = None):
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.limit = max_input_bytes() if limit is None else limit
        self.interactive = stdin.isatty()
        self.lines = 0
        if self.interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:  # not on every platform; input() still works without it
                pass

    def read(self, prompt: str) -> Optional[str]:
        if not self.interactive:
            # limit + 2: room for a line of exactly `limit` bytes and its "\r\n".
            source = self.stdin.buffer if hasattr(self.stdin, "buffer") else self.stdin
            raw = source.readline(self.limit + 2)
            if not raw:
                return None
            ends = b"\r\n" if isinstance(raw, bytes) else "\r\n"
            ended = raw.endswith(ends[1:])
            if len(raw.rstrip(ends) if ended else raw) > self.limit:  # not ended: cut short at limit + 2
                raise input_limit_error(MESSAGE_WHAT, self.limit)
            line = raw.rstrip(ends)
            self.lines += 1
            if isinstance(line, str):
                return line
            try:
                return line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UsageError(f"line {self.lines} of stdin is not UTF-8 text (bad byte at column {err.start + 1}); chat reads one message per line of text") from None
        try:
            if self.stdout.isatty():
                line = input(prompt)
            else:
                self.stderr.write(prompt)
                self.stderr.flush()
                line = input()
        except EOFError:
            self.stderr.write("\n")
            return None
        if len(line.encode("utf-8", errors="replace")) > self.limit:
            raise input_limit_error("a chat message", self.limit)
        return line


def read_message(read: Callable[[str], Optional[str]], prompt: str = ">>> ", more: str = "... ",
                 limit: Optional[int] = None) -> Optional[str]:
    """One message: a line, or several when each but the last ends with a backslash (joined by
    newlines, backslashes removed). None at end of input with nothing pending. UsageError when
    the joined lines pass `limit` bytes (None: no limit)."""
    lines: list[str] = []
    size = 0
    while True:
        line = read(more if lines else prompt)
        if line is None:
            return "\n".join(lines) if lines else None
        size += len(line.encode("utf-8", errors="replace")) + 1
        if limit is not None and size - 1 > limit:
            raise input_limit_error(MESSAGE_WHAT, limit)
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


# --- the session ---------------------------------------------------------------------------------
@dataclass
class ChatOptions:
    max_tokens: int = 256
    system: Optional[str] = None
    quiet: bool = False
    verbose: bool = False
    show_accept: bool = False
    stop: tuple[str, ...] = ()  # --stop: ends a reply (besides the plain format's own)
    constraint: object | None = None  # --json-schema or --grammar: every reply's (constraints.Constraint)


@dataclass
class ChatSession:
    """One conversation on one loaded decoder (models are never reloaded)."""

    loaded: Loaded
    formatter: Formatter
    options: ChatOptions
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    messages: list[dict] = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)
    # How a reply is shown (turn() needs both): the CLI's render.stream_generation and
    # summary_line, handed in so that the session does not import the CLI above it.
    stream_generation: Optional[Callable[..., bool]] = None
    summary_line: Optional[Callable[..., str]] = None

    def __post_init__(self) -> None:
        self.system: Optional[str] = self.options.system

    @property
    def with_drafting(self) -> bool:
        return self.loaded.plan.mode != DraftMode.TARGET_ONLY

    def notice(self, text: str) -> None:
        """A one-line message on stderr (kept even with --quiet only when it reports a refusal)."""
        print(text, file=self.err, flush=True)

    def tokens_of(self, system: Optional[str], messages: list[dict]) -> list[int]:
        return encode_conversation(self.loaded.model_tgt, self.formatter, system, messages)

    # --- a turn --------------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        """Answer `text`: fit the conversation, stream the reply, add both to the history."""
        decoder = self.loaded.decoder
        n_ctx = decoder.model_tgt.n_ctx
        message = {"role": "user", "content": text}
        try:
            ids, dropped = fit_conversation(self.system, self.messages, message, self.tokens_of, n_ctx, self.options.max_tokens)
        except MessageTooLong as too_long:
            self.notice(
                f"specli: message refused: with the system prompt it is {too_long.args[0]} tokens, "
                f"more than the context of {n_ctx} (shorten it or raise -c)"
            )
            return
        except UsageError as err:  # the model's template refuses this conversation (a /system?)
            self.notice(f"specli: message refused: {err}")
            return
        if dropped and not self.options.quiet:
            self.notice(f"context full: dropped the oldest {dropped} exchange(s) to fit the {n_ctx}-token context with --max-tokens {self.options.max_tokens}")
        stop = (*self.formatter.stop, *self.options.stop)
        gen = generate(decoder, Request(ids, max_tokens=self.options.max_tokens, stop=stop, constraint=self.options.constraint))
        interrupted = self.stream_generation(
            gen, self.out, self.err, show_text=True, live=not self.options.quiet and not self.options.verbose,
            show_accept=self.options.show_accept, with_drafting=self.with_drafting,
        )
        if interrupted:
            self._forget_untracked()
        else:  # a finished reply: into the memory (--memory), saved with persist
            problem = self.loaded.remember(gen)
            if problem and not self.options.quiet:
                self.notice(problem)
        if not self.out.isatty() or not gen.text:
            # stream_generation ends a terminal's line itself; a pipe gets one newline per reply.
            self.out.write("\n")
        self.out.flush()
        self.messages += [message, {"role": "assistant", "content": gen.text}]
        self.totals.add(gen.stats)
        if not self.options.quiet:
            stats = gen.stats
            # The prompt's reuse is a chat's essential: among the segments, so that it wraps with them.
            reuse = f"prompt {stats.prompt_tokens} tokens ({stats.prompt_tokens - stats.prompt_reused} new, {stats.prompt_reused} reused)"
            line = self.summary_line(stats, stop_reason=gen.stop_reason, with_drafting=self.with_drafting, extra=(reuse,))
            self.notice(line)

    def _forget_untracked(self) -> None:
        # Ctrl-C may land between a decode and its bookkeeping: make each cache match its record.
        for model in (self.loaded.model_tgt, self.loaded.model_dft):
            if model is not None:
                model.forget_untracked()

    # --- commands ------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command. Returns False when the session should end."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        handler = {
            "/help": lambda: self.notice(HELP),
            "/stats": lambda: self.notice(self.totals.describe(with_drafting=self.with_drafting)),
            "/n": lambda: self._set_n(arg),
            "/reset": self._reset,
            "/system": lambda: self._set_system(arg),
            "/save": lambda: self._save(arg),
        }.get(name)
        if handler is None:
            self.notice(f"unknown command {name}; /help lists the commands")
        else:
            handler()
        return True

    def _set_n(self, arg: str) -> None:
        if not self.with_drafting:
            self.notice("/n: no drafting in --target-only mode")
            return
        try:
            n = DraftLength.parse(arg)
        except ValueError:
            self.notice(f"/n needs 'auto' or a number of draft tokens from 1 to {MAX_DRAFT}, e.g. /n 8")
            return
        self.loaded.decoder.set_draft_length(n)
        self.notice("draft length: chosen each step (auto)" if n.is_auto else f"draft length: {n} tokens per step")

    def _reset(self) -> None:
        self.messages.clear()
        for model in (self.loaded.model_tgt, self.loaded.model_dft):
            if model is not None:
                model.reset()
        self.notice("conversation cleared" + (" (system prompt kept)" if self.system else ""))

    def _set_system(self, arg: str) -> None:
        if not arg:
            self.notice(f"system prompt: {self.system!r}" if self.system else "no system prompt (/system TEXT sets one)")
            return
        self.system = arg
        self.notice("system prompt set")

    def _save(self, path: str) -> None:
        if not path:
            self.notice("/save needs a file name, e.g. /save chat.json")
            return
        text = json.dumps(self.to_json(), ensure_ascii=False, indent=2) + "\n"
        try:
            # A temporary file renamed over the old one: a full disk keeps the earlier save whole.
            replace_text(path, text)
        except OSError as err:
            kept = " (an earlier save there is kept as it was)" if err.errno != errno.ENXIO else ""  # (ENXIO: a FIFO, no file)
            self.notice(f"/save: cannot write {path}: {err.strerror or err}{kept}")
            return
        self.notice(f"saved {len(self.messages)} messages to {path}")

    def to_json(self) -> dict:
        """The conversation and the settings it was produced with (what /save writes)."""
        plan = self.loaded.plan
        return {
            "system": self.system,
            "messages": [dict(m) for m in self.messages],
            "settings": {
                "target": str(plan.target_path),
                "draft": plan.draft_label,
                "n_draft": self.loaded.decoder.draft_length.json_value,
                "template": self.formatter.name,
                "max_tokens": self.options.max_tokens,
                "n_ctx": self.loaded.model_tgt.n_ctx,
                "sampling": sampling_json(plan.sampling),
            },
        }

    # --- the loop ------------------------------------------------------------------------------
    def loop(self, reader: LineReader) -> int:
        """Read messages and commands until /exit, end of input or Ctrl-C at the prompt; exit code 0."""
        if reader.interactive and not self.options.quiet:
            self.notice("specli chat: /help for commands, /exit or Ctrl-D to leave")
        while True:
            try:
                text = read_message(reader.read, limit=reader.limit)
            except KeyboardInterrupt:
                self.err.write("\n")
                return 0
            if text is None:
                return 0
            if not text.strip():
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return 0
                continue
            self.turn(text)
            if terminated():  # SIGTERM (`kill`, `timeout`): the reply so far is kept, and the session ends
                return 130
