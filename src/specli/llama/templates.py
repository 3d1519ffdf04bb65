"""llama.cpp's chat templates (for `specli chat`): its built-in names and rendering a conversation.

A model's own template is read by LlamaModel.chat_template().
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import llama_cpp


def builtin_chat_templates() -> list[str]:
    """Names of the chat templates llama.cpp knows by name (chatml, gemma, llama3, ...)."""
    n = int(llama_cpp.llama_chat_builtin_templates(None, 0))
    names = (ctypes.c_char_p * max(n, 1))()
    n = int(llama_cpp.llama_chat_builtin_templates(names, n))
    return [names[i].decode("utf-8") for i in range(max(n, 0))]


def apply_chat_template(template: str, messages: Sequence[tuple[str, str]], *, add_assistant: bool = True) -> str | None:
    """Render (role, content) messages with `template` (a built-in name or a template's source).

    add_assistant ends the text with the opening of an assistant turn. Returns None when
    llama.cpp does not recognise the template (its detection covers the common families only).
    """
    chat = (llama_cpp.llama_chat_message * max(len(messages), 1))()
    # Keep the encoded strings referenced while llama.cpp reads them.
    encoded = [(role.encode("utf-8"), content.encode("utf-8")) for role, content in messages]
    for i, (role, content) in enumerate(encoded):
        chat[i].role, chat[i].content = role, content
    tmpl = template.encode("utf-8")
    size = max(256, 2 * sum(len(r) + len(c) for r, c in encoded))
    for _ in range(2):  # a second try when the first buffer was too small
        buf = ctypes.create_string_buffer(size)
        n = int(llama_cpp.llama_chat_apply_template(tmpl, chat, len(encoded), add_assistant, buf, size))
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
    return None
