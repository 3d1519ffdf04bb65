"""llama-server's own endpoints, which editors and tools call besides the OpenAI routes:

- POST /infill: fill-in-the-middle code completion (llama.vscode, llama.vim), with
  llama-server's request and response shapes (its /completion object, streamed as its SSE
  events), the prompt built as llama-server builds it (fim.py), and llama-server's n_indent
  and t_max_predict_ms limits (decoding/stopping.py);
- POST /tokenize, /detokenize, /apply-template; GET /props; GET /metrics (--metrics,
  Prometheus text, llama-server's `llamacpp:` names plus specli's drafting figures); GET /slots
  (--slots).

Leniency as llama-server's: unknown fields are ignored; known ones are checked (a 400 naming the
field), and the ones specli does not implement are taken at their neutral value and refused
otherwise (protocol.py's rule). app.Service serves these routes through a LlamaRoutes of its
own; what they share with the OpenAI routes (checks, jobs, events, the log) is handling.py's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from specli import __version__
from specli.constraints import Grammar
from specli.decoding.generation import Request
from specli.decoding.sampling import SamplingParams
from specli.decoding.text import TextStream
from specli.decoding.stopping import STOP_CONTEXT_FULL, LineLimits
from specli.errors import SpecliError
from specli.modes import DraftMode
from specli.llama.conversation import render_conversation
from specli.server import fim, protocol, tool_calls
from specli.server.handling import (Settings, check_key, check_model, finish_all, log_done, make_constraint, merged, read_json, sse_event, sse_response,
                                    submit, submit_all)
from specli.server.protocol import ApiError, quoted
from specli.server.scheduler import Delta, Done, Event, Failed, Scheduler

INT32_MAX = 2**31 - 1
# llama-server fields specli does not implement, with the values that mean "not used" (None
# and absent are always fine).
NEUTRAL = {
    "dry_multiplier": (0,),
    "mirostat": (0,), "typical_p": (1,), "xtc_probability": (0,), "dynatemp_range": (0,),
    "grammar": ("",), "json_schema": ({},), "lora": ([],), "n_cmpl": (1,), "n": (1,),
}
# Known fields accepted and not acted on (their types are still checked): specli's sampling
# chain is fixed (llama.cpp's default order; no "infill" sampler), one slot is as good as another.
IGNORED_BOOLS = ("timings_per_token", "return_progress", "verbose", "post_sampling_probs")
IGNORED_INTS = ("id_slot", "n_keep", "n_discard")  # (n_keep, n_discard: context shifting, which specli does not do)
LARGEST_MS = 2**53  # (a JSON number any client writes exactly)
NOT_SUPPORTED = "not_supported_error"
FIM_PRESET_CTX = 4096  # the -c of llama-server's FIM presets (--fim-qwen-1.5b-default, ...): /infill's prefix and suffix fit with room


@dataclass
class InfillRequest:
    """One checked /infill request, or /completion's (`content`: its prompt; then the prefix,
    suffix and extra context are unused)."""

    model: Optional[str]
    prefix: fim.Mixed
    suffix: fim.Mixed
    extra: list[tuple[str, str]]  # (filename, text)
    prompt: str
    n_predict: Optional[int]  # None (or -1): the server's -n; 0: the prompt and one token
    sampling: SamplingParams
    seed: Optional[int]
    stop: tuple[str, ...]
    stream: bool
    n_indent: int
    t_max_predict_ms: Optional[int]
    cache_prompt: bool
    n_cache_reuse: Optional[int]
    return_tokens: bool
    response_fields: Optional[list[str]]
    content: Optional[fim.Mixed] = None  # /completion's prompt: a text, token ids, or a mix
    contents: Optional[list] = None  # /completion's prompts, when given as a list of several (an answer each)
    n_probs: int = 0  # the log probabilities of each token and of the n_probs most likely there
    post_sampling: bool = False  # post_sampling_probs: the sampling chain's probabilities instead (prob, top_probs)
    grammar: Optional[Grammar] = None  # /completion: grammar or json_schema


# --- checking requests ------------------------------------------------------------------------------
def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {quoted(value)}", param=name)
    return value


def _int(body: dict, name: str, low: int, high: int = INT32_MAX) -> Optional[int]:
    if body.get(name) is None:
        return None
    value = protocol.number_field(body, name, int)
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high:,}, got {value}", param=name)
    return value


def _mixed(body: dict, name: str, n_vocab: int) -> fim.Mixed:
    """A text, or llama-server's list of texts and token ids."""
    value = body.get(name)
    if isinstance(value, str):
        return protocol.unicode_text(value, name)
    if isinstance(value, list) and all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in value):
        bad = next((p for p in value if isinstance(p, int) and not 0 <= p < n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"'{name}' holds token id {quoted(bad)}, not in the model's vocabulary (0..{n_vocab - 1})", param=name)
        return [protocol.unicode_text(p, name) if isinstance(p, str) else p for p in value]
    raise ApiError(400, f"'{name}' must be a string (or a list of strings and token ids), got {quoted(value)}", param=name)


def _extra(value: Any) -> list[tuple[str, str]]:
    if value is None:
        return []
    shape = 'a list of {"filename": string, "text": string} objects'
    if not isinstance(value, list):
        raise ApiError(400, f"'input_extra' must be {shape}", param="input_extra")
    chunks = []
    for i, chunk in enumerate(value):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise ApiError(400, f"input_extra[{i}] must be an object with a string 'text' ({shape})", param="input_extra")
        filename = chunk.get("filename", "tmp")  # (llama-server's name for a chunk without one)
        if not isinstance(filename, str):
            raise ApiError(400, f"input_extra[{i}]'s 'filename' must be a string", param="input_extra")
        chunks.append((protocol.unicode_text(filename, "input_extra"), protocol.unicode_text(chunk["text"], "input_extra")))
    return chunks


def _infill_stop(value: Any) -> tuple[str, ...]:
    """llama-server's `stop`: a string or a list of them; empty strings are skipped, as it does."""
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        value = [s for s in value if s] or None
    elif value == "":
        value = None
    return protocol.parse_stop(value)


def _check_neutral(body: dict) -> None:
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        # (True is not 1 here, nor 0 False: a number's field given a boolean is refused)
        if value is not None and not any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral):
            raise ApiError(400, f"'{name}' = {quoted(value)} is not supported by specli (leave it out)", param=name)


MAX_N_PROBS = 100  # /completion's n_probs, at most (each costs a look at the whole row)


def parse_completion(body: Any, defaults: SamplingParams, n_vocab: int, target=None) -> InfillRequest:
    """Check a /completion body (llama-server's native completion): `prompt` a text, token ids,
    or a mix of both; n_probs (or its alias logprobs); grammar or json_schema; the rest as
    /infill's."""
    body = _object(body)
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required (a text, a list of token ids, or a mix of both)", param="prompt")
    prompt = body["prompt"]
    # llama-server's forms: a text, a {"prompt_string": text} object, a list of ids and texts
    # (one prompt), or a list of such prompts (a list of texts is several: an answer each)
    several = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list, dict)) for p in prompt)
    prompts = list(prompt) if several else [prompt]
    if len(prompts) > protocol.MAX_CHOICES:
        raise ApiError(400, f"'prompt' holds {len(prompts):,} prompts; at most {protocol.MAX_CHOICES} in one request", param="prompt")
    contents = []
    for one in prompts:
        if isinstance(one, dict):
            if one.get("multimodal_data"):
                raise ApiError(400, "this model takes no images or audio ('multimodal_data'): send the text alone", param="prompt")
            one = one.get("prompt_string")
        content = _mixed({"prompt": one}, "prompt", n_vocab)
        if not content:
            raise ApiError(400, "the prompt is empty; give some text to continue", param="prompt")
        contents.append(content)
    constraint = {k: body[k] for k in ("json_schema", "grammar") if body.get(k) not in (None, "", {})}
    if body.get("json_schema") == {}:  # (llama-server's empty schema: any object)
        constraint["json_schema"] = {"type": "object"}
    if "json_schema" in constraint:  # (llama-server's precedence: json_schema over grammar)
        constraint.pop("grammar", None)
    grammar = protocol.parse_constraint(constraint)
    checked = {k: v for k, v in body.items() if k not in ("json_schema", "grammar")}
    req = _parse_native(checked, defaults, n_vocab, prompt="", target=target)
    # (one result is answered as an object, as llama-server answers it)
    req.content, req.contents, req.grammar = contents[0], contents if len(contents) > 1 else None, grammar
    return req


def parse_infill(body: Any, defaults: SamplingParams, n_vocab: int, target=None) -> InfillRequest:
    """Check an /infill body. `defaults`: the server's sampling (its command line)."""
    body = _object(body)
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise ApiError(400, f"'{name}' is required (the text before the cursor, and after it; \"\" for none)", param=name)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ApiError(400, f"'prompt' must be a string (it goes after the prefix), got {quoted(prompt)}", param="prompt")
    return _parse_native(body, defaults, n_vocab, prompt=prompt or "", prefix=_mixed(body, "input_prefix", n_vocab),
                         suffix=_mixed(body, "input_suffix", n_vocab), extra=_extra(body.get("input_extra")), target=target)


def _parse_native(body: dict, defaults: SamplingParams, n_vocab: int, *, prompt: str, prefix: fim.Mixed = "", suffix: fim.Mixed = "",
                  extra: Optional[list] = None, target=None) -> InfillRequest:
    """The fields /infill and /completion share (`target`: the model, for logit_bias and ignore_eos)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    _check_neutral(body)
    n_predict = None
    for name in ("n_predict", "max_tokens", "max_completion_tokens"):  # (llama-server's aliases, in its order)
        if body.get(name) is not None:
            n_predict = _int(body, name, -1)
            break
    fields = {name: protocol.number_field(body, name, kind) for name, kind in protocol.SAMPLING_FIELDS.items() if body.get(name) is not None}
    seed = protocol.number_field(body, "seed", int) if body.get("seed") is not None else defaults.seed
    if seed is not None and seed < 0:
        if seed != -1:
            raise ApiError(400, f"'seed' must be a non-negative integer (or -1 for a fresh one), got {seed}", param="seed")
        seed = None
    sampling = protocol.request_sampling(body, defaults, fields, target)
    samplers = body.get("samplers")
    if samplers is not None and not isinstance(samplers, str) and not (isinstance(samplers, list) and all(isinstance(s, str) for s in samplers)):
        raise ApiError(400, "'samplers' must be a list of sampler names or a string of sampler letters", param="samplers")
    fields_wanted = body.get("response_fields")
    if fields_wanted is not None and not (isinstance(fields_wanted, list) and all(isinstance(f, str) for f in fields_wanted)):
        raise ApiError(400, "'response_fields' must be a list of field names (such as \"content\" or \"timings/prompt_n\")", param="response_fields")
    for name in IGNORED_BOOLS:
        _bool(body, name, False)
    for name in IGNORED_INTS:
        _int(body, name, -1)
    t_max = _int(body, "t_max_predict_ms", -1, LARGEST_MS)
    n_probs = 0
    for name in ("n_probs", "logprobs"):  # (logprobs: llama-server's alias, when n_probs is not given)
        if body.get(name) is not None and body[name] is not False:
            n_probs = _int(body, name, 0, MAX_N_PROBS)
            break
    return InfillRequest(
        model=model, prefix=prefix, suffix=suffix, extra=extra or [], prompt=protocol.unicode_text(prompt, "prompt"),
        n_predict=n_predict, sampling=sampling, seed=seed, stop=_infill_stop(body.get("stop")), stream=_bool(body, "stream", False),
        n_indent=_int(body, "n_indent", 0) or 0, t_max_predict_ms=t_max if t_max is not None and t_max > 0 else None,
        cache_prompt=_bool(body, "cache_prompt", True), n_cache_reuse=_int(body, "n_cache_reuse", 0),
        return_tokens=_bool(body, "return_tokens", False), response_fields=fields_wanted or None, n_probs=n_probs,
        post_sampling=_bool(body, "post_sampling_probs", False),
    )



# --- responses ------------------------------------------------------------------------------------
def nested_fields(paths: list[str], body: dict) -> dict:
    """llama-server's response_fields: each "a/b" path's value, under the path as its key
    (paths that lead nowhere are left out)."""
    out = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def infill_timings(stats) -> dict:
    """llama-server's `timings` (protocol.timings, with its per-token times)."""
    t = protocol.timings(stats)
    # (per decoding step after the prompt's pass, whose first tokens cost no step of their own;
    # 0 where there is none: llama-server's fields are numbers, never null)
    decoded = stats.decided - stats.prompt_pass_decided
    t["prompt_per_token_ms"] = round(t["prompt_ms"] / t["prompt_n"], 3) if t["prompt_n"] else 0.0
    t["predicted_per_token_ms"] = round(t["predicted_ms"] / decoded, 3) if decoded > 0 else 0.0
    return t


def pieces_text(pieces: list[bytes]) -> str:
    return b"".join(pieces).decode("utf-8", errors="replace")


def generation_settings(sampling: SamplingParams) -> dict:
    """A sampling setting as llama-server's `params` show it (/props, /slots, /infill's
    generation_settings)."""
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
            "repeat_last_n": sampling.repeat_last_n, "repeat_penalty": sampling.repeat_penalty,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            # (llama-server's shape; a banned token's -inf is null, as its JSON writes it)
            "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in sampling.logit_bias]}


class LlamaRoutes:
    """The routes above, on the server's scheduler, target model and settings."""

    def __init__(self, scheduler: Scheduler, model, settings: Settings):
        self.scheduler, self.model, self.settings = scheduler, model, settings
        self._fim: Optional[dict] = None  # the model's FIM tokens, read at the first use
        self._special_pieces: dict[int, bytes] = {}

    # --- POST /infill -------------------------------------------------------------------------------
    async def infill(self, http: HttpRequest) -> Response:
        check_key(self.settings, http)
        body = await read_json(http)
        missing = fim.missing_tokens(self._fim_tokens())
        if missing:
            raise ApiError(400, f"{self.model.path.name} has no fill-in-the-middle tokens ({', '.join(missing)} missing): /infill needs a code "
                                "model trained for it, such as Qwen2.5-Coder; send the text to /v1/completions instead", code="infill_not_supported")
        req = parse_infill(body, self.settings.defaults, self.model.n_vocab, self.model)
        check_model(self.settings, req.model)
        prompt_ids = await run_in_threadpool(self._infill_ids, req)
        return await self._generate(http, req, prompt_ids)

    # --- POST /completion (and /completions): llama-server's native completion -----------------------
    async def completion(self, http: HttpRequest) -> Response:
        check_key(self.settings, http)
        body = await read_json(http)
        req = parse_completion(body, self.settings.defaults, self.model.n_vocab, self.model)
        check_model(self.settings, req.model)
        constraint = None if req.grammar is None else await run_in_threadpool(make_constraint, req.grammar, self.model)
        if req.contents is None:
            return await self._generate(http, req, await run_in_threadpool(self._completion_ids, req.content), constraint)
        prompts = [await run_in_threadpool(self._completion_ids, content) for content in req.contents]
        return await self._generate_each(http, req, prompts, constraint)

    async def _generate_each(self, http: HttpRequest, req: InfillRequest, prompts: list[list[int]], constraint) -> Response:
        """Several prompts in one request, as llama-server answers them: a list of final
        objects (each with its `index`), or one stream of every prompt's events. Whole greedy
        answers to the same tokens are one answer (the target's argmax: computed once)."""
        dedupe = req.sampling.greedy and not req.stream
        unique = list(dict.fromkeys(map(tuple, prompts))) if dedupe else [tuple(p) for p in prompts]
        job_of = [unique.index(tuple(p)) for p in prompts] if dedupe else list(range(len(prompts)))
        submitted = submit_all(self.scheduler, [self._request(req, list(ids), constraint) for ids in unique])
        t0 = time.perf_counter()
        if req.stream:
            streams = [sub.stream(lambda events, i=i, n=len(ids): self._infill_events(events, req, n, t0, http, index=i))
                       for i, (sub, ids) in enumerate(zip(submitted, prompts))]
            return sse_response(merged(streams))
        finished = await finish_all(submitted, http)
        if finished is None:  # the client left: nobody to answer
            return Response(status_code=499)
        return JSONResponse([self._final_body(req, finished[job_of[i]][0], http, t0, index=i) for i in range(len(prompts))])

    def _completion_ids(self, content: fim.Mixed) -> list[int]:
        """A prompt's tokens as llama-server makes them: texts with BOS first (where the model
        wants one) and control text parsed, ids as they are."""
        ids = self.model.tokenize_prompt(content) if isinstance(content, str) else fim.tokenize_mixed(
            self.model, content, add_special=self.model.vocab_info().add_bos, parse_special=True)
        protocol.check_fits(ids, self.scheduler.n_ctx, "prompt")
        return ids

    def _request(self, req: InfillRequest, prompt_ids: list[int], constraint=None) -> Request:
        if req.n_predict is None or req.n_predict == -1:
            max_tokens = self.settings.default_max_tokens or self.scheduler.n_ctx
        else:
            max_tokens = max(1, req.n_predict)  # (0: llama-server evaluates the prompt and returns the one token it makes)
        return Request(
            prompt_ids, max_tokens, req.sampling, seed=req.seed, stop=req.stop, limits=LineLimits(req.n_indent, req.t_max_predict_ms),
            fresh=not req.cache_prompt, cache_reuse=req.n_cache_reuse, constraint=constraint, logprobs=req.n_probs or None,
            post_sampling=req.post_sampling,
        )

    async def _generate(self, http: HttpRequest, req: InfillRequest, prompt_ids: list[int], constraint=None) -> Response:
        """/infill's or /completion's generation, answered in llama-server's shapes."""
        submitted = submit(self.scheduler, self._request(req, prompt_ids, constraint))
        t0 = time.perf_counter()
        if req.stream:
            return sse_response(submitted.stream(lambda events: self._infill_events(events, req, len(prompt_ids), t0, http)))
        finished = await submitted.finished(http)
        if finished is None:  # the client left: nobody to answer
            return Response(status_code=499)
        return JSONResponse(self._final_body(req, finished[0], http, t0))

    def _final_body(self, req: InfillRequest, event: Done, http: HttpRequest, t0: float, index: int = 0) -> dict:
        log_done(self.settings, self.scheduler, http, event, t0)
        gen = event.generation
        body = self._infill_final(req, event, gen.text, list(gen.token_ids) if req.return_tokens else [])
        body["index"] = index
        if gen.logprobs:
            body["completion_probabilities"] = self._probabilities(gen.token_ids, gen.logprobs, TextStream(self.model.piece), req.post_sampling)
        return nested_fields(req.response_fields, body) if req.response_fields else body

    def _probabilities(self, tokens, entries, texts: TextStream, post: bool = False) -> list[dict]:
        """llama-server's completion_probabilities: each token's id, text, bytes and logprob, and
        its top_logprobs (post: `prob` and `top_probs`, the sampling chain's probabilities)."""
        out = [protocol.logprob_entry(self.model, e, texts.feed([t]), with_id=True) for t, e in zip(tokens, entries)]
        if post:
            for entry in out:
                entry["prob"] = math.exp(entry.pop("logprob"))
                entry["top_probs"] = [{"id": a["id"], "token": a["token"], "bytes": a["bytes"], "prob": math.exp(a["logprob"])} for a in entry.pop("top_logprobs")]
        return out

    async def _infill_events(self, events: AsyncIterator[Event], req: InfillRequest, n_prompt: int, t0: float, http: HttpRequest, index: int = 0):
        """llama-server's /infill and /completion stream: a `data: {...}` event per step with its
        text (its /completion partial object, with its tokens' completion_probabilities when
        asked for), then the final object with "stop": true (its text already sent); no [DONE]."""
        n_sent = 0
        texts = TextStream(self.model.piece)
        async for event in events:
            if isinstance(event, Delta):
                n_sent += len(event.tokens)
                partial = self._infill_partial(event.text, list(event.tokens), n_sent, n_prompt, index)
                if event.logprobs:
                    partial["completion_probabilities"] = self._probabilities(event.tokens, event.logprobs, texts, req.post_sampling)
                yield sse_event(partial)
            elif isinstance(event, Failed):
                yield sse_event(ApiError(event.status, event.message).body())
            else:
                gen = event.generation
                if event.tail or gen.token_ids[n_sent:]:
                    partial = self._infill_partial(event.tail, gen.token_ids[n_sent:], len(gen.token_ids), n_prompt, index)
                    if gen.logprobs and gen.logprobs[n_sent:]:
                        partial["completion_probabilities"] = self._probabilities(gen.token_ids[n_sent:], gen.logprobs[n_sent:], texts, req.post_sampling)
                    yield sse_event(partial)
                final = dict(self._infill_final(req, event, "", []), index=index)
                yield sse_event(nested_fields(req.response_fields, final) if req.response_fields else final)
                log_done(self.settings, self.scheduler, http, event, t0)

    def _infill_ids(self, req: InfillRequest) -> list[int]:
        n_ctx, server_n = self.scheduler.n_ctx, self.settings.default_max_tokens
        # The room the extra context leaves for the completion: the tokens asked for (0: the one
        # token a warm-up makes; none: the server's -n; without -n, the rest of the context)
        n_room = max(1, req.n_predict) if req.n_predict not in (None, -1) else server_n or 1
        ids = fim.infill_prompt(
            self.model, self._fim_tokens(), prefix=req.prefix, suffix=req.suffix, extra=req.extra, prompt=req.prompt, n_ctx=n_ctx,
            n_predict=server_n or -1, n_room=n_room,
        )
        if len(ids) >= n_ctx:
            # (the extra context gave way already: what is left is the prefix, `prompt` and suffix,
            # at most fim.PREFIX_TAKE + fim.SUFFIX_TAKE + 4 tokens unless the prompt passes its share)
            n_prompt = len(self.model.tokenize(req.prompt, add_bos=False, parse_special=True)) if req.prompt else 0
            if n_prompt > fim.SUFFIX_TAKE:
                fix, param = f"send a shorter 'prompt' (it takes {n_prompt:,} tokens), or restart the server with a -c above {len(ids)}", "prompt"
            else:
                fix, param = f"restart the server with a larger -c ({FIM_PRESET_CTX}, as llama-server's FIM presets, holds any prefix and suffix)", "input_prefix"
            raise protocol.context_exceeded(
                f"the prefix, 'prompt' and suffix take {len(ids)} tokens with the FIM tokens (the prefix keeps its last "
                f"{fim.PREFIX_TAKE:,} tokens, the suffix its first {fim.SUFFIX_TAKE:,} less the 'prompt's), but a request's context "
                f"holds {n_ctx}; {fix}", param=param, n_prompt_tokens=len(ids), n_ctx=n_ctx,
            )
        return ids

    def _infill_partial(self, text: str, tokens: list[int], n_decoded: int, n_prompt: int, index: int = 0) -> dict:
        return {"index": index, "content": text, "tokens": tokens, "stop": False, "id_slot": -1, "tokens_predicted": n_decoded, "tokens_evaluated": n_prompt}

    def _infill_final(self, req: InfillRequest, event: Done, content: str, tokens: list[int]) -> dict:
        gen = event.generation
        scheduler = self.scheduler
        spec = protocol.speculative(gen.stats, mode=scheduler.mode, draft_length=scheduler.draft_length, seed=gen.seed, stop_reason=gen.stop_reason)
        settings = {
            "n_predict": -1 if req.n_predict is None else req.n_predict, "max_tokens": -1 if req.n_predict is None else req.n_predict,
            "seed": -1 if gen.seed is None else gen.seed, **generation_settings(req.sampling), "stop": list(req.stop),
            "stream": req.stream, "n_indent": req.n_indent, "t_max_predict_ms": req.t_max_predict_ms or -1,
            "cache_prompt": req.cache_prompt, "n_cache_reuse": scheduler.cache_reuse if req.n_cache_reuse is None else req.n_cache_reuse,
        }
        body = {
            "index": 0, "content": content, "tokens": tokens, "id_slot": event.slot, "stop": True, "model": self.settings.model_id,
            "tokens_predicted": len(gen.token_ids), "tokens_evaluated": len(gen.prompt_ids), "generation_settings": settings,
            "prompt": self.prompt_text(gen.prompt_ids), "has_new_line": "\n" in gen.text,
            "truncated": gen.stop_reason == STOP_CONTEXT_FULL, "stop_type": protocol.STOP_TYPES.get(gen.stop_reason, "limit"),
            "stopping_word": gen.stop_word, "tokens_cached": len(gen.prompt_ids) + max(0, len(gen.token_ids) - 1),
            "timings": infill_timings(gen.stats), "speculative": spec,
        }
        settings["n_probs"] = req.n_probs
        return body

    def _fim_tokens(self) -> dict:
        if self._fim is None:
            self._fim = self.model.fim_tokens()
        return self._fim

    def prompt_text(self, tokens: list[int]) -> str:
        """A prompt's text with its control tokens as their text (llama-server's `prompt` field)."""
        return pieces_text([self._special_piece(t) for t in tokens])

    def _special_piece(self, token: int) -> bytes:
        """The model's text of a token, control tokens included (cached: a prompt of a few
        thousand tokens is rendered in each /infill response)."""
        cache = self._special_pieces
        piece = cache.get(token)
        if piece is None:
            piece = cache[token] = self.model.special_piece(token)
        return piece

    # --- POST /tokenize, /detokenize, /apply-template ----------------------------------------------
    async def tokenize(self, http: HttpRequest) -> Response:
        check_key(self.settings, http)
        body = _object(await read_json(http))
        add_special, parse_special = _bool(body, "add_special", False), _bool(body, "parse_special", True)
        with_pieces = _bool(body, "with_pieces", False)
        if "content" not in body:
            return JSONResponse({"tokens": []})  # (llama-server's answer to no content)
        content = _mixed(body, "content", self.model.n_vocab)
        tokens = await run_in_threadpool(fim.tokenize_mixed, self.model, content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": tokens})
        out = []
        for token in tokens:
            piece = self._special_piece(token)
            try:
                shown: Any = piece.decode("utf-8")
            except UnicodeDecodeError:  # (part of a character: its bytes, as llama-server gives them)
                shown = list(piece)
            out.append({"id": token, "piece": shown})
        return JSONResponse({"tokens": out})

    async def detokenize(self, http: HttpRequest) -> Response:
        check_key(self.settings, http)
        body = _object(await read_json(http))
        # (a 16 MiB body holds millions of ids, a native call each: off the event loop, as /tokenize's)
        return await run_in_threadpool(self._detokenized, body.get("tokens", []))

    def _detokenized(self, tokens: Any) -> Response:
        n_vocab = self.model.n_vocab
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
        bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {quoted(bad)} is not in the model's vocabulary (0..{n_vocab - 1})", param="tokens")
        return JSONResponse({"content": pieces_text([self._special_piece(t) for t in tokens])})  # (rendered here too)

    async def apply_template(self, http: HttpRequest) -> Response:
        """The text /v1/chat/completions would evaluate for these messages (rendered with the
        same template and checks; tokenized, it gets BOS where the model wants one)."""
        check_key(self.settings, http)
        body = _object(await read_json(http))
        if "messages" not in body:
            raise ApiError(400, "'messages' is required", param="messages")
        req = protocol.parse_request({**body, "tools": None, "tool_choice": None}, protocol.CHAT, self.settings.defaults)
        tools = tool_calls.parse_tools(body) if body.get("tools") else None
        if self.settings.chat_problem:
            raise ApiError(400, self.settings.chat_problem, param="messages")
        try:
            text = await run_in_threadpool(lambda: render_conversation(
                self.settings.formatter, None, req.messages, tools=tools.given if tools is not None else None,
                add_assistant=req.add_assistant, continue_final=req.continue_final))
        except SpecliError as err:
            raise ApiError(400, str(err), param="messages") from None
        return JSONResponse({"prompt": text})

    # --- GET /props, /metrics, /slots --------------------------------------------------------------
    async def props(self, http: HttpRequest) -> Response:
        check_key(self.settings, http)
        s, scheduler, model = self.settings, self.scheduler, self.model
        sampling = s.defaults
        info = model.vocab_info()
        special = lambda t: pieces_text([self._special_piece(t)]) if 0 <= t < model.n_vocab else ""  # noqa: E731
        params = {
            "seed": -1 if sampling.seed is None else sampling.seed, **generation_settings(sampling),
            "n_predict": s.default_max_tokens or -1, "max_tokens": s.default_max_tokens or -1, "stream": False,
        }
        fim_ok = not fim.missing_tokens(self._fim_tokens())
        template = model.chat_template() or ""
        template = template[:-1] if template.endswith("\n") else template  # (one final newline is no part of a Jinja template's text: llama-server shows it without)
        return JSONResponse({
            "default_generation_settings": {"params": params, "n_ctx": scheduler.n_ctx}, "total_slots": len(scheduler.slots),
            "model_alias": s.model_id, "model_path": s.model_path, "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": s.slots, "endpoint_props": False, "endpoint_metrics": s.metrics,
            "chat_template": template, "bos_token": special(info.bos), "eos_token": special(info.eos),
            "build_info": f"specli {__version__}", "is_sleeping": False,
            "specli": {"version": __version__, "drafting": scheduler.mode, "draft_max": scheduler.draft_length.json_value,
                       "cache_reuse": scheduler.cache_reuse if scheduler.can_reuse else 0, "infill": fim_ok},
        })

    async def metrics(self, http: HttpRequest) -> Response:
        check_key(self.settings, http)
        if not self.settings.metrics:
            raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`", kind=NOT_SUPPORTED)
        text = prometheus_text(self.scheduler.metrics(), queue_limit=self.scheduler.queue_limit)
        response = Response(text, media_type="text/plain; version=0.0.4")
        # (in llama-server's casing: clients that read headers into a plain dict look it up so)
        response.raw_headers.append((b"Process-Start-Time-Unix", str(self.settings.created).encode()))
        return response

    async def slots(self, http: HttpRequest) -> Response:
        check_key(self.settings, http)
        if not self.settings.slots:
            raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`", kind=NOT_SUPPORTED)
        scheduler = self.scheduler
        states = scheduler.slot_states()
        if http.query_params.get("fail_on_no_slot") and not any(not state["is_processing"] for state in states):
            raise ApiError(503, "no slot available", kind="unavailable_error")
        out = []
        for state in states:
            entry = {"id": state["id"], "n_ctx": scheduler.n_ctx, "speculative": scheduler.mode != DraftMode.TARGET_ONLY,
                     "is_processing": state["is_processing"], "n_cached": state["n_cached"]}
            if state["is_processing"]:
                entry.update(
                    n_prompt_tokens=state["n_prompt_tokens"], params=generation_settings(state["sampling"]),
                    next_token=[{"has_next_token": True, "has_new_line": state["has_new_line"], "n_remain": state["n_remain"], "n_decoded": state["n_decoded"]}],
                    generated=state["generated"],
                )
            out.append(entry)
        return JSONResponse(out)


# --- /metrics -----------------------------------------------------------------------------------------
def _number_text(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "0"
    return str(round(value, 6)) if isinstance(value, float) else str(value)


def prometheus_text(m: dict, *, queue_limit: int) -> str:
    """The Prometheus text of Scheduler.metrics(): llama-server's `llamacpp:` series where it has
    one (its names and help texts), then specli's own. Averages are since the start."""
    t, counts = m["totals"], m["counts"]
    prompt_n = t.prompt_tokens - t.prompt_reused
    passes = counts["passes"]
    drafts = sum(t.draft_lengths[1:])  # passes that checked at least one draft token
    llamacpp = [
        ("counter", "prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", prompt_n),
        ("counter", "prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", t.prompt_reused),
        ("counter", "prompt_seconds_total", "Total time spent processing prompts", t.prompt_s),
        ("counter", "tokens_predicted_total", "Number of generation tokens processed", t.n_tokens),
        ("counter", "tokens_predicted_seconds_total", "Total time spent generating tokens", t.generation_s),
        ("counter", "n_decode_total", "Total number of target passes during generation (one per step, drafts included)", passes),
        ("counter", "n_tokens_max", "Largest observed sequence length (prompt + generation)", m["most_tokens"]),
        ("counter", "spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", t.drafted),
        ("counter", "spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", t.accepted),
        ("counter", "spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", drafts),
        ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_n / t.prompt_s if t.prompt_s > 0 else 0.0),
        # (Stats.tokens_per_s, as each response's timings and speculative give it; 0 before there is one)
        ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s", t.tokens_per_s or 0.0),
        ("gauge", "requests_processing", "Number of requests processing", m["processing"]),
        ("gauge", "requests_deferred", "Number of requests deferred", m["queued"]),
        ("gauge", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", m["pass_sequences"] / max(passes, 1)),
    ]
    lines: list[str] = []
    for kind, name, help_text, value in llamacpp:
        lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {_number_text(value)}"]
    if t.accepted_at:
        name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
        lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(t.accepted_at)]
    own = [
        ("counter", "requests_total", "Requests finished, by outcome", [(f'{{outcome="{k}"}}', counts[k]) for k in ("completed", "cancelled", "failed")]),
        ("gauge", "tokens_per_pass", "Generated tokens per target pass (1: drafting saved nothing)", [("", t.mean_tokens_per_pass or 0.0)]),
        ("gauge", "acceptance_rate", "Accepted draft tokens per drafted token", [("", t.acceptance_rate or 0.0)]),
        ("counter", "drafted_tokens_total", "Draft tokens checked, by drafter", [(f'{{source="{s}"}}', d) for s, (d, _) in sorted(t.by_source.items())]),
        ("counter", "accepted_tokens_total", "Draft tokens accepted, by drafter", [(f'{{source="{s}"}}', a) for s, (_, a) in sorted(t.by_source.items())]),
        ("gauge", "queue_length", "Requests waiting for a slot", [("", m["queued"])]),
        ("gauge", "queue_limit", "Requests that may wait (--queue); one more is answered 503", [("", queue_limit)]),
    ]
    for kind, name, help_text, series in own:
        lines += [f"# HELP specli:{name} {help_text}", f"# TYPE specli:{name} {kind}"]
        lines += [f"specli:{name}{labels} {_number_text(value)}" for labels, value in series]
    return "\n".join(lines) + "\n"
