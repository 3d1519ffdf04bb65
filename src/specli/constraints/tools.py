"""Tool calls: how a chat template writes a call (`ToolFormat`), the grammar of a call on a
request's tools, the matcher that leaves text free until the format's opening token and
constrains the call from there (`ToolConstraint`), and the parser that turns output into calls
(`CallStream`: whole, or as a stream's pieces). docs/constraints.md has the whole story.

Only the Hermes format (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Qwen
2.5 and others) is known; a template that writes calls any other way is refused by the server,
naming it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from specli.constraints import JSON_STYLES, Constraint, Grammar, Matcher
from specli.llama.model import LlamaModel

AUTO, NONE, REQUIRED = "auto", "none", "required"


@dataclass(frozen=True)
class ToolFormat:
    """How a template writes calls: `open`, then `before`, the call as JSON ({"name": ...,
    "arguments": {...}}), `after`, `close`; several calls are joined by `between`."""

    name: str
    open: str
    close: str
    before: str = "\n"
    after: str = "\n"
    between: str = "\n"


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")


def tool_format(template_source: Optional[str]) -> Optional[ToolFormat]:
    """The format a chat template writes tool calls in, or None when it writes none that specli
    knows. (Hermes: the template renders `tools` and its calls in <tool_call> tags.)"""
    if template_source and "tools" in template_source and HERMES.open in template_source:
        return HERMES
    return None


@dataclass(frozen=True)
class Tool:
    """One function a request offers: its name and its arguments' JSON schema."""

    name: str
    parameters: dict = field(default_factory=lambda: {"type": "object"})


def call_lark(fmt: ToolFormat, tools: Sequence[Tool], *, opened: bool, parallel: bool, marks: dict[str, str]) -> str:
    """The Lark grammar (llguidance's dialect) of the calls after the opening (`opened`: the
    opening was already emitted, the lazy case) or from the first token. `marks`: how the
    opening and closing are written in the grammar (a special token's `<[id]>`, else the text)."""
    def lit(text: str) -> str:
        return json.dumps(text)

    lines = []
    one = f"{lit(fmt.before)} call {lit(fmt.after)} {marks['close']}"
    # Several calls are joined by `between`, after which the reply may still end (a model that
    # wants to write on after a call is not made to open another).
    more = f"({lit(fmt.between)} {marks['open']} {one})* {lit(fmt.between)}?" if parallel else ""
    lines.append(f"start: {'' if opened else marks['open'] + ' '}{one} {more}".rstrip())
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
        lines.append(f"call_{i}: {lit(head)} args_{i} {lit('}')}")
        lines.append(f"args_{i}: %json {_schema(tool, JSON_STYLES['spaced'])}")  # (as the template's tojson writes arguments back)
    return "\n".join(lines)


FLEXIBLE = {"whitespace_flexible": True}


def _schema(tool: Tool, style: dict) -> str:
    schema = dict(tool.parameters) if isinstance(tool.parameters, dict) else {"type": "object"}
    schema["x-guidance"] = {**style, **schema.get("x-guidance", {})}
    return json.dumps(schema, ensure_ascii=False)


def json_call_lark(tools: Sequence[Tool]) -> str:
    """The grammar of a whole reply that is one call written as a bare JSON object (or in a
    ```json fence), with free whitespace: what small models write instead of the template's
    format when the choice is theirs (choice auto)."""
    lines = ['start: WS? call WS? | WS? "```" "json"? WS? call WS? "```"',
             'call: "{" WS? "\\"name\\"" WS? ":" WS? (' + " | ".join(f"call_{i}" for i in range(len(tools))) + ")",
             "WS: /[ \\t\\n]+/"]
    for i, tool in enumerate(tools):
        lines.append(f'call_{i}: {json.dumps(json.dumps(tool.name, ensure_ascii=False))} WS? "," WS? "\\"arguments\\"" WS? ":" WS? args_{i} WS? "}}"')
        lines.append(f"args_{i}: %json {_schema(tool, FLEXIBLE)}")
    return "\n".join(lines)


def json_call_start(text: str) -> Optional[int]:
    """Where a reply written as a bare JSON call (json_call_lark) has shown its hand: the end of
    `{"name": "` (after optional whitespace and a ```json fence); -1 while `text` may still become
    that; None once it cannot."""
    i, n = 0, len(text)

    def ws(i: int) -> int:
        while i < n and text[i] in _WS:
            i += 1
        return i

    i = ws(0)
    if text.startswith("```", i):
        i += 3
        if text.startswith("json", i):
            i += 4
        elif i < n and "json".startswith(text[i:]):
            return -1
        i = ws(i)
    elif i < n and "```".startswith(text[i:]):
        return -1
    for literal in ("{", '"name"', ":", '"'):
        i = ws(i)
        if i == n:
            return -1
        if text.startswith(literal, i):
            i += len(literal)
        elif literal.startswith(text[i:]):
            return -1
        else:
            return None
    return i


class ToolConstraint:
    """Tools on one model's vocabulary, as Request.constraint. Each sequence's matcher is
    constrained from the first token (required, or a named tool: a call always comes), never
    lets a call open (none), or (auto) leaves the reply free until it opens a call: the
    format's opening token, or a reply that starts as a bare JSON call (`{"name": "`, what
    small models write instead), from where the call's grammar holds."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Tool], model: LlamaModel, *, choice: str = AUTO, parallel: bool = True,
                 where: str = "'tools'"):
        self.fmt, self.choice, self.n_vocab = fmt, choice, model.n_vocab
        self.open_token = _single_token(model, fmt.open)
        close_token = _single_token(model, fmt.close)
        marks = {"open": f"<[{self.open_token}]>" if self.open_token is not None else json.dumps(fmt.open),
                 "close": f"<[{close_token}]>" if close_token is not None else json.dumps(fmt.close)}
        self._piece = model.piece
        self._calls: Optional[Constraint] = None  # the format's calls (from its opening on, when auto)
        self._json: Optional[Constraint] = None  # auto: a reply that is one bare JSON call
        if choice == NONE:
            return
        # (auto needs the opening as one token, to tell where a call starts in the format)
        if choice == REQUIRED or self.open_token is not None:
            lark = call_lark(fmt, tools, opened=choice == AUTO, parallel=parallel, marks=marks)
            self._calls = Constraint(Grammar("lark", lark, where=where), model)
        if choice == AUTO:
            self._json = Constraint(Grammar("lark", json_call_lark(tools), where=where), model)

    def start(self) -> "ToolMatcher":
        if self.choice == REQUIRED:
            return ToolMatcher(self.n_vocab, self._piece, inner=self._calls.start())
        if self.choice == NONE:
            return ToolMatcher(self.n_vocab, self._piece, forbid=self.open_token)
        return ToolMatcher(self.n_vocab, self._piece, calls=self._calls, trigger=self.open_token, json_call=self._json)


def _single_token(model: LlamaModel, text: str) -> Optional[int]:
    ids = model.tokenize(text, add_bos=False, parse_special=True)
    return ids[0] if len(ids) == 1 else None


class ToolMatcher:
    """A Matcher (constraints.Matcher's verbs) for tools. Before a call opens, text is free
    (every row allowed; with `forbid`, the opening never is). A draft that opens a call is
    checked from the opening on by the call's grammar, which masks the rows after it: so a draft
    sampled from q is never cut on what it drew, and each row is masked as the constraint stands
    at that position. A bare JSON call's grammar covers the whole reply, so it is started on the
    reply so far (from `{"name": "` on, the name is one of the tools'); a reply whose start it would
not hold stays free."""

    def __init__(self, n_vocab: int, piece: Callable[[int], bytes], *, inner: Optional[Matcher] = None, calls: Optional[Constraint] = None,
                 trigger: Optional[int] = None, json_call: Optional[Constraint] = None, forbid: Optional[int] = None):
        self.n_vocab, self._piece = n_vocab, piece
        self._inner, self._calls, self._trigger, self._json, self._forbid = inner, calls, trigger, json_call, forbid
        self._reply: list[int] = []  # while the reply may still be a bare JSON call: its tokens
        self._text = ""  # ... and their text

    def _opening(self, tokens: list[int]) -> Optional[int]:
        """Where in `tokens` (after the reply so far) a call opens: the index of the token."""
        at = tokens.index(self._trigger) if self._calls is not None and self._trigger in tokens else None
        if self._json is not None:
            text = self._text
            for k, token in enumerate(tokens[: at if at is not None else len(tokens)]):
                text += self._piece(token).decode("utf-8", "ignore")
                start = json_call_start(text)
                if start is None:
                    break
                if start >= 0:
                    return k
        return at

    def _split(self, tokens: list[int]) -> Optional[tuple[int, Matcher]]:
        """Where in `tokens` a call opens, and the call's matcher after tokens[: k + 1]; None when
        none opens (or the reply so far is not one the call's grammar holds: it stays free)."""
        k = self._opening(tokens)
        if k is None:
            return None
        if self._calls is not None and tokens[k] == self._trigger:
            return k, self._calls.start()
        matcher, reply = self._json.start(), self._reply + tokens[: k + 1]
        if matcher.valid_prefix(reply) < len(reply):
            return None
        matcher.accept(reply, _never)
        return k, matcher

    def forced(self, n_max: int) -> list[int]:
        return self._inner.forced(n_max) if self._inner is not None else []

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        if self._inner is not None:
            return self._inner.valid_prefix(tokens)
        tokens = list(tokens)
        if self._forbid is not None:
            return tokens.index(self._forbid) if self._forbid in tokens else len(tokens)
        split = self._split(tokens)
        if split is None:
            return len(tokens)
        k, matcher = split
        return k + 1 + matcher.valid_prefix(tokens[k + 1:])

    def masks(self, draft: Sequence[int]) -> np.ndarray:
        if self._inner is not None:
            return self._inner.masks(draft)
        rows = np.full((len(draft) + 1, (self.n_vocab + 31) // 32), -1, dtype=np.int32)
        if self._forbid is not None:
            rows.view(np.uint32)[:, self._forbid >> 5] &= ~np.uint32(1 << (self._forbid & 31))
            return rows
        split = self._split(list(draft))
        if split is not None:  # (the rows after the opening: the call's)
            k, matcher = split
            rows[k + 1:] = matcher.masks(list(draft[k + 1:]))
        return rows

    def accept(self, tokens: Sequence[int], is_eog) -> None:
        if self._inner is not None:
            self._inner.accept(tokens, is_eog)
            return
        tokens = [t for t in tokens if not is_eog(t)]
        if self._forbid is not None or not tokens:
            return
        split = self._split(tokens)
        if split is None:
            if self._json is not None:
                self._reply += tokens
                self._text += b"".join(self._piece(t) for t in tokens).decode("utf-8", "ignore")
                if json_call_start(self._text) != -1:
                    self._json, self._reply = None, []  # (decided: free text, or a start the call's grammar would not hold)
            return
        k, self._inner = split
        self._json, self._reply = None, []
        self._inner.accept(tokens[k + 1:], is_eog)

    @property
    def done(self) -> bool:
        return self._inner is not None and self._inner.done

    @property
    def opened(self) -> bool:
        """Whether a call has opened (its grammar holds from there)."""
        return self._inner is not None


def _never(token: int) -> bool:
    return False


# --- output -> calls ------------------------------------------------------------------------------
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_WS = " \t\r\n"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class CallStream:
    """Generated text, piece by piece, as OpenAI's pieces: ("content", text), ("call", index,
    name) once a call's name is known, ("arguments", index, text) as its arguments come. Text a
    call could not be parsed from goes back to the content: nothing generated is lost."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self._buf = ""
        self._state = "content"  # content, head, arguments, between
        self._index = -1
        self._sent = 0  # the arguments' characters sent so far
        self._close = fmt.close  # what ends the call being read: the format's closing, a fence's "```", or "" (the reply's end)
        self._bare = None  # the reply's start: None while it may be a bare JSON call (json_call_start), else False

    def feed(self, text: str) -> list[tuple]:
        self._buf += text
        out: list[tuple] = []
        while True:
            before = (self._state, len(self._buf))
            self._step(out, final=False)
            if (self._state, len(self._buf)) == before:
                return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        self._step(out, final=False)
        while self._buf or self._state == "head":
            if not self._step(out, final=True):
                break
        return out

    def _step(self, out: list, *, final: bool) -> bool:
        fmt, buf = self.fmt, self._buf
        if self._state == "content" and self._bare is None:
            start = json_call_start(buf)
            if start == -1 and not final:
                return False  # (held back: it may be a call)
            self._bare = False
            if start is not None and start >= 0:
                brace = buf.index("{")
                self._close = "```" if "```" in buf[:brace] else ""
                self._buf, self._state = buf[brace:], "head"
                return True
        if self._state in ("content", "between"):
            at = buf.find(fmt.open)
            if at >= 0:
                self._content(out, buf[:at])
                self._buf, self._state, self._close = buf[at + len(fmt.open):], "head", fmt.close
                return True
            keep = 0 if final else _partial_suffix(buf, fmt.open)
            self._content(out, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        if self._state == "head":
            head = _HEAD.match(buf)
            if head is None or head.end() == len(buf) and not final:  # (the name's line may go on: wait)
                if final:  # never a call: its text is content
                    self._content(out, fmt.open + buf)
                    self._buf, self._state = "", "content"
                return False
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                name = head.group(1)
            self._index += 1
            self._sent = 0
            out.append(("call", self._index, name))
            self._buf, self._state = buf[head.end():], "arguments"
            return True
        # arguments: up to the closing (the outer object's "}" and the format's text before it held back)
        close = self._close
        at = buf.find(close) if close else -1
        if at >= 0 or final:
            args = (buf[:at] if at >= 0 else buf).rstrip(_WS)
            if final and at < 0 and close == "```":
                args = args[:-3].rstrip(_WS) if args.endswith("```") else args
            if (at >= 0 or close != fmt.close) and args.endswith("}"):  # (the call object's own end; a truncated call keeps its text)
                args = args[:-1].rstrip(_WS)
            if len(args) > self._sent:
                out.append(("arguments", self._index, args[self._sent:]))
            self._buf = buf[at + len(close):] if at >= 0 else ""
            self._state = "between"
            return at >= 0
        safe = _held_back(buf, close)
        if safe > self._sent:
            out.append(("arguments", self._index, buf[self._sent:safe]))
            self._sent = safe
        return False

    def _content(self, out: list, text: str) -> None:
        if self._state == "between" and self._index >= 0:
            text = text.strip(_WS)  # (the newlines between calls)
        if text:
            out.append(("content", text))


def _partial_suffix(text: str, mark: str) -> int:
    """The length of the longest end of `text` that begins `mark` (held back: it may be it)."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0


def _held_back(buf: str, close: str) -> int:
    """How much of a call's text may be sent as arguments now: all but a last "}" followed only
    by whitespace and the beginning of the closing (the call's own end, perhaps)."""
    at = buf.rfind("}")
    if at < 0:
        return len(buf)
    rest = buf[at + 1:].lstrip(_WS)
    return len(buf[:at].rstrip(_WS)) if close.startswith(rest) else len(buf)


@dataclass
class ParsedCalls:
    """A whole output as content and calls (each: id, name, arguments as JSON text)."""

    content: str
    calls: list[dict]


def parse_calls(fmt: ToolFormat, text: str) -> ParsedCalls:
    stream = CallStream(fmt)
    pieces = stream.feed(text) + stream.finish()
    content, calls = [], []
    for piece in pieces:
        if piece[0] == "content":
            content.append(piece[1])
        elif piece[0] == "call":
            calls.append({"id": new_call_id(), "name": piece[2], "arguments": ""})
        else:
            calls[piece[1]]["arguments"] += piece[2]
    return ParsedCalls("".join(content), calls)


def check_tools(tools: Any) -> None:
    """Raise GrammarError when a tool's parameters are not a JSON schema llguidance compiles."""
    for tool in tools:
        Grammar("json_schema", json.dumps(tool.parameters), where=f"'tools' ({tool.name}): 'parameters'").check()

