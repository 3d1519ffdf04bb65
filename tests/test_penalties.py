"""The frequency and presence penalties and the logit bias (issue 49): llama.cpp's arithmetic
(llama_sampler_penalties_apply, the logit-bias sampler ahead of the chain), applied to the
target's row at every verified position, so that speculative output keeps their law: greedy
output with every drafter equals target-only output under the same setting, and sampled output
is distributed as the target's own."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from specli.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.sampling import SamplingParams, distribution, greedy_choice, penalized_row, with_bias
from specli.decoding.step import SpeculativeDecoder
from specli.errors import SettingError
from specli.server import protocol
from specli.server.protocol import ApiError
from stats_check import chi_square_p_value

PROMPT = "Once upon a time, in a small village, there lived"


# --- the arithmetic ------------------------------------------------------------------------------------
def test_the_penalties_are_llama_cpps_per_distinct_token_with_its_count():
    row = np.array([2.0, -1.0, 0.5, 3.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=0, repeat_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5, repeat_last_n=4)
    history = [9, 0, 1, 1, 1, 3]  # the window: 1, 1, 1, 3 (9 is outside the vocabulary, 0 outside the window)
    out = penalized_row(row, params, history[:-4], history[-4:])
    assert out.dtype == np.float32
    expected = [2.0, -1.0 * 2.0 - 3 * 0.25 - 0.5, 0.5, 3.0 / 2.0 - 1 * 0.25 - 0.5, 0.0]
    assert out.tolist() == pytest.approx(expected)
    assert row.tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # (never modified: it may be llama.cpp's buffer)


def test_the_bias_comes_first_and_minus_infinity_bans_a_token():
    row = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    params = SamplingParams(temperature=0, logit_bias=with_bias({2: -math.inf, 0: 1.5}), presence_penalty=1.0)
    assert greedy_choice(row, params, []) == 0  # (2 banned; 0 lifted to 2.5 over 1's 2.0)
    assert greedy_choice(row, params, [0]) == 1  # (the presence penalty acts on the biased 2.5: 1.5)
    sampled = distribution(row, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias=with_bias({2: -math.inf})))
    assert sampled[2] == 0.0 and sampled[0] + sampled[1] == pytest.approx(1.0)
    assert SamplingParams(temperature=0, logit_bias=with_bias({7: 1.0})).validate()  # (an id past a row is ignored there)
    assert penalized_row(row, SamplingParams(logit_bias=((7, 1.0),)), []).tolist() == row.tolist()


@pytest.mark.parametrize("field,value", [("frequency_penalty", math.nan), ("presence_penalty", math.inf), ("logit_bias", ((2, 1.0), (1, 1.0))),
                                         ("logit_bias", ((-1, 1.0),)), ("logit_bias", ((1, math.inf),)), ("logit_bias", ((1, math.nan),))])
def test_bad_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(SettingError) as caught:
        SamplingParams(**{field: value}).validate()
    assert caught.value.setting == field


class Vocab:
    n_vocab = 100

    def tokenize(self, text, add_bos=False):
        return [ord(c) % 100 for c in text]

    def eog_tokens(self):
        return (1, 2)


def test_logit_bias_reads_openais_and_llama_servers_forms():
    parse = protocol.parse_logit_bias
    assert parse({"5": 1.5, "7": -100}, Vocab()) == {5: 1.5, 7: -100.0}
    assert parse([[5, 2], [5, 1], ["ab", False]], Vocab()) == {5: 3.0, 97: -math.inf, 98: -math.inf}  # (twice: summed; a text: its tokens)
    assert parse(None, Vocab()) == {} and parse({}, Vocab()) == {}
    for value in ({"100": 1}, {"-1": 1}, {"5": "x"}, {"5": math.inf}, {"5": True}, [[5]], "5", {"text": 1.0}):
        with pytest.raises(ApiError) as caught:
            parse(value, Vocab() if value != {"text": 1.0} else None)
        assert caught.value.status == 400 and caught.value.param == "logit_bias", value
    sampling = protocol.request_sampling({"ignore_eos": True, "logit_bias": {"3": 2}}, SamplingParams(), {"presence_penalty": 0.5}, Vocab())
    assert sampling.logit_bias == ((1, -math.inf), (2, -math.inf), (3, 2.0)) and sampling.presence_penalty == 0.5


def test_openai_penalty_fields_are_taken_by_chat_and_completions():
    req = protocol.parse_request({"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -0.25, "logit_bias": {"3": -5}}, protocol.TEXT,
                                 SamplingParams(), Vocab())
    assert (req.sampling.presence_penalty, req.sampling.frequency_penalty, req.sampling.logit_bias) == (0.5, -0.25, ((3, -5.0),))
    with pytest.raises(ApiError) as caught:
        protocol.parse_request({"prompt": "hi", "presence_penalty": "lots"}, protocol.TEXT, SamplingParams())
    assert caught.value.param == "presence_penalty"


# --- under speculation ----------------------------------------------------------------------------------
def test_greedy_output_with_penalties_and_a_bias_is_target_only_output_with_every_drafter(perturbed):
    target, draft = perturbed
    ids = target.tokenize(PROMPT)
    plain = generate(SpeculativeDecoder(target, None, 0), Request(ids, max_tokens=60)).run()
    banned = Counter(plain.token_ids).most_common(1)[0][0]
    settings = [
        SamplingParams(temperature=0.0, frequency_penalty=0.8, repeat_last_n=64),
        SamplingParams(temperature=0.0, presence_penalty=1.5, repeat_last_n=32),
        SamplingParams(temperature=0.0, logit_bias=with_bias({banned: -math.inf})),
        SamplingParams(temperature=0.0, repeat_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.3, logit_bias=with_bias({banned: -2.0})),
    ]
    for sampling in settings:
        reference = generate(SpeculativeDecoder(target, None, 0, sampling), Request(ids, max_tokens=60)).run()
        assert reference.token_ids != plain.token_ids, sampling  # (the setting really changed the choices)
        if sampling.logit_bias and sampling.logit_bias[0][1] == -math.inf:
            assert banned not in reference.token_ids
        accepted = 0
        for drafter in (DraftModelDrafter(draft), PromptLookupDrafter(ngram_max=3, ngram_min=1)):
            gen = generate(SpeculativeDecoder(target, drafter, 4, sampling), Request(ids, max_tokens=60)).run()
            assert gen.token_ids == reference.token_ids, sampling
            accepted += gen.stats.accepted
        assert accepted > 0


@pytest.mark.slow
def test_sampled_with_a_penalty_and_a_bias_the_draft_model_keeps_the_targets_law(perturbed):
    """The second token's law (its row sees the first token through the penalty) under the draft
    model, against the target's own distribution for each first token."""
    target, draft = perturbed
    ids = target.tokenize(PROMPT)
    target.reset()
    row = target.eval(ids, logits="last")[-1].copy()
    target.reset()
    top = int(np.argmax(row))
    second = int(np.argsort(row)[-2])
    # (the bias lifts the runner-up over the best; the penalty hits the prompt's tokens, some in the top 8)
    sampling = SamplingParams(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0, presence_penalty=2.0, repeat_last_n=64,
                              logit_bias=with_bias({second: 1.0, top: -0.5}))
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft), 3, sampling)
    n = 1500
    firsts = []
    for seed in range(n):
        gen = generate(decoder, Request(ids, max_tokens=3, seed=seed)).run()  # (the first token: a draft verified or resampled)
        firsts.append(gen.token_ids[0])
    p = distribution(row, sampling, ids)
    counts = Counter(firsts)
    assert set(counts) <= {int(t) for t in p.ids}
    assert chi_square_p_value(counts, {int(t): float(q) for t, q in zip(p.ids, p.probs)}, n) > 1e-3


def test_the_commands_take_llama_cpps_spellings(pair_perturbed):
    import json

    from fixtures.cli import assert_one_line_error, specli

    target = str(pair_perturbed[0])
    args = ("run", PROMPT, "-m", target, "--max-tokens", "12", "--temperature", "0", "--json", "-q", "--lookup")
    plain = json.loads(specli(*args).stdout)
    first = plain["token_ids"][0]
    banned = json.loads(specli(*args, "-l", f"{first}-inf", "--logit-bias", f"{plain['token_ids'][1]}+0.5", "--presence-penalty", "0.4",
                               "--frequency-penalty", "0.2").stdout)
    assert first not in banned["token_ids"]
    assert banned["sampling"]["logit_bias"] == {str(first): None, str(plain["token_ids"][1]): 0.5}  # (null: -inf, banned)
    assert banned["sampling"]["presence_penalty"] == 0.4 and banned["sampling"]["frequency_penalty"] == 0.2
    for bad in ("12", "x+1", "12+inf", "12-nan"):
        assert_one_line_error(specli(*args, "-l", bad), 2, "--logit-bias", "TOKEN_ID+BIAS")
    assert_one_line_error(specli(*args, "--presence-penalty", "nan"), 2, "--presence-penalty")
