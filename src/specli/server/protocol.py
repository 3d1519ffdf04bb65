"""The OpenAI wire format, without HTTP: a request body checked and turned into an `ApiRequest` (the app makes the generation's decoding Request of it),
and the response bodies and stream chunks built from a finished or running generation.

Leniency follows the clients: unknown fields are ignored (editors and agents send vendor
fields), known fields we do not implement are accepted at their neutral value (best_of=1,
echo=false, ...) and refused otherwise, so nothing a client asked for is
silently dropped. Every refusal is an ApiError: status, message, and the field at fault.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from specli import __version__
from specli.constraints import Grammar
from specli.decoding.sampling import JSON_FIELDS, SamplingParams, with_bias
from specli.decoding.stats import Stats
from specli.decoding.stopping import STOP_CONTEXT_FULL, STOP_EOS, STOP_INTERRUPTED, STOP_MAX_TOKENS, STOP_STRING
from specli.errors import SettingError, UsageError
from specli.modes import DraftLength

CHAT = "chat.completion"
TEXT = "text_completion"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; llama-server any)
MAX_STOP_CHARS = 1024  # characters per stop string (each is searched for at every character generated)
MAX_MESSAGE_CHARS = 1000  # an error message, at most (values in it are shortened by quoted())
SYSTEM_FINGERPRINT = f"specli-{__version__}"  # (OpenAI's: which backend answered; llama-server's build)
LARGEST = 2**63  # integers of a request are below this in size (a seed, a token count, a token id)

# The sampling fields a request may set (bool is refused where a number is wanted: True is 1 in
# Python, never in intent); the seed is read on its own (-1: a fresh one).
SAMPLING_FIELDS = {name: kind for name, kind in JSON_FIELDS.items() if name != "seed"}
# OpenAI fields specli does not implement, with the values that mean "not used".
NEUTRAL = {
    "best_of": (1,), "echo": (False,),
    "suffix": ("",), "functions": ([],),
}


class ApiError(Exception):
    """A refused request: its HTTP status and OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None, kind: Optional[str] = None,
                 fields: Optional[dict] = None):
        if len(message) > MAX_MESSAGE_CHARS:  # (a message quoting what quoted() did not shorten: a template's own error text)
            message = f"{message[: MAX_MESSAGE_CHARS - 3]}... ({len(message):,} characters)"
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.fields = fields or {}  # more of the error object (llama-server's n_prompt_tokens and n_ctx)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code, **self.fields}}


def context_exceeded(message: str, *, param: str, n_prompt_tokens: Optional[int] = None, n_ctx: Optional[int] = None) -> ApiError:
    """A prompt that does not fit: OpenAI's code (context_length_exceeded) with llama-server's
    type and fields, so that clients of either read it (n_prompt_tokens when it was counted)."""
    fields = {"n_ctx": n_ctx} if n_ctx is not None else {}
    if n_prompt_tokens is not None:
        fields["n_prompt_tokens"] = n_prompt_tokens
    return ApiError(400, message, param=param, code="context_length_exceeded", kind="exceed_context_size_error", fields=fields)


@dataclass
class ApiRequest:
    """One checked completion request, as the wire format has it."""

    kind: str  # CHAT or TEXT
    model: Optional[str]
    messages: Optional[list[dict]]  # chat: [{"role", "content": str}], system/developer first or anywhere
    prompt: Optional[str]  # completions: the text (None when given as token ids)
    prompt_ids: Optional[list[int]]  # completions given as token ids
    max_tokens: Optional[int]  # None: until the context is full (or the server's -n)
    sampling: SamplingParams  # seed left None: `seed` is the request's
    seed: Optional[int]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices
    # A text prompt's control text (`<|im_start|>`) becomes control tokens, as llama-server does;
    # false (the field of llama-server's /tokenize): all of it text. Chat messages are always text.
    parse_special: bool = True
    grammar: Optional[Grammar] = None  # response_format, json_schema or grammar: the output's constraint
    # Chat: end the prompt with the assistant's opening; or continue the last message, the
    # assistant's (a prefill: llama-server's continue_final_message, and its rule that a
    # conversation ending with an assistant message is continued)
    add_assistant: bool = True
    continue_final: bool = False
    logprobs: Optional[int] = None  # log probabilities: of each token and of the N most likely there (None: off)
    n: int = 1  # choices


def number_field(body: dict, name: str, kind: type) -> Any:
    value = body[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if ok and abs(value) >= LARGEST:  # (before float(): a 400-digit integer overflows it)
        raise ApiError(400, f"'{name}' is out of range (at most {LARGEST - 1:,} in size)", param=name)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a finite number'}, got {quoted(value)}", param=name)
    return kind(value)


QUOTE_CHARS = 100  # what an error message quotes of a value of the request, at most


def quoted(value: Any) -> str:
    """A value of the request as an error message quotes it: its first QUOTE_CHARS characters,
    and its size when that is not all of it. Every message that quotes a value goes through
    here, so that no answer grows with the request (one repeating a 1,000,000-entry
    `logit_bias` would be 15 MB). (reprlib: the repr is built only as far as it can be shown.)"""
    text = repr(value[: QUOTE_CHARS + 1]) if isinstance(value, str) else _QUOTE.repr(value)
    cut = len(text) > QUOTE_CHARS
    if cut:
        text = text[: QUOTE_CHARS - 3] + "..."
    if isinstance(value, (str, list, tuple, dict)) and (cut or len(value) > _QUOTE.maxlist):
        units = ("character", "characters") if isinstance(value, str) else ("entry", "entries") if isinstance(value, dict) else ("item", "items")
        text += f" ({len(value):,} {units[len(value) != 1]})"
    return text


_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = QUOTE_CHARS
_QUOTE.maxlist = _QUOTE.maxtuple = _QUOTE.maxdict = _QUOTE.maxset = 8
_QUOTE.maxlevel = 3


def unicode_text(value: str, name: str) -> str:
    """A string of the request, which must be valid Unicode (JSON's \\ud800 escapes can make a
    lone surrogate, which no tokenizer or response can encode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{name}' holds a lone surrogate (\\ud800-\\udfff), which is not valid Unicode text", param=name) from None
    return value


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined); images are refused."""
    if isinstance(content, str):
        return unicode_text(content, "messages")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}: only text content parts are supported, got {quoted(kind)}", param="messages")
            parts.append(unicode_text(part["text"], "messages"))
        return "".join(parts)
    raise ApiError(400, f"{where}: 'content' must be a string or a list of text parts", param="messages")


def parse_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with 'role' and 'content'", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}: role must be one of {', '.join(ROLES)}, got {quoted(role)}", param="messages")
        content = message.get("content")
        content = "" if content is None and role == "assistant" else _text_content(content, where)
        parsed = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            parsed["tool_calls"] = assistant_calls(message["tool_calls"], where)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise ApiError(400, f"{where}: 'tool_call_id' must be a string", param="messages")
            parsed["tool_call_id"] = call_id or ""
            if isinstance(message.get("name"), str):
                parsed["name"] = message["name"]
        out.append(parsed)
    return out


def assistant_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, as a template takes them (the arguments an object,
    as the templates write them back with tojson)."""
    if not isinstance(value, list):
        raise ApiError(400, f"{where}: 'tool_calls' must be a list", param="messages")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where}: tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", param="messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as err:
                raise ApiError(400, f"{where}: tool_calls[{j}]'s 'arguments' is not JSON ({err.msg})", param="messages") from None
        call_id = call.get("id")
        calls.append({"id": call_id if isinstance(call_id, str) else "", "type": "function",
                      "function": {"name": unicode_text(function["name"], "messages"), "arguments": arguments}})
    return calls


def _prompt(value: Any) -> tuple[Optional[str], Optional[list[int]]]:
    """A completion prompt: a string, a list of one string, or a list of token ids."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "'prompt' is empty; give some text to continue", param="prompt")
        return unicode_text(value, "prompt"), None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(not 0 <= t < LARGEST for t in value):
            raise ApiError(400, "'prompt' holds a token id out of range", param="prompt")
        return None, list(value)
    if isinstance(value, list) and len(value) > 1:
        raise ApiError(400, "one prompt per request; send the others as their own requests", param="prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"'stop' holds {len(stops)} strings; at most {MAX_STOP}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop' holds a string over {MAX_STOP_CHARS} characters", param="stop")
    return tuple(unicode_text(s, "stop") for s in stops)


def parse_request(body: Any, kind: str, defaults: SamplingParams, target=None) -> ApiRequest:
    """Check a decoded JSON body for /v1/chat/completions (CHAT) or /v1/completions (TEXT).
    `defaults`: the server's sampling settings (its command line), which a request overrides;
    `target` (the model) resolves logit_bias and ignore_eos (None: texts and ignore_eos are refused)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise ApiError(400, f"'{name}' = {quoted(body[name])} is not supported by specli (leave it out)", param=name)
    if kind == TEXT and body.get("tools") not in (None, []):
        raise ApiError(400, f"'tools' = {quoted(body['tools'])} is a chat completions field (POST /v1/chat/completions)", param="tools")
    grammar = parse_constraint(body)
    messages = prompt = prompt_ids = None
    add_assistant, continue_final = True, False
    if kind == CHAT:
        if "messages" not in body:
            raise ApiError(400, "'messages' is required", param="messages")
        messages = parse_messages(body["messages"])
        add_assistant, continue_final = _turn_end(body, messages)
    else:
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", param="prompt")
        prompt, prompt_ids = _prompt(body["prompt"])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if model is not None:
        unicode_text(model, "model")

    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        if body.get(name) is not None:
            max_tokens = number_field(body, name, int)
            if max_tokens < 1:
                raise ApiError(400, f"'{name}' must be at least 1, got {max_tokens}", param=name)
            break
    fields = {name: number_field(body, name, kind_) for name, kind_ in SAMPLING_FIELDS.items() if body.get(name) is not None}
    seed = number_field(body, "seed", int) if body.get("seed") is not None else defaults.seed
    if seed is not None and seed < 0:
        if seed != -1:
            raise ApiError(400, f"'seed' must be a non-negative integer (or -1 for a fresh one), got {seed}", param="seed")
        seed = None  # llama-server's -1: a fresh seed
    sampling = request_sampling(body, defaults, fields, target)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    parse_special = body.get("parse_special", True)
    if not isinstance(parse_special, bool):
        raise ApiError(400, "'parse_special' must be true or false", param="parse_special")
    return ApiRequest(
        kind=kind, model=model, messages=messages, prompt=prompt, prompt_ids=prompt_ids, max_tokens=max_tokens,
        sampling=sampling, seed=seed, stop=parse_stop(body.get("stop")), stream=stream,
        include_usage=bool(options.get("include_usage")), parse_special=parse_special, grammar=grammar,
        add_assistant=add_assistant, continue_final=continue_final, logprobs=parse_logprobs(body, kind), n=parse_n(body),
    )


MAX_CHOICES = 16  # `n`, at most (each sampled choice is a generation of its own)


def parse_n(body: dict) -> int:
    """`n` (or llama-server's n_cmpl): how many choices, 1..MAX_CHOICES."""
    for name in ("n", "n_cmpl"):
        if body.get(name) is not None:
            n = number_field(body, name, int)
            if not 1 <= n <= MAX_CHOICES:
                raise ApiError(400, f"'{name}' must be from 1 to {MAX_CHOICES}, got {n}", param=name)
            return n
    return 1


def request_sampling(body: dict, defaults: SamplingParams, fields: dict, model) -> SamplingParams:
    """The request's sampling: the server's defaults with the request's fields, its logit_bias
    and ignore_eos (llama-server's: every end-of-generation token biased to -inf) on top."""
    bias = parse_logit_bias(body.get("logit_bias"), model)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ApiError(400, f"'ignore_eos' must be true or false, got {quoted(ignore_eos)}", param="ignore_eos")
    if ignore_eos:
        if model is None:
            raise ApiError(400, "'ignore_eos' is not supported here (leave it out)", param="ignore_eos")
        bias.update({t: -math.inf for t in model.eog_tokens()})
    if bias:
        fields = {**fields, "logit_bias": with_bias({**dict(defaults.logit_bias), **bias})}
    try:
        return dataclasses.replace(defaults, **fields, seed=None).validate()
    except SettingError as err:
        raise ApiError(400, err.worded(f"'{err.setting}'"), param=err.setting) from None


MAX_LOGIT_BIAS = 100_000  # entries (OpenAI allows 300; a whole vocabulary's worth is never needed)


def parse_logit_bias(value: Any, model) -> dict[int, float]:
    """`logit_bias` as OpenAI ({"token id": bias}) and llama-server ([[id or text, bias], ...], a
    text's tokens all biased, false for -inf: the token is banned) write it, as {token: bias}
    (a token given twice: the biases add up, as llama.cpp applies each). Refused: an id outside
    the vocabulary, a bias that is not a finite number (or false)."""
    if value is None:
        return {}
    if isinstance(value, (dict, list)) and len(value) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' = {quoted(value)} has too many entries; at most {MAX_LOGIT_BIAS:,}", param="logit_bias")
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise ApiError(400, "'logit_bias' must be an object {\"token id\": bias} or a list of [token id or text, bias] pairs", param="logit_bias")
    n_vocab = model.n_vocab if model is not None else None
    out: dict[int, float] = {}
    for key, bias in pairs:
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ApiError(400, f"'logit_bias': the bias of {quoted(key)} must be a finite number (or false to ban it), got {quoted(bias)}", param="logit_bias")
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool):
            if key < 0 or (n_vocab is not None and key >= n_vocab):
                raise ApiError(400, f"'logit_bias': token id {quoted(key)} is not in the model's vocabulary (0..{(n_vocab or 1) - 1})", param="logit_bias")
            tokens = [key]
        elif isinstance(key, str) and model is not None:
            tokens = model.tokenize(unicode_text(key, "logit_bias"), add_bos=False)
        else:
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {quoted(key)}", param="logit_bias")
        for t in tokens:
            out[t] = out.get(t, 0.0) + float(bias)
    return out


MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's limit; each costs a look at the whole row)


def parse_logprobs(body: dict, kind: str) -> Optional[int]:
    """How many alternatives per token a request wants with its log probabilities, None for
    none: chat's `logprobs` (true/false) and `top_logprobs` (0..20, which needs logprobs);
    completions' `logprobs` (the number, 0..20)."""
    if kind == CHAT:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise ApiError(400, f"'logprobs' must be true or false on chat completions (the number of alternatives is 'top_logprobs'), got {quoted(wanted)}", param="logprobs")
        if body.get("top_logprobs") is None:
            return 0 if wanted else None
        if not wanted:
            raise ApiError(400, "'top_logprobs' requires 'logprobs' to be set to true", param="top_logprobs")
        name = "top_logprobs"
    else:
        if body.get("logprobs") is None or body["logprobs"] is False:
            return None
        name = "logprobs"
    n = number_field(body, name, int) if not isinstance(body[name], bool) else -1
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'{name}' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {quoted(body[name])}", param=name)
    return n


def logprob_entry(model, entry, text: str, *, with_id: bool = False) -> dict:
    """One token's log probabilities as OpenAI's chat shape has it (llama-server's native one
    adds the id): `text`, the output text the token completed (so that the tokens' texts make
    the output's), its bytes, and the alternatives (`top_logprobs`)."""
    def one(token: int, logprob: float, shown: str) -> dict:
        piece = model.piece(token)
        out = {"id": token} if with_id else {}
        out.update(token=shown, logprob=logprob, bytes=list(piece))
        return out

    top = [one(t, lp, model.piece(t).decode("utf-8", "replace")) for t, lp in entry.top]
    return {**one(entry.token, entry.logprob, text), "top_logprobs": top}


def choice_logprobs(kind: str, entries: list[dict], start: int = 0) -> dict:
    """A choice's (or a chunk's) `logprobs` of logprob_entry()'s entries: chat's {"content"},
    completions' completion_logprobs (`start`: the first token's text offset)."""
    return {"content": entries, "refusal": None} if kind == CHAT else completion_logprobs(entries, start)


def completion_logprobs(entries: list[dict], start: int = 0) -> dict:
    """/v1/completions' logprobs: OpenAI's legacy fields (tokens, token_logprobs, top_logprobs as
    {token: logprob}, text_offset) and llama-server's `content` list of the same entries.
    `start`: the text offset of the first token (a streamed chunk's)."""
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries], "text_offset": offsets, "content": entries}


def _turn_end(body: dict, messages: list[dict]) -> tuple[bool, bool]:
    """(add_assistant, continue_final) for a chat, by llama-server's rules: add_generation_prompt
    (default true) and continue_final_message (default false) may not both be true; a
    conversation ending with an assistant message is continued (then two assistant messages
    may not end it, and it may not hold tool calls)."""
    for name in ("add_generation_prompt", "continue_final_message"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise ApiError(400, f"'{name}' must be true or false, got {quoted(body[name])}", param=name)
    add = body.get("add_generation_prompt") is not False
    cont = bool(body.get("continue_final_message"))
    last_is_assistant = messages[-1]["role"] == "assistant"
    if not cont and last_is_assistant:
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list.", param="messages")
        cont, add = True, False
    if cont and add:
        raise ApiError(400, "Cannot set both add_generation_prompt and continue_final_message to true.", param="continue_final_message")
    if cont and not last_is_assistant:
        raise ApiError(400, "'continue_final_message' needs the last message to be the assistant's (the text to continue)", param="continue_final_message")
    if cont and messages[-1].get("tool_calls"):
        raise ApiError(400, "Cannot continue an assistant message that contains tool calls.", param="messages")
    return add, cont


def parse_constraint(body: dict) -> Optional[Grammar]:
    """The output's constraint: OpenAI's `response_format` (json_object, json_schema; text: none)
    or llama-server's `json_schema` and `grammar` (GBNF) fields; at most one. Checked here (a
    400 naming the problem); None when the output is free."""
    asked = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise ApiError(400, "'response_format' must be an object with a 'type' (text, json_object or json_schema)", param="response_format")
        if rf["type"] == "json_object":
            schema = rf.get("schema", {"type": "object"})  # (llama-server also takes a schema here)
            asked.append(("response_format", "json_schema", schema))
        elif rf["type"] == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ApiError(400, "'response_format' of type json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}", param="response_format")
            asked.append(("response_format", "json_schema", spec["schema"]))
        elif rf["type"] != "text":
            raise ApiError(400, f"'response_format' type {quoted(rf['type'])} is not one of text, json_object, json_schema", param="response_format")
    if body.get("json_schema") is not None:
        asked.append(("json_schema", "json_schema", body["json_schema"]))
    if body.get("grammar") is not None:
        if not isinstance(body["grammar"], str):
            raise ApiError(400, "'grammar' must be a string (a GBNF grammar)", param="grammar")
        asked.append(("grammar", "gbnf", body["grammar"]))
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(400, f"'{asked[0][0]}' and '{asked[1][0]}' both constrain the output; send one of them", param=asked[1][0])
    field, kind, value = asked[0]
    if kind == "json_schema":
        if not isinstance(value, (dict, bool)):
            raise ApiError(400, f"'{field}': a JSON schema must be an object, got {quoted(value)}", param=field)
        value = json.dumps(value)
    grammar = Grammar(kind, value, where=f"'{field}'")
    try:
        grammar.check()
    except UsageError as err:
        raise ApiError(400, str(err), param=field) from None
    return grammar


def check_fits(ids: list[int], n_ctx: int, param: str) -> None:
    """A prompt's tokens against a request's context: the 400 for an empty prompt, and
    context_exceeded for one that leaves no room to generate."""
    if not ids:
        raise ApiError(400, "the prompt is empty; give some text to continue", param="prompt")
    if len(ids) >= n_ctx:
        raise context_exceeded(f"the prompt is {len(ids)} tokens but a request's context holds {n_ctx}; shorten it, or restart the server with a larger -c",
                               param=param, n_prompt_tokens=len(ids), n_ctx=n_ctx)


# --- responses ------------------------------------------------------------------------------------
STOP_TYPES = {STOP_EOS: "eos", STOP_STRING: "word"}  # llama-server's stop_type; every other reason is its "limit"

FINISH_REASONS = {
    STOP_EOS: "stop", STOP_STRING: "stop", STOP_MAX_TOKENS: "length", STOP_CONTEXT_FULL: "length",
    STOP_INTERRUPTED: "length",  # the server is shutting down: the text is cut short
}


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def speculative(stats: Stats, *, mode: str, draft_length: DraftLength, seed: Optional[int], stop_reason: Optional[str]) -> dict:
    """This request's drafting figures (stats.py defines each), beside `usage`."""
    s = stats.to_dict()
    keep = ("drafted", "accepted", "acceptance_rate", "target_passes", "mean_tokens_per_pass", "tokens_per_s",
            "prompt_tokens", "prompt_reused", "prompt_s", "wall_s", "mean_draft_length")
    return {"mode": mode, "draft_max": draft_length.json_value, **{k: s[k] for k in keep}, "seed": seed, "stop_reason": stop_reason}


def timings(stats: Stats) -> dict:
    """llama-server's `timings` object, for tools that read it. predicted_per_second is
    Stats.tokens_per_s, the figure `speculative.tokens_per_s` gives (the tokens decided after
    the prompt's pass, over the generation time), computed over the predicted_ms shown (so the
    two agree to its rounding, and a client recomputing it gets it exactly); where that is None (the prompt's pass made every token) it is 0, as the speeds here
    are: llama-server's fields are numbers, and a tool summing or plotting them takes 0 where
    null would break it."""
    # (no time after the prompt's pass when it made every token: a one-token reply decodes nothing)
    decoded = stats.decided - stats.prompt_pass_decided
    gen_ms = round(stats.generation_s * 1000, 3) if decoded > 0 else 0.0
    prompt_n = stats.prompt_tokens - stats.prompt_reused
    return {
        "cache_n": stats.prompt_reused, "prompt_n": prompt_n, "prompt_ms": round(stats.prompt_s * 1000, 3),
        "prompt_per_second": round(prompt_n / stats.prompt_s, 3) if stats.prompt_s > 0 else 0.0,
        "predicted_n": stats.n_tokens, "predicted_ms": gen_ms,
        # (over the shown predicted_ms, so that a client recomputing it gets it to the last digit)
        "predicted_per_second": decoded * 1000 / gen_ms if gen_ms > 0 else 0.0,
        "draft_n": stats.drafted, "draft_n_accepted": stats.accepted,
    }


def response_body(kind: str, rid: str, model: str, text: str, finish_reason: str, extra: dict, message: Optional[dict] = None,
                  logprobs: Optional[dict] = None) -> dict:
    """The whole (non-streamed) response; `extra`: usage, speculative, timings; `message`: the
    chat's message when it is not the text alone (tool calls); `logprobs`: the choice's."""
    if kind == CHAT:
        choice = {"index": 0, "message": message or {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice], **extra}


def chunk(kind: str, rid: str, model: str, created: int, *, text: Optional[str] = None, role: bool = False,
          finish_reason: Optional[str] = None, extra: Optional[dict] = None, no_choices: bool = False, delta: Optional[dict] = None,
          logprobs: Optional[dict] = None, index: int = 0) -> dict:
    """One streamed chunk: a piece of text (or a chat's `delta`: tool calls), the chat's opening
    role, or the finish (with `extra`)."""
    if no_choices:
        choices = []
    elif kind == CHAT:
        if delta is None:
            # (the opening's content is null, as OpenAI and llama-server send it: no text yet)
            delta = {"role": "assistant", "content": None} if role else ({"content": text} if text is not None else {})
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices, **(extra or {})}
