"""Tool calls (constraints/tools.py, server/tool_calls.py): the output parsed into calls the same
way whole and streamed, the request's tools checked, and on the real pair: a required call is
always a valid call, the constrained target's own with every drafter; auto opens calls in the
template's format or as a bare JSON object; none never opens one; the openai client's tool round
trip, streamed and not; a template without tools is a 400 naming it."""

from __future__ import annotations

import json
import random

import pytest

from specli.constraints.tools import AUTO, HERMES, NONE, REQUIRED, CallStream, Tool, call_lark, json_call_lark, json_call_start, parse_calls
from specli.server import protocol
from specli.server.protocol import ApiError
from specli.server.tool_calls import ToolDeltas, parse_tools

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from specli.constraints import Grammar  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]

# (text, content, [(name, arguments)])
OUTPUTS = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [("get_weather", '{"city": "Paris"}')]),
    ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": {"y": "}"}}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     "Let me look.\n", [("a", '{"x": {"y": "}"}}'), ("b", "{}")]),
    ('```json\n{\n  "name": "add",\n  "arguments": {\n    "a": 1,\n    "b": 2\n  }\n}\n```', "", [("add", '{\n    "a": 1,\n    "b": 2\n  }')]),
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [("add", '{"a": 1, "b": 2}')]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b"', "", [("add", '{"a": 1, "b"')]),  # cut short: what came is kept
    ('The answer is {"name": 4}.', 'The answer is {"name": 4}.', []),
    ('<tool_call>\n{"nam', '<tool_call>\n{"nam', []),  # never a call: its text stays content
    ('``` not json', '``` not json', []),
    ('Plain text with a < and a `', 'Plain text with a < and a `', []),
]


@pytest.mark.parametrize("text,content,calls", OUTPUTS)
def test_output_parses_into_content_and_calls_the_same_whole_and_in_any_pieces(text, content, calls):
    whole = parse_calls(HERMES, text)
    assert whole.content == content and [(c["name"], c["arguments"]) for c in whole.calls] == calls
    rng = random.Random(7)
    for _ in range(100):
        stream, pieces, at = CallStream(HERMES), [], 0
        while at < len(text):
            step = rng.randint(1, 7)
            pieces += stream.feed(text[at: at + step])
            at += step
        pieces += stream.finish()
        got: dict[int, list] = {}
        for piece in pieces:
            if piece[0] == "call":
                got[piece[1]] = [piece[2], ""]
            elif piece[0] == "arguments":
                got[piece[1]][1] += piece[2]
        assert "".join(p[1] for p in pieces if p[0] == "content") == content
        assert [tuple(v) for v in got.values()] == calls


def test_stream_deltas_are_openai_s_id_and_name_once_then_argument_pieces():
    deltas = ToolDeltas(HERMES)
    out = []
    for ch in OUTPUTS[0][0]:
        out += deltas.feed(ch)
    out += deltas.finish()
    first = out[0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function" and first["function"] == {"name": "get_weather", "arguments": ""}
    rest = [d["tool_calls"][0] for d in out[1:]]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == '{"city": "Paris"}'


@pytest.mark.parametrize("text,expected", [
    ("", -1), ("  \n", -1), ("`", -1), ("```js", -1), ("```json\n", -1), ('{"na', -1), ('{ "name" :', -1),
    ('{"name": "', 10), ('```json\n{\n  "name": "g', 21), ("Hello", None), ('{"x"', None), ("```python", None), ("{{", None),
])
def test_a_reply_shows_it_is_a_bare_json_call_at_the_name(text, expected):
    assert json_call_start(text) == expected


def test_the_call_grammars_compile_and_hold_each_tool_s_schema():
    tools = [Tool("get_weather", WEATHER), Tool("add", TOOLS[1]["function"]["parameters"])]
    marks = {"open": json.dumps("<tool_call>"), "close": json.dumps("</tool_call>")}
    for opened in (True, False):
        for parallel in (True, False):
            Grammar("lark", call_lark(HERMES, tools, opened=opened, parallel=parallel, marks=marks)).check()
    Grammar("lark", json_call_lark(tools)).check()
    with pytest.raises(Exception, match="does not compile"):  # a tool whose schema is not one
        Grammar("lark", json_call_lark([Tool("f", {"type": "object", "properties": {"x": {"type": "nonsense"}}})])).check()


@pytest.mark.parametrize("body,param,words", [
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "letters, digits"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "two tools are named"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "JSON schema object"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
])
def test_bad_tools_are_a_400_naming_the_field(body, param, words):
    with pytest.raises(ApiError) as err:
        parse_tools(body)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message


def test_tools_choices_and_messages_with_calls_and_results_are_read():
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    assert parse_tools({"tools": TOOLS}).choice == AUTO
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}).choice == NONE
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}, "parallel_tool_calls": False})
    assert named.choice == REQUIRED and [t.name for t in named.offered()] == ["add"] and not named.parallel
    messages = protocol.parse_messages([
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ])
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2} and messages[1]["content"] == ""
    assert messages[2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    with pytest.raises(ApiError, match="not JSON"):
        protocol.parse_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{oops"}}]}])


# --- the real pair -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(qwen_pair):
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend
    from specli.session.chat import choose_formatter

    init_backend()
    target = LlamaModel(qwen_pair[0], n_ctx=1024, n_threads=2)
    draft = LlamaModel(qwen_pair[1], n_ctx=1024, n_threads=2)
    formatter, _ = choose_formatter(target, None)
    yield target, draft, formatter
    target.close()
    draft.close()


def tool_prompt(qwen, text: str) -> list[int]:
    from specli.llama.conversation import encode_conversation

    target, _, formatter = qwen
    return encode_conversation(target, formatter, None, [{"role": "user", "content": text}], tools=TOOLS)


def run_tools(qwen, drafter, ids, choice, max_tokens=80):
    from specli.constraints.tools import ToolConstraint
    from specli.decoding.generation import Request
    from specli.decoding.loop import generate
    from specli.decoding.sampling import GREEDY
    from specli.decoding.step import SpeculativeDecoder

    target, _, formatter = qwen
    constraint = ToolConstraint(formatter.tool_format, [Tool(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS], target, choice=choice)
    decoder = SpeculativeDecoder(target, drafter, 4 if drafter is not None else 1, GREEDY)
    return generate(decoder, Request(ids, max_tokens=max_tokens, constraint=constraint)).run(), constraint


def check_calls(text: str) -> list[dict]:
    calls = parse_calls(HERMES, text).calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    return calls


@pytest.mark.real_pair
def test_real_pair_a_required_call_is_valid_and_the_constrained_target_s_own_with_every_drafter(qwen):
    from test_constraints import LOGIT_MARGIN, masked_gaps

    from specli.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
    from specli.decoding.step import GRAMMAR

    target, draft, formatter = qwen
    assert formatter.tool_format is HERMES
    ids = tool_prompt(qwen, "What is 17 plus 25? Use the tools.")
    reference, constraint = run_tools(qwen, None, ids, REQUIRED)
    calls = check_calls(reference.text)
    assert calls and calls[0]["name"] == "add" and json.loads(calls[0]["arguments"]) == {"a": 17, "b": 25}
    assert reference.stop_reason == "eos"
    for drafter in (PromptLookupDrafter(), DraftModelDrafter(draft)):
        gen, constraint = run_tools(qwen, drafter, ids, REQUIRED)
        assert check_calls(gen.text)
        assert masked_gaps(target, constraint, ids, gen.token_ids).max() <= LOGIT_MARGIN
        assert gen.stats.by_source[GRAMMAR][0] > 0 and gen.stats.target_passes < reference.stats.target_passes


@pytest.mark.real_pair
def test_real_pair_auto_opens_a_call_and_none_never_does(qwen):
    target, _, _ = qwen
    ids = tool_prompt(qwen, "What is the weather in Paris right now?")
    gen, _ = run_tools(qwen, None, ids, AUTO)
    calls = check_calls(gen.text)  # (this model writes a ```json block, not <tool_call>: read as the call it is)
    assert [c["name"] for c in calls] == ["get_weather"] and json.loads(calls[0]["arguments"])["city"] == "Paris"
    free, constraint = run_tools(qwen, None, ids, NONE, max_tokens=24)
    assert constraint.open_token is not None and constraint.open_token not in free.token_ids


@pytest.mark.real_pair
def test_real_pair_a_draft_that_opens_a_call_is_held_by_the_call_s_grammar_from_there(qwen):
    from specli.constraints.tools import ToolConstraint
    from specli.decoding.verifier import allowed

    target, _, formatter = qwen
    constraint = ToolConstraint(formatter.tool_format, [Tool("add", TOOLS[1]["function"]["parameters"])], target, choice=AUTO)
    matcher = constraint.start()

    def tokens(text):
        return target.tokenize(text, add_bos=False, parse_special=False)

    hello, newline, opening = tokens("Sure"), tokens("\n"), constraint.open_token
    assert matcher.valid_prefix(hello) == len(hello) and (matcher.masks(hello) == -1).all()  # (free text: every row free)
    assert matcher.valid_prefix([*hello, opening, *hello]) == len(hello) + 1  # after the opening, the call's grammar: "\n" first
    draft = [*hello, opening, *newline]
    assert matcher.valid_prefix(draft) == len(draft)
    rows = matcher.masks(draft)
    assert (rows[: len(hello) + 1] == -1).all()
    after = [t for t in range(target.n_vocab) if allowed(rows[len(hello) + 1], t)]
    assert newline[0] in after and len(after) < 10
    bare, wrong = tokens('{"name": "add", "arguments": {'), tokens('{"name": "nope"')
    assert matcher.valid_prefix(bare) == len(bare)
    named = matcher.valid_prefix(wrong)  # cut where the name goes wrong: from `{"name": "` on, it is a tool's
    assert json_call_start(b"".join(target.piece(t) for t in wrong[:named]).decode()) >= 0 and named < len(wrong)
    matcher.accept([*hello, opening], target.is_eog)
    assert matcher.opened and matcher.forced(8)  # the call's scaffold: drafted for free
    none = ToolConstraint(formatter.tool_format, [Tool("add")], target, choice=NONE).start()
    assert none.valid_prefix([*hello, opening]) == len(hello)
    assert not allowed(none.masks([])[0], opening)


@pytest.fixture(scope="module")
def qwen_server(qwen_pair, tmp_path_factory):
    from test_serve import serving

    with serving(qwen_pair[0], tmp_path_factory.mktemp("serve-tools"), "-d", str(qwen_pair[1]), "--draft-max", "4", "-c", "2048") as srv:
        yield srv


@pytest.mark.real_pair
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_real_pair_openai_tool_round_trip(qwen_server, stream):
    client = qwen_server.client()
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]

    def ask(messages, **kw):
        if not stream:
            r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=120, **kw)
            return r.choices[0].message, r.choices[0].finish_reason
        calls, content, finish = {}, "", None
        for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=120, stream=True, **kw):
            if not chunk.choices:
                continue
            delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                assert call.index == len(calls) - 1 and (call.id is None or entry["id"] == call.id)
                entry["arguments"] += call.function.arguments or ""
        msg = {"role": "assistant", "content": content or None,
               "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]}
        return msg, finish

    for choice in ("required", "auto", {"type": "function", "function": {"name": "get_weather"}}):
        msg, finish = ask(messages, tool_choice=choice)
        calls = msg["tool_calls"] if isinstance(msg, dict) else [c.model_dump() for c in msg.tool_calls or []]
        assert finish == "tool_calls" and len(calls) >= 1, (choice, msg)
        call = calls[0]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] == "Paris"
    followup = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})}]
    msg, finish = ask(followup, tool_choice="none")
    content = msg["content"] if isinstance(msg, dict) else msg.content
    assert finish in ("stop", "length") and content and not (msg["tool_calls"] if isinstance(msg, dict) else msg.tool_calls)


@pytest.mark.real_pair
def test_real_pair_a_bad_tool_schema_and_tools_with_a_response_format_are_a_400(qwen_server):
    import openai

    client = qwen_server.client()
    model = client.models.list().data[0].id
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}]
    for kw in ({"tools": bad, "tool_choice": "required"}, {"tools": TOOLS, "response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw)
        assert err.value.body["param"] == "tools"


def test_a_template_that_writes_no_calls_is_a_400_naming_it(gemma_path, tmp_path):
    import openai
    from test_serve import serving

    with serving(gemma_path, tmp_path, "--target-only") as srv:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=4)
        assert err.value.body["param"] == "tools" and "chat template (plain)" in err.value.body["message"]
