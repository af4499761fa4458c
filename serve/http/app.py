"""The FastAPI app: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models``,
``/health`` (GET and HEAD), ``/metrics``, over one :class:`serve.http.loop.EngineLoop`.

Errors are OpenAI-style bodies (:class:`serve.http.protocol.RequestError`, ``param`` the field's path as the
client wrote it, e.g. ``messages[0].content``): 400 for a body that is not JSON or not UTF-8, an unknown field, a
wrong type (at any depth: ``messages[0]`` that is not an object) or a value out of range; 404 for another model or
path (a trailing slash is not redirected: a redirect would be built from the request's Host header); 415 for a body
sent with a Content-Type other than application/json (:func:`require_json`); 429 with ``Retry-After`` when
``max_num_seqs + max_queue`` requests are outstanding; 500 when the engine aborted the request because its row failed
(its reason in the message; the server goes on serving the others); 503 with ``Retry-After`` when the engine rejects
a request it can never fit or the engine loop is down. A streaming response starts only after the request's first
token (so an error before it still gets its status code); a failure after it ends the stream with an ``error``
event (as vLLM's streaming error) and ``[DONE]``. A client that disconnects, before or during its stream, has its
request aborted on the engine thread, which frees its slot and pages. FastAPI's ``/docs`` (which loads its scripts
from a CDN) and ``/openapi.json`` are served only with ``docs=True`` (``--docs``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.config import STATE_DTYPES
from serve.engine import ServeEngine
from serve.engine.request import RequestResult, RequestStatus
from serve.http.loop import EngineLoop, LoopStopped, QueueFull, Stream
from serve.http.metrics import ServerMetrics
from serve.http.model import pool_capacity
from serve.http.protocol import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    TextDecoder,
    chat_body,
    check_request,
    client_path,
    completion_body,
    decode_all,
    logprobs_body,
    new_id,
    usage,
)
from serve.http.step_trace import StepTrace
from serve.text_codec import BYTES

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.2


async def require_json(request: Request) -> None:
    """A request body must be sent as ``Content-Type: application/json`` (parameters such as ``charset`` allowed):
    another or no Content-Type is a 415 naming it, as vLLM's ``validate_json_request``
    (``vllm/entrypoints/openai/api_server.py``) refuses it, rather than a "not a JSON object" 400 about a body
    that may well be valid JSON (FastAPI does not parse a body of another content type)."""
    content_type = request.headers.get("content-type")
    if content_type is None or content_type.split(";", 1)[0].strip().lower() != "application/json":
        got = "missing" if content_type is None else f"{content_type!r}"
        raise StarletteHTTPException(415, f"Unsupported Media Type: Content-Type is {got}; only "
                                          "'application/json' is allowed")


def error_response(err: RequestError, retry_after: int | None = None) -> JSONResponse:
    headers = None if retry_after is None else {"Retry-After": str(retry_after)}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(engine: ServeEngine, model_name: str, max_model_len: int, max_num_seqs: int,
               max_queue: int, trace: StepTrace | None = None, *, docs: bool = False,
               on_death: Callable[[BaseException], None] | None = None, codec=BYTES) -> FastAPI:
    """The server app over ``engine`` (whose thread starts and stops with the app). ``max_model_len``:
    prompt + output tokens per request; ``max_num_seqs``: requests inside the engine at once; ``max_queue``:
    requests queued in front of it before a 429; ``trace``: an optional :class:`StepTrace` of every step and
    request; ``docs``: serve FastAPI's ``/docs`` and ``/openapi.json``; ``on_death``: called with the error if the
    engine loop dies (:class:`EngineLoop`); ``codec``: the served model's text codec (:mod:`serve.text_codec`; the
    byte vocabulary by default). ``app.state.loop`` is the :class:`EngineLoop`. ``/v1/models`` reports, besides vLLM's
    ``max_model_len``, the engine's decode-time ``state_write``, its ``ring_size`` (null under "slot") and the
    stored dtype of its KDA recurrent states, ``state_dtype`` ("fp32", "bf16" or "fp16"), and
    ``prefix_hit_exact``: whether a prefix-cache hit serves bitwise the tokens of the same request run cold (true
    with fp32 states only: a 16-bit checkpoint is rounded where the cold run's state is not; null without a
    prefix cache)."""
    vocab_size = engine.model.cfg.vocab_size
    metrics = ServerMetrics(model_name, engine.layout.block_size)
    metrics.pool_capacity(pool_capacity(engine, max_model_len))
    loop = EngineLoop(engine, metrics, max_num_seqs, max_queue, trace, on_death)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()

    app = FastAPI(title="KDA Serve Lab OpenAI-compatible server", lifespan=lifespan, redirect_slashes=False,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.loop, app.state.metrics, app.state.created = loop, metrics, int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        model = ChatRequest if request.url.path.endswith("/chat/completions") else CompletionRequest
        errors = [(e, client_path(model, e.get("loc", ())[1:])) for e in exc.errors()]
        # a union field gets one error per member tried: report the member that got furthest into the value
        first, where = max(errors, key=lambda ew: len(ew[0].get("loc", ())), default=({}, None))
        kind, loc = first.get("type", ""), tuple(first.get("loc", ("",)))
        if kind == "json_invalid" or loc[0] != "body" or len(loc) == 1:
            where, msg = None, f"the body is not a JSON object: {first.get('msg', 'invalid JSON')}"
        elif kind in ("model_attributes_type", "model_type"):          # a nested value that must be an object
            msg = f"{where} must be a JSON object, got {json.dumps(first.get('input'), default=repr)}"
        elif kind == "extra_forbidden":
            msg = f"unknown field {where!r}"
        elif kind == "missing":
            msg = f"missing required field {where!r}"
        else:
            tried = dict.fromkeys(e.get("msg", "invalid value") for e, path in errors if path == where)
            msg = f"{where}: {', or '.join(tried)} (got {first.get('input')!r})"
        return error_response(RequestError(msg, where))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):       # e.g. a body that is not UTF-8
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(RequestError(f"{exc.detail} (is the body UTF-8 JSON?)" if exc.status_code == 400
                                           else str(exc.detail), None, exc.status_code, kind))

    @app.get("/health")
    async def health():
        if loop.alive:
            return Response(status_code=200)
        why = "" if loop.error is None else f": {type(loop.error).__name__}: {loop.error}"
        return error_response(RequestError(f"the engine loop is down{why}", None, 503, "service_unavailable"),
                              RETRY_AFTER_S)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)   # load balancers' probe

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    ring_size = engine.replay.ring_size if engine.replay is not None else None     # as the engine runs it
    state_dtype = next(k for k, v in STATE_DTYPES.items() if v == engine.config.state_dtype)
    hit_exact = None if engine.cache is None else state_dtype == "fp32"

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": app.state.created,
                                            "owned_by": "kda-serve-lab", "root": model_name,
                                            "max_model_len": max_model_len, "state_write": engine.state_write,
                                            "ring_size": ring_size, "state_dtype": state_dtype,
                                            "prefix_hit_exact": hit_exact}]}

    @app.post("/v1/completions", dependencies=[Depends(require_json)])
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(body, request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_json)])
    async def chat(body: ChatRequest, request: Request):
        return await _serve(body, request, chat=True)

    async def _serve(body, request: Request, chat: bool):
        try:
            checked = check_request(body, model_name, max_model_len, codec, vocab_size)
            if engine.speculation is not None and not checked.sampling.greedy:
                raise RequestError("temperature > 0 is not supported by this server: it decodes speculatively "
                                   "(--speculative-config), accepting drafts greedily; send temperature 0",
                                   "temperature")
            prompt = checked.prompt
            stream = loop.submit(prompt, checked.max_tokens, checked.sampling, checked.logprobs)
        except RequestError as err:
            return error_response(err)
        except QueueFull as err:
            metrics.queue_full()
            return error_response(RequestError(f"server busy: {err}; retry later", None, 429, "rate_limit_exceeded"),
                                  RETRY_AFTER_S)
        except LoopStopped as err:
            return error_response(RequestError(str(err), None, 503, "service_unavailable"), RETRY_AFTER_S)
        rid = new_id("chatcmpl" if chat else "cmpl")
        watcher = asyncio.ensure_future(_watch_disconnect(request))
        try:
            return await _respond(body, stream, watcher, prompt, rid, chat)
        finally:
            watcher.cancel()

    async def _respond(body, stream: Stream, watcher, prompt: list, rid: str, chat: bool):
        try:
            first = await _next_or_disconnect(stream, watcher)
        except _Disconnected:
            loop.abort(stream)
            return Response(status_code=499)               # nobody reads it: nginx's "client closed request"
        except asyncio.CancelledError:
            loop.abort(stream)
            raise
        if isinstance(first, RequestResult) and first.status is not RequestStatus.FINISHED:
            return _ended_early(first, "request not served")
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_sse(stream, first, rid, chat, include_usage,
                                          getattr(body, "return_tokens_as_token_ids", False)),
                                     media_type="text/event-stream")
        ids = [] if isinstance(first, RequestResult) else list(first)
        lps = [] if isinstance(first, RequestResult) else list(first.logprobs or ())
        try:
            while not isinstance(first, RequestResult):
                first = await _next_or_disconnect(stream, watcher)
                if not isinstance(first, RequestResult):
                    ids += first
                    lps += first.logprobs or ()
        except _Disconnected:
            loop.abort(stream)
            return Response(status_code=499)
        except asyncio.CancelledError:
            loop.abort(stream)
            raise
        if first.status is not RequestStatus.FINISHED:
            return _ended_early(first, "request ended early")
        use = usage(len(prompt), len(ids), first.hit_tokens)
        text = decode_all(ids, codec)
        if chat:
            return chat_body(rid, model_name, text, "length", use, False)
        as_ids = body.return_tokens_as_token_ids
        return completion_body(rid, model_name, text, "length", use,
                               None if stream.logprobs is None else logprobs_body(ids, lps, as_ids))

    def _failure(res: RequestResult, what: str) -> tuple[RequestError, int | None]:
        """The error of a request the engine ended unfinished, and its Retry-After: 500 if the engine aborted it
        for its own failure while serving on (a retry would fail the same way), else 503 (rejected: it can never
        fit; or the engine loop is down)."""
        if res.status is RequestStatus.ABORTED and loop.alive:
            return RequestError(f"{what}: the request failed in the engine: {res.reason or 'aborted'}", None, 500,
                                "server_error"), None
        return RequestError(f"{what}: {res.reason or res.status.value}", None, 503, "service_unavailable"), RETRY_AFTER_S

    def _ended_early(res: RequestResult, what: str) -> JSONResponse:
        return error_response(*_failure(res, what))

    async def _sse(stream: Stream, first, rid: str, chat: bool, include_usage: bool, body_as_ids: bool = False):
        """The SSE body: one chunk per engine push, the last with ``finish_reason``, usage if asked, [DONE]."""
        dec, n, item, started, sent = TextDecoder(codec), 0, first, False, []
        as_ids = not chat and stream.logprobs is not None and body_as_ids
        try:
            if chat:
                yield _event(chat_body(rid, model_name, "", None, None, True, first=True))
                started = True
            while True:
                if isinstance(item, RequestResult):
                    break
                n += len(item)
                text = dec.feed(item)
                if item.logprobs is not None:            # every token's logprob, even before its text completes
                    yield _event(completion_body(rid, model_name, text, None, None,
                                                 logprobs_body(list(item), item.logprobs, as_ids, sent)))
                elif text:
                    yield _event(chat_body(rid, model_name, text, None, None, True) if chat else
                                 completion_body(rid, model_name, text, None, None))
                sent += item
                item = await stream.events.get()
            if item.status is not RequestStatus.FINISHED:            # the engine ended it: say why, as an error
                yield f"data: {json.dumps(_failure(item, 'stream ended early')[0].body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            tail, finish = dec.feed([], final=True), "length"
            yield _event(chat_body(rid, model_name, tail, finish, None, True, first=not started) if chat else
                         completion_body(rid, model_name, tail, finish, None))
            if include_usage:
                use = usage(len(stream.prompt), n, item.hit_tokens)
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _event({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                              "choices": [], "usage": use})
            yield "data: [DONE]\n\n"
        finally:
            if not stream.done:                       # client gone mid-stream (cancelled or closed)
                loop.abort(stream)

    return app


class _Disconnected(Exception):
    """The client closed the connection before its response started."""


async def _watch_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (polled every DISCONNECT_POLL_S)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _next_or_disconnect(stream: Stream, watcher: asyncio.Future):
    """The stream's next event, or _Disconnected once ``watcher`` (:func:`_watch_disconnect`) has fired. The
    watcher runs beside the whole wait: polling only between events would never poll while tokens arrive
    faster than the poll period."""
    get = asyncio.ensure_future(stream.events.get())
    try:
        done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        raise _Disconnected()
    finally:
        if not get.done():
            get.cancel()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
