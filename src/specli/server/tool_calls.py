"""OpenAI's tools on the wire: `tools`, `tool_choice` and `parallel_tool_calls` checked into a
`ToolRequest`, and a generation's text turned into `tool_calls` (whole, or as a stream's deltas:
the id and name once, then the arguments in pieces). The grammar and the parsing are
constraints/tools.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from specli.constraints.tools import AUTO, NONE, REQUIRED, CallStream, Tool, ToolFormat, new_call_id, parse_calls
from specli.server.protocol import ApiError, quoted

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit


@dataclass
class ToolRequest:
    """The request's tools: as given (for the template) and as Tools (for the grammar); the
    choice (auto, none, required; a named tool is `required` with `only`)."""

    given: list[dict]
    tools: list[Tool]
    choice: str = AUTO
    only: Optional[str] = None
    parallel: bool = True

    def offered(self) -> list[Tool]:
        """The tools a call may name."""
        return [t for t in self.tools if self.only is None or t.name == self.only]


def parse_tools(body: dict) -> Optional[ToolRequest]:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`; None without tools."""
    value = body.get("tools")
    if value is None or value == []:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(value, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects", param="tools")
    if len(value) > MAX_TOOLS:
        raise ApiError(400, f"'tools' holds {len(value)} tools; at most {MAX_TOOLS}", param="tools")
    given, tools = [], []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}", param="tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ApiError(400, f"{where}: 'name' must be 1 to 64 letters, digits, '_' or '-', got {quoted(name)}", param="tools")
        if any(t.name == name for t in tools):
            raise ApiError(400, f"{where}: two tools are named {quoted(name)}", param="tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ApiError(400, f"{where}: 'parameters' must be a JSON schema object, got {quoted(parameters)}", param="tools")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ApiError(400, f"{where}: 'description' must be a string", param="tools")
        given.append({"type": "function", "function": function})
        tools.append(Tool(name, parameters))
    request = ToolRequest(given, tools)
    choice = body.get("tool_choice")
    if choice is None or choice in (AUTO, NONE, REQUIRED):
        request.choice = choice or AUTO
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise ApiError(400, f"'tool_choice' names {quoted(name)}, which is not one of 'tools'", param="tool_choice")
        request.choice, request.only = REQUIRED, name
    else:
        raise ApiError(400, f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                       f"got {quoted(choice)}", param="tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    request.parallel = parallel
    return request


def message(fmt: ToolFormat, text: str) -> tuple[dict, bool]:
    """A whole reply as OpenAI's assistant message, and whether it holds calls."""
    parsed = parse_calls(fmt, text)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, False
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content.strip() or None, "tool_calls": calls}, True


class ToolDeltas:
    """A streamed reply as OpenAI's deltas: content, then each call's id and name once and its
    arguments in pieces."""

    def __init__(self, fmt: ToolFormat):
        self._stream = CallStream(fmt)
        self.ids: list[str] = []

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self._stream.feed(text))

    def finish(self) -> list[dict]:
        return self._deltas(self._stream.finish())

    def _deltas(self, pieces: list[tuple]) -> list[dict]:
        out = []
        for piece in pieces:
            if piece[0] == "content":
                out.append({"content": piece[1]})
            elif piece[0] == "call":
                self.ids.append(new_call_id())
                out.append({"tool_calls": [{"index": piece[1], "id": self.ids[-1], "type": "function",
                                            "function": {"name": piece[2], "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": piece[1], "function": {"arguments": piece[2]}}]})
        return out
