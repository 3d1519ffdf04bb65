"""The draft-then-verify loop on generated F32 models: exactness, cache bookkeeping, stops."""

from __future__ import annotations

import pytest

from conftest import load
from fixtures import synthetic
from fixtures.clock import VirtualClock
from specli.decoding.drafters import DraftModelDrafter, HybridDrafter, PromptLookupDrafter
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.policy.adaptive import AdaptivePolicy, StepReport
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.decoding.step import SpeculativeDecoder
from specli.errors import IncompatibleDraftError, UsageError
from specli.llama.model import LlamaModel
from specli.modes import AUTO_MAX_DRAFT, DraftLength
from specli.session.loading import ModelChoice, plan
from specli.session.loading import load as load_plan

N_VALUES = ["auto", 1, 2, 3, 5, 8, 12]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, in a small village, there lived",
    "café 日本 😀 – numbers 1 2 3",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def truncated(pair_truncated):
    target, draft = load(pair_truncated[0]), load(pair_truncated[1])
    yield target, draft
    target.close(), draft.close()


def target_only(model_tgt, prompt_ids, max_tokens=MAX_TOKENS):
    return generate(SpeculativeDecoder(model_tgt, None, 0), Request(prompt_ids, max_tokens=max_tokens)).run()


@pytest.mark.parametrize("pair_name", ["perturbed", "truncated"])
@pytest.mark.parametrize("n_draft", N_VALUES)
def test_draft_model_output_equals_target_only(request, monkeypatch, pair_name, n_draft):
    model_tgt, model_dft = request.getfixturevalue(pair_name)
    if n_draft == "auto":  # (costs where drafting pays, on any machine: auto drafts, and is refused)
        clock = VirtualClock(monkeypatch)
        clock.charge(model_tgt)
        clock.charge(model_dft, scale=0.1)
    drafted = accepted = 0
    for prompt in PROMPTS:
        ids = model_tgt.tokenize(prompt)
        reference = target_only(model_tgt, ids)
        gen = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), n_draft), Request(ids, max_tokens=MAX_TOKENS)).run()
        assert gen.token_ids == reference.token_ids, (prompt, n_draft)
        assert gen.text == reference.text
        drafted += gen.stats.drafted
        accepted += gen.stats.accepted
    # The test only means something if drafts were both accepted and rejected. (With auto the
    # weak truncated draft, whose drafts cost about a target pass, is rightly given up after
    # a few rejections and re-probed: rejected drafts only.)
    assert drafted > 0 and accepted < drafted
    if not (n_draft == "auto" and pair_name == "truncated"):
        assert accepted > 0


@pytest.mark.parametrize("n_draft", N_VALUES)
def test_lookup_output_equals_target_only(perturbed, monkeypatch, n_draft):
    model_tgt, _ = perturbed
    if n_draft == "auto":
        VirtualClock(monkeypatch).charge(model_tgt)
    drafted = accepted = 0
    for prompt in PROMPTS:
        ids = model_tgt.tokenize(prompt)
        reference = target_only(model_tgt, ids, max_tokens=80)
        # Short keys: random fixture text rarely repeats 6-grams, and rejections must happen too.
        drafter = PromptLookupDrafter(ngram_max=3, ngram_min=1)
        gen = generate(SpeculativeDecoder(model_tgt, drafter, n_draft), Request(ids, max_tokens=80)).run()
        assert gen.token_ids == reference.token_ids, (prompt, n_draft)
        drafted += gen.stats.drafted
        accepted += gen.stats.accepted
    assert drafted > 0 and 0 < accepted < drafted


@pytest.mark.parametrize("n_draft", ["auto", 3, 8])
def test_hybrid_output_equals_target_only_and_uses_both_sources(perturbed, n_draft):
    model_tgt, model_dft = perturbed
    by_source: dict[str, list[int]] = {}
    for prompt in PROMPTS:
        ids = model_tgt.tokenize(prompt)
        reference = target_only(model_tgt, ids, max_tokens=80)
        drafter = HybridDrafter(PromptLookupDrafter(ngram_max=3, ngram_min=2), DraftModelDrafter(model_dft))
        gen = generate(SpeculativeDecoder(model_tgt, drafter, n_draft), Request(ids, max_tokens=80)).run()
        assert gen.token_ids == reference.token_ids, (prompt, n_draft)
        for source, (d, a) in gen.stats.by_source.items():
            by_source.setdefault(source, [0, 0])
            by_source[source][0] += d
            by_source[source][1] += a
    # auto may rightly drop a source that does not pay (the timings decide), so only fixed
    # lengths must use both; any drafting at all makes the exactness check meaningful.
    assert sum(d for d, _ in by_source.values()) > 0
    if n_draft != "auto":
        assert set(by_source) == {"lookup", "draft-model"}, by_source
        assert all(d > 0 for d, _ in by_source.values())


@pytest.mark.parametrize("n_draft", [1, 4, 12])
def test_draft_identical_to_target_is_accepted_fully(pair_identical, n_draft):
    model_tgt, model_dft = load(pair_identical[0]), load(pair_identical[1])
    try:
        ids = model_tgt.tokenize(PROMPTS[0])
        gen = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), n_draft), Request(ids, max_tokens=60)).run()
        assert gen.stats.drafted > 0
        assert gen.stats.accepted == gen.stats.drafted
        # Every pass emits all of its drafts plus one (the last pass may be cut by max_tokens).
        assert gen.stats.target_passes == -(-60 // (n_draft + 1))
    finally:
        model_tgt.close(), model_dft.close()


def test_caches_hold_exactly_the_context_after_every_step(perturbed):
    model_tgt, model_dft = perturbed
    ids = model_tgt.tokenize(PROMPTS[2])
    drafter = DraftModelDrafter(model_dft)
    evaluated = []
    original_eval = model_dft.eval

    def counting_eval(tokens, **kwargs):
        evaluated.append(len(tokens))
        return original_eval(tokens, **kwargs)

    model_dft.eval = counting_eval
    try:
        gen = generate(SpeculativeDecoder(model_tgt, drafter, 4), Request(ids, max_tokens=MAX_TOKENS))
        steps = 0
        for _ in gen:
            steps += 1
            if gen.stop_reason is None:
                context = ids + gen.token_ids
                # Target: everything but the newest token, which starts the next pass.
                assert model_tgt.cached == context[:-1]
                # Draft: accepted text only, lacking at most the tokens it never evaluated (the
                # target's own token, and the last draft after a full accept).
                assert model_dft.cached == context[: len(model_dft.cached)]
                assert len(model_dft.cached) >= len(context) - 2
        assert steps == gen.stats.target_passes
    finally:
        del model_dft.eval
    # Per step the draft model evaluates at most the k-1 drafts it extends plus 2 catch-up
    # tokens (the last draft and the target's token after a full accept); the prompt once.
    assert sum(evaluated) <= len(ids) + gen.stats.target_passes * (4 - 1 + 2)


@pytest.mark.parametrize("drafting", ["target-only", "lookup", "draft-model"])
def test_the_first_tokens_come_from_the_pass_that_ends_the_prompt(perturbed, drafting):
    """As llama-server: no pass of its own for the first token. The prompt's end, `last` and the
    first draft go in one target pass (logits only for `last` and the drafts); the output is
    the same as target-only's, and a prompt longer than a pass goes in whole passes first."""
    model_tgt, model_dft = perturbed
    ids = model_tgt.tokenize(PROMPTS[1] * 3)
    drafter = {"target-only": None, "lookup": PromptLookupDrafter(), "draft-model": DraftModelDrafter(model_dft)}[drafting]
    reference = target_only(model_tgt, ids)
    passes = []
    original_eval = model_tgt.eval
    model_tgt.eval = lambda tokens, **kw: (tokens and passes.append((len(tokens), kw.get("logits")))) or original_eval(tokens, **kw)
    try:
        model_tgt.reset()
        gen = generate(SpeculativeDecoder(model_tgt, drafter, 4), Request(ids, max_tokens=MAX_TOKENS))
        first = next(iter(gen))
        assert first.tokens and passes == [(len(ids) + first.n_drafted, first.n_drafted + 1)]
        gen.run()
        assert gen.token_ids == reference.token_ids
        assert len(passes) == gen.stats.target_passes
    finally:
        del model_tgt.eval


def test_a_prompt_longer_than_a_pass_goes_in_whole_passes_first(pair_perturbed):
    """The prompt's whole batches first, its rest with `last` and the first draft."""
    model_tgt = LlamaModel(pair_perturbed[0], n_ctx=512, n_batch=32, n_threads=2, kv_type="f32", flash_attn="off")
    try:
        ids = model_tgt.tokenize(PROMPTS[2] * 6)
        assert len(ids) - 1 > 2 * model_tgt.n_batch and (len(ids) - 1) % model_tgt.n_batch
        reference = target_only(model_tgt, ids)
        model_tgt.reset()
        passes = []
        original_eval = model_tgt.eval
        model_tgt.eval = lambda tokens, **kw: (tokens and passes.append((len(tokens), kw.get("logits")))) or original_eval(tokens, **kw)
        gen = generate(SpeculativeDecoder(model_tgt, PromptLookupDrafter(), 4), Request(ids, max_tokens=MAX_TOKENS))
        step = next(iter(gen))
        n_tail = (len(ids) - 1) % model_tgt.n_batch
        assert passes == [(len(ids) - 1 - n_tail, "none"), (n_tail + 1 + step.n_drafted, step.n_drafted + 1)]
        assert gen.run().token_ids == reference.token_ids
    finally:
        model_tgt.close()


def test_a_draft_cache_far_behind_starts_over_on_a_window(perturbed):
    model_tgt, model_dft = perturbed
    drafter = DraftModelDrafter(model_dft)
    prompt = model_tgt.tokenize(PROMPTS[0])
    drafter.begin(prompt)
    # 100 tokens of plain decoding later (the draft model saw none of them), and no time has
    # passed: catching up on them would cost more than CATCH_UP_SHARE of it.
    context = prompt + [(7 * i) % 500 + 10 for i in range(100)]
    evaluated = []
    original_eval = model_dft.eval
    model_dft.eval = lambda tokens, **kw: evaluated.append(len(tokens)) or original_eval(tokens, **kw)
    try:
        proposal = drafter.propose(context, 3)
    finally:
        del model_dft.eval
    window = [context[0], *context[-DraftModelDrafter.CATCH_UP_LIMIT :]]
    assert len(proposal.tokens) == 3
    assert model_dft.cached[: len(window)] == window  # BOS and the last 16 tokens, not all 100 missed
    assert evaluated[0] <= len(window)  # (BOS may still be cached) not the 100 tokens missed
    # Later proposals extend the same window incrementally.
    drafter.update(3, 1)
    context = context + proposal.tokens[:1] + [11]
    drafter.propose(context, 2)
    assert model_dft.cached[: len(window) + 2] == [*window, proposal.tokens[0], 11]


def test_a_draft_cache_catches_up_in_full_when_that_is_cheap_next_to_the_plain_steps(perturbed):
    model_tgt, model_dft = perturbed
    drafter = DraftModelDrafter(model_dft)
    prompt = model_tgt.tokenize(PROMPTS[0])
    drafter.begin(prompt)  # a batch pass over the prompt: the draft model's batch speed
    context = prompt + [(7 * i) % 500 + 10 for i in range(100)]
    drafter._last_call -= 60.0  # the 100 plain steps took a minute: a 100-token batch is cheap
    proposal = drafter.propose(context, 3)
    assert len(proposal.tokens) == 3
    assert model_dft.cached[: len(context)] == context  # all of it, no window
    assert proposal.first_s is None  # a catch-up is no measure of a step's start-up cost


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_confidence_steers_auto_in_greedy_decoding_only(perturbed, temperature):
    model_tgt, model_dft = perturbed
    asked = []

    class Recording(AdaptivePolicy):
        def keep(self, source, position, confidence):
            asked.append(confidence)
            return super().keep(source, position, confidence)

    policy = Recording(8)
    for _ in range(2):  # the plain steps that measure plain decoding
        policy.observe(StepReport(None, 0, 0, None, 0.0, 1, 1e-3))
    drafter = DraftModelDrafter(model_dft)
    prompt = model_tgt.tokenize(PROMPTS[0])
    sampling = GREEDY if temperature == 0 else SamplingParams(temperature=temperature, seed=1)
    drafter.begin(prompt, sampling)
    proposal = drafter.propose(prompt, 4, policy)
    if temperature == 0:
        assert proposal.confidences is not None and len(asked) >= len(proposal.tokens) > 0
        assert all(0 < c <= 1 for c in asked)
    else:  # a sampled draft is judged on the acceptance per position alone
        assert proposal.confidences is None and asked == [] and len(proposal.tokens) > 0
        assert proposal.q_rows is not None and len(proposal.q_rows) == len(proposal.tokens)


def test_the_engine_tells_auto_the_loops_time_between_passes(perturbed):
    model_tgt, model_dft = perturbed
    gaps = []

    class Recording(AdaptivePolicy):
        def observe(self, step):
            gaps.append(step.gap_s)
            super().observe(step)

    decoder = SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), DraftLength.auto())
    decoder.policy = decoder.judge = Recording(AUTO_MAX_DRAFT)
    prompt = model_tgt.tokenize(PROMPTS[0])
    for _ in range(2):  # each generation starts afresh: its first two steps report no gap
        start = len(gaps)
        gen = generate(decoder, Request(prompt, max_tokens=24))
        steps = sum(1 for _ in gen)
        assert len(gaps) - start == steps >= 4
        assert gaps[start : start + 2] == [None, None]
        assert all(gap is not None and 0 <= gap < 1.0 for gap in gaps[start + 2 :])
    assert decoder.policy.plain_gap_s is not None or decoder.policy.draft_gap_s is not None


def test_context_full_stops_cleanly(pair_perturbed):
    model_tgt, model_dft = load(pair_perturbed[0], n_ctx=64), load(pair_perturbed[1], n_ctx=64)
    try:
        ids = model_tgt.tokenize(PROMPTS[2])
        gen = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 5), Request(ids, max_tokens=500)).run()
        assert gen.stop_reason == "context_full"
        assert len(ids) + len(gen.token_ids) == model_tgt.n_ctx  # llama.cpp may round the size up
        reference = generate(SpeculativeDecoder(model_tgt, None, 0), Request(ids, max_tokens=500)).run()
        assert reference.stop_reason == "context_full"
        assert reference.token_ids == gen.token_ids
    finally:
        model_tgt.close(), model_dft.close()


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_is_exact(perturbed, max_tokens):
    model_tgt, model_dft = perturbed
    ids = model_tgt.tokenize(PROMPTS[0])
    gen = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 5), Request(ids, max_tokens=max_tokens)).run()
    assert len(gen.token_ids) == max_tokens
    assert gen.stop_reason == "max_tokens"


def test_end_of_generation_token_stops_and_is_not_emitted(perturbed, monkeypatch):
    model_tgt, model_dft = perturbed
    ids = model_tgt.tokenize(PROMPTS[0])
    reference = target_only(model_tgt, ids)
    stop_token = reference.token_ids[6]
    first = reference.token_ids.index(stop_token)
    monkeypatch.setattr(model_tgt, "is_eog", lambda token: token == stop_token)
    gen = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 5), Request(ids, max_tokens=MAX_TOKENS)).run()
    assert gen.stop_reason == "eos"
    assert gen.token_ids == reference.token_ids[:first]


def test_plain_decoding_reads_one_token_per_pass_when_it_ends_at_eos(perturbed, monkeypatch):
    """The pass that makes the end-of-generation token counts, and so does that token: plain
    decoding reads exactly 1.0 tokens per pass, and drafting 1 + accepted / passes."""
    model_tgt, model_dft = perturbed
    ids = model_tgt.tokenize(PROMPTS[0])
    stop_token = target_only(model_tgt, ids).token_ids[9]
    monkeypatch.setattr(model_tgt, "is_eog", lambda token: token == stop_token)
    plain = target_only(model_tgt, ids)
    assert plain.stop_reason == "eos" and plain.stats.n_tokens < plain.stats.target_passes
    assert plain.stats.mean_tokens_per_pass == 1.0
    st = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 4), Request(ids, max_tokens=MAX_TOKENS)).run().stats
    assert st.mean_tokens_per_pass == pytest.approx(1 + st.accepted / st.target_passes)


def test_a_reply_made_by_the_prompts_pass_alone_has_no_decoding_speed(perturbed):
    """A one-token reply comes out of the pass that finished the prompt (prompt time): it has
    no decoding speed (was: a token over ~0 s, a million tokens per second)."""
    model_tgt, _ = perturbed
    ids = model_tgt.tokenize(PROMPTS[0])
    model_tgt.reset()  # (a prompt already in the cache leaves the first pass none of it: a decoding pass)
    one = generate(SpeculativeDecoder(model_tgt, None, 0), Request(ids, max_tokens=1)).run().stats
    assert one.n_tokens == 1 and one.tokens_per_s is None and one.to_dict()["tokens_per_s"] is None
    model_tgt.reset()
    more = generate(SpeculativeDecoder(model_tgt, None, 0), Request(ids, max_tokens=8)).run().stats
    assert more.prompt_reused == 0
    assert more.tokens_per_s == pytest.approx(7 / more.generation_s)  # the 7 tokens decoded after the prompt's pass


def test_prompt_errors(perturbed):
    model_tgt, _ = perturbed
    decoder = SpeculativeDecoder(model_tgt, PromptLookupDrafter(), 5)
    with pytest.raises(UsageError, match="empty"):
        generate(decoder, Request([], max_tokens=5))
    with pytest.raises(UsageError, match="raise n_ctx"):
        generate(decoder, Request([5] * model_tgt.n_ctx, max_tokens=5))
    with pytest.raises(UsageError, match="draft_length must be 'auto' or between 1 and 64"):
        SpeculativeDecoder(model_tgt, PromptLookupDrafter(), 0)


def test_interrupt_keeps_what_was_produced(perturbed):
    model_tgt, model_dft = perturbed
    ids = model_tgt.tokenize(PROMPTS[0])
    gen = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 3), Request(ids, max_tokens=MAX_TOKENS))
    for step_no, _ in enumerate(gen):
        if step_no == 2:
            break
    gen.interrupt()
    assert gen.stop_reason == "interrupted"
    assert 0 < len(gen.token_ids) < MAX_TOKENS
    assert gen.text  # what was produced is kept, text included


@pytest.mark.parametrize("variant, expected", [
    ("renamed", "disagree on token"),
    ("small", "differ in size"),
    ("eos", "different EOS"),
])
def test_incompatible_draft_is_refused_before_generating(fixture_dir, pair_perturbed, variant, expected):
    bad_draft = synthetic.make_incompatible_draft(fixture_dir, variant)
    choice = ModelChoice(model=str(pair_perturbed[0]), draft=str(bad_draft), n_ctx=128)
    with pytest.raises(IncompatibleDraftError, match=expected):
        load_plan(plan(choice), choice)


def test_padded_vocabulary_is_compatible(fixture_dir, pair_perturbed):
    """A draft with 16 unused tokens appended loads as the target's drafter, and both models
    read and write text alike."""
    from fixtures.helpers import detokenize

    draft = synthetic.make_incompatible_draft(fixture_dir, "padded")
    choice = ModelChoice(model=str(pair_perturbed[0]), draft=str(draft), n_ctx=128)
    loaded = load_plan(plan(choice), choice)
    try:
        model_tgt, model_dft = loaded.model_tgt, loaded.model_dft
        assert (loaded.plan.mode, model_tgt.path, model_dft.path) == ("draft-model", pair_perturbed[0], draft)
        assert loaded.decoder.drafter.model_dft is model_dft
        assert model_tgt.n_ctx == model_dft.n_ctx == 256  # -c 128, padded by llama.cpp to a multiple of 256
        assert model_dft.n_vocab == model_tgt.n_vocab + 16
        assert model_dft.token_text(model_tgt.n_vocab) == b"<unused0>"
        for prompt in PROMPTS:
            ids = model_tgt.tokenize(prompt)
            assert ids[0] == model_tgt.vocab_info().bos and model_dft.tokenize(prompt) == ids
            # The SPM tokenizer puts a space before the text; BOS renders empty.
            assert detokenize(model_tgt.piece, ids) == detokenize(model_dft.piece, ids) == " " + prompt
    finally:
        loaded.close()


def test_recurrent_target_is_refused(fixture_dir):
    path = synthetic.make_recurrent_model(fixture_dir / "mamba.gguf")
    choice = ModelChoice(model=str(path), lookup=True, n_ctx=128)
    with pytest.raises(UsageError, match="recurrent or hybrid"):
        load_plan(plan(choice), choice)


def test_greedy_with_repeat_penalty_is_exact_and_applies_the_penalty(perturbed):
    from specli.decoding.sampling import SamplingParams

    model_tgt, model_dft = perturbed
    ids = model_tgt.tokenize(PROMPTS[2])
    penalized = SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=64)
    plain = target_only(model_tgt, ids, max_tokens=60)
    reference = generate(SpeculativeDecoder(model_tgt, None, 0, penalized), Request(ids, max_tokens=60)).run()
    for drafter in (DraftModelDrafter(model_dft), PromptLookupDrafter(ngram_max=3, ngram_min=1)):
        gen = generate(SpeculativeDecoder(model_tgt, drafter, 4, penalized), Request(ids, max_tokens=60)).run()
        assert gen.token_ids == reference.token_ids
    assert reference.token_ids != plain.token_ids  # the penalty really changed the choices


def test_streamed_text_is_the_detokenized_output(perturbed):
    """Step texts, joined, equal detokenizing all tokens at once (split characters included)."""
    from fixtures.helpers import detokenize

    model_tgt, model_dft = perturbed
    for prompt in PROMPTS:
        ids = model_tgt.tokenize(prompt)
        gen = generate(SpeculativeDecoder(model_tgt, DraftModelDrafter(model_dft), 5), Request(ids, max_tokens=80))
        streamed = "".join(step.text for step in gen)
        assert gen.text.startswith(streamed)  # the rest was held back for an incomplete character
        assert gen.text == detokenize(model_tgt.piece, gen.token_ids)
    byte_tokens = [t for t in range(model_tgt.n_vocab) if model_tgt.token_text(t).startswith(b"<0x")]
    assert byte_tokens  # the fixture vocabulary has byte fallback, so characters can be split


def test_make_drafter_builds_every_mode_and_a_new_drafter_each_call():
    from specli.decoding.drafters import MODES, make_drafter

    model_dft = object()  # (drafters only keep it until they draft)
    assert make_drafter("target-only") is None
    assert isinstance(make_drafter("lookup"), PromptLookupDrafter)
    assert make_drafter("lookup") is not make_drafter("lookup")
    draft = make_drafter("draft-model", model_dft)
    assert isinstance(draft, DraftModelDrafter) and draft.model_dft is model_dft
    hybrid = make_drafter("hybrid", model_dft)
    assert isinstance(hybrid, HybridDrafter) and hybrid.draft.model_dft is model_dft
    assert {(d.name if d else "target-only") for d in (make_drafter(m, model_dft) for m in MODES)} == set(MODES)
    for mode, model in (("draft-model", None), ("hybrid", None), ("ngram", model_dft)):
        with pytest.raises(ValueError):
            make_drafter(mode, model)


def test_a_draft_model_the_policy_set_aside_does_not_read_the_next_prompt(perturbed, monkeypatch):
    # A server or a chat keeps its policy between generations. Once the policy has found that
    # the draft model cannot pay (it waits for a re-timing), the next request's prompt is not
    # read into the draft model's cache (on a CPU that read cost 0.4 s a request on the real
    # pair, for drafts never made); the output stays the target's.
    model_tgt, model_dft = perturbed
    clock = VirtualClock(monkeypatch)
    clock.charge(model_tgt)
    clock.charge(model_dft, scale=0.1)
    drafter = DraftModelDrafter(model_dft)
    decoder = SpeculativeDecoder(model_tgt, drafter, "auto")
    first, second = (model_tgt.tokenize(p) for p in PROMPTS[:2])
    generate(decoder, Request(first, max_tokens=MAX_TOKENS)).run()
    state = decoder.policy.source(drafter.name)
    for resting in (False, True):
        state.recheck_in = 100 if resting else None
        model_dft.reset()
        gen = generate(decoder, Request(second, max_tokens=8))
        gen.run()
        assert gen.token_ids == target_only(model_tgt, second, max_tokens=8).token_ids
        read = model_dft.cached[: len(second) - 1] == second[:-1]
        assert read is not resting, resting
