"""`specli serve`'s HTTP side: the OpenAI routes on Starlette, served by uvicorn (the `server`
extra). Requests are checked here (protocol.py) and tokenized; generation happens on the
scheduler's thread, whose events come back through the event loop.

Streaming is server-sent events as the OpenAI clients read them (`data: {chunk}`, then `data:
[DONE]`). A client that leaves is noticed at once and its job cancelled (handling.py, which
llama-server's routes share). SIGINT/SIGTERM: uvicorn stops accepting, the scheduler ends the
running generations with what they have (finish_reason "length", stop_reason "interrupted")
and fails queued ones with 503, each response is completed, and the process exits 0 (with
--rpc, a pass stalled on a server is not waited for: Service.on_stop, llama/rpc.py's
stop_asked).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import sys
import time
from typing import AsyncIterator, Callable, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specli.constraints.tools import NONE, ToolConstraint, ToolFormat
from specli.decoding.generation import Request
from specli.decoding.text import TextStream
from specli.errors import SpecliError, UsageError
from specli.llama.conversation import encode_conversation
from specli.server import protocol, tool_calls
from specli.server.handling import (ClientLeft, Cors, Settings, check_key, check_model, finish_all, log_done, make_constraint, merged, read_json, sse_event,
                                    sse_response, submit_all)
from specli.server.llama_api import LlamaRoutes
from specli.server.protocol import CHAT, TEXT, ApiError
from specli.server.scheduler import Delta, Done, Event, Failed, Scheduler


class Service:
    """The OpenAI routes, and llama-server's own (`llama`: llama_api.py's), on one scheduler."""

    def __init__(self, scheduler: Scheduler, model_tgt, settings: Settings):
        self.scheduler, self.model, self.settings = scheduler, model_tgt, settings
        self.llama = LlamaRoutes(scheduler, model_tgt, settings)
        self.stopping = False
        # Called from the signal handler when a signal asks the server to stop (--rpc: a pass
        # stalled on a server is then not waited for; llama/rpc.py's stop_asked)
        self.on_stop: list[Callable[[], None]] = []
        model_tgt.longest_token_bytes()  # (a scan of the vocabulary: now, not in the first request)

    # --- routes -----------------------------------------------------------------------------------
    async def health(self, http: HttpRequest) -> Response:
        if self.stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if self.scheduler.broken:
            return JSONResponse({"status": "error", "error": self.scheduler.broken}, status_code=503)
        return JSONResponse({"status": "ok", **self.scheduler.health()})

    async def models(self, http: HttpRequest) -> Response:
        check_key(self.settings, http)
        s = self.settings
        entry = {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "specli", "aliases": s.alias_list or [s.model_id], "tags": s.tags,
                 "meta": {"n_ctx": self.scheduler.n_ctx, "drafting": self.scheduler.mode, "draft_max": self.scheduler.draft_length.json_value,
                          "parallel": len(self.scheduler.slots)}}
        return JSONResponse({"object": "list", "data": [entry]})

    async def chat(self, http: HttpRequest) -> Response:
        return await self._generate(http, CHAT)

    async def completions(self, http: HttpRequest) -> Response:
        return await self._generate(http, TEXT)

    # --- a generation -------------------------------------------------------------------------------
    async def _generate(self, http: HttpRequest, kind: str) -> Response:
        check_key(self.settings, http)
        body = body_fields = await read_json(http)
        req = protocol.parse_request(body, kind, self.settings.defaults, self.model)
        if body.get("verbose") is not None and not isinstance(body["verbose"], bool):
            raise ApiError(400, f"'verbose' must be true or false, got {protocol.quoted(body['verbose'])}", param="verbose")
        check_model(self.settings, req.model)
        tools = self._tools(body, req)
        prompt_ids, format_stop = await run_in_threadpool(self._prompt_ids, req, tools)
        max_tokens = req.max_tokens or self.settings.default_max_tokens or self.scheduler.n_ctx
        if tools is not None:
            constraint = await run_in_threadpool(self._tool_constraint, tools)
        else:
            constraint = None if req.grammar is None else await run_in_threadpool(make_constraint, req.grammar, self.model)
        request = Request(prompt_ids, max_tokens, req.sampling, seed=req.seed, stop=(*format_stop, *req.stop), constraint=constraint,
                          logprobs=req.logprobs)
        # n choices: greedy ones are one and the same text (the target's argmax: computed once,
        # answered n times); sampled ones are generations of their own, with seeds seed, seed + 1, ...
        copies = req.n if req.sampling.greedy else 1
        jobs = [request] if copies > 1 or req.n == 1 else [
            dataclasses.replace(request, seed=None if req.seed is None else req.seed + i) for i in range(req.n)]  # (a constraint is per sequence: Constraint.start)
        submitted = submit_all(self.scheduler, jobs)
        rid, t0 = protocol.new_id(kind), time.perf_counter()
        calls = self.settings.formatter.tool_format if tools is not None and tools.choice != NONE else None  # (parsed from the output)
        if req.stream:
            streams = [sub.stream(lambda events, i=i: self._chunks(events, req, rid, t0, http, calls, index=i)) for i, sub in enumerate(submitted)]
            return sse_response(self._sse(streams, req, rid, copies))
        finished = await finish_all(submitted, http, on_done=lambda event: self._log(http, event, t0))
        if finished is None:  # the client left: nobody to answer
            return Response(status_code=499)
        choices, extras = [], []
        for event, text in finished:
            finish = protocol.FINISH_REASONS.get(event.generation.stop_reason, "stop")
            message = None
            if calls is not None:
                message, called = tool_calls.message(calls, text)
                finish = "tool_calls" if called and finish == "stop" else finish
            gen = event.generation
            logprobs = None if gen.logprobs is None else self._logprobs(kind, list(gen.token_ids), gen.logprobs)
            choices.append(protocol.response_body(kind, rid, self.settings.model_id, text, finish, {}, message, logprobs)["choices"][0])
            extras.append(self._extra(event))
        choices = [dict(choices[i % len(choices)], index=i) for i in range(req.n)]
        body = protocol.response_body(kind, rid, self.settings.model_id, "", "stop", extras[0])
        if body_fields.get("verbose", self.settings.verbose) is True:  # (llama-server's debugging echo: the prompt as evaluated, the reply)
            body["__verbose"] = self._verbose(event)
        body["choices"] = choices
        if req.n > 1:
            body["usage"] = self._total_usage(extras, copies)
        return JSONResponse(body)

    def _verbose(self, event: Done) -> dict:
        """llama-server's `__verbose`: its native completion object for this reply (the prompt as
        evaluated, control tokens as their text)."""
        gen = event.generation
        return {"content": gen.text, "prompt": self.llama.prompt_text(gen.prompt_ids), "tokens_predicted": len(gen.token_ids),
                "tokens_evaluated": len(gen.prompt_ids), "stop_type": protocol.STOP_TYPES.get(gen.stop_reason, "limit"),
                "stopping_word": gen.stop_word, "timings": protocol.timings(gen.stats)}

    async def input_tokens(self, http: HttpRequest) -> Response:
        """llama-server's POST /chat/completions/input_tokens: how many tokens the conversation's
        prompt takes (rendered and checked as a chat completion's)."""
        check_key(self.settings, http)
        body = await read_json(http)
        req = protocol.parse_request(body, CHAT, self.settings.defaults, self.model)
        tools = self._tools(body, req)
        ids, _ = await run_in_threadpool(self._prompt_ids, req, tools)
        return JSONResponse({"input_tokens": len(ids)})

    @staticmethod
    def _total_usage(extras: list[dict], copies: int) -> dict:
        """The usage of n choices: the prompt once, every choice's tokens (a greedy choice
        answered n times counts n times, as n choices are billed)."""
        prompt = extras[0]["usage"]["prompt_tokens"]
        completion = copies * sum(e["usage"]["completion_tokens"] for e in extras)
        return protocol.usage(prompt, completion)

    async def _sse(self, streams: list, req: protocol.ApiRequest, rid: str, copies: int) -> AsyncIterator[str]:
        """The server-sent events of a request's choices: each choice's chunks as they come
        (several: interleaved; a greedy choice answered `copies` times: each chunk once per
        index), then the usage chunk when asked for, then [DONE]."""
        extras: list[dict] = []
        async for item in merged(streams):
            if isinstance(item, _Finished):
                extras.append(item.extra)
                continue
            choices = item.get("choices")
            if copies > 1 and choices:
                for i in range(copies):
                    yield sse_event({**item, "choices": [dict(choices[0], index=i)]})
            else:
                yield sse_event(item)
        if req.include_usage and extras:  # usage once, in its own last chunk (as OpenAI sends it)
            model, created = self.settings.model_id, int(time.time())
            extra = dict(extras[0], usage=self._total_usage(extras, copies))
            yield sse_event(protocol.chunk(req.kind, rid, model, created, no_choices=True, extra=extra))
        yield "data: [DONE]\n\n"

    def _logprobs(self, kind: str, tokens: list[int], entries) -> dict:
        """A whole choice's `logprobs` (each token's text: the text it completes)."""
        texts = TextStream(self.model.piece)
        return protocol.choice_logprobs(kind, [protocol.logprob_entry(self.model, e, texts.feed([t])) for t, e in zip(tokens, entries)])

    async def _chunks(self, events: AsyncIterator[Event], req: protocol.ApiRequest, rid: str, t0: float, http: HttpRequest,
                      calls: Optional[ToolFormat] = None, index: int = 0):
        """The OpenAI chunks of one choice's job (choice `index`): the chat's opening role, a
        chunk per step (with tools: content and tool-call deltas), the finish (with usage,
        unless it goes in a chunk of its own: _sse), then a _Finished with the figures."""
        kind, model, created = req.kind, self.settings.model_id, int(time.time())
        deltas = tool_calls.ToolDeltas(calls) if calls is not None else None
        # With logprobs: the entries of the tokens not yet shown, which go with the next chunk
        # (with tools, text held back by the call parser shows no chunk yet)
        texts = TextStream(self.model.piece) if req.logprobs is not None else None
        pending: list[dict] = []
        n_sent, offset = 0, 0

        def take(tokens, entries) -> None:
            if texts is not None:
                pending.extend(protocol.logprob_entry(self.model, e, texts.feed([t])) for t, e in zip(tokens, entries))

        def shown() -> Optional[dict]:
            nonlocal offset
            if texts is None or not pending:
                return None
            content = list(pending)
            pending.clear()
            out = protocol.choice_logprobs(kind, content, offset)
            offset += sum(len(c["token"]) for c in content)
            return out

        def pieces(text: str):
            if deltas is None:
                return [protocol.chunk(kind, rid, model, created, index=index, text=text, logprobs=shown())]
            out = [protocol.chunk(kind, rid, model, created, index=index, delta=d) for d in deltas.feed(text)]
            if out and pending:
                out[0]["choices"][0]["logprobs"] = shown()
            return out

        if kind == CHAT:
            yield protocol.chunk(kind, rid, model, created, index=index, role=True)
        async for event in events:
            if isinstance(event, Delta):
                n_sent += len(event.tokens)
                take(event.tokens, event.logprobs)
                for piece in pieces(event.text):
                    yield piece
            elif isinstance(event, Failed):
                yield ApiError(event.status, event.message).body()
            else:
                gen = event.generation
                if gen.logprobs is not None:
                    take(gen.token_ids[n_sent:], gen.logprobs[n_sent:])
                for piece in pieces(event.tail) if event.tail or pending else []:
                    yield piece
                finish = protocol.FINISH_REASONS.get(gen.stop_reason, "stop")
                if deltas is not None:
                    for d in deltas.finish():
                        yield protocol.chunk(kind, rid, model, created, index=index, delta=d)
                    finish = "tool_calls" if deltas.ids and finish == "stop" else finish
                extra = self._extra(event)
                finish_extra = {k: v for k, v in extra.items() if k != "usage"} if req.include_usage else extra
                yield protocol.chunk(kind, rid, model, created, index=index, finish_reason=finish, extra=finish_extra, logprobs=shown())
                yield _Finished(extra)
                self._log(http, event, t0)

    # --- helpers ------------------------------------------------------------------------------------
    def _tools(self, body: dict, req: protocol.ApiRequest) -> Optional[tool_calls.ToolRequest]:
        """The request's tools (chat only), refused when the model's template writes no calls
        that specli reads, or when another constraint is asked for too."""
        if req.kind != CHAT:
            return None  # (protocol refuses tools there)
        tools = tool_calls.parse_tools(body)
        if tools is None:
            return None
        formatter = self.settings.formatter
        if formatter is None:
            return None  # (chat is refused: _prompt_ids says why)
        if formatter.tool_format is None:
            raise ApiError(400, f"'tools': the chat template ({formatter.owner if formatter.jinja is not None else formatter.name}) writes no tool calls "
                           "that specli can read (it reads the Hermes <tool_call> format, as Qwen 2.5's template writes it)", param="tools")
        if req.grammar is not None and tools.choice != NONE:
            raise ApiError(400, "'tools' and a response format both constrain the output; send one of them (or tool_choice \"none\")", param="tools")
        return tools

    def _tool_constraint(self, tools: tool_calls.ToolRequest) -> ToolConstraint:
        try:
            return ToolConstraint(self.settings.formatter.tool_format, tools.offered(), self.model, choice=tools.choice, parallel=tools.parallel)
        except UsageError as err:
            raise ApiError(400, str(err), param="tools") from None

    def _prompt_ids(self, req: protocol.ApiRequest, tools: Optional[tool_calls.ToolRequest] = None) -> tuple[list[int], tuple[str, ...]]:
        """The prompt's tokens (a chat rendered with the model's template) and the format's own
        stop strings; ApiError when it is refused or does not fit the context."""
        model, stops = self.model, ()
        n_ctx = self.scheduler.n_ctx
        field = "messages" if req.kind == CHAT else "prompt"
        chars = sum(len(m["content"]) for m in req.messages) if req.kind == CHAT else len(req.prompt or "")
        # Refused before tokenizing: no token stands for more than longest_token_bytes() bytes
        # (a character is at least one), so such a text could never fit (margin 2 for tokenizers
        # whose unknown-token stands for a whole word).
        if chars > 2 * n_ctx * model.longest_token_bytes():
            raise protocol.context_exceeded(f"the {'messages hold' if req.kind == CHAT else 'prompt is'} {chars:,} characters,"
                                            f" far more than a request's context of {n_ctx} tokens can hold; shorten it, or restart the server with a larger -c",
                                            param=field, n_ctx=n_ctx)
        if req.kind == CHAT:
            if self.settings.chat_problem:
                raise ApiError(400, self.settings.chat_problem, param="messages")
            formatter = self.settings.formatter
            try:
                ids = encode_conversation(model, formatter, None, req.messages, tools=tools.given if tools is not None else None,
                                          add_assistant=req.add_assistant, continue_final=req.continue_final)
            except SpecliError as err:
                raise ApiError(400, str(err), param="messages") from None
            stops = tuple(formatter.stop)
        elif req.prompt_ids is not None:
            bad = next((t for t in req.prompt_ids if not 0 <= t < model.n_vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is not in the model's vocabulary (0..{model.n_vocab - 1})", param="prompt")
            ids = req.prompt_ids
        else:
            ids = model.tokenize_prompt(req.prompt, parse_special=req.parse_special)  # (as llama-server: control text parsed)
        protocol.check_fits(ids, n_ctx, field)
        return ids, stops

    def _extra(self, event: Done) -> dict:
        gen = event.generation
        spec = protocol.speculative(gen.stats, mode=self.scheduler.mode, draft_length=self.scheduler.draft_length, seed=gen.seed, stop_reason=gen.stop_reason)
        return {"usage": protocol.usage(len(gen.prompt_ids), len(gen.token_ids)), "speculative": spec, "timings": protocol.timings(gen.stats)}

    def _log(self, http: HttpRequest, event: Done, t0: float) -> None:
        log_done(self.settings, self.scheduler, http, event, t0)


@dataclasses.dataclass
class _Finished:
    """The end of one choice's chunks: its usage, speculative and timings."""

    extra: dict


# --- the app and the server -------------------------------------------------------------------------
def make_app(service: Service):
    async def api_error(_request, err: ApiError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    async def http_error(_request, err: HTTPException) -> Response:
        message = {404: "no such endpoint (see GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /completion, POST /infill; docs/serve.md)",
                   405: "method not allowed here"}.get(err.status_code, err.detail)
        return JSONResponse(ApiError(err.status_code, message).body(), status_code=err.status_code, headers=getattr(err, "headers", None))

    async def client_left(_request, _err: ClientLeft) -> Response:
        return Response(status_code=499)  # (sent to nobody: the connection is closed)

    async def internal(_request, err: Exception) -> Response:
        return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}: {err} (a bug in specli; please report it)").body(), status_code=500)

    routes = [
        Route("/health", service.health, methods=["GET"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/chat/completions", service.chat, methods=["POST"]),
        Route("/v1/completions", service.completions, methods=["POST"]),
        # llama-server's and some clients' spellings without the version
        Route("/models", service.models, methods=["GET"]),
        Route("/chat/completions", service.chat, methods=["POST"]),
        Route("/chat/completions/input_tokens", service.input_tokens, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", service.input_tokens, methods=["POST"]),
        # llama-server's own (llama_api.py); /completions without the version is its native one, as llama-server routes it
        Route("/completion", service.llama.completion, methods=["POST"]),
        Route("/completions", service.llama.completion, methods=["POST"]),
        Route("/infill", service.llama.infill, methods=["POST"]),
        Route("/tokenize", service.llama.tokenize, methods=["POST"]),
        Route("/detokenize", service.llama.detokenize, methods=["POST"]),
        Route("/apply-template", service.llama.apply_template, methods=["POST"]),
        Route("/props", service.llama.props, methods=["GET"]),
        Route("/metrics", service.llama.metrics, methods=["GET"]),
        Route("/slots", service.llama.slots, methods=["GET"]),
        Route("/v1/health", service.health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error, ClientLeft: client_left, Exception: internal})
    guarded = framing_guard(app)
    return cors_guard(guarded, service.settings.cors) if service.settings.cors is not None else guarded


def cors_guard(app, cors: Cors):
    """llama-server's CORS, before anything else (its header names in its casing: clients that
    read headers into a plain dict look them up so): every response gets its
    Access-Control-Allow-Origin, and an OPTIONS request (a browser's preflight, which carries no
    API key) is answered at once, 200 with the allowed methods and headers."""

    async def with_cors(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        origin = headers.get(b"origin")
        allow = cors.allow_origin(origin.decode("latin-1") if origin is not None else None)
        extra = [] if allow is None else [(b"Access-Control-Allow-Origin", allow.encode("latin-1"))]
        if scope["method"] == "OPTIONS":
            extra += [(b"Access-Control-Allow-Credentials", b"true" if cors.credentials else b"false"),
                      (b"Access-Control-Allow-Methods", cors.methods.encode("latin-1")),
                      (b"Access-Control-Allow-Headers", cors.headers.encode("latin-1"))]
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/html"), (b"content-length", b"0"), *extra]})
            return await send({"type": "http.response.body", "body": b""})

        async def send_with_cors(message):
            if message["type"] == "http.response.start" and extra:
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await app(scope, receive, send_with_cors)

    return with_cors


MAX_HEADER_BYTES = 32 * 1024  # every header together; clients send well under 8 KB
SHUTDOWN_GRACE_S = 5.0  # at SIGTERM: how long requests still being received get to finish


def framing_guard(app):
    """Refuse at once, before any body is read, a request that gives both Content-Length and
    Transfer-Encoding (the two framings disagree on where the body ends: the shape of request
    smuggling, and waiting for either one only hangs the connection), and one whose headers
    pass MAX_HEADER_BYTES (431). A request still being received when a shutdown's grace runs
    out is cancelled without a traceback: its client was too slow, nothing went wrong here."""

    async def refuse(send, status: int, message: str) -> None:
        body = json.dumps(ApiError(status, message).body()).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            headers = scope.get("headers", ())
            names = {name.lower() for name, _ in headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                return await refuse(send, 400, "the request gives both Content-Length and Transfer-Encoding; send one")
            size = sum(len(name) + len(value) + 4 for name, value in headers)
            if size > MAX_HEADER_BYTES:
                return await refuse(send, 431, f"the request's headers are {size:,} bytes; at most {MAX_HEADER_BYTES:,} are read")
        try:
            await app(scope, receive, send)
        except asyncio.CancelledError:
            if not _shutting_down:
                raise

    return guarded


_shutting_down = False  # set by _Server.handle_exit


class _QuietShutdown(logging.Filter):
    """uvicorn's lines about requests cut short by the shutdown's grace (cancelled, so without a
    response): expected then, and said by "stopped"."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (_shutting_down and (text.startswith("Cancel ") or text.startswith("ASGI callable returned without")))


logging.getLogger("uvicorn.error").addFilter(_QuietShutdown())


def bind_all(hosts: str, port: int) -> list[socket.socket]:
    """A socket for each of the comma-separated hosts, all on one port (with port 0, the one the
    first host got), as llama-server's --host takes several."""
    names = [h.strip() for h in hosts.split(",") if h.strip()]
    if not names:
        raise UsageError("--host is empty; give an address such as 127.0.0.1 (several: comma-separated)")
    socks: list[socket.socket] = []
    try:
        for name in names:
            socks.append(bind(name, port))
            port = port or address_of(socks[0])[1]
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (before the models load: a busy port fails at once)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise UsageError(f"cannot listen on {host}: {err.strerror}; give an address such as 127.0.0.1 or 0.0.0.0 (--host)") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror}; pick another --port (or stop what uses it)") from None
    sock.set_inheritable(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn, telling the scheduler when a signal asks it to stop, and exiting 0 after a
    clean stop rather than re-raising the signal."""

    def __init__(self, config: uvicorn.Config, service: Service, on_ready: Callable[[], None]):
        super().__init__(config)
        self.service, self.on_ready = service, on_ready
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.loop = asyncio.get_running_loop()
        if self.started and not self.should_exit:
            self.on_ready()

    def handle_exit(self, sig, frame) -> None:
        global _shutting_down
        _shutting_down = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        self.service.stopping = True
        for callback in self.service.on_stop:
            callback()
        if self.loop is not None:  # (a signal handler must not take the scheduler's lock itself)
            self.loop.call_soon_threadsafe(self.service.scheduler.stop)


def serve(service: Service, socks: list[socket.socket], *, on_ready: Callable[[], None], verbose: bool = False) -> None:
    """Serve until SIGINT/SIGTERM, then stop the scheduler and wait for it."""
    config = uvicorn.Config(
        make_app(service), lifespan="off", http="h11", loop="asyncio", log_level="info" if verbose else "warning",
        h11_max_incomplete_event_size=MAX_HEADER_BYTES + 8192,  # (past it, h11 answers 400 before framing_guard sees the request)
        access_log=verbose, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, log_config=None if not verbose else uvicorn.config.LOGGING_CONFIG,
    )
    server = _Server(config, service, on_ready)
    service.scheduler.start()
    try:
        server.run(sockets=socks)
    finally:
        service.stopping = True
        service.scheduler.stop()
        if not service.scheduler.join(timeout=60):
            # Still inside a decode (a long prompt): freeing the models under it would crash.
            stderr_line("specli serve: stopped (a decode was still running; exiting without waiting for it)")
            os._exit(0)
        for sock in socks:
            sock.close()
    if not server.started:
        raise SpecliError("the HTTP server did not start (--verbose shows uvicorn's log)")


def address_of(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return host, port


def stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
