"""A conversation as prompt tokens: rendered by a chat format (session/chat.py's Formatter, which
renders with the model's template, templates.py), then tokenized so that only the template's own
text may become control tokens. `specli chat`, `run`/`batch` with --chat and the server's chat
route all encode a conversation here.
"""

from __future__ import annotations

import json
import re
from typing import Optional, Protocol

from specli.errors import UsageError
from specli.llama.model import LlamaModel


class ChatFormat(Protocol):
    """What encoding needs of a chat format: its name (for errors) and its rendering."""

    name: str

    def render(self, system: Optional[str], messages: list[dict], *, add_assistant: bool = True, tools: Optional[list[dict]] = None) -> str:
        """The conversation as text, ending with the opening of the assistant's turn (when add_assistant)."""
        ...


def encode(model: LlamaModel, text: str) -> list[int]:
    """Tokens of a rendered conversation. Templates contain special tokens (parse_special), and
    some start with BOS themselves: add it only when the model wants one and it is missing."""
    return _with_bos(model, model.tokenize(text, add_bos=False, parse_special=True))


def _with_bos(model: LlamaModel, ids: list[int]) -> list[int]:
    info = model.vocab_info()
    if info.add_bos and (not ids or ids[0] != info.bos):
        ids.insert(0, info.bos)
    return ids


def encode_conversation(model: LlamaModel, formatter: ChatFormat, system: Optional[str], messages: list[dict], *,
                        tools: Optional[list[dict]] = None, add_assistant: bool = True, continue_final: bool = False) -> list[int]:
    """Tokens of the conversation rendered by `formatter`, where only the template's own text
    may become control tokens: a message holding a marker's text (`<start_of_turn>` typed into
    a chat) is tokenized as that text, so that no message can forge a turn. Conversations
    without such text are tokenized as a whole.

    add_assistant: end with the opening of the assistant's turn. continue_final: the last
    message is the assistant's, and the reply continues its text (a prefill): the conversation
    ends right after that text, before the template closes the turn.

    Raises UsageError when a message holds a marker's text and the template changes message
    text beyond trimming it (its spans cannot then be told apart from the template's)."""
    contents = ([system] if system else []) + [m["content"] for m in messages]
    if _continues_text(messages, continue_final):
        if any(_holds_control_text(model, c) for c in contents):
            raise UsageError("a message holds the text of one of the model's control tokens, which a continued assistant message "
                             "cannot keep apart from the template's own; remove it")
        return encode(model, render_conversation(formatter, system, messages, tools=tools, continue_final=True))
    messages, add_assistant = _turn_end(messages, add_assistant, continue_final)
    text = formatter.render(system, messages, add_assistant=add_assistant, **({"tools": tools} if tools else {}))
    calls = [json.dumps(m["tool_calls"], ensure_ascii=False) for m in messages if m.get("tool_calls")]
    if tools or calls:  # (tools and calls are rendered as JSON: no span of the text is theirs alone)
        if any(_holds_control_text(model, c) for c in [*contents, *calls, json.dumps(tools or [], ensure_ascii=False)]):
            raise UsageError("a message or tool holds the text of one of the model's control tokens, which a conversation with tools "
                             "cannot keep apart from the template's own; remove it")
        return encode(model, text)
    if not any(_holds_control_text(model, c) for c in contents):
        return encode(model, text)
    spans = _content_spans(formatter, system, messages, contents, text)
    if spans is None:
        raise UsageError(
            f"a message holds the text of one of the model's control tokens, and the chat template ({formatter.name}) "
            "changes message text, so it cannot be kept apart from the template's own; remove it, or pass --template NAME"
        )
    # Where the template's own text holds control tokens (never inside a message) ...
    marks: list[tuple[int, int, int]] = []  # (start, end, token)
    edges = [0] + [p for span in spans for p in span] + [len(text)]
    for start, end in zip(edges[0::2], edges[1::2]):
        marks += _control_marks(model, text, start, end)
    # ... and the text between them, tokenized as text: what llama.cpp does with parse_special,
    # which tokenizes the text between two control tokens on its own (without the whitespace
    # next to a token that strips it).
    ids, at, strip_next = [], 0, False
    for start, end, token in marks + [(len(text), len(text), None)]:
        lstrip, rstrip = model.strips(token) if token is not None else (False, False)
        piece = text[at:start]
        piece = piece.lstrip(_C_SPACE) if strip_next else piece
        piece = piece.rstrip(_C_SPACE) if lstrip else piece
        if piece:
            ids += model.tokenize(piece, add_bos=False, parse_special=False)
        if token is not None:
            ids.append(token)
        at, strip_next = end, rstrip
    return _with_bos(model, ids)


_C_SPACE = " \t\n\v\f\r"  # what C's isspace() takes, as llama.cpp strips


def render_conversation(formatter: ChatFormat, system: Optional[str], messages: list[dict], *, tools: Optional[list[dict]] = None,
                        add_assistant: bool = True, continue_final: bool = False) -> str:
    """The conversation's text as encode_conversation encodes it (continue_final: up to the end of
    the last message's text; with no text, the assistant's turn opened as for a new reply)."""
    given = {"tools": tools} if tools else {}
    if _continues_text(messages, continue_final):
        return cut_after(formatter.render(system, messages, add_assistant=False, **given), messages[-1]["content"], formatter.name)
    messages, add_assistant = _turn_end(messages, add_assistant, continue_final)
    return formatter.render(system, messages, add_assistant=add_assistant, **given)


def _continues_text(messages: list[dict], continue_final: bool) -> bool:
    """Whether the reply continues the last message's text (a prefill with text in it)."""
    return continue_final and bool(messages[-1]["content"].strip())


def _turn_end(messages: list[dict], add_assistant: bool, continue_final: bool) -> tuple[list[dict], bool]:
    """The messages rendered, and whether the assistant's turn opens after them: continuing an
    empty assistant message is opening the assistant's turn, as for a new reply."""
    return (messages[:-1], True) if continue_final else (messages, add_assistant)


def cut_after(text: str, content: str, name: str) -> str:
    """`text` up to the end of its last copy of `content` (the final message, which the reply
    continues), as it is or as the template trimmed it."""
    for kept in dict.fromkeys((content, content.rstrip(), content.strip())):
        at = text.rfind(kept)
        if kept and at >= 0:
            return text[: at + len(kept)]
    raise UsageError(f"the chat template ({name}) changes the final assistant message's text, so the reply cannot continue it; "
                     "send it as an earlier turn, or leave it out")


def _holds_control_text(model: LlamaModel, text: str) -> bool:
    return any(model.is_control(t) for t in model.tokenize(text, add_bos=False, parse_special=True))


def _content_spans(formatter: ChatFormat, system: Optional[str], messages: list[dict], contents: list[str], text: str) -> Optional[list[tuple[int, int]]]:
    """Where each message's text lies in `text`, found by rendering the conversation again with a
    mark in place of each message: the template's text between the marks must then be `text`'s,
    and each message must sit between them as it is or trimmed. None when they do not match."""
    mark = "\ue000{}\ue001"
    shape = formatter.render(
        mark.format(0) if system else None,
        [dict(m, content=mark.format(k + bool(system))) for k, m in enumerate(messages)],
    )
    parts = re.split("\ue000(\\d+)\ue001", shape)  # template text, message number, template text, ...
    spans, at = [], 0
    for i, part in enumerate(parts):
        if i % 2 == 0:
            if not text.startswith(part, at):
                return None
            at += len(part)
            continue
        content, after = contents[int(part)], parts[i + 1]
        for kept in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if text.startswith(kept, at) and text.startswith(after, at + len(kept)):
                spans.append((at, at + len(kept)))
                at += len(kept)
                break
        else:
            return None
    return spans if at == len(text) else None


def _control_marks(model: LlamaModel, text: str, start: int, end: int) -> list[tuple[int, int, int]]:
    """The control tokens that llama.cpp finds in text[start:end] (template text only), as
    (start, end, token) in order, longest first where two begin at one place."""
    piece = text[start:end]
    found = {t for t in model.tokenize(piece, add_bos=False, parse_special=True) if model.is_control(t)}
    names = sorted({model.token_text(t).decode("utf-8", "replace"): t for t in found}.items(), key=lambda nt: -len(nt[0]))
    marks, at = [], 0
    while names and at < len(piece):
        hits = [(piece.find(name, at), -len(name), name, t) for name, t in names]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            break
        pos, _, name, token = min(hits)
        marks.append((start + pos, start + pos + len(name), token))
        at = pos + len(name)
    return marks
