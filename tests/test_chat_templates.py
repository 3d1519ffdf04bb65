"""Chat templates in one-shot use: `run`/`batch` with --chat, --system, --template, and batch
items with `system`/`messages`; the model's own Jinja template rendered in a sandbox."""

from __future__ import annotations

import json

import pytest

from fixtures import synthetic
from fixtures.cli import assert_one_line_error, specli
from specli.decoding.sampling import GREEDY
from specli.llama.templates import JinjaTemplate, TemplateRenderError
from specli.session import batch

# A template of our own: "[role] content" lines after BOS, then the assistant's opening. It
# refuses a message "boom" (raise_exception), as real templates refuse e.g. a misplaced role.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.content == 'boom' %}{{ raise_exception('no booms here') }}{% endif %}"
    "[{{ m.role }}] {{ m.content }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
FAST = ("--target-only", "--temperature", "0", "--max-tokens", "8", "-c", "256", "--threads", "1")


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    directory = tmp_path_factory.mktemp("templated")
    return {
        "good": str(synthetic.make_model(directory / "good.gguf", seed=1, chat_template=TEMPLATE)),
        "unsafe": str(synthetic.make_model(directory / "unsafe.gguf", seed=1,
                                           chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")),
        "refusing": str(synthetic.make_model(directory / "refusing.gguf", seed=1,
                                             chat_template="{{ raise_exception('only tools here') }}")),
    }


def run_json(*args: str) -> dict:
    result = specli("run", *args, *FAST, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# --- rendering (no model) ------------------------------------------------------------------------
def test_jinja_template_renders_roles_bos_and_the_assistant_opening():
    template = JinjaTemplate(TEMPLATE, bos_token="<s>", eos_token="</s>")
    text = template.render([("system", "Be brief."), ("user", "hi")])
    assert text == "<s>[system] Be brief.\n[user] hi\n[assistant]"
    assert template.render([("user", "hi")], add_assistant=False) == "<s>[user] hi\n"
    with pytest.raises(TemplateRenderError, match="no booms here") as refused:
        template.render([("user", "boom")])
    assert not refused.value.unsafe


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}",  # the stock sandbox renders this as '' and goes on
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}",  # the immutable sandbox: no changing the conversation
    "{{ bos_token['__class__'] }}",
])
def test_the_sandbox_refuses_unsafe_templates(source):
    template = JinjaTemplate(source, bos_token="<s>", eos_token="</s>")
    with pytest.raises(TemplateRenderError) as refused:
        template.render([("user", "hi")])
    assert refused.value.unsafe and "\n" not in str(refused.value)


def test_a_template_that_does_not_compile_names_the_line():
    with pytest.raises(TemplateRenderError, match="syntax error on line 2"):
        JinjaTemplate("ok\n{% for m in messages %}", bos_token="", eos_token="")


# --- run -----------------------------------------------------------------------------------------
def test_run_chat_renders_the_models_template_with_the_system_turn(templated):
    model = templated["good"]
    chat = run_json("-m", model, "--system", "Be brief.", "hello")  # --system implies --chat
    # The same text, rendered by hand: its BOS comes from the tokenizer, the template's "<s>"
    # must have become that same single BOS (not the text "<s>", not a second BOS).
    raw = run_json("-m", model, "[system] Be brief.\n[user] hello\n[assistant]")
    assert chat["stats"]["prompt_tokens"] == raw["stats"]["prompt_tokens"]
    assert chat["token_ids"] == raw["token_ids"]
    plain = run_json("-m", model, "hello")
    assert plain["stats"]["prompt_tokens"] < chat["stats"]["prompt_tokens"]
    assert run_json("-m", model, "--chat", "hello")["token_ids"] == run_json("-m", model, "[user] hello\n[assistant]")["token_ids"]


def test_run_template_name_overrides_the_models_own(templated):
    own = run_json("-m", templated["good"], "--chat", "hello")
    chatml = run_json("-m", templated["good"], "--template", "chatml", "hello")  # implies --chat
    assert chatml["stats"]["prompt_tokens"] != own["stats"]["prompt_tokens"]


def test_run_refuses_an_unsafe_template_in_one_line(templated):
    result = specli("run", "-m", templated["unsafe"], "--chat", "hello", *FAST)
    assert_one_line_error(result, 2, "unsafe.gguf's chat template", "sandbox refused", "__class__", "--template NAME")
    # The fix the line names works.
    assert specli("run", "-m", templated["unsafe"], "--template", "chatml", "hello", *FAST).returncode == 0


def test_run_template_that_fails_to_render_is_one_line_with_the_fix(templated):
    result = specli("run", "-m", templated["refusing"], "--chat", "hello", *FAST)
    assert_one_line_error(result, 2, "refusing.gguf's chat template", "only tools here", "--template NAME")


def test_run_without_a_template_uses_plain_turns_and_says_so(pair_perturbed):
    target = str(pair_perturbed[0])
    result = specli("run", "-m", target, "--chat", "hello", *FAST, "--json")
    assert result.returncode == 0, result.stderr
    assert "has no chat template" in result.stderr and "--template NAME" in result.stderr
    by_hand = run_json("-m", target, "User: hello\nAssistant:")
    assert json.loads(result.stdout)["token_ids"] == by_hand["token_ids"]


def test_run_unknown_template_name_before_loading(templated):
    assert_one_line_error(specli("run", "-m", templated["good"], "--template", "nope", "hi", *FAST), 2, "unknown chat template 'nope'")


# --- batch ---------------------------------------------------------------------------------------
def parse(*objects, **defaults):
    return batch.parse_lines([json.dumps(o).encode() for o in objects], "jsonl", GREEDY, 8, **defaults)


def test_batch_items_with_system_and_messages():
    user = {"role": "user", "content": "hi"}
    plain, with_system, conversation, own_system = parse(
        {"prompt": "hi"}, {"prompt": "hi", "system": "S"}, {"messages": [user]},
        {"messages": [{"role": "system", "content": "mine"}, user]}, system="CLI",
    )
    # --system makes every item a chat item; an item's own system prompt replaces it.
    assert plain.messages == [{"role": "system", "content": "CLI"}, user]
    assert with_system.messages == [{"role": "system", "content": "S"}, user]
    assert conversation.messages == [{"role": "system", "content": "CLI"}, user]
    assert own_system.messages == [{"role": "system", "content": "mine"}, user]
    raw, chat = parse({"prompt": "hi"}, {"prompt": "hi", "system": ""})
    assert raw.messages is None and chat.messages == [user]  # "system" alone asks for chat


@pytest.mark.parametrize("obj, fragment", [
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 'either "prompt" or "messages"'),
    ({"messages": []}, "messages must be a non-empty array"),
    ({"messages": "hi"}, "messages must be a non-empty array"),
    ({"messages": ["hi"]}, "messages[0] must be an object"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role must be one of system, user, assistant"),
    ({"messages": [{"role": "user"}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "unknown field 'name'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "last message must be the user's"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "c"}]}, "only the first"),
    ({"system": "S", "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}, "system prompt is given twice"),
    ({"system": 3, "prompt": "x"}, "system must be a string"),
    ({"system": "S"}, 'no "prompt" field'),
])
def test_batch_bad_chat_items_are_one_line_item_errors(obj, fragment):
    (entry,) = parse(obj)
    assert isinstance(entry, batch.LineError) and fragment in entry.error and "\n" not in entry.error


def test_batch_chat_items_through_the_command(tmp_path, templated):
    model = templated["good"]
    src = tmp_path / "in.jsonl"
    lines = [
        {"id": "raw", "prompt": "hello"},
        {"id": "sys", "prompt": "hello", "system": "Be brief."},
        {"id": "conv", "messages": [{"role": "user", "content": "hello"}]},
        {"id": "boom", "messages": [{"role": "user", "content": "boom"}]},
        {"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
    ]
    src.write_text("".join(json.dumps(o) + "\n" for o in lines), encoding="utf-8")
    result = specli("batch", str(src), "-m", model, *FAST)
    assert result.returncode == 1, result.stderr  # some items failed
    records = {r["id"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert records["raw"]["token_ids"] == run_json("-m", model, "hello")["token_ids"]
    assert records["sys"]["token_ids"] == run_json("-m", model, "--system", "Be brief.", "hello")["token_ids"]
    assert records["conv"]["token_ids"] == run_json("-m", model, "--chat", "hello")["token_ids"]
    assert "no booms here" in records["boom"]["error"] and "--template NAME" in records["boom"]["error"]
    assert 'either "prompt" or "messages"' in records["both"]["error"]

    # --chat on a text file: each line is a user message.
    text = tmp_path / "in.txt"
    text.write_text("hello\n", encoding="utf-8")
    result = specli("batch", str(text), "-m", model, "--chat", *FAST)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == records["conv"]["token_ids"]
    # --parallel takes the same rendered prompts.
    text.write_text("hello\nhello\n", encoding="utf-8")
    result = specli("batch", str(text), "-m", model, "--chat", "--parallel", "2", *FAST)
    assert result.returncode == 0, result.stderr
    counts = [json.loads(line)["stats"]["prompt_tokens"] for line in result.stdout.splitlines()]
    assert counts == [records["conv"]["stats"]["prompt_tokens"]] * 2


def test_batch_with_an_unsafe_template_stops_before_any_item(tmp_path, templated):
    src = tmp_path / "in.txt"
    src.write_text("hello\n", encoding="utf-8")
    result = specli("batch", str(src), "-m", templated["unsafe"], "--chat", *FAST)
    assert_one_line_error(result, 2, "sandbox refused", "--template NAME")


def test_run_chat_on_plain_turns_stops_at_the_next_user_line(pair_perturbed, templated):
    # As in `chat`: a reply in plain User:/Assistant: turns ends where the model starts the
    # user's next turn; a real template ends its turns itself.
    from specli.cli.run import chat_prompt_ids
    from specli.llama.model import LlamaModel

    for path, expected in ((pair_perturbed[0], ("\nUser:",)), (templated["good"], ())):
        model = LlamaModel(str(path), n_ctx=256, n_threads=1, kv_type="f32", flash_attn="off")
        try:
            _, stops = chat_prompt_ids(model, None, None, "hello", quiet=True)
        finally:
            model.close()
        assert stops == expected, path
