"""`specli serve` below HTTP: the OpenAI request checks and bodies (protocol.py), and the
scheduler's slots on the synthetic F32 pair (no HTTP, no threads but the scheduler's)."""

from __future__ import annotations

import contextlib
import dataclasses
import queue as queue_module

import pytest

from conftest import load
from specli.decoding.drafters import make_drafter
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.decoding.step import SpeculativeDecoder
from specli.decoding.stopping import STOP_INTERRUPTED
from specli.modes import DraftLength
from specli.server import protocol
from specli.server.protocol import CHAT, TEXT, ApiError, parse_request
from specli.server.scheduler import Delta, Failed, Job, QueueFull, Scheduler, ShuttingDown
from specli.session.loading import Loaded, Plan

DEFAULTS = SamplingParams()  # the server's command line: llama.cpp's defaults


# --- protocol -----------------------------------------------------------------------------------
def refused(body, kind=TEXT) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(body, kind, DEFAULTS)
    return info.value


def test_a_request_overrides_the_servers_sampling_and_keeps_the_rest():
    req = parse_request({"prompt": "hi", "temperature": 0, "top_k": 5, "seed": 7, "max_tokens": 9, "stop": "x"}, TEXT, DEFAULTS)
    assert req.sampling == dataclasses.replace(DEFAULTS, temperature=0.0, top_k=5, seed=None)
    assert (req.seed, req.max_tokens, req.stop, req.prompt, req.stream) == (7, 9, ("x",), "hi", False)
    assert parse_request({"prompt": "hi", "max_completion_tokens": 4}, TEXT, DEFAULTS).max_tokens == 4
    assert parse_request({"prompt": "hi"}, TEXT, dataclasses.replace(DEFAULTS, seed=3)).seed == 3  # the server's --seed


def test_prompt_forms_and_chat_messages():
    assert parse_request({"prompt": ["one"]}, TEXT, DEFAULTS).prompt == "one"
    assert parse_request({"prompt": [1, 2, 3]}, TEXT, DEFAULTS).prompt_ids == [1, 2, 3]
    req = parse_request({"messages": [{"role": "developer", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
                        CHAT, DEFAULTS)
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


def test_neutral_values_of_unsupported_fields_pass_and_others_are_refused():
    body = {"prompt": "hi", "n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u", "some_vendor_field": 1}
    assert parse_request(body, TEXT, DEFAULTS).prompt == "hi"
    for field, value in (("n", 0), ("logprobs", True), ("best_of", 3), ("echo", True), ("tools", [{"type": "function"}])):
        err = refused({"prompt": "hi", field: value})
        assert err.status == 400 and err.param == field


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"), ({"prompt": "hi", "temperature": True}, "temperature"),
    ({"prompt": "hi", "top_k": 1.5}, "top_k"), ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "stop": ""}, "stop"), ({"prompt": "hi", "stop": ["a"] * 17}, "stop"), ({"prompt": "hi", "stream": "yes"}, "stream"),
])
def test_bad_completion_fields_name_the_field(body, param):
    err = refused(body)
    assert err.status == 400 and err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error" and err.body()["error"]["message"]


@pytest.mark.parametrize("messages", [None, [], [{"role": "robot", "content": "x"}], [{"role": "user"}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]])
def test_bad_messages_are_refused(messages):
    body = {} if messages is None else {"messages": messages}
    assert refused(body, CHAT).param == "messages"


def test_chunks_and_bodies_have_the_openai_shape():
    first = protocol.chunk(CHAT, "id", "m", 1, role=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    piece = protocol.chunk(TEXT, "id", "m", 1, text="ab")
    assert piece["object"] == "text_completion" and piece["choices"][0]["text"] == "ab"
    last = protocol.chunk(CHAT, "id", "m", 1, finish_reason="stop", extra={"usage": protocol.usage(3, 4)})
    assert last["choices"][0]["finish_reason"] == "stop" and last["usage"]["total_tokens"] == 7
    assert protocol.chunk(CHAT, "id", "m", 1, no_choices=True)["choices"] == []
    body = protocol.response_body(CHAT, "id", "m", "hello", "length", {})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"} and body["object"] == "chat.completion"
    assert protocol.FINISH_REASONS[STOP_INTERRUPTED] == "length"


# --- the scheduler ----------------------------------------------------------------------------------
PROMPTS = ["Once upon a time", "def fibonacci(n):", "hello world hello world hello", "a b c d e f g a b c d", "In 1492 Columbus sailed"]


class Collector:
    """A job's events, as the front end receives them (here: from the scheduler's thread)."""

    def __init__(self):
        self.events: queue_module.Queue = queue_module.Queue()

    def __call__(self, event):
        self.events.put(event)

    def result(self, timeout: float = 120):
        text = []
        while True:
            event = self.events.get(timeout=timeout)
            if isinstance(event, Delta):
                text.append(event.text)
            elif isinstance(event, Failed):
                return event
            else:
                text.append(event.tail)
                return "".join(text), event


@contextlib.contextmanager
def running(scheduler: Scheduler):
    """The scheduler's thread for the with-block; then stopped, joined and closed."""
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.stop()
        scheduler.join(30)
        scheduler.close()


def loaded_for(model, mode="lookup", draft_length=4, sampling=GREEDY) -> Loaded:
    decoder = SpeculativeDecoder(model, make_drafter(mode), draft_length, sampling)
    return Loaded(Plan(model.path, None, mode, decoder.draft_length, sampling), model, None, decoder)


def job_for(model, prompt, max_tokens, collector, **kw) -> Job:
    return Job(Request(model.tokenize(prompt, add_bos=model.vocab_info().add_bos), max_tokens, kw.pop("sampling", GREEDY), **kw), emit=collector)


@pytest.fixture(scope="module")
def model(pair_perturbed):
    m = load(pair_perturbed[0], n_ctx=256)
    yield m
    m.close()


@pytest.fixture
def draft(pair_perturbed):
    m = load(pair_perturbed[1], n_ctx=256)
    yield m
    m.close()


def draft_scheduler(model, draft, spy, **kw) -> Scheduler:
    """A scheduler drafting with the draft model, greedy, N = 4, F32 numerics; spy(requests)
    sees every pass of the slots' draft-model context."""
    decoder = SpeculativeDecoder(model, make_drafter("draft-model", draft), 4, GREEDY)
    loaded = Loaded(Plan(model.path, draft.path, "draft-model", DraftLength.fixed_at(4), GREEDY), model, draft, decoder)
    scheduler = Scheduler(loaded, queue_limit=16, n_threads=1, kv_type="f32", flash_attn="off", **kw)
    original = scheduler.loop.draft_passes.eval
    scheduler.loop.draft_passes.eval = lambda requests, **kw: spy(requests) or original(requests, **kw)
    return scheduler




def sequential(model, prompt, max_tokens, mode="lookup", draft=None):
    """The text of one generation on its own (greedy, N = 4)."""
    decoder = SpeculativeDecoder(model, make_drafter(mode, draft), 4, GREEDY)
    ids = model.tokenize(prompt, add_bos=model.vocab_info().add_bos)
    return generate(decoder, Request(ids, max_tokens=max_tokens)).run().text


def submit_all(scheduler, model, max_tokens: list[int]) -> list:
    """PROMPTS[i] with max_tokens[i] each, submitted at once; their (text, Done) in order."""
    collectors = [Collector() for _ in PROMPTS]
    for p, n, c in zip(PROMPTS, max_tokens, collectors):
        scheduler.submit(job_for(model, p, n, c))
    return [c.result() for c in collectors]


@pytest.mark.parametrize("n_seq", [1, 3])
def test_jobs_in_slots_give_what_one_generation_gives(model, n_seq):
    """F32 numerics: a shared pass gives a single pass's logits, so every text matches exactly."""
    expected = [sequential(model, p, 12 + 7 * i) for i, p in enumerate(PROMPTS)]
    scheduler = Scheduler(loaded_for(model), n_seq=n_seq, queue_limit=16, n_threads=1, kv_type="f32", flash_attn="off")
    with running(scheduler):
        results = submit_all(scheduler, model, [12 + 7 * i for i in range(len(PROMPTS))])
        assert [text for text, _ in results] == expected
        assert all(done.generation.text == text for text, done in results)
        health = scheduler.health()
        assert health["completed"] == len(PROMPTS) and health["slots_idle"] == n_seq
        assert health["most_sequences_in_a_pass"] == n_seq  # jobs were verified together


def test_cancel_frees_the_slot_and_a_resent_conversation_reuses_its_cache(model):
    scheduler = Scheduler(loaded_for(model), n_seq=2, queue_limit=4, n_threads=1, kv_type="f32", flash_attn="off")
    with running(scheduler):
        long = Collector()
        job = job_for(model, PROMPTS[4], 200, long)  # (runs to max_tokens on this fixture)
        scheduler.submit(job)
        assert isinstance(long.events.get(timeout=60), Delta)  # it runs
        scheduler.cancel(job)
        first = Collector()
        scheduler.submit(job_for(model, PROMPTS[3], 20, first))
        text, done = first.result()
        assert done.generation.stop_reason == "max_tokens"
        health = scheduler.health()
        assert health["cancelled"] == 1 and health["slots_idle"] == 2 and health["completed"] == 1
        assert health["tokens"] == 20  # the cancelled job counts no tokens: it never finished
        # The same conversation with its reply and more: its slot's cache is reused.
        again = Collector()
        scheduler.submit(job_for(model, PROMPTS[3] + text + " and", 8, again))
        _, done_again = again.result()
        assert done_again.slot == done.slot
        assert done_again.generation.stats.prompt_reused >= len(done.generation.prompt_ids)


def test_a_long_prompt_goes_in_between_the_other_slots_passes(model):
    """A new prompt is evaluated a batch at a time, each batch between two passes of the slots
    already generating, instead of holding them up until all of it is in."""
    log: queue_module.Queue = queue_module.Queue()
    long_prompt = " ".join(PROMPTS * 4)  # ~100 tokens: 13 batches of 8
    expected = sequential(model, long_prompt, 10)
    scheduler = Scheduler(loaded_for(model), n_seq=2, queue_limit=4, n_threads=1, kv_type="f32", flash_attn="off", prefill_batch=8)
    with running(scheduler):
        scheduler.submit(job_for(model, PROMPTS[4], 200, lambda event: log.put(("running", event))))
        assert log.get(timeout=60)[0] == "running"  # it generates
        scheduler.submit(job_for(model, long_prompt, 10, lambda event: log.put(("new", event))))
        between, text = 0, []
        while True:
            who, event = log.get(timeout=120)
            if who == "running":
                between += not text
            elif isinstance(event, Delta):
                text.append(event.text)
            else:
                text.append(event.tail)
                break
        assert "".join(text) == expected  # whole batches: the numerics of one evaluation
        assert event.generation.stats.prompt_tokens == len(model.tokenize(long_prompt, add_bos=model.vocab_info().add_bos))
        assert between >= 10  # the running slot went on while the prompt went in


def test_a_long_prompt_goes_into_the_draft_models_cache_a_batch_at_a_time_too(model, draft):
    long_prompt = " ".join(PROMPTS * 4)
    expected = sequential(model, long_prompt, 10, "draft-model", draft)
    widest = []
    scheduler = draft_scheduler(model, draft, lambda requests: widest.append(max(map(len, requests.values()))), n_seq=2, prefill_batch=8)
    with running(scheduler):
        c = Collector()
        scheduler.submit(job_for(model, long_prompt, 10, c))
        text, done = c.result()
        assert text == expected
        assert done.generation.stats.drafted > 0
        assert max(widest) <= 8  # the prompt went in 8 tokens at a time, no pass wider
        assert len(widest) >= len(done.generation.prompt_ids) // 8


def test_the_queue_is_bounded_and_stop_ends_running_and_queued_jobs(model):
    scheduler = Scheduler(loaded_for(model), n_seq=1, queue_limit=1, n_threads=1)
    with running(scheduler):
        generating, queued = Collector(), Collector()
        scheduler.submit(job_for(model, PROMPTS[4], 240, generating))
        assert isinstance(generating.events.get(timeout=60), Delta)
        scheduler.submit(job_for(model, PROMPTS[1], 10, queued))
        with pytest.raises(QueueFull):
            scheduler.submit(job_for(model, PROMPTS[2], 10, Collector()))
        scheduler.stop()
        text, done = generating.result()
        assert done.generation.stop_reason == STOP_INTERRUPTED and 0 < len(done.generation.token_ids) < 240
        failed = queued.result()
        assert isinstance(failed, Failed) and failed.status == 503
        with pytest.raises(ShuttingDown):
            scheduler.submit(job_for(model, PROMPTS[2], 10, Collector()))


def test_a_job_that_fails_is_answered_and_the_loop_goes_on(model):
    scheduler = Scheduler(loaded_for(model), n_seq=1, queue_limit=4, n_threads=1)
    with running(scheduler):
        too_long = Collector()
        scheduler.submit(Job(Request([1] * 300, 5, GREEDY), emit=too_long))  # longer than the 256-token context
        failed = too_long.result()
        assert isinstance(failed, Failed) and failed.status == 400 and "context" in failed.message
        ok = Collector()
        scheduler.submit(job_for(model, PROMPTS[0], 5, ok))
        assert ok.result()[1].generation.stop_reason == "max_tokens"
        assert scheduler.health()["failed"] == 1


def test_sampled_jobs_replay_with_their_seed(model):
    sampling = SamplingParams(temperature=0.9)
    scheduler = Scheduler(loaded_for(model, draft_length=3, sampling=sampling), n_seq=1, queue_limit=4, n_threads=1)
    with running(scheduler):
        texts = []
        for _ in range(2):
            c = Collector()
            scheduler.submit(job_for(model, PROMPTS[0], 24, c, sampling=sampling, seed=5))
            text, done = c.result()
            assert done.generation.seed == 5
            texts.append(text)
        assert texts[0] == texts[1]


def test_the_rest_of_specli_imports_and_runs_without_the_server_extra():
    """Starlette and uvicorn are the `server` extra: nothing but `serve` may need them, and
    `serve` without them says how to install them, in one line, before loading anything."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['starlette'] = None; sys.modules['uvicorn'] = None\n"
        "from specli.cli.app import main\n"
        "sys.argv = ['specli'] + sys.argv[1:]; main()\n"
    )
    ok = subprocess.run([sys.executable, "-c", code, "run", "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--draft-max" in ok.stdout
    missing = subprocess.run([sys.executable, "-c", code, "serve", "--lookup"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.count("\n") == 1 and "pip install '.[server]'" in missing.stderr


def test_seed_minus_one_is_a_fresh_seed_and_other_negatives_are_refused():
    assert parse_request({"prompt": "hi", "seed": -1}, TEXT, dataclasses.replace(DEFAULTS, seed=3)).seed is None
    assert refused({"prompt": "hi", "seed": -2}).param == "seed"


def test_the_queue_bound_counts_what_waits_beyond_the_free_slots(model):
    """--queue 0 with free slots still takes requests; a burst fills the free slots first."""
    scheduler = Scheduler(loaded_for(model), n_seq=2, queue_limit=0, n_threads=1)  # (not started: nothing leaves the queue)
    try:
        scheduler.submit(job_for(model, PROMPTS[0], 5, Collector()))
        scheduler.submit(job_for(model, PROMPTS[1], 5, Collector()))
        with pytest.raises(QueueFull):
            scheduler.submit(job_for(model, PROMPTS[2], 5, Collector()))
    finally:
        scheduler.close()


def test_a_loop_that_dies_answers_every_waiting_request(model, monkeypatch):
    scheduler = Scheduler(loaded_for(model), n_seq=1, queue_limit=4, n_threads=1)
    monkeypatch.setattr(scheduler, "_assign", lambda: 1 / 0)  # a bug in the loop
    waiting = Collector()
    scheduler.submit(job_for(model, PROMPTS[0], 5, waiting))
    scheduler.start()
    try:
        failed = waiting.result(timeout=30)
        assert isinstance(failed, Failed) and failed.status == 500 and "ZeroDivisionError" in failed.message
        assert scheduler.join(30) and scheduler.broken
        with pytest.raises(ShuttingDown):
            scheduler.submit(job_for(model, PROMPTS[1], 5, Collector()))
    finally:
        scheduler.stop()
        scheduler.close()


def test_slots_with_a_draft_model_draft_in_lockstep_and_give_one_generations_text(model, draft):
    """Each round of drafting evaluates every slot's next draft token in one pass of the draft
    model's context (StepLoop's lockstep drafting); the texts stay a single generation's."""
    expected = [sequential(model, p, 10 + 6 * i, "draft-model", draft) for i, p in enumerate(PROMPTS)]
    calls = []
    scheduler = draft_scheduler(model, draft, lambda requests: calls.append(len(requests)), n_seq=3)
    with running(scheduler):
        results = submit_all(scheduler, model, [10 + 6 * i for i in range(len(PROMPTS))])
        assert [text for text, _ in results] == expected
        assert sum(done.generation.stats.drafted for _, done in results) > 0
        assert max(calls) >= 2  # some draft passes served several slots at once
