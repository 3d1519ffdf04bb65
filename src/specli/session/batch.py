"""`specli batch`: the parts that need no model — input lines to items, output records, resume,
the summary.

Input: one JSON object per line (`prompt`, optional `id`, `max_tokens`, sampling fields,
`metadata`), or plain text with one prompt per line. Blank lines are no items. A line that
cannot become an item becomes a `LineError` (an error record in the output) and the batch goes
on. Output: one JSON object per item, written and flushed as soon as the item is complete.

Resume: an output file left by an earlier run (complete, interrupted or killed) tells which ids
are done; their items are skipped. Error records and a line cut short by a kill are dropped
and those items run again. When the run ends the file is rewritten, atomically, in input order.
A file that is not such an output (any complete line that is not a record) is refused untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional, Union

from specli.constraints import Constraint, Grammar
from specli.decoding.generation import Request
from specli.decoding.sampling import JSON_FIELDS, SamplingParams, sampling_json
from specli.decoding.stats import Stats
from specli.decoding.stopping import check_stop
from specli.errors import SettingError, UsageError
from specli.files import open_to_read, read_limited, strip_bom, write_atomically
from specli.llama.model import LlamaModel

# Per-item fields that override the command line, with the JSON types they accept.
SAMPLING_FIELDS = JSON_FIELDS
# `metadata` is carried to the output unchanged; any other field is an error (a typo such as
# "temprature" would otherwise sample with the default without a word).
ITEM_FIELDS = ("prompt", "id", "max_tokens", "stop", "metadata", *SAMPLING_FIELDS, "system", "messages", "json_schema", "grammar")
MESSAGE_ROLES = ("system", "user", "assistant")
FORMATS = ("auto", "jsonl", "text")

ItemId = Union[int, str]


@dataclass
class Item:
    """One prompt to generate for, with its own settings."""

    line: int  # 1-based line number in the input
    id: ItemId
    prompt: str
    max_tokens: int
    sampling: SamplingParams
    echo: dict = field(default_factory=dict)  # fields copied to the output record (metadata)
    # A chat item (--chat, --system, or its own `system`/`messages`): the conversation to render
    # with the chat template (system first, if any; the last message the user's), else None.
    messages: Optional[list[dict]] = None
    prompt_ids: Optional[list[int]] = None  # the rendered conversation's tokens, set just before it runs
    parse_special: bool = True  # a raw prompt's control text becomes control tokens (off: --no-parse-special)
    stop: tuple[str, ...] = ()  # stop strings: the item's `stop`, else the command line's --stop
    grammar: Optional[Grammar] = None  # the output's constraint: the item's json_schema or grammar, else the command line's

    def request(self, model_tgt: LlamaModel) -> Request:
        """The item's generation: a chat item's rendered tokens, else its raw prompt's as llama.cpp
        makes them, its control text parsed unless the item says not to (LlamaModel.tokenize_prompt)."""
        ids = self.prompt_ids if self.prompt_ids is not None else model_tgt.tokenize_prompt(self.prompt, parse_special=self.parse_special)
        constraint = None if self.grammar is None else Constraint(self.grammar, model_tgt)
        return Request(ids, max_tokens=self.max_tokens, sampling=self.sampling, seed=self.sampling.seed, stop=self.stop, constraint=constraint)


@dataclass
class LineError:
    """An input line that could not be processed: becomes an error record."""

    line: int
    id: ItemId
    error: str

    def record(self) -> dict:
        return {"id": self.id, "line": self.line, "error": self.error}


Entry = Union[Item, LineError]


def id_key(item_id: ItemId) -> str:
    """Ids compare as their JSON text: 1 and "1" are different ids."""
    return json.dumps(item_id, ensure_ascii=False)


def is_done(entry: Entry, done: set[str]) -> bool:
    """An item whose id has a result already (a bad line is never done: its error is written
    again, e.g. a repeated id whose first line is done)."""
    return isinstance(entry, Item) and id_key(entry.id) in done


# --- input ------------------------------------------------------------------------------------
def read_input(path: str, stdin: IO[bytes]) -> list[bytes]:
    """The raw lines of the input file ('-' = stdin), without a leading UTF-8 byte-order mark.
    Raises UsageError when it cannot be read or is over the input size limit (files.py; a FIFO
    or a device is read too, up to that limit)."""
    if path == "-":
        data = read_limited(stdin, "the input on stdin")
    else:
        p = Path(path)
        if not p.exists():
            raise UsageError(f"input file not found: {path} (give a JSONL or text file, or '-' for stdin)")
        if p.is_dir():
            raise UsageError(f"{path} is a directory; give a JSONL or text file of prompts")
        try:
            with p.open("rb") as handle:
                data = read_limited(handle, f"input file {path}")
        except OSError as err:
            raise UsageError(f"cannot read {path}: {err.strerror} (check its permissions)") from None
    return strip_bom(data).splitlines()


def detect_format(path: str, lines: list[bytes], fmt: str) -> str:
    """'jsonl' or 'text'. auto: by the extension (.jsonl/.json, .txt), else JSONL when the first
    non-blank line starts with '{'."""
    if fmt != "auto":
        return fmt
    suffix = Path(path).suffix.lower() if path != "-" else ""
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix == ".txt":
        return "text"
    first = next((line.strip() for line in lines if line.strip()), b"")
    return "jsonl" if first.startswith(b"{") else "text"


def parse_lines(lines: list[bytes], fmt: str, sampling: SamplingParams, max_tokens: int, *,
                chat: bool = False, system: Optional[str] = None, stop: tuple[str, ...] = (), grammar: Optional[Grammar] = None) -> list[Entry]:
    """Items (and errors for bad lines) in input order; `sampling` and `max_tokens` are the
    command line's defaults, and so are `chat` (every prompt is a user message for the chat
    template) and `system` (the system prompt of chat items without their own; implies chat).
    `stop` is --stop's strings, `grammar` the command line's constraint (a record's json_schema or
    grammar replaces it). A later line repeating an earlier id is an error."""
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        entry = _parse_line(number, raw, fmt, sampling, max_tokens, chat or system is not None, system, stop, grammar)
        key = id_key(entry.id)
        if key in seen:
            entry = LineError(number, entry.id, f"id {entry.id!r} was already used on line {seen[key]}; give each line its own id")
        else:
            seen[key] = number
        entries.append(entry)
    return entries


def _parse_line(number: int, raw: bytes, fmt: str, sampling: SamplingParams, max_tokens: int,
                chat: bool = False, system: Optional[str] = None, stop: tuple[str, ...] = (), grammar: Optional[Grammar] = None) -> Entry:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return LineError(number, number, f"the line is not UTF-8 text (bad byte at column {err.start + 1})")
    if fmt == "text":
        prompt = text.rstrip("\r")
        return Item(number, number, prompt, max_tokens, sampling, messages=_as_chat(prompt, system) if chat else None, stop=stop, grammar=grammar)
    try:
        obj = json.loads(text)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")  # (a JSON \ud800 escape decodes to a lone surrogate)
    except json.JSONDecodeError as err:
        return LineError(number, number, f"invalid JSON at column {err.colno}: {err.msg}")
    except RecursionError:
        return LineError(number, number, "the line is JSON nested too deeply")
    except UnicodeEncodeError:
        return LineError(number, number, "the line holds a lone surrogate escape (\\ud800-\\udfff), which is not valid Unicode text")
    if not isinstance(obj, dict):
        return LineError(number, number, 'the line is JSON but not an object; write {"prompt": "..."}')
    item_id = obj.get("id", number)
    if isinstance(item_id, bool) or not isinstance(item_id, (int, str)):
        return LineError(number, number, f"id must be a string or an integer, got {json.dumps(item_id)}")
    unknown = [name for name in obj if name not in ITEM_FIELDS]
    if unknown:
        return LineError(number, item_id, f"unknown field {unknown[0]!r}; known fields: {', '.join(ITEM_FIELDS)} (put your own data under metadata)")
    conversation = _conversation(obj, chat, system)
    if isinstance(conversation, str):
        return LineError(number, item_id, conversation)
    prompt, messages = conversation
    overrides = {}
    for name, kind in SAMPLING_FIELDS.items():
        if name in obj:
            problem = _type_problem(obj[name], kind, allow_null=name == "seed")
            if problem:
                return LineError(number, item_id, f"{name} must be {problem}, got {json.dumps(obj[name])}")
            overrides[name] = obj[name]
    item_max_tokens = obj.get("max_tokens", max_tokens)
    problem = _type_problem(item_max_tokens, int)
    if problem or item_max_tokens < 1:
        return LineError(number, item_id, f"max_tokens must be an integer >= 1, got {json.dumps(item_max_tokens)}")
    item_stop = [obj["stop"]] if isinstance(obj.get("stop"), str) else obj.get("stop", stop)
    if not isinstance(item_stop, (list, tuple)) or not all(isinstance(s, str) for s in item_stop):
        return LineError(number, item_id, f"stop must be a string or a list of strings, got {json.dumps(obj['stop'])}")
    try:
        item_sampling = dataclasses.replace(sampling, **overrides).validate()
        item_stop = check_stop(item_stop)
    except SettingError as err:  # it names the field (top_k, stop), as an item spells it
        return LineError(number, item_id, str(err))
    item_grammar = _item_grammar(obj, grammar)
    if isinstance(item_grammar, str):
        return LineError(number, item_id, item_grammar)
    echo = {"metadata": obj["metadata"]} if "metadata" in obj else {}
    return Item(number, item_id, prompt, item_max_tokens, item_sampling, echo, messages=messages, stop=item_stop, grammar=item_grammar)


def _item_grammar(obj: dict, default: Optional[Grammar]) -> Optional[Grammar] | str:
    """A JSON item's constraint (its json_schema, an object, or grammar, GBNF text; else the
    command line's), or what is wrong with it."""
    if "json_schema" in obj and "grammar" in obj:
        return 'give either "json_schema" or "grammar", not both'
    if "json_schema" in obj:
        if not isinstance(obj["json_schema"], (dict, bool)):
            return f"json_schema must be a JSON Schema object, got {_json_type(obj['json_schema'])}"
        style = default.json_style if default is not None else "spaced"
        grammar = Grammar("json_schema", json.dumps(obj["json_schema"]), json_style=style, where="json_schema")
    elif "grammar" in obj:
        if not isinstance(obj["grammar"], str):
            return f"grammar must be a string (GBNF), got {_json_type(obj['grammar'])}"
        grammar = Grammar("gbnf", obj["grammar"], where="grammar")
    else:
        return default
    try:
        grammar.check()
    except UsageError as err:
        return str(err)
    return grammar


def _as_chat(prompt: str, system: Optional[str]) -> list[dict]:
    """A prompt as a chat item's conversation: the system prompt (if any), then the user's."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _conversation(obj: dict, chat: bool, system: Optional[str]) -> tuple[str, Optional[list[dict]]] | str:
    """A JSON item's (prompt, messages): `messages` is the conversation for the chat template
    (see Item), None for a plain prompt; or what is wrong, as a string. The item's `system`
    (or a first message with role system) replaces the command line's --system."""
    if "prompt" in obj and "messages" in obj:
        return 'give either "prompt" or "messages", not both'
    if "system" in obj:
        if not isinstance(obj["system"], str):
            return f"system must be a string, got {_json_type(obj['system'])}"
        chat, system = True, obj["system"]
    if "messages" in obj:
        messages = _check_messages(obj["messages"])
        if isinstance(messages, str):
            return messages
        if messages[0]["role"] == "system":
            if "system" in obj:
                return 'the system prompt is given twice ("system" and a first message with role "system"); keep one'
            return messages[-1]["content"], messages
        return messages[-1]["content"], ([{"role": "system", "content": system}] if system else []) + messages
    prompt = obj.get("prompt")
    if prompt is None:
        return 'no "prompt" field; every line needs {"prompt": "..."} (or {"messages": [...]} for a conversation)'
    if not isinstance(prompt, str):
        return f"prompt must be a string, got {_json_type(prompt)}"
    if not prompt.strip():
        return "the prompt is empty; give some text for the model to continue"
    return prompt, _as_chat(prompt, system) if chat else None


def _check_messages(value: object) -> list[dict] | str:
    """`messages` as a list of {"role", "content"} dicts, or what is wrong with it."""
    shape = '{"role": "user", "content": "..."}'
    if not isinstance(value, list) or not value:
        return f"messages must be a non-empty array of {shape} objects, got {_json_type(value) if value != [] else 'an empty array'}"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"messages[{i}] must be an object {shape}, got {_json_type(message)}"
        extra = [name for name in message if name not in ("role", "content")]
        if extra:
            return f"messages[{i}] has an unknown field {extra[0]!r}; a message has role and content only"
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            return f"messages[{i}].role must be one of {', '.join(MESSAGE_ROLES)}, got {json.dumps(role)}"
        if not isinstance(content, str):
            return f"messages[{i}].content must be a string, got {_json_type(content)}"
        if role == "system" and i > 0:
            return f"messages[{i}] has role system; only the first message may (or use the item's \"system\" field)"
    if value[-1]["role"] != "user":
        return f"the last message must be the user's (the model answers it), got role {value[-1]['role']}"
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _type_problem(value: object, kind: type, *, allow_null: bool = False) -> str | None:
    """None when `value` is a JSON value of `kind` (ints count as floats), else what it must be."""
    if value is None and allow_null:
        return None
    if isinstance(value, bool):
        return "a number" if kind is float else "an integer"
    if kind is int:
        return None if isinstance(value, int) else "an integer"
    return None if isinstance(value, (int, float)) else "a number"


def _json_type(value: object) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object", str: "a string"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


# --- output -----------------------------------------------------------------------------------
def generation_json(gen, the_plan) -> dict:
    """`run --json`'s object (and a batch record's fields)."""
    return {
        "text": gen.text,
        "token_ids": gen.token_ids,
        "n_tokens": len(gen.token_ids),
        "stop_reason": gen.stop_reason,
        "target": str(the_plan.target_path),
        "draft": the_plan.draft_label,
        "n_draft": the_plan.draft_length.json_value,  # a number or "auto" (0: target-only)
        "sampling": sampling_json(the_plan.sampling),
        "seed": gen.seed,
        "stats": gen.stats.to_dict(),
    }


def result_record(item: Item, result: dict) -> dict:
    """The output line of a finished item: its id and line, `run --json`'s object, metadata."""
    return {"id": item.id, "line": item.line, **result, **item.echo}


# An existing output is read back to resume only up to MAX_RESUME_BYTES, and no line past
# MAX_RECORD_BYTES: a wrong -o (a disk image, a log) is refused before it is loaded whole.
MAX_RESUME_BYTES = 1 << 30
MAX_RECORD_BYTES = 16 << 20
# The fields every result record has (`run --json`'s object), with their JSON types.
RESULT_FIELDS = {"text": str, "token_ids": list, "n_tokens": int, "stop_reason": str, "stats": dict}
RECORD_START = b'{"id": '  # how every record line begins (json.dumps of {"id": ..., "line": ...})


def record_kind(obj: object) -> str | None:
    """'result' or 'error' for a specli batch record, None for anything else: an object with
    `id` (a string or an integer) and `line` (an integer), and either `error` (a string) or
    every field of RESULT_FIELDS with its type."""
    if not isinstance(obj, dict):
        return None
    item_id, line = obj.get("id"), obj.get("line")
    if isinstance(item_id, bool) or not isinstance(item_id, (int, str)):
        return None
    if isinstance(line, bool) or not isinstance(line, int):
        return None
    if "error" in obj:
        return "error" if isinstance(obj["error"], str) else None
    for name, kind in RESULT_FIELDS.items():
        value = obj.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            return None
    return "result"


@dataclass
class Previous:
    """What an existing output file says: which ids are done, and the lines worth keeping."""

    done: set[str]  # id keys of items with a result (no error)
    kept: list[str]  # their lines, in file order
    settings: dict[str, dict] = field(default_factory=dict)  # id key -> the record's RECORD_SETTINGS
    n_errors: int = 0  # error records dropped (those items run again)
    n_partial: int = 0  # a last line cut short by a kill, dropped
    rewrite: bool = False  # the file must be rewritten as `kept` before appending

    @property
    def needs_rewrite(self) -> bool:
        return self.rewrite or bool(self.n_errors or self.n_partial)


class NotAnOutput(UsageError):
    """An existing -o file that is not a specli batch output: refused, never written."""


def read_previous(path: Path) -> Previous:
    """Read an output file of an earlier run. Raises UsageError (NotAnOutput) when it is not
    one, so that a wrong -o is never rewritten: every complete line must be a record (blank
    lines aside); only a last line without its newline that is the start of a record cut short
    by a kill may be dropped, and only after at least one record. Reads nothing of a file over
    MAX_RESUME_BYTES, and no line past MAX_RECORD_BYTES."""
    try:
        # (a FIFO put in the output's place since it was checked must not hang us: open_to_read)
        with open_to_read(path) as (handle, info):
            if not stat.S_ISREG(info.st_mode):
                raise NotAnOutput(f"{path} is not a regular file, so it cannot be a batch output; give a file name for -o, or '-' for stdout")
            if info.st_size > MAX_RESUME_BYTES:
                raise NotAnOutput(
                    f"{path} is {info.st_size} bytes, over the {_size(MAX_RESUME_BYTES)} that batch reads back to resume; "
                    "pick another -o, or pass --overwrite to replace the file"
                )
            return _read_records(handle, path)
    except OSError as err:
        raise UsageError(f"cannot read {path} to resume: {err.strerror} (pass --overwrite to start over)") from None


def _read_records(handle: IO[bytes], path: Path) -> Previous:
    prev = Previous(done=set(), kept=[])
    n_records = 0
    number = 0
    while True:
        raw = handle.readline(MAX_RECORD_BYTES + 1)
        if not raw:
            return prev
        number += 1
        complete = raw.endswith(b"\n")
        if not complete and len(raw) > MAX_RECORD_BYTES:
            raise NotAnOutput(
                f"{path} line {number} is longer than {_size(MAX_RECORD_BYTES)}, so it is not a specli batch record and the file "
                "cannot be resumed; pick another -o, or pass --overwrite to replace the file"
            )
        body = raw.rstrip(b"\r\n")
        if not body.strip():
            if not complete:
                prev.rewrite = True  # trailing blanks without a newline: appending needs one
            continue
        try:
            record = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            record = None
        kind = record_kind(record)
        if kind is None:
            if not complete and n_records and record is None and _cut_short(body):
                prev.n_partial += 1  # the last write of a killed run
                return prev
            raise NotAnOutput(
                f"{path} line {number} is not a specli batch record (a JSON object with id, line, and text, token_ids, n_tokens, "
                "stop_reason, stats or an error), so the file cannot be resumed; pick another -o, or pass --overwrite to replace it"
            )
        n_records += 1
        if not complete:
            prev.rewrite = True  # a whole record without its newline: restore it before appending
        if kind == "error":
            prev.n_errors += 1
            continue
        key = id_key(record["id"])
        if key not in prev.done:
            prev.done.add(key)
            prev.kept.append(body.decode("utf-8"))
            prev.settings[key] = {name: record[name] for name in RECORD_SETTINGS if name in record}


# What a result record says about how it was made (`run --json`'s fields); a resumed run whose
# settings differ would mix two kinds of results in one file.
RECORD_SETTINGS = ("target", "draft", "n_draft", "sampling")


def settings_differences(previous: Previous, entries: list[Entry], run_settings: dict, item_sampling) -> list[str]:
    """How the earlier run's results differ from this run's settings, one phrase per setting
    ("temperature 0.8 (this run: 0.0)"), the first record showing each difference; [] when
    they agree. `run_settings` has this run's target, draft and n_draft as records spell them;
    item_sampling(item) is an item's `sampling` object. A record of an id that is not in this
    input is compared on the run's settings only (its own sampling overrides are unknown)."""
    items = {id_key(e.id): e for e in entries if isinstance(e, Item)}
    found: dict[str, str] = {}
    for key, made_with in previous.settings.items():
        for name in ("target", "draft", "n_draft"):
            if name in made_with and name not in found and not _same_setting(made_with[name], run_settings[name]):
                found[name] = f"{name} {_show(made_with[name])} (this run: {_show(run_settings[name])})"
        item = items.get(key)
        sampling = made_with.get("sampling")
        if item is None or not isinstance(sampling, dict):
            continue
        now = item_sampling(item)
        for name in [*now, *(name for name in sampling if name not in now)]:  # temperature first
            if name not in found and sampling.get(name) != now.get(name):
                found[name] = f"{name} {_show(sampling.get(name))} (this run: {_show(now.get(name))})"
    if "temperature" in found:
        found.pop("greedy", None)  # follows from the temperature
    return list(found.values())


def _same_setting(before: object, now: object) -> bool:
    """Equal, or paths (or lookup+PATH labels) naming the same file from here."""
    if before == now:
        return True
    if not (isinstance(before, str) and isinstance(now, str)):
        return False
    prefix = "lookup+"
    if before.startswith(prefix) != now.startswith(prefix):
        return False
    a, b = before.removeprefix(prefix), now.removeprefix(prefix)
    try:
        return Path(a).resolve() == Path(b).resolve() or (Path(a).exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _show(value: object) -> str:
    return "none" if value is None else json.dumps(value, ensure_ascii=False)


def _cut_short(body: bytes) -> bool:
    """Whether an unparseable fragment can be the start of a record line."""
    body = body.lstrip()
    return body.startswith(RECORD_START) if len(body) >= len(RECORD_START) else RECORD_START.startswith(body)


def _size(n_bytes: int) -> str:
    return f"{n_bytes >> 30} GiB" if n_bytes >= 1 << 30 else f"{n_bytes >> 20} MiB"


def sort_output(path: Path, entries: list[Entry]) -> None:
    """Rewrite the output file in input order (records of other inputs last), if needed."""
    order = {_record_key(e.id, e.line): i for i, e in enumerate(entries)}
    # Split at "\n" only: a record's text may hold U+2028 or U+0085 unescaped, which
    # str.splitlines would take for line ends and so cut the record in two.
    lines = [line.rstrip("\r") for line in path.read_bytes().decode("utf-8").split("\n") if line.strip()]
    positions = []
    for line in lines:
        try:
            record = json.loads(line)
            positions.append(order.get(_record_key(record["id"], record["line"]), len(order)))
        except (json.JSONDecodeError, KeyError, TypeError):
            positions.append(len(order))
    if positions != sorted(positions):
        write_atomically(path, [line for _, line in sorted(zip(positions, lines), key=lambda pair: pair[0])])


def _record_key(item_id: ItemId, line: int) -> tuple[str, int]:
    """A record's place in the input: its id and line (a duplicate id's error has its own line)."""
    return id_key(item_id), line


class RecordWriter:
    """Writes one JSON record per line and flushes it at once.

    in_order=True (stdout, where nothing can be rewritten later) holds a record back until every
    earlier item's record is out; otherwise records go out as they complete.
    """

    def __init__(self, stream: IO[str], entries: list[Entry], *, in_order: bool, skip: set[str]):
        self.stream = stream
        self.in_order = in_order
        # Records still expected, in input order (skipped items are not waited for).
        self._pending = [_record_key(e.id, e.line) for e in entries if not is_done(e, skip)]
        self._next = 0
        self._held: dict[tuple[str, int], str] = {}

    def write(self, record: dict) -> None:
        """Write (or hold back) a record; it must have the `id` and `line` of its entry."""
        line = json.dumps(record, ensure_ascii=False)
        if not self.in_order:
            self._emit(line)
            return
        self._held[_record_key(record["id"], record["line"])] = line
        while self._next < len(self._pending) and self._pending[self._next] in self._held:
            self._emit(self._held.pop(self._pending[self._next]))
            self._next += 1

    def release_held(self) -> None:
        """Write the records still held back (an interrupted run: finished results are never
        dropped, even if an earlier item never completed)."""
        for key in self._pending[self._next :]:
            if key in self._held:
                self._emit(self._held.pop(key))

    def _emit(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


# --- summary ----------------------------------------------------------------------------------
@dataclass
class Summary:
    """Totals of one `specli batch` run (items skipped as already done count only as skipped)."""

    items: int = 0  # items in the input (good and bad lines)
    done: int = 0  # generated in this run
    failed: int = 0  # error records written in this run
    skipped: int = 0  # already in the output file
    wall_s: float = 0.0  # from the first item to the last (model loading excluded)
    interrupted: bool = False
    stats: Stats = field(default_factory=Stats)

    @property
    def tokens_per_s(self) -> float | None:
        return self.stats.n_tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def items_per_s(self) -> float | None:
        return self.done / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict:
        rnd = lambda x: None if x is None else round(x, 4)  # noqa: E731
        st = self.stats
        return {
            "items": self.items, "done": self.done, "failed": self.failed, "skipped": self.skipped,
            "interrupted": self.interrupted, "tokens": st.n_tokens, "wall_s": rnd(self.wall_s),
            "tokens_per_s": rnd(self.tokens_per_s), "items_per_s": rnd(self.items_per_s),
            "drafted": st.drafted, "accepted": st.accepted, "acceptance_rate": rnd(st.acceptance_rate),
            "target_passes": st.target_passes, "mean_tokens_per_pass": rnd(st.mean_tokens_per_pass),
            # Tokens per target pass bounds the speedup from above: it ignores the drafter's cost
            # and the wider passes (measure against --target-only for the real figure).
            "speedup_estimate": rnd(st.mean_tokens_per_pass),
            "prompt_tokens": st.prompt_tokens,
        }

    def line(self, *, with_drafting: bool) -> str:
        """The summary for stderr."""
        st = self.stats
        parts = [f"{self.items} items: {self.done} done, {self.failed} failed, {self.skipped} skipped (already done)"]
        parts.append(f"{st.n_tokens} tokens in {self.wall_s:.2f}s")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:.1f} tok/s, {self.items_per_s:.2f} items/s")
        if with_drafting:
            parts.extend(st.drafting_summary())
            if st.drafted and st.mean_tokens_per_pass:
                parts[-1] += " (the speedup's upper bound)"
        if self.interrupted:
            parts.append("interrupted: run again to finish")
        return "batch: " + " · ".join(parts)
