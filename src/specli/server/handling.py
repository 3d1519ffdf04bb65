"""What both route families (app.py's OpenAI routes, llama_api.py's llama-server ones) do with a
request: check its API key and model, read its body, submit its generation to the scheduler,
wait for the generation's end (a plain response) or stream its events (server-sent events), and
log it.

A client that leaves is noticed at once, and its job cancelled, which frees its slot before the
next pass: a plain request watches for the disconnect itself (Submitted.finished); while a
response streams, Starlette listens for it and ends the stream, which cancels the job
(Submitted.stream).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse

from specli.decoding.generation import Request
from specli.decoding.sampling import SamplingParams
from specli.modes import DraftMode
from specli.server.protocol import ApiError, quoted
from specli.server.scheduler import Delta, Done, Event, Job, QueueFull, Scheduler, ShuttingDown

MAX_BODY_BYTES = 16 << 20  # a request body (a 128k-token conversation is well under 1 MiB)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
    strict_models: bool = False  # --strict-model-names: a request naming another model is a 404
    alias_list: list[str] = field(default_factory=list)  # --alias's names (/v1/models' aliases)
    tags: list[str] = field(default_factory=list)  # --tags
    verbose: bool = False  # -v: every whole response carries __verbose (as llama-server's --verbose)
    cors: Optional["Cors"] = None  # the CORS answers (None: no CORS headers at all)


@dataclass(frozen=True)
class Cors:
    """llama-server's CORS settings (--cors-origins, --cors-methods, --cors-headers,
    --cors-credentials), with its defaults: any origin, with credentials (the request's Origin is
    echoed back). --api-key still guards every endpoint: a preflight carries no key, and gets only
    these headers."""

    origins: str = "*"  # a comma-separated list, "*", or "localhost" (echo a localhost Origin only)
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    def allow_origin(self, origin: Optional[str]) -> Optional[str]:
        """The Access-Control-Allow-Origin value for a request from `origin` (None: no header)."""
        if self.origins == "*" and self.credentials:
            return origin or ""  # (llama-server echoes it, empty when absent)
        if self.origins == "localhost":
            return origin if origin and is_localhost_origin(origin) else None
        return self.origins


def is_localhost_origin(origin: str) -> bool:
    """Whether an Origin (scheme://host[:port]) names this machine."""
    from urllib.parse import urlsplit

    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


# --- checking a request -------------------------------------------------------------------------------
def check_key(settings: Settings, http: HttpRequest) -> None:
    """401 unless the request carries the server's --api-key (when it has one)."""
    key = settings.api_key
    if key is None:
        return
    given = http.headers.get("authorization")
    if given is not None:
        scheme, _, token = given.partition(" ")
    else:  # (llama-server's fallback, the header Anthropic's clients send: the key alone, or after "Bearer ")
        given = http.headers.get("x-api-key", "")
        scheme, _, token = given.partition(" ") if given[:7].lower() == "bearer " else ("bearer", "", given)
    # Header bytes reach us decoded as Latin-1 (ASGI): back to the bytes sent, against the
    # key's UTF-8 bytes, so a key with non-ASCII characters sent as UTF-8 is the same key.
    sent = token.encode("latin-1", errors="replace").strip(b" \t")  # (str.strip would take \xa0, a UTF-8 byte)
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, key.encode("utf-8")):
        raise ApiError(401, "invalid or missing API key: send the server's --api-key as 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY')",
                       code="invalid_api_key", kind="authentication_error")


def check_model(settings: Settings, name: Optional[str]) -> None:
    """With --strict-model-names, 404 when a request names a model this server does not serve
    (None: it names none). Else any name is this server's one model, as llama-server and LM
    Studio take it: clients send their own defaults ("gpt-3.5-turbo")."""
    if not settings.strict_models:
        return
    if name is not None and name != settings.model_id and name not in settings.aliases:
        raise ApiError(404, f"model {quoted(name)} is not served here; this server serves '{settings.model_id}' (GET /v1/models)", param="model", code="model_not_found")


def make_constraint(grammar, model):
    """A request's grammar on the model's vocabulary (constraints.Constraint; the tokenizer is
    built once: about a second, the first time); 400 when the vocabulary refuses it."""
    from specli.constraints import Constraint
    from specli.errors import UsageError

    try:
        return Constraint(grammar, model)
    except UsageError as err:
        raise ApiError(400, str(err)) from None


class ClientLeft(Exception):
    """The client closed its connection while sending its request: nobody to answer, and no
    fault of the server's, so nothing is logged (as for one that leaves mid-generation)."""


async def read_json(http: HttpRequest) -> Any:
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


# --- a generation -------------------------------------------------------------------------------------
def submit(scheduler: Scheduler, request: Request) -> Submitted:
    """Queue a generation on the scheduler, from a route's event loop. A full queue or a stopping
    server is a 503 (every route that generates: the OpenAI ones, /infill)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    job = Job(request, emit=lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
    try:
        scheduler.submit(job)
    except QueueFull:
        raise ApiError(503, f"the server is busy ({scheduler.queue_limit} requests are waiting); retry later", code="server_busy") from None
    except ShuttingDown:
        raise ApiError(503, scheduler.broken or "the server is shutting down", code="shutting_down") from None
    return Submitted(scheduler, job, queue)


def submit_all(scheduler: Scheduler, requests: list[Request]) -> list[Submitted]:
    """submit() each of a request's generations (its choices, its prompts); when one is refused
    (a full queue), those already queued are cancelled and the 503 raised."""
    submitted: list[Submitted] = []
    try:
        for request in requests:
            submitted.append(submit(scheduler, request))
    except ApiError:
        for other in submitted:
            scheduler.cancel(other.job)
        raise
    return submitted


async def finish_all(submitted: list[Submitted], http: HttpRequest,
                     on_done: Optional[Callable[[Done], None]] = None) -> Optional[list[tuple[Done, str]]]:
    """Each generation's end (Submitted.finished), in order, `on_done` told of each as it comes;
    None when the client left. Whatever ends the wait (a failure, a client gone), every
    generation is cancelled then."""
    out = []
    try:
        for sub in submitted:
            finished = await sub.finished(http)
            if finished is None:
                return None
            if on_done is not None:
                on_done(finished[0])
            out.append(finished)
    finally:
        for sub in submitted:
            sub.scheduler.cancel(sub.job)
    return out


class Submitted:
    """A job on the scheduler, and the queue its events come back in (through the event loop).
    Whichever way its response ends, the job is cancelled then (nothing when it finished)."""

    def __init__(self, scheduler: Scheduler, job: Job, queue: asyncio.Queue):
        self.scheduler, self.job, self.queue = scheduler, job, queue

    async def finished(self, http: HttpRequest) -> Optional[tuple[Done, str]]:
        """Wait for the job's end: its Done, and the text its events released. None when the
        client left first (nobody to answer: the route returns 499); ApiError when it failed."""
        text = []
        try:
            while True:
                event = await _next_or_disconnect(self.queue, http)
                if event is None:
                    return None
                if isinstance(event, Delta):
                    text.append(event.text)
                elif isinstance(event, Done):
                    text.append(event.tail)
                    return event, "".join(text)
                else:
                    raise ApiError(event.status, event.message)
        finally:
            self.scheduler.cancel(self.job)

    async def stream(self, render: Callable[[AsyncIterator[Event]], AsyncIterator[str]]) -> AsyncIterator[str]:
        """A streamed response's body: the text `render` makes of the job's events, which it gets
        as they come, up to the last (the Done or Failed). The job is cancelled when the stream
        ends or is left: a client that leaves mid-stream frees its slot now."""
        try:
            async for text in render(self._events()):
                yield text
        finally:
            self.scheduler.cancel(self.job)

    async def _events(self) -> AsyncIterator[Event]:
        while True:
            event = await self.queue.get()
            yield event
            if not isinstance(event, Delta):
                return


async def merged(streams: list) -> AsyncIterator:
    """The items of several async iterators as they come; each is closed when the merged one is
    (a client that leaves cancels every choice's job)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


def sse_event(obj: dict) -> str:
    """One server-sent event holding `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _next_or_disconnect(queue: asyncio.Queue, http: HttpRequest) -> Optional[Event]:
    """The next event, or None when the client disconnects first."""
    get = asyncio.ensure_future(queue.get())
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


# --- the log ------------------------------------------------------------------------------------------
def log_done(settings: Settings, scheduler: Scheduler, http: HttpRequest, event: Done, t0: float) -> None:
    """The request's line in the server's log (none with --quiet): its tokens, speed, drafting
    and prompt reuse. t0: when its job was submitted."""
    if settings.log is None:
        return
    stats = event.generation.stats
    parts = [f"{http.url.path}: {stats.n_tokens} tokens in {time.perf_counter() - t0:.2f} s"]
    if stats.tokens_per_s:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
    if scheduler.mode != DraftMode.TARGET_ONLY:
        parts += stats.drafting_summary()
    if stats.prompt_reused:
        parts.append(f"{stats.prompt_reused}/{stats.prompt_tokens} prompt tokens reused")
    parts.append(f"slot {event.slot}, {event.generation.stop_reason}")
    settings.log(", ".join(parts))
