"""`specli serve`'s HTTP side: the OpenAI routes on Starlette, served by uvicorn (the `server`
extra). Requests are checked here (protocol.py) and tokenized; generation happens on the
scheduler's thread, whose events come back through the event loop.

Streaming is server-sent events as the OpenAI clients read them (`data: {chunk}`, then `data:
[DONE]`). A client that leaves is noticed at once (Starlette listens for the disconnect while
it streams; a plain request watches for it itself) and its job cancelled, which frees its slot
before the next pass. SIGINT/SIGTERM: uvicorn stops accepting, the scheduler ends the running
generations with what they have (finish_reason "length", stop_reason "interrupted") and fails
queued ones with 503, each response is completed, and the process exits 0 (with --rpc, a pass
stalled on a server is not waited for: Service.on_stop, llama/rpc.py's stop_asked).
"""

from __future__ import annotations

import asyncio
import logging
import hmac
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specli.decoding.sampling import SamplingParams
from specli.errors import SpecliError, UsageError
from specli.server import protocol
from specli.server.llama_api import LlamaRoutes
from specli.server.protocol import CHAT, TEXT, ApiError
from specli.server.scheduler import Delta, Done, Failed, Job, QueueFull, Scheduler, ShuttingDown
from specli.modes import DraftMode

MAX_BODY_BYTES = 16 << 20  # a request body (a 128k-token conversation is well under 1 MiB)


@dataclass
class Settings:
    """What the routes need besides the scheduler."""

    model_id: str  # the name /v1/models lists
    aliases: set[str]  # other names a request's `model` may use (the file's name, -m as typed)
    defaults: SamplingParams  # the command line's sampling, which a request overrides
    api_key: Optional[str] = None
    default_max_tokens: Optional[int] = None  # -n; None: until the context is full
    formatter: Any = None  # session.chat.Formatter for chat requests
    chat_problem: Optional[str] = None  # why chat requests are refused (an unusable template)
    log: Optional[Callable[[str], None]] = None  # a line per request (None: --quiet)
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: bool = False  # --metrics: GET /metrics answers (else 501, as llama-server's)
    slots: bool = False  # --slots: GET /slots answers
    model_path: str = ""  # for /props


class Service(LlamaRoutes):  # (llama-server's own routes: llama_api.py)
    def __init__(self, scheduler: Scheduler, model_tgt, settings: Settings):
        self.scheduler, self.model, self.settings = scheduler, model_tgt, settings
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
        self._check_key(http)
        s = self.settings
        entry = {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "specli",
                 "meta": {"n_ctx": self.scheduler.n_ctx, "drafting": self.scheduler.mode, "draft_max": self.scheduler.draft_length.json_value,
                          "parallel": len(self.scheduler.slots)}}  # fmt: skip
        return JSONResponse({"object": "list", "data": [entry]})

    async def chat(self, http: HttpRequest) -> Response:
        return await self._generate(http, CHAT)

    async def completions(self, http: HttpRequest) -> Response:
        return await self._generate(http, TEXT)

    # (for llama_api's routes, which cannot import this module: it imports them)
    async def _body(self, http: HttpRequest) -> Any:
        return await _read_json(http)

    async def _next_event(self, events: asyncio.Queue, http: HttpRequest):
        return await _next_or_disconnect(events, http)

    @staticmethod
    def _sse(obj: dict) -> str:
        return _sse(obj)

    # --- a generation -------------------------------------------------------------------------------
    async def _generate(self, http: HttpRequest, kind: str) -> Response:
        self._check_key(http)
        req = protocol.parse_request(await _read_json(http), kind, self.settings.defaults)
        self._check_model(req.model)
        prompt_ids, format_stop = await run_in_threadpool(self._prompt_ids, req)
        max_tokens = req.max_tokens or self.settings.default_max_tokens or self.scheduler.n_ctx
        job, events = self._submit(prompt_ids, max_tokens, req.sampling, seed=req.seed, stop=(*format_stop, *req.stop))
        rid, t0 = protocol.new_id(kind), time.perf_counter()
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self._stream(job, events, req, rid, t0, http), media_type="text/event-stream", headers=headers)
        try:
            text = []
            while True:
                event = await _next_or_disconnect(events, http)
                if event is None:  # the client left: nobody to answer
                    return Response(status_code=499)
                if isinstance(event, Delta):
                    text.append(event.text)
                elif isinstance(event, Failed):
                    raise ApiError(event.status, event.message)
                else:
                    text.append(event.tail)
                    gen = event.generation
                    self._log(http, kind, event, t0)
                    finish = protocol.FINISH_REASONS.get(gen.stop_reason, "stop")
                    return JSONResponse(protocol.response_body(kind, rid, self.settings.model_id, "".join(text), finish, self._extra(event)))
        finally:
            self.scheduler.cancel(job)  # (nothing when it finished)

    async def _stream(self, job: Job, events: asyncio.Queue, req: protocol.Request, rid: str, t0: float, http: HttpRequest):
        kind, model, created = req.kind, self.settings.model_id, int(time.time())
        try:
            if kind == CHAT:
                yield _sse(protocol.chunk(kind, rid, model, created, role=True))
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    yield _sse(protocol.chunk(kind, rid, model, created, text=event.text))
                elif isinstance(event, Failed):
                    yield _sse(ApiError(event.status, event.message).body())
                    break
                else:
                    if event.tail:
                        yield _sse(protocol.chunk(kind, rid, model, created, text=event.tail))
                    finish = protocol.FINISH_REASONS.get(event.generation.stop_reason, "stop")
                    extra = self._extra(event)
                    if req.include_usage:  # usage once, in its own last chunk (as OpenAI sends it)
                        finish_extra = {k: v for k, v in extra.items() if k != "usage"}
                        yield _sse(protocol.chunk(kind, rid, model, created, finish_reason=finish, extra=finish_extra))
                        yield _sse(protocol.chunk(kind, rid, model, created, no_choices=True, extra=extra))
                    else:
                        yield _sse(protocol.chunk(kind, rid, model, created, finish_reason=finish, extra=extra))
                    self._log(http, kind, event, t0)
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.scheduler.cancel(job)  # a client that left mid-stream frees its slot now

    # --- helpers ------------------------------------------------------------------------------------
    def _submit(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, **fields) -> tuple[Job, asyncio.Queue]:
        """Queue a generation on the scheduler (`fields`: Job's others), from a route's event
        loop; its events come back in the queue returned. A full queue or a stopping server is a
        503 (every route that generates: the OpenAI ones, /infill)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(prompt_ids, max_tokens, sampling, emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event), **fields)
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise ApiError(503, f"the server is busy ({self.scheduler.queue_limit} requests are waiting); retry later", code="server_busy") from None
        except ShuttingDown:
            raise ApiError(503, self.scheduler.broken or "the server is shutting down", code="shutting_down") from None
        return job, events

    def _check_key(self, http: HttpRequest) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = http.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # Header bytes reach us decoded as Latin-1 (ASGI): back to the bytes sent, against the
        # key's UTF-8 bytes, so a key with non-ASCII characters sent as UTF-8 is the same key.
        sent = token.encode("latin-1", errors="replace").strip(b" \t")  # (str.strip would take \xa0, a UTF-8 byte)
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, key.encode("utf-8")):
            raise ApiError(401, "invalid or missing API key: send the server's --api-key as 'Authorization: Bearer KEY'",
                           code="invalid_api_key", kind="authentication_error")  # fmt: skip

    def _check_model(self, name: Optional[str]) -> None:
        s = self.settings
        if name is not None and name != s.model_id and name not in s.aliases:
            raise ApiError(404, f"model {protocol.quoted(name)} is not served here; this server serves '{s.model_id}' (GET /v1/models)", param="model", code="model_not_found")

    def _prompt_ids(self, req: protocol.Request) -> tuple[list[int], tuple[str, ...]]:
        """The prompt's tokens (a chat rendered with the model's template) and the format's own
        stop strings; ApiError when it is refused or does not fit the context."""
        from specli.session.chat import encode_conversation

        model, stops = self.model, ()
        n_ctx = self.scheduler.n_ctx
        field = "messages" if req.kind == CHAT else "prompt"
        chars = sum(len(m["content"]) for m in req.messages) if req.kind == CHAT else len(req.prompt or "")
        # Refused before tokenizing: no token stands for more than longest_token_bytes() bytes
        # (a character is at least one), so such a text could never fit (margin 2 for tokenizers
        # whose unknown-token stands for a whole word).
        if chars > 2 * n_ctx * model.longest_token_bytes():
            raise ApiError(400, f"the {'messages hold' if req.kind == CHAT else 'prompt is'} {chars:,} characters, far more than a request's context of {n_ctx} tokens can hold; shorten it, or restart the server with a larger -c",
                           param=field, code="context_length_exceeded")  # fmt: skip
        if req.kind == CHAT:
            if self.settings.chat_problem:
                raise ApiError(400, self.settings.chat_problem, param="messages")
            formatter = self.settings.formatter
            try:
                ids = encode_conversation(model, formatter, None, req.messages)
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
        if not ids:
            raise ApiError(400, "the prompt is empty; give some text to continue", param="prompt")
        if len(ids) >= n_ctx:
            raise ApiError(400, f"the prompt is {len(ids)} tokens but a request's context holds {n_ctx}; shorten it, or restart the server with a larger -c",
                           param=field, code="context_length_exceeded")  # fmt: skip
        return ids, stops

    def _extra(self, event: Done) -> dict:
        gen = event.generation
        spec = protocol.speculative(gen.stats, mode=self.scheduler.mode, draft_length=self.scheduler.draft_length, seed=gen.seed, stop_reason=gen.stop_reason)
        return {"usage": protocol.usage(len(gen.prompt_ids), len(gen.token_ids)), "speculative": spec, "timings": protocol.timings(gen.stats)}

    def _log(self, http: HttpRequest, kind: str, event: Done, t0: float) -> None:
        if self.settings.log is None:
            return
        stats = event.generation.stats
        parts = [f"{http.url.path}: {stats.n_tokens} tokens in {time.perf_counter() - t0:.2f} s"]
        if stats.tokens_per_s:
            parts.append(f"{stats.tokens_per_s:.1f} tok/s")
        if self.scheduler.mode != DraftMode.TARGET_ONLY:
            parts += stats.drafting_summary()
        if stats.prompt_reused:
            parts.append(f"{stats.prompt_reused}/{stats.prompt_tokens} prompt tokens reused")
        parts.append(f"slot {event.slot}, {event.generation.stop_reason}")
        self.settings.log(", ".join(parts))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ClientLeft(Exception):
    """The client closed its connection while sending its request: nobody to answer, and no
    fault of the server's, so nothing is logged (as for one that leaves mid-generation)."""


async def _read_json(http: HttpRequest) -> Any:
    """The body as JSON, at most MAX_BODY_BYTES (413 beyond); ClientLeft when the client closes
    its connection before the body is all sent."""
    length = http.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {int(length):,} bytes; at most {MAX_BODY_BYTES:,}")
    data = bytearray()
    try:
        async for piece in http.stream():
            data += piece
            if len(data) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES:,} bytes")
    except ClientDisconnect:
        raise ClientLeft() from None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deeply") from None


async def _next_or_disconnect(events: asyncio.Queue, http: HttpRequest):
    """The next event, or None when the client disconnects first."""
    get = asyncio.ensure_future(events.get())
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if get in done:
        return get.result()
    get.cancel()
    return None


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


# --- the app and the server -------------------------------------------------------------------------
def make_app(service: Service):
    async def api_error(_request, err: ApiError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    async def http_error(_request, err: HTTPException) -> Response:
        message = {404: "no such endpoint (see GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /infill; docs/serve.md)",
                   405: "method not allowed here"}.get(err.status_code, err.detail)  # fmt: skip
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
        Route("/completions", service.completions, methods=["POST"]),
        # llama-server's own (llama_api.py)
        Route("/infill", service.infill, methods=["POST"]),
        Route("/tokenize", service.tokenize, methods=["POST"]),
        Route("/detokenize", service.detokenize, methods=["POST"]),
        Route("/apply-template", service.apply_template, methods=["POST"]),
        Route("/props", service.props, methods=["GET"]),
        Route("/metrics", service.metrics, methods=["GET"]),
        Route("/slots", service.slots, methods=["GET"]),
        Route("/v1/health", service.health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error, ClientLeft: client_left, Exception: internal})
    return framing_guard(app)


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
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})  # fmt: skip
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


def serve(service: Service, sock: socket.socket, *, on_ready: Callable[[], None], verbose: bool = False) -> None:
    """Serve until SIGINT/SIGTERM, then stop the scheduler and wait for it."""
    config = uvicorn.Config(
        make_app(service), lifespan="off", http="h11", loop="asyncio", log_level="info" if verbose else "warning",
        h11_max_incomplete_event_size=MAX_HEADER_BYTES + 8192,  # (past it, h11 answers 400 before framing_guard sees the request)
        access_log=verbose, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, log_config=None if not verbose else uvicorn.config.LOGGING_CONFIG,
    )  # fmt: skip
    server = _Server(config, service, on_ready)
    service.scheduler.start()
    try:
        server.run(sockets=[sock])
    finally:
        service.stopping = True
        service.scheduler.stop()
        if not service.scheduler.join(timeout=60):
            # Still inside a decode (a long prompt): freeing the models under it would crash.
            stderr_line("specli serve: stopped (a decode was still running; exiting without waiting for it)")
            os._exit(0)
        sock.close()
    if not server.started:
        raise SpecliError("the HTTP server did not start (--verbose shows uvicorn's log)")


def address_of(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return host, port


def stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
