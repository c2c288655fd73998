"""The FastAPI application of ``edgesync serve``: the routes and how an answer is shaped.

Requests are answered by the :class:`~.pool.WorkerPool`; this module checks them, turns the
worker's messages into OpenAI shapes (:mod:`.schemas`) and counts them (:mod:`.metrics`). One
model is served, whatever model a request names. A stream waits for its worker's first message,
so a refused prompt still gets a plain 400; a later error is a last ``{"error": ...}`` event. A
client that goes away stops its job; once shutdown began a job may run ``shutdown_grace_s``,
then is answered 503 ``shutting_down``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request, Response
from sse_starlette.sse import EventSourceResponse

from edgesync_engines.server import schemas
from edgesync_engines.server.errors import APIError, install_handlers
from edgesync_engines.server.metrics import CONTENT_TYPE, ErrorCounter, ServerMetrics
from edgesync_engines.server.pool import WorkerPool
from edgesync_engines.server.security import Guard

log = logging.getLogger(__name__)

MAX_LOGGED_MODEL_NAMES = 256
"""Distinct unknown model names logged (one line each); later ones are served unlogged."""
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
"""The answering endpoints (chat, then text), counted by name in ``edgesync_requests_total``."""
DISCONNECT_POLL_S = 0.25
"""Seconds between checks that a job's client is connected and the shutdown grace not over."""
STREAM_CUT_MARGIN_S = 0.5
"""Seconds after the grace at which sse-starlette cancels an open stream (room for its 503 event)."""
CLIENT_CLOSED = 499
"""Status counted for a client that went away (nginx's convention)."""


@dataclass(frozen=True)
class ServeSettings:
    """What the routes need: ``model_id`` (the served model's name, the GGUF's stem),
    ``max_tokens_limit``, ``default_max_tokens``, ``max_body_bytes``, ``api_key`` (None: no key),
    ``shutdown_grace_s`` (seconds a job may run once shutdown began; keep it under the ASGI server's
    graceful-shutdown timeout)."""

    model_id: str
    store: Path
    max_tokens_limit: int
    default_max_tokens: int
    max_body_bytes: int
    api_key: str | None = None
    shutdown_grace_s: float = 0.0


class _Shutdown:
    """When the jobs' shutdown grace (``grace_s`` seconds from ``stopping``'s first True) is over;
    ``on_over`` is called once then."""

    def __init__(self, stopping: Callable[[], bool], grace_s: float, on_over: Callable[[], None]) -> None:
        self.stopping = stopping
        self.grace_s = grace_s
        self.on_over = on_over
        self.began_at: float | None = None
        self.over = False

    def grace_over(self) -> bool:
        if self.over:
            return True
        if self.began_at is None:
            if not self.stopping():
                return False
            self.began_at = time.monotonic()
        if time.monotonic() - self.began_at < self.grace_s:
            return False
        self.over = True
        self.on_over()
        return True


class _Interrupted(Exception):
    """The message awaited did not come: the client went away (``gone``), or the shutdown grace ran out."""

    def __init__(self, gone: bool) -> None:
        super().__init__("the client went away" if gone else "the shutdown grace ran out")
        self.gone = gone


async def _watched(awaitable, shutdown: _Shutdown, request: Request | None = None):
    """The result of ``awaitable``, checking every :data:`DISCONNECT_POLL_S` that ``request``'s
    client is connected and the grace not over (else cancelled, raising _Interrupted)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            if shutdown.grace_over():  # checked first: a stream's pieces come sooner than the poll
                raise _Interrupted(gone=False)
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                raise _Interrupted(gone=True)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def warm_streaming() -> None:
    """Stream one event to nobody first, so the first client's first token waits for no set-up
    (sse-starlette's and anyio's, once per process: ``edgesync serve`` runs it while its workers
    load, and the app's start-up again, then in well under a millisecond)."""

    async def one_event():
        yield {"data": "warm-up"}

    async def receive() -> dict:  # never disconnects: the stream's end stops the response
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(_message: dict) -> None:
        return None

    scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
    await EventSourceResponse(one_event(), ping=0)(scope, receive, send)


def create_app(pool: WorkerPool, settings: ServeSettings, stopping: Callable[[], bool] | None = None) -> FastAPI:
    """The application over a started ``pool`` (the caller starts and closes the pool).
    ``stopping``: returns True once the ASGI server began to shut down (None: never)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await warm_streaming()
        yield

    app = FastAPI(title="EdgeSync", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    shutdown = _Shutdown(stopping or (lambda: False), settings.shutdown_grace_s, pool.cancel_all)
    metrics = ServerMetrics(settings.store, lambda: pool.n_workers, pool.restarts, pool.queued, pool.cancelled,
                            idle=pool.idle_totals, routed=pool.routed_by_prefix,
                            handed_over=pool.handed_over, slots=pool.n_slots)
    install_handlers(app)
    started = int(time.time())
    names = _ModelNames(settings.model_id)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": settings.model_id, "workers": pool.n_workers, "slots": pool.n_slots(),
                "worker_pids": pool.pids()}

    @app.get("/v1/models")
    async def models() -> schemas.ModelList:
        return schemas.ModelList(data=[schemas.ModelCard(id=settings.model_id, created=started)])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat(body: schemas.ChatCompletionRequest, request: Request):
        names.check(body.model)
        prompt = [m.plain() for m in body.messages]
        return await _answer(pool, settings, metrics, shutdown, body, prompt, "chat", request)

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request):
        names.check(body.model)
        return await _answer(pool, settings, metrics, shutdown, body, body.text(), "completion", request)

    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(ErrorCounter, metrics=metrics, endpoints=ENDPOINTS)  # outermost: sees every error
    return app


class _ModelNames:
    """Logs, once each, the model names requests give that are not the served one (at most
    :data:`MAX_LOGGED_MODEL_NAMES` of them)."""

    def __init__(self, served: str) -> None:
        self.served = served
        self.seen: set[str] = set()

    def check(self, name: str) -> None:
        if name == self.served or name in self.seen or len(self.seen) >= MAX_LOGGED_MODEL_NAMES:
            return
        self.seen.add(name)
        log.info("a request names the model %r; it is served by %r, the one model of this server", name[:200],
                 self.served)


def _job(body: schemas.SamplingRequest, settings: ServeSettings, prompt) -> dict:
    """The worker job of a checked request (APIError for a max_tokens over the limit)."""
    max_tokens = body.wanted_tokens() or settings.default_max_tokens
    if max_tokens > settings.max_tokens_limit:
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{field}: {max_tokens} is over this server's limit of {settings.max_tokens_limit}",
                       code="invalid_value", param=field)
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "seed": body.seed, "stop": body.stops(), "stream": body.stream,
            "reuse": body.edgesync.reuse if body.edgesync is not None else None, "submitted_at": time.time()}


async def _answer(pool: WorkerPool, settings: ServeSettings, metrics: ServerMetrics, shutdown: _Shutdown, body,
                  prompt, kind: str, request: Request):
    """Run one request on the pool and answer it whole or as a stream."""
    endpoint = ENDPOINTS[0] if kind == "chat" else ENDPOINTS[1]
    job = _job(body, settings, prompt)
    messages = pool.submit(job)
    shaper = _Shaper(kind, settings.model_id, job)
    try:
        # a whole answer's job sends nothing before its final message
        first = await _watched(anext(messages) if body.stream else _final(messages), shutdown, request)
    except RuntimeError as exc:  # the pool is shutting down (raised at the generator's first step)
        raise APIError(503, str(exc), code="shutting_down") from None
    except _Interrupted as exc:
        await messages.aclose()  # cancels the job
        if exc.gone:
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it; counted as 499
        raise _shutting_down() from None
    except asyncio.CancelledError:  # a forced stop (a second Ctrl-C) cancels the request's task: answer it
        await messages.aclose()
        raise _shutting_down() from None
    if not body.stream:
        return _whole(first, shaper, metrics, endpoint)
    if first["type"] == "error":
        await messages.aclose()
        raise _api_error(first)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = _events(first, messages, shaper, metrics, endpoint, include_usage, shutdown, pool.first_piece_sent)
    return _EventStream(events, ping=15, shutdown_grace_period=settings.shutdown_grace_s + STREAM_CUT_MARGIN_S)


class _EventStream(EventSourceResponse):
    """Server-sent events of a streamed answer; a forced stop ends the body with the 503 error event and ``[DONE]``."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            end = f"data: {json.dumps(_shutting_down().body())}\r\n\r\ndata: [DONE]\r\n\r\n".encode()
            with contextlib.suppress(Exception):  # the connection may be gone too
                await send({"type": "http.response.body", "body": end, "more_body": False})


async def _final(messages) -> dict:
    """The job's final message (the pool's iterator ends with it)."""
    final = None
    async for msg in messages:
        final = msg
    return final


def _api_error(msg: dict) -> APIError:
    return APIError(msg["status"], msg["message"], code=msg.get("code"), param=msg.get("param"),
                    err_type=msg.get("err_type"))


def _shutting_down() -> APIError:
    """The error of a job cancelled because the server is shutting down."""
    return APIError(503, "the request was cancelled: the server is shutting down", code="shutting_down")


def _whole(final: dict, shaper: "_Shaper", metrics: ServerMetrics, endpoint: str) -> dict:
    """The non-streamed response body of a job's final message."""
    if final["type"] == "error":
        raise _api_error(final)
    if final["type"] != "done":
        raise _shutting_down()
    metrics.answered(endpoint, final["result"], final["first_token_at"] - shaper.job["submitted_at"])
    return shaper.whole(final).model_dump()


async def _events(first: dict, messages, shaper: "_Shaper", metrics: ServerMetrics, endpoint: str,
                  include_usage: bool, shutdown: _Shutdown, first_sent: Callable[[int], None] | None = None):
    """The events of a streamed answer: chunks, then ``[DONE]`` (a 503 error event first when the grace
    cancels it); ``first_sent(job id)`` is called once the first piece is written."""
    msg = first
    if shaper.kind == "chat":
        yield {"data": shaper.chunk(role=True).model_dump_json(exclude_none=True)}
    while True:
        if msg["type"] == "piece":
            yield {"data": shaper.chunk(text=msg["text"]).model_dump_json(exclude_none=True)}
            if first_sent is not None:
                first_sent(msg["id"])
                first_sent = None
        elif msg["type"] == "done":
            metrics.answered(endpoint, msg["result"], msg["first_token_at"] - shaper.job["submitted_at"])
            yield {"data": shaper.chunk(final=msg).model_dump_json(exclude_none=True)}
            if include_usage:
                yield {"data": shaper.usage_chunk(msg).model_dump_json(exclude_none=True)}
            break
        else:
            status = msg.get("status", 503)
            metrics.failed(endpoint, status)
            error = _api_error(msg) if msg["type"] == "error" else _shutting_down()
            yield {"data": json.dumps(error.body())}
            break
        try:
            msg = await _watched(anext(messages), shutdown)
        except _Interrupted:
            await messages.aclose()  # cancels the job
            msg = {"type": "cancelled", "status": 503}
    yield {"data": "[DONE]"}


class _Shaper:
    """Builds the OpenAI objects of one job (one id and creation time for all its chunks)."""

    def __init__(self, kind: str, model: str, job: dict) -> None:
        self.kind = kind
        self.model = model
        self.job = job
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _common(self, **fields) -> dict:
        """The fields every object of this job shares, with ``fields``."""
        return {"id": self.id, "created": self.created, "model": self.model, **fields}

    def usage(self, final: dict) -> schemas.Usage:
        r = final["result"]
        return schemas.Usage(prompt_tokens=r["prompt_tokens"], completion_tokens=r["completion_tokens"],
                             total_tokens=r["prompt_tokens"] + r["completion_tokens"],
                             prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=r["tokens_reused"]))

    def info(self, final: dict) -> schemas.EdgeSyncInfo:
        r = final["result"]
        waited_ms = (final["first_token_at"] - self.job["submitted_at"]) * 1000 - r["ttft_ms"]
        return schemas.EdgeSyncInfo(hit=r["hit"], tokens_reused=r["tokens_reused"],
                                    tokens_prefilled=r["tokens_prefilled"], ttft_ms=round(r["ttft_ms"], 3),
                                    queue_ms=round(max(0.0, waited_ms), 3), approximate=r["approximate"],
                                    convertible=r["convertible"], similarity=r["similarity"],
                                    uncached_reason=r["uncached_reason"], live_tokens=r["live_tokens"],
                                    idle_wait_ms=r["idle_wait_ms"])

    def whole(self, final: dict):
        """The non-streamed ChatCompletion or Completion."""
        common = self._common(usage=self.usage(final), edgesync=self.info(final))
        if self.kind == "chat":
            choice = schemas.ChatChoice(message=schemas.ChatMessageOut(content=final["text"]),
                                        finish_reason=final["finish_reason"])
            return schemas.ChatCompletion(choices=[choice], **common)
        return schemas.Completion(choices=[schemas.CompletionChoice(text=final["text"],
                                                                    finish_reason=final["finish_reason"])],
                                  **common)

    def chunk(self, text: str | None = None, role: bool = False, final: dict | None = None):
        """A streamed chunk: the opening role (chat), a text piece, or the finish (with ``edgesync``)."""
        finish = final["finish_reason"] if final is not None else None
        info = self.info(final) if final is not None else None
        common = self._common(edgesync=info)
        if self.kind == "chat":
            delta = schemas.ChatDelta(role="assistant" if role else None, content="" if role else text)
            return schemas.ChatCompletionChunk(choices=[schemas.ChatChunkChoice(delta=delta, finish_reason=finish)],
                                               **common)
        return schemas.Completion(choices=[schemas.CompletionChoice(text=text or "", finish_reason=finish)], **common)

    def usage_chunk(self, final: dict):
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        common = self._common(usage=self.usage(final))
        if self.kind == "chat":
            return schemas.ChatCompletionChunk(choices=[], **common)
        return schemas.Completion(choices=[], **common)
