"""Chat templates (for `specli chat`, `run`/`batch` with --chat, and serve's chat route):
llama.cpp's built-in ones by name, and a model's own Jinja template rendered in a sandbox.

A model's own template is read by LlamaModel.chat_template(); a conversation rendered with a
template becomes prompt tokens in conversation.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os

try:
    import resource
except ImportError:  # (not on Windows: the deadline and the other caps still hold)
    resource = None
import sys
import threading
import time
from typing import Optional, Sequence

import jinja2
import jinja2.ext
import llama_cpp
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


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


# --- a model's own template (Jinja) --------------------------------------------------------------
class TemplateRenderError(Exception):
    """A chat template that cannot be compiled or rendered; the message is one line naming the
    problem. unsafe: the sandbox refused what the template tried to do."""

    def __init__(self, problem: str, *, unsafe: bool = False):
        super().__init__(" ".join(problem.split()))  # one line, whatever the template raised
        self.unsafe = unsafe


RENDER_SECONDS = 5.0  # a template renders in well under a millisecond a message
RENDER_GROWTH = 8  # ... and writes its messages plus some scaffolding, not this many times more
RENDER_VALUE_MAX = 1 << 24  # no string or list a template builds in one operation is longer
RENDER_MEMORY = 256 << 20  # ... nor does it need this much memory


class _RenderTimeout(Exception):
    """A template ran past its deadline or its memory (raised from the trace function, inside
    the template)."""


def _memory_reader():
    """A function giving the process's memory now, in bytes: its resident set from
    /proc/self/statm where there is one, else its peak (getrusage; weaker: memory freed since
    the peak is counted as in use); None where neither is known."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        page = os.sysconf("SC_PAGE_SIZE")
        return (lambda: int(os.pread(fd, 64, 0).split()[1]) * page), fd
    except (OSError, ValueError, AttributeError):
        if resource is None:
            return None, None
        unit = 1 if sys.platform == "darwin" else 1024  # (ru_maxrss: bytes on macOS, KiB elsewhere)
        return (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit), None


def _faults() -> dict[int, int] | None:
    """Each thread's minor page faults so far (/proc/self/task/*/stat), by native thread id; None
    where they are not known. A thread grows the process's memory by touching new pages, each
    a fault counted for that thread."""
    counts = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                counts[int(tid)] = int(stat.read().rsplit(b")", 1)[1].split()[7])  # (field 10, minflt; the name before it may hold spaces)
        except (OSError, ValueError, IndexError):
            continue  # (a thread that has just ended)
    return counts


def _grew_it(tid: int, before: dict[int, int] | None) -> bool:
    """Whether thread `tid` touched more new memory since `before` than any other thread of the
    process (True where that is not known: the process's growth is then taken for its own)."""
    now = _faults()
    if before is None or now is None or tid not in now or tid not in before:
        return True
    mine = now[tid] - before[tid]
    return mine > 0 and all(count - before.get(other, 0) <= mine for other, count in now.items() if other != tid)


@contextlib.contextmanager
def _deadline(seconds: float, memory: int):
    """Raise _RenderTimeout inside the code running in this thread once `seconds` have passed, or
    once the process's memory has grown by `memory` bytes: Jinja compiles a template to
    Python, whose every line a trace function sees (a loop that writes nothing included), and
    an exception it raises stops the template there. The thread's own trace function (a
    debugger, coverage) is put back after.

    The memory is the process's, which other threads grow too (serve renders several templates
    at once, and generates meanwhile): the growth is blamed on this render only when its own
    thread touched the most new memory since it began (_grew_it), so one that loops without
    building anything beside one that builds a huge string is stopped for its time, not for
    the other's memory."""
    end = time.monotonic() + seconds
    used, fd = _memory_reader()
    ceiling = used() + memory if used else None
    tid, before = threading.get_native_id(), _faults() if used else None
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        count += 1
        if count % 256 == 0:
            if time.monotonic() > end:
                raise _RenderTimeout(f"ran for over {seconds:g} s without finishing")
            if ceiling is not None and used() > ceiling and _grew_it(tid, before):
                raise _RenderTimeout(f"took over {memory >> 20} MiB of memory")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)
        if fd is not None:
            os.close(fd)


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself (e.g. "roles must alternate")."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox (as Hugging Face and llama-cpp-python's Jinja2ChatFormatter use),
    except that an unsafe attribute (`__class__`, `list.append`) stops the rendering at once: the
    stock sandbox renders it as an empty value, so a hostile template would still render."""

    def unsafe_undefined(self, obj: object, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    # `'a' * 10**9` builds a gigabyte in one step, before any deadline or output cap can see it.
    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context, operator: str, left, right):
        sized = (str, list, tuple)
        if operator == "*" and (isinstance(left, sized) and isinstance(right, int) or isinstance(right, sized) and isinstance(left, int)):
            size = len(left) * right if isinstance(left, sized) else len(right) * left
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            size = len(left) + len(right)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            size = abs(right) * max(1, abs(left)).bit_length() // 8  # about the result's bytes
        else:
            size = 0
        if size > RENDER_VALUE_MAX:
            raise SecurityError(f"the template builds a value of over {RENDER_VALUE_MAX:,} items with {operator!r}")
        return super().call_binop(context, operator, left, right)

    # ... and so does `'x'.ljust(10**9)`.
    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        _check_sizes(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _check_sizes(args, kwargs) -> None:
    """SecurityError for an integer argument no template needs: a width or count that would
    build a huge value in one call."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > RENDER_VALUE_MAX:
            raise SecurityError(f"the template passes {value:,} to a function (at most {RENDER_VALUE_MAX:,})")


def _bounded_filter(f):
    """A Jinja filter whose arguments after the value are checked by _check_sizes
    (`'x' | center(10**9)`)."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # (context or environment, then the value)

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_sizes(args[skip:], kwargs)
        return f(*args, **kwargs)

    return bounded


class JinjaTemplate:
    """A GGUF's `tokenizer.chat_template`, compiled once in the sandbox.

    The environment matches llama-cpp-python's Jinja2ChatFormatter (trim_blocks, lstrip_blocks,
    the `{% generation %}` tag, loop controls, Transformers' `tojson`, raise_exception,
    strftime_now). Raises TemplateRenderError when the source does not compile.
    """

    def __init__(self, source: str, *, bos_token: str, eos_token: str):
        env = _StrictSandbox(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
            extensions=[Jinja2ChatFormatter.IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = Jinja2ChatFormatter.tojson
        env.filters.update({name: _bounded_filter(f) for name, f in env.filters.items()})
        env.globals.update(raise_exception=_raise_exception, strftime_now=Jinja2ChatFormatter.strftime_now)
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as err:
            raise TemplateRenderError(f"Jinja syntax error on line {err.lineno}: {err.message}") from None
        except Exception as err:  # anything else the compiler refuses
            raise TemplateRenderError(f"it does not compile: {type(err).__name__}: {err}") from None

    def render(self, messages: Sequence[tuple[str, str] | dict], *, add_assistant: bool = True, tools: Optional[list[dict]] = None,
               variables: Optional[dict] = None) -> str:
        """The messages ((role, content), or OpenAI's message objects: a tool call's arguments
        as an object) as text, ending with the opening of the assistant's turn when
        add_assistant; `tools`: OpenAI's tool objects, for a template that renders them. Raises
        TemplateRenderError for whatever stops the template, and for a template that runs past
        RENDER_SECONDS or writes past RENDER_GROWTH times what it was given (a template is code:
        it may loop for ever, or build a gigabyte). `variables`: more of the template's inputs
        (llama-server's template kwargs, such as enable_thinking)."""
        messages = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
        given = sum(len(str(m.get("content") or "")) + len(json.dumps(m.get("tool_calls") or "", default=str)) + 256 for m in messages)
        given += len(json.dumps(tools or "", default=str))
        limit = RENDER_GROWTH * (given + 4096)  # (room for each turn's scaffolding)
        extra = {**(variables or {}), **({"tools": tools} if tools else {})}
        try:
            with _deadline(RENDER_SECONDS, RENDER_MEMORY):
                out, size = [], 0
                for piece in self._template.generate(
                    messages=messages, bos_token=self.bos_token, eos_token=self.eos_token, add_generation_prompt=add_assistant, **extra,
                ):
                    size += len(piece)
                    if size > limit:
                        raise TemplateRenderError(f"the template wrote over {limit:,} characters for {len(messages)} message(s); it is not a chat template")
                    out.append(piece)
            return "".join(out)
        except TemplateRenderError:
            raise
        except _RenderTimeout as err:
            raise TemplateRenderError(f"the template {err}; it is not a chat template") from None
        except SecurityError as err:
            raise TemplateRenderError(f"the sandbox refused it: {err}", unsafe=True) from None
        except _TemplateRaised as err:
            raise TemplateRenderError(f"the template refuses this conversation: {err}") from None
        except Exception as err:  # the template's own code failed (a type error, an undefined name...)
            raise TemplateRenderError(f"{type(err).__name__}: {err}") from None
