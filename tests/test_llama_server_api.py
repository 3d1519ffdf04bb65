"""What clients written for llama-server send, answered as llama-server answers (issue 49): its
native POST /completion (and /completions without /v1), log probabilities on chat, completions
and /completion, CORS, X-Api-Key, --alias and any model name, the assistant prefill and its
refusals, system_fingerprint, a null first delta, and its context error's type and fields.

The behaviours are llama-server's at the revision llama-cpp-python 0.3.36 vendors
(tools/server: server-http.cpp, server-common.cpp, server-task.cpp, server-schema.cpp; its tests
under tools/server/tests/unit), ported here onto the embedded Gemma (a real server process) and
onto the wire format's pure functions.
"""

from __future__ import annotations

import json
import math

import pytest
from starlette.requests import Request as HttpRequest

from specli.decoding.sampling import GREEDY
from specli.server import protocol
from specli.server.handling import Cors, Settings, check_key, check_model, is_localhost_origin
from specli.server.llama_api import parse_completion
from specli.server.protocol import CHAT, TEXT, ApiError
from test_serve import CTX, assert_error_body, serving, sse

pytestmark = pytest.mark.gemma

KEY = "sk-this-is-the-secret-key"
ALIAS = "my-model"


def refused(call, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    return caught.value


# --- pure: the request's fields -----------------------------------------------------------------------
def test_logprobs_fields_read_as_openai_and_llama_server_write_them():
    parse = protocol.parse_logprobs
    assert parse({}, CHAT) is None and parse({"logprobs": False}, CHAT) is None
    assert parse({"logprobs": True}, CHAT) == 0 and parse({"logprobs": True, "top_logprobs": 3}, CHAT) == 3
    assert parse({"logprobs": 2}, TEXT) == 2 and parse({"logprobs": 0}, TEXT) == 0 and parse({}, TEXT) is None
    for body, kind, param in (({"top_logprobs": 3}, CHAT, "top_logprobs"), ({"logprobs": 1}, CHAT, "logprobs"),
                              ({"logprobs": True, "top_logprobs": 21}, CHAT, "top_logprobs"), ({"logprobs": -1}, TEXT, "logprobs"),
                              ({"logprobs": True}, TEXT, "logprobs")):
        err = refused(parse, body, kind)
        assert err.status == 400 and err.param == param, body


def turn_end(messages: list[dict], **fields):
    req = protocol.parse_request({"messages": messages, **fields}, CHAT, GREEDY)
    return req.add_assistant, req.continue_final


def test_a_conversation_ending_with_the_assistant_is_continued_and_llama_servers_refusals_hold():
    user, assistant = {"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}
    assert turn_end([user]) == (True, False)
    assert turn_end([user], add_generation_prompt=False) == (False, False)
    assert turn_end([user, assistant]) == (False, True)
    assert turn_end([user, assistant], continue_final_message=True, add_generation_prompt=False) == (False, True)
    cases = [
        ([user, assistant, assistant], {}, "Cannot have 2 or more assistant messages at the end of the list."),
        ([user, assistant], {"continue_final_message": True}, "Cannot set both add_generation_prompt and continue_final_message to true."),
        ([user], {"continue_final_message": True, "add_generation_prompt": False}, "'continue_final_message' needs"),
        ([user], {"add_generation_prompt": "no"}, "'add_generation_prompt' must be true or false"),
    ]
    for messages, fields, message in cases:
        err = refused(protocol.parse_request, {"messages": messages, **fields}, CHAT, GREEDY)
        assert err.status == 400 and err.message.startswith(message), err.message


def test_the_native_completions_prompt_forms_and_fields():
    def parse(**body):
        return parse_completion(body, GREEDY, n_vocab=1000)

    assert parse(prompt="hi").content == "hi" and parse(prompt=["hi"]).content == "hi"
    assert parse(prompt=[1, 2, 3]).content == [1, 2, 3] and parse(prompt=[[1, 2]]).content == [1, 2]
    assert parse(prompt=[5, "hi", 6]).content == [5, "hi", 6]
    assert parse(prompt="hi", n_probs=3).n_probs == 3 and parse(prompt="hi", logprobs=4).n_probs == 4 and parse(prompt="hi").n_probs == 0
    assert parse(prompt="hi", json_schema={}).grammar is not None  # (llama-server: any object)
    assert parse(prompt="hi", grammar="").grammar is None and parse(prompt="hi", json_schema=None).grammar is None
    assert parse(prompt="hi", grammar='root ::= "a"', json_schema={"type": "string"}).grammar.kind == "json_schema"  # (its precedence)
    assert parse(prompt=["a", [1, 2], {"prompt_string": "b"}]).contents == ["a", [1, 2], "b"] and parse(prompt=["a"]).contents is None
    for body, param in (({}, "prompt"), ({"prompt": ["a", ""]}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [5000]}, "prompt"),
                        ({"prompt": {"prompt_string": "a", "multimodal_data": ["x"]}}, "prompt"), ({"prompt": ["a"] * 17}, "prompt"),
                        ({"prompt": "hi", "n_probs": 101}, "n_probs"), ({"prompt": "hi", "n_probs": 2, "post_sampling_probs": "yes"}, "post_sampling_probs"),
                        ({"prompt": "hi", "grammar": "root ::= ("}, "grammar"), ({"prompt": "hi", "mirostat": 2}, "mirostat")):
        err = refused(parse_completion, body, GREEDY, 1000)
        assert err.status == 400 and err.param == param, body


def http_request(*headers: tuple[str, str]) -> HttpRequest:
    return HttpRequest({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers]})


def test_the_key_may_come_as_x_api_key_and_any_model_name_is_served_unless_strict():
    settings = Settings(model_id="m", aliases={"m.gguf"}, defaults=GREEDY, api_key=KEY)
    for headers in ((("Authorization", f"Bearer {KEY}"),), (("X-Api-Key", KEY),), (("X-Api-Key", f"Bearer {KEY}"),)):
        check_key(settings, http_request(*headers))
    for headers in ((), (("X-Api-Key", "wrong"),), (("Authorization", KEY),), (("Authorization", "Bearer wrong"), ("X-Api-Key", KEY))):
        err = refused(check_key, settings, http_request(*headers))
        assert err.status == 401 and err.kind == "authentication_error", headers
    for name in ("m", "gpt-3.5-turbo", None):
        check_model(settings, name)
    settings.strict_models = True
    check_model(settings, "m.gguf")
    err = refused(check_model, settings, "gpt-3.5-turbo")
    assert err.status == 404 and err.code == "model_not_found"


def test_cors_answers_as_llama_servers_settings_say():
    assert Cors().allow_origin("http://a.example") == "http://a.example"  # (any origin, with credentials: echoed)
    assert Cors(credentials=False).allow_origin("http://a.example") == "*"
    assert Cors(origins="http://b.example").allow_origin("http://a.example") == "http://b.example"
    local = Cors(origins="localhost")
    assert local.allow_origin("http://localhost:5173") == "http://localhost:5173" and local.allow_origin("http://[::1]") == "http://[::1]"
    assert local.allow_origin("http://127.0.0.1:3000") == "http://127.0.0.1:3000"
    assert local.allow_origin("http://evil.example") is None and local.allow_origin(None) is None
    assert not is_localhost_origin("http://localhost.evil.example") and not is_localhost_origin("http://[bad")


def test_the_context_error_has_openais_code_and_llama_servers_type_and_fields():
    body = protocol.context_exceeded("too long", param="prompt", n_prompt_tokens=2000, n_ctx=1024).body()["error"]
    assert body["code"] == "context_length_exceeded" and body["type"] == "exceed_context_size_error"
    assert body["n_prompt_tokens"] == 2000 and body["n_ctx"] == 1024 and body["param"] == "prompt"


# --- a real server on the embedded Gemma ----------------------------------------------------------------
@pytest.fixture(scope="module")
def server(gemma_path, tmp_path_factory):
    with serving(gemma_path, tmp_path_factory.mktemp("llama-api"), "--lookup", "--draft-max", "4", "--api-key", KEY, "--alias", ALIAS) as srv:
        yield srv


def post(server, path: str, body: dict, headers: dict | None = None):
    with server.http() as http:
        return http.post(path, json=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})


def test_a_preflight_needs_no_key_and_every_answer_carries_the_origin(server):
    with server.http() as http:
        pre = http.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://web.example", "Access-Control-Request-Method": "POST",
                                                                        "Access-Control-Request-Headers": "Authorization"})
        assert pre.status_code == 200 and pre.text == ""
        assert pre.headers["access-control-allow-origin"] == "http://web.example"
        assert pre.headers["access-control-allow-credentials"] == "true"
        assert pre.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS" and pre.headers["access-control-allow-headers"] == "*"
        denied = http.get("/v1/models", headers={"Origin": "http://web.example"})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://web.example"
        listed = http.get("/v1/models", headers={"Origin": "http://web.example", "X-Api-Key": KEY})
        assert listed.status_code == 200 and listed.json()["data"][0]["id"] == ALIAS


def test_the_alias_names_the_model_and_a_clients_default_name_is_served(server):
    client = server.client(KEY)
    reply = client.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    assert reply.model == ALIAS and reply.system_fingerprint == protocol.SYSTEM_FINGERPRINT


def test_chat_logprobs_whole_and_streamed_spell_the_reply(server):
    client = server.client(KEY)
    kw = dict(model="x", messages=[{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}],
              max_tokens=12, temperature=0, logprobs=True, top_logprobs=4)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == whole.choices[0].message.content and len(content) == whole.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") and len(t.top_logprobs) == 4
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)  # (greedy: the most likely token)
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
    text, spelled, streamed = "", "", []
    for i, chunk in enumerate(client.chat.completions.create(**kw, stream=True)):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if i == 0:
            assert choice.delta.role == "assistant" and choice.delta.content is None
            continue
        if choice.finish_reason is None:
            text += choice.delta.content or ""
            assert choice.logprobs is not None and choice.logprobs.content
        for t in (choice.logprobs.content if choice.logprobs else []):
            spelled += t.token
            streamed.append(t.logprob)
    assert text == spelled == whole.choices[0].message.content
    assert streamed == pytest.approx([t.logprob for t in content], abs=1e-9)


def test_completion_logprobs_have_the_legacy_fields_and_the_entries(server):
    client = server.client(KEY)
    reply = client.completions.create(model="x", prompt="def fibonacci(n):", max_tokens=8, temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(alternatives) == 2 and max(alternatives.values()) == pytest.approx(p, abs=1e-6)
               for alternatives, p in zip(lp.top_logprobs, lp.token_logprobs))
    streamed = [c.choices[0].logprobs for c in client.completions.create(model="x", prompt="def fibonacci(n):", max_tokens=8, temperature=0, logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [p for part in streamed for p in part.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-9)
    assert [o for part in streamed for o in part.text_offset] == lp.text_offset


def test_the_native_completion_answers_in_llama_servers_shape(server, gemma):
    body = {"prompt": "def fibonacci(n):", "n_predict": 6, "temperature": 0}
    plain = post(server, "/completion", body).json()
    assert plain["stop"] is True and plain["tokens_predicted"] == 6 and plain["stop_type"] == "limit" and plain["model"] == ALIAS
    assert plain["tokens_evaluated"] == len(gemma.tokenize_prompt(body["prompt"])) and "completion_probabilities" not in plain
    assert post(server, "/completions", body).json()["content"] == plain["content"]  # (llama-server's route: the native shape)
    ids = gemma.tokenize_prompt(body["prompt"])
    assert post(server, "/completion", {**body, "prompt": ids}).json()["content"] == plain["content"]
    mixed = [ids[0], gemma.piece(ids[1]).decode() + gemma.piece(ids[2]).decode(), *ids[3:]]  # (ids, then a text, then ids)
    assert post(server, "/completion", {**body, "prompt": mixed}).json()["content"] == plain["content"]
    probs = post(server, "/completion", {**body, "n_probs": 3, "return_tokens": True}).json()
    entries = probs["completion_probabilities"]
    assert [e["id"] for e in entries] == probs["tokens"] and "".join(e["token"] for e in entries) == plain["content"]
    assert all(len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["id"] == e["id"] and e["logprob"] <= 0 for e in entries)
    assert probs["generation_settings"]["n_probs"] == 3
    fields = post(server, "/completion", {**body, "response_fields": ["content", "generation_settings/n_predict", "nothing/here"]}).json()
    assert fields == {"content": plain["content"], "generation_settings/n_predict": 6}


def test_the_native_stream_sends_each_steps_probabilities_then_the_final_object(server):
    with server.http() as http, http.stream("POST", "/completion", json={"prompt": "def fibonacci(n):", "n_predict": 6, "temperature": 0, "n_probs": 2, "stream": True},
                                            headers={"X-Api-Key": KEY}) as response:
        events = sse(response)
    assert "[DONE]" not in events and events[-1]["stop"] is True and "completion_probabilities" not in events[-1]
    partials = events[:-1]
    assert all(e["stop"] is False and len(e["completion_probabilities"]) == len(e["tokens"]) for e in partials)
    assert sum(len(e["tokens"]) for e in partials) == 6
    assert "".join(p["token"] for e in partials for p in e["completion_probabilities"]) == "".join(e["content"] for e in partials)


def test_a_native_json_schema_constrains_the_completion(server):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}
    reply = post(server, "/completion", {"prompt": "A person, as JSON:", "n_predict": 40, "temperature": 0, "json_schema": schema}).json()
    value = json.loads(reply["content"])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and reply["stop_type"] == "eos"


def test_a_final_assistant_message_is_continued(server, gemma):
    client = server.client(KEY)
    messages = [{"role": "user", "content": "Count to five"}, {"role": "assistant", "content": "1, 2, 3"}]
    reply = client.chat.completions.create(model="x", messages=messages, max_tokens=4, temperature=0)
    # (Gemma's file has no template: plain turns; the prompt ends with the text continued, no new turn)
    assert reply.usage.prompt_tokens == len(gemma.tokenize("User: Count to five\nAssistant: 1, 2, 3", parse_special=True))
    err = assert_error_body(post(server, "/v1/chat/completions", {"messages": [*messages, {"role": "assistant", "content": "4"}]}), 400)
    assert err["message"] == "Cannot have 2 or more assistant messages at the end of the list."


def test_an_over_long_prompt_names_its_size_and_the_context(server):
    err = assert_error_body(post(server, "/v1/completions", {"prompt": "word " * (CTX + 50), "max_tokens": 2}), 400)
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == CTX and err["n_prompt_tokens"] > CTX
    err = assert_error_body(post(server, "/completion", {"prompt": "word " * (CTX + 50)}), 400)
    assert err["type"] == "exceed_context_size_error" and err["n_prompt_tokens"] > CTX
    assert math.isfinite(err["n_ctx"])


def test_logit_bias_bans_a_token_and_ignore_eos_bans_every_end_token(server, gemma):
    body = {"prompt": "def fibonacci(n):", "n_predict": 8, "temperature": 0, "return_tokens": True}
    plain = post(server, "/completion", body).json()
    first = plain["tokens"][0]
    for bias in ({str(first): False}, [[first, False]], {str(first): -100}):
        banned = post(server, "/completion", {**body, "logit_bias": bias}).json()
        assert first not in banned["tokens"] and banned["tokens"] != plain["tokens"], bias
    openai_style = server.client(KEY).completions.create(model="x", prompt=body["prompt"], max_tokens=8, temperature=0, logit_bias={str(first): -100})
    assert openai_style.choices[0].text == post(server, "/completion", {**body, "logit_bias": {str(first): -100}}).json()["content"]
    settings = post(server, "/completion", {**body, "ignore_eos": True, "presence_penalty": 0.5}).json()["generation_settings"]
    assert {e["token"] for e in settings["logit_bias"]} == set(gemma.eog_tokens()) and settings["presence_penalty"] == 0.5
    assert all(e["bias"] is None for e in settings["logit_bias"])  # (-inf: null, as llama-server writes it)


def test_n_choices_greedy_once_sampled_each_with_its_seed(server):
    client = server.client(KEY)
    one = client.completions.create(model="x", prompt="Once upon a time", max_tokens=10, temperature=0)
    four = client.completions.create(model="x", prompt="Once upon a time", max_tokens=10, temperature=0, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and {c.text for c in four.choices} == {one.choices[0].text}
    # (greedy choices are one text: computed once, so they cost one choice's passes)
    assert four.model_extra["speculative"]["target_passes"] <= one.model_extra["speculative"]["target_passes"]
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens and four.usage.prompt_tokens == one.usage.prompt_tokens
    kw = dict(model="x", prompt="Once upon a time", max_tokens=10, temperature=1.0)
    three = client.completions.create(**kw, n=3, seed=11)
    alone = [client.completions.create(**kw, seed=11 + i).choices[0].text for i in range(3)]
    assert [c.text for c in three.choices] == alone and len(set(alone)) > 1
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kw, n=3, seed=11, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == alone
    err = assert_error_body(post(server, "/v1/completions", {"prompt": "hi", "n": 17}), 400)
    assert err["param"] == "n"


def test_several_prompts_get_an_answer_each(server):
    body = {"n_predict": 5, "temperature": 0}
    alone = [post(server, "/completion", {**body, "prompt": p}).json()["content"] for p in ("def fibonacci(n):", "Once upon a time")]
    both = post(server, "/completion", {**body, "prompt": ["def fibonacci(n):", {"prompt_string": "Once upon a time"}]}).json()
    assert [b["index"] for b in both] == [0, 1] and [b["content"] for b in both] == alone
    with server.http() as http, http.stream("POST", "/completion", json={**body, "prompt": ["def fibonacci(n):", "Once upon a time"], "stream": True},
                                            headers={"X-Api-Key": KEY}) as response:
        events = sse(response)
    texts = ["".join(e["content"] for e in events if e["index"] == i and not e["stop"]) for i in range(2)]
    assert texts == alone and sum(e["stop"] for e in events) == 2


TEMPLATE = """{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif -%}
{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif -%}"""


def test_a_template_file_with_reasoning_off_and_apply_template_as_llama_server(gemma_path, tmp_path):
    template = tmp_path / "chatml-thinking.jinja"
    template.write_text(TEMPLATE)
    with serving(gemma_path, tmp_path, "--chat-template-file", str(template), "--reasoning", "off") as srv:
        def apply(**body):
            response = post(srv, "/apply-template", body, headers={})
            assert response.status_code == 200, response.text
            return response.json()["prompt"]

        user = {"role": "user", "content": "What is today?"}
        assert apply(messages=[user]) == "<|im_start|>user\nWhat is today?<|im_end|>\n<|im_start|>assistant\n<think></think>"
        assert apply(messages=[user], add_generation_prompt=False) == "<|im_start|>user\nWhat is today?<|im_end|>\n"
        assert apply(messages=[user, {"role": "assistant", "content": "It is"}]).endswith("<|im_start|>assistant\nIt is")
        tool = {"type": "function", "function": {"name": "today", "parameters": {"type": "object", "properties": {}}}}
        assert apply(messages=[user], tools=[tool]).startswith('<tools>[{"type": "function"')
        reply = srv.client().chat.completions.create(model="x", messages=[user], max_tokens=2, temperature=0)
        assert reply.usage.prompt_tokens == len(gemma_tokens(srv, apply(messages=[user])))
    from fixtures.cli import assert_one_line_error, specli

    missing = specli("serve", "-m", str(gemma_path), "--port", "0", "--chat-template-file", str(tmp_path / "missing.jinja"))
    assert_one_line_error(missing, 2, "--chat-template-file", "no such file")
    assert_one_line_error(specli("serve", "-m", str(gemma_path), "--port", "0", "--reasoning", "maybe"), 2, "--reasoning")


def gemma_tokens(srv, text: str) -> list[int]:
    return post(srv, "/tokenize", {"content": text, "add_special": True}, headers={}).json()["tokens"]


def test_verbose_echoes_the_prompt_and_input_tokens_counts_it(server, gemma):
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    plain = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).json()
    assert "__verbose" not in plain
    verbose = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "verbose": True}).json()
    assert "Book" in verbose["__verbose"]["prompt"] and verbose["__verbose"]["tokens_evaluated"] == verbose["usage"]["prompt_tokens"]
    counted = post(server, "/chat/completions/input_tokens", {"messages": messages}).json()
    assert counted == {"input_tokens": verbose["usage"]["prompt_tokens"]}
    assert assert_error_body(post(server, "/v1/chat/completions", {"messages": messages, "verbose": "yes"}), 400)["param"] == "verbose"


def test_post_sampling_probs_are_the_chains_and_identical_greedy_prompts_one_answer(server, gemma):
    body = {"prompt": "Today was the day. Today I would finally become a", "n_probs": 10, "temperature": 1.0, "n_predict": 5,
            "post_sampling_probs": True, "top_k": 8, "seed": 3}
    entries = post(server, "/completion", body).json()["completion_probabilities"]
    assert len(entries) == 5
    for e in entries:
        assert 0 < e["prob"] <= 1 and "logprob" not in e and 0 < len(e["top_probs"]) <= 8  # (top_k 8: the chain keeps 8 at most)
        assert sum(a["prob"] for a in e["top_probs"]) == pytest.approx(1.0) and e["prob"] in [a["prob"] for a in e["top_probs"]]
    ids = gemma.tokenize_prompt("def fibonacci(n):")
    both = post(server, "/completion", {"prompt": [ids, "def fibonacci(n):"], "n_predict": 12, "temperature": 0}).json()
    assert both[0]["content"] == both[1]["content"] and [b["index"] for b in both] == [0, 1]
