"""Hostile or unlucky input is answered as bad input, never as "a bug in specli", and never
hangs (issue 33): numbers out of range, lone surrogates, JSON nested too deeply, stop strings
too long, both HTTP framings in one request, an empty or non-ASCII API key (serve); the same
text faults in a batch item; a FIFO where the policy file or a Hugging Face ref should be.
No model needed."""

from __future__ import annotations

import asyncio
import json

import pytest

from fixtures.cli import assert_one_line_error, specli
from specli.decoding.sampling import SamplingParams
from specli.server.protocol import CHAT, TEXT, ApiError, parse_request
from specli.session.batch import LineError, _parse_line

DEFAULTS = SamplingParams()
HUGE = 10**400
LONE = json.loads('"a\\ud800b"')  # what a JSON body's \ud800 escape decodes to


def refused(body: dict, kind: str = TEXT) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_request(body, kind, DEFAULTS)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "seed", "top_k", "n_predict"])
def test_a_number_out_of_any_range_is_a_400_naming_its_field(field):
    err = refused({"prompt": "hi", field: HUGE})
    assert err.param == field and len(err.message) < 200
    assert refused({"prompt": "hi", field: -HUGE}).param == field
    assert refused({"prompt": "hi", field: 1e300}).param == field  # (an integer sent as a float)


def test_token_ids_out_of_range_are_refused():
    assert refused({"prompt": [1, 2, HUGE]}).param == "prompt"
    assert refused({"prompt": [1, -5]}).param == "prompt"


@pytest.mark.parametrize("body, kind, field", [
    ({"prompt": LONE}, TEXT, "prompt"),
    ({"prompt": "hi", "model": LONE}, TEXT, "model"),
    ({"prompt": "hi", "stop": ["ok", LONE]}, TEXT, "stop"),
    ({"messages": [{"role": "user", "content": LONE}]}, CHAT, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, CHAT, "messages"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(body, kind, field):
    err = refused(body, kind)
    assert err.param == field and "surrogate" in err.message


def test_a_stop_string_too_long_to_search_is_refused():
    assert refused({"prompt": "hi", "stop": ["x" * 2000]}).param == "stop"
    assert parse_request({"prompt": "hi", "stop": ["x" * 1000]}, TEXT, DEFAULTS).stop == ("x" * 1000,)


class FakeHttp:
    """What read_json and check_key read of a Starlette request."""

    def __init__(self, body: bytes = b"", headers: dict | None = None):
        self.body, self.headers = body, headers or {}

    async def stream(self):
        yield self.body


def test_json_nested_too_deeply_is_a_400():
    pytest.importorskip("starlette")
    from specli.server.handling import read_json

    for deep in ("[" * 100_000 + "]" * 100_000, '{"x": ' + "[" * 100_000 + "]" * 100_000 + ', "prompt": "hi"}'):
        with pytest.raises(ApiError) as caught:
            asyncio.run(read_json(FakeHttp(deep.encode())))
        assert caught.value.status == 400 and "nested" in caught.value.message


@pytest.mark.parametrize("key", ["clé-secrète-ключ", "clé-voilà", "ключх"])  # (à and х end in \xa0 and \x85 in UTF-8)
def test_a_non_ascii_api_key_sent_as_utf8_is_the_key(key):
    pytest.importorskip("starlette")
    from specli.server.handling import check_key

    class Settings:
        api_key = key

    sent = "Bearer " + Settings.api_key.encode("utf-8").decode("latin-1")  # as an ASGI server hands it over
    check_key(Settings(), FakeHttp(headers={"authorization": sent}))
    with pytest.raises(ApiError) as caught:
        check_key(Settings(), FakeHttp(headers={"authorization": "Bearer cle-secrete"}))
    assert caught.value.status == 401


def test_an_empty_api_key_from_the_environment_is_refused_at_start_up(tmp_path):
    result = specli("serve", "-m", str(tmp_path / "absent.gguf"), env={"SPECLI_API_KEY": ""})
    assert_one_line_error(result, 2, "SPECLI_API_KEY", "empty")


@pytest.mark.parametrize("line, words", [
    (b'{"prompt": "a\\ud800b"}', "surrogate"),
    (b'{"prompt": "hi", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
])
def test_a_batch_item_with_bad_text_is_bad_input_not_a_bug(line, words):
    entry = _parse_line(1, line, "jsonl", DEFAULTS, 16)
    assert isinstance(entry, LineError) and words in entry.error


def test_a_request_with_both_framings_is_refused_before_its_body():
    pytest.importorskip("starlette")
    from specli.server.app import framing_guard

    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope)

    async def receive():
        raise AssertionError("the body must not be read")

    async def send(message):
        sent.append(message)

    headers = [(b"host", b"x"), (b"Content-Length", b"10"), (b"Transfer-Encoding", b"chunked")]
    asyncio.run(framing_guard(app)({"type": "http", "headers": headers}, receive, send))
    assert not reached and sent[0]["status"] == 400 and (b"connection", b"close") in sent[0]["headers"]
    asyncio.run(framing_guard(app)({"type": "http", "headers": headers[:2]}, receive, send))
    assert len(reached) == 1  # one framing: through


def test_a_fifo_in_place_of_the_policy_file_never_blocks_the_save(tmp_path):
    import os
    import threading

    from specli.decoding.policy.store import Saved
    from specli.session.loading import read_policy_file, save_policy_state

    fifo = tmp_path / "policy.json"
    os.mkfifo(fifo)
    done = threading.Event()

    def save():
        save_policy_state(fifo, Saved(passes={}, saved_at=0.0))
        done.set()

    threading.Thread(target=save, daemon=True).start()
    assert done.wait(5), "saving onto a FIFO blocked"
    assert read_policy_file(fifo) is None  # and reading it neither blocks nor counts as a state


@pytest.mark.parametrize("ref", ["fifo", "/", "../../..", "garbage \xff\xfe", ""])
def test_a_damaged_hugging_face_ref_is_skipped_without_blocking(tmp_path, monkeypatch, ref):
    import os

    from huggingface_hub import constants

    from specli.models import hub

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    good = tmp_path / "models--user--good"
    (good / "refs").mkdir(parents=True)
    (good / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    (good / "snapshots" / "0123456789abcdef0123456789abcdef01234567").mkdir(parents=True)
    (good / "snapshots" / "0123456789abcdef0123456789abcdef01234567" / "m-Q4_K_M.gguf").write_bytes(b"GGUF")
    bad = tmp_path / "models--user--bad" / "refs"
    bad.mkdir(parents=True)
    if ref == "fifo":
        os.mkfifo(bad / "main")
    else:
        (bad / "main").write_bytes(ref.encode("latin-1"))
    assert hub.cached_snapshot("user/bad") is None
    assert [r for r, _, _ in hub.cached_ggufs()] == ["user/good"]


def test_a_hugging_face_ref_that_is_not_text_is_named_and_the_rest_listed(tmp_path):
    # Was: `specli models` and `specli fit -m PAIR` ended in a UnicodeDecodeError (the hub client
    # reads a registry repo's ref as text), nothing listed, and a hint to a --verbose that
    # `models` does not have; a FIFO or "/" ref was skipped without a word.
    import os

    hub = tmp_path / "hf" / "hub"
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "SPECLI_MODELS": ""}
    commit = "0123456789abcdef0123456789abcdef01234567"
    good = hub / "models--user--good"
    (good / "refs").mkdir(parents=True)
    (good / "refs" / "main").write_text(commit)
    (good / "snapshots" / commit).mkdir(parents=True)
    (good / "snapshots" / commit / "m-Q4_K_M.gguf").write_bytes(b"GGUF")
    refs = {}
    for repo, make in (("bartowski/Meta-Llama-3.1-70B-Instruct-GGUF", lambda p: p.write_bytes(b"\xff\xfe\x00garbage")),  # a registry pair's target
                       ("user/fifo", os.mkfifo), ("user/slash", lambda p: p.write_text("/"))):
        ref = hub / ("models--" + repo.replace("/", "--")) / "refs" / "main"
        ref.parent.mkdir(parents=True)
        make(ref)
        refs[repo] = ref
    why = {"bartowski/Meta-Llama-3.1-70B-Instruct-GGUF": "it is not text", "user/fifo": "it is a FIFO (named pipe)",
           "user/slash": "'/' is not a commit hash"}
    for args in (["models"], ["models", "--json"]):
        result = specli(*args, env=env, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "llama-3.1-70b" in result.stdout and ("user/good:Q4_K_M" in result.stdout or args[-1] == "--json")
        lines = result.stderr.splitlines()
        assert len(lines) == (3 if args == ["models"] else 1), result.stderr  # (--json: the registry's rows only)
        for repo, ref in refs.items():
            if args == ["models"] or repo.startswith("bartowski"):
                assert any(line.startswith(f"specli: warning: skipped the Hugging Face cache ref {ref}: {why[repo]}") for line in lines), result.stderr
    result = specli("fit", "-m", "llama-3.1-70b", env=env, timeout=60)
    assert result.returncode in (0, 3), result.stderr  # (fits or not, by this machine's memory: from models.toml's facts)
    assert result.stderr.splitlines() == [f"specli: warning: skipped the Hugging Face cache ref {refs['bartowski/Meta-Llama-3.1-70B-Instruct-GGUF']}: "
                                          "it is not text (it should hold a commit hash); the repo counts as not downloaded "
                                          "(delete the ref; specli pull then fetches the repo again)"]
    assert "Traceback" not in result.stderr and "UnicodeDecodeError" not in result.stderr
    # A pull would have the hub client read it as text (a FIFO: for ever): one line saying what to do.
    result = specli("pull", "llama-3.1-70b", env=env, timeout=60)
    assert result.returncode == 1 and result.stderr.splitlines()[-1].startswith("specli: error: cannot download"), result.stderr
    assert f"the Hugging Face cache ref {refs['bartowski/Meta-Llama-3.1-70B-Instruct-GGUF']} is damaged; delete it" in result.stderr


@pytest.mark.parametrize("command, hinted", [(["models"], False), (["run", "hi"], True)])
def test_the_verbose_hint_is_given_only_by_a_command_that_has_verbose(monkeypatch, capsys, command, hinted):
    from specli.cli import models, run
    from specli.cli.app import _main

    def broken(*args, **kwargs):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(models, "registry_rows", broken)
    monkeypatch.setattr(run, "read_prompt", broken)
    monkeypatch.setattr(run, "model_choice", lambda *a, **k: None)
    assert _main(command) == 1
    err = capsys.readouterr().err
    assert err.startswith("specli: error: RuntimeError: something unforeseen") and err.count("\n") == 1
    assert ("--verbose" in err) == hinted, err


@pytest.mark.parametrize("source, words", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "ran for over"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'ab' }}{% endfor %}{% endfor %}", "wrote over"),
    # a gigabyte in one step, before any deadline or output cap could see it
    ("{% set s = 'a' * 1000000000 %}{{ s | length }}", "builds a value of over"),
    ("{% set s = ['a'] * 1000000000 %}{{ s | length }}", "builds a value of over"),
    ("{{ (10 ** 1000000000) | string | length }}", "builds a value of over"),
    ("{{ 'x'.ljust(1000000000) | length }}", "passes 1,000,000,000 to a function"),
    ("{{ 'x' | center(1000000000) | length }}", "passes 1,000,000,000 to a function"),
    # a string doubled in a loop: each step is small, the memory is not
    ("{% set s = namespace(t='x') %}{% for i in range(40) %}{% set s.t = s.t ~ s.t %}{% endfor %}{{ s.t }}", "MiB of memory"),
])
def test_a_template_is_bounded_in_time_and_size(source, words, monkeypatch):
    import time

    from specli.llama import templates

    monkeypatch.setattr(templates, "RENDER_SECONDS", 1.0)
    monkeypatch.setattr(templates, "RENDER_MEMORY", 64 << 20)
    template = templates.JinjaTemplate(source, bos_token="<s>", eos_token="</s>")
    t0 = time.monotonic()
    with pytest.raises(templates.TemplateRenderError) as caught:
        template.render([("user", "hi")])
    assert words in str(caught.value) and time.monotonic() - t0 < 10
    ok = templates.JinjaTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", bos_token="", eos_token="")
    assert ok.render([("user", "hi")]) == "hi"


@pytest.mark.parametrize("args", [["cache"], ["cache", "--json"], ["cache", "--clear"]])
def test_a_cache_folder_that_cannot_be_read_is_an_error_not_zero_files(tmp_path, monkeypatch, capsys, args):
    # Unreadable as a user would find it (a root test process reads any folder: the refusal is
    # made where the listing happens).
    import os

    from specli.cli.app import _main

    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "policy-x.json").write_text("{}")
    monkeypatch.setenv("SPECLI_CACHE_DIR", str(folder))
    scandir = os.scandir

    def refusing(path="."):
        if os.fspath(path) == str(folder):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    assert _main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot read the cache folder {folder}: Permission denied" in err
    assert (folder / "policy-x.json").exists()


LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
GROWING = "{% set s = namespace(t='x') %}{% for i in range(40) %}{% set s.t = s.t ~ s.t %}{% endfor %}{{ s.t }}"


def test_a_looping_template_beside_growing_memory_is_stopped_for_its_time(monkeypatch):
    """The memory a render is checked against is the process's, which serve grows elsewhere
    meanwhile (other renders in other threads, the generation): a render that only loops is
    stopped for its time, and the one that builds a huge string for its memory (was: the
    looping one's 400 said "took over 256 MiB of memory")."""
    import threading
    import time

    from specli.llama import templates

    monkeypatch.setattr(templates, "RENDER_SECONDS", 2.0)
    monkeypatch.setattr(templates, "RENDER_MEMORY", 64 << 20)
    errors: dict[str, str] = {}

    def render(name: str, source: str) -> None:
        try:
            templates.JinjaTemplate(source, bos_token="", eos_token="").render([("user", "hi")])
        except templates.TemplateRenderError as err:
            errors[name] = str(err)

    looping = threading.Thread(target=render, args=("looping", LOOPING))
    looping.start()
    time.sleep(0.3)  # (its render under way: the memory below comes after its start)
    held = b"x" * (128 << 20)  # this thread grows the process: not the looping render's doing
    growing = threading.Thread(target=render, args=("growing", GROWING))
    growing.start()
    growing.join(30)
    looping.join(30)
    del held
    assert "ran for over 2 s" in errors["looping"], errors
    assert "MiB of memory" in errors["growing"], errors


@pytest.mark.parametrize("body, kind, field, size", [
    (lambda: {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1_000_000)}}, TEXT, "logit_bias", "1,000,000 entries"),
    (lambda: {"prompt": "hi", "tools": [{"x": "A" * 10_000_000}]}, TEXT, "tools", "1 item"),
    (lambda: {"messages": [{"role": "A" * 10_000_000, "content": "hi"}]}, CHAT, "messages", "10,000,000 characters"),
    (lambda: {"messages": [{"role": "user", "content": [{"type": "A" * 10_000_000}]}]}, CHAT, "messages", "10,000,000 characters"),
], ids=["logit_bias", "tools", "role", "content-part-type"])
def test_an_error_quotes_at_most_the_start_of_a_huge_value(body, kind, field, size):
    # (was: the whole value, a 14.9 MB answer for the logit_bias, 10 MB for the tools)
    err = refused(body(), kind)
    assert err.param == field and size in err.message and len(json.dumps(err.body())) < 500, err.message[:300]


def test_an_unknown_model_name_is_quoted_short_and_no_message_is_huge():
    pytest.importorskip("starlette")
    from specli.server.handling import check_model

    class Settings:
        model_id, aliases, strict_models = "served", set(), True  # (--strict-model-names: else any name is served)

    with pytest.raises(ApiError) as caught:
        check_model(Settings(), "m" * 10_000_000)
    assert caught.value.status == 404 and "10,000,000 characters" in caught.value.message and len(caught.value.message) < 300
    # whatever a message holds (a template's own error text quoting a message), it stays short
    assert len(ApiError(400, "the template refuses this conversation: " + "A" * 10_000_000).message) < 1100
