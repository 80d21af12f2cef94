"""The FastAPI application: routes, auth, error bodies, metrics — no generation logic.

Routes (query strings are ignored everywhere, conformance 0.1):

- ``POST /v1/chat/completions``, ``POST /v1/completions``  (:mod:`resin.server.openai`)
- ``POST /v1/responses``                                      (:mod:`resin.server.openai.responses`)
- ``POST /v1/messages``, ``POST /v1/messages/count_tokens``   (:mod:`resin.server.anthropic`)
- ``GET /v1/models`` (OpenAI list; Anthropic's shape when ``anthropic-version`` is sent),
  ``GET /health`` (200 ``{}``; 503 once the engine loop died; ``HEAD`` too), ``GET /metrics``,
  ``GET /version``.

Bodies are read as JSON dicts (unknown fields ignored; :mod:`resin.server.request_body`: size
and time limits, strict JSON); malformed JSON, wrong types and every other client error become
400 in the API's own error shape (Anthropic's under ``/v1/messages``), FastAPI's 422 included.
A large request is validated and its prompt built in a worker thread
(:meth:`ServerContext.prepare`), so the event loop keeps serving other clients meanwhile. With
``--api-key``, ``/v1/*`` needs ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
(compared in constant time; 401 with ``WWW-Authenticate: Bearer`` otherwise), and the
FastAPI docs pages (``/docs``, ``/redoc``, ``/openapi.json``) are off unless
``--enable-fastapi-docs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import resin
from resin.server.context import ServerContext
from resin.server.engine_loop import RequestRejected, RunnerFailure
from resin.server.errors import APIError, model_not_found, rejected
from resin.server.http_metrics import HttpMetrics
from resin.server.ids import random_id
from resin.server.request_body import parse_json, read_body
from resin.server.sse import generation_response

ENDPOINTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
    "/version",
]


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, error: APIError) -> JSONResponse:
    body = error.anthropic_body() if _is_anthropic(path) else error.openai_body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class AuthAndMetrics:
    """ASGI middleware: API-key check on ``/v1/*`` and the HTTP request counter."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: HttpMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.key = None if api_key is None else api_key.encode("utf-8")
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        started = time.perf_counter()
        if self.api_key is not None and path.startswith("/v1/") and not self._authorized(scope):
            error = APIError(
                401,
                "Invalid API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                code="invalid_api_key",
                headers={"www-authenticate": 'Bearer realm="resin"'},
            )
            response = error_response(path, error)
            self.metrics.observe(path, scope["method"], 401, time.perf_counter() - started)
            await response(scope, receive, send)
            return
        recorded = False
        anthropic = _is_anthropic(path)

        async def send_and_count(message: Message) -> None:
            nonlocal recorded
            if message["type"] == "http.response.start" and not recorded:
                recorded = True
                self.metrics.observe(
                    path, scope["method"], message["status"], time.perf_counter() - started
                )
                if anthropic:  # Anthropic's API names every response (the SDKs' _request_id)
                    headers = list(message.get("headers", []))
                    headers.append((b"request-id", random_id("req_").encode("ascii")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_and_count)

    def _authorized(self, scope: Scope) -> bool:
        """Whether a header carries the key; compared in constant time (secrets.compare_digest),
        so response timing does not reveal how much of a guess was right."""
        assert self.key is not None
        authorized = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                if value[:7].lower() == b"bearer ":
                    authorized |= secrets.compare_digest(value[7:].strip(), self.key)
            elif name == b"x-api-key":
                authorized |= secrets.compare_digest(value.strip(), self.key)
        return authorized


T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody receives it


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Await ``work`` (a handler's response), cancelling it if the client disconnects first —
    the cancellation reaches the generation, which aborts its engine requests. A streaming
    handler returns its response at once, so this only guards the time to the first byte."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def read_raw(ctx: ServerContext, request: Request) -> bytes:
    """The request body, within the size and time limits (413 / 408 / 400)."""
    return await read_body(request, ctx.max_request_body_bytes, ctx.options.timeout_body)


async def prepare_body(
    ctx: ServerContext, raw: bytes, prepare: Callable[[dict[str, Any]], T]
) -> tuple[dict[str, Any], T]:
    """Parse the body and run the endpoint's ``prepare`` on it (in a worker thread when the
    body is large): ``(body, prepared)``."""

    def work() -> tuple[dict[str, Any], T]:
        body = parse_json(raw)
        return body, prepare(body)

    # A body that may ask for a grammar (a forced tool call, a response format) is prepared off
    # the event loop whatever its size: compiling a few hundred tools' schemas takes ~1 s.
    may_compile = any(field in raw for field in GRAMMAR_FIELDS)
    return await ctx.prepare(len(raw), work, offload=may_compile)


# Request fields whose presence may make the request compile a grammar (resin.server.structured):
# Chat / Responses / Anthropic tool_choice, Chat response_format, Responses text.format.
GRAMMAR_FIELDS = (b'"tool_choice"', b'"response_format"', b'"format"')


def build_app(ctx: ServerContext) -> FastAPI:
    metrics = HttpMetrics(ENDPOINTS)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        ctx.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            ctx.loop.stop()

    docs = ctx.options.enable_docs
    if docs is None:  # the schema is no secret, but a locked server need not advertise it
        docs = ctx.options.api_key is None
    app = FastAPI(
        title="Resin",
        version=resin.__version__,
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.add_middleware(AuthAndMetrics, api_key=ctx.options.api_key, metrics=metrics)
    if ctx.options.allowed_origins:
        # Outermost, so a preflight (OPTIONS, no credentials) is answered before the key check,
        # as vLLM and SGLang answer it; the actual request still needs the key.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=ctx.options.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.state.ctx = ctx
    app.state.http_metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, APIError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        return error_response(
            request.url.path, APIError(exc.status_code, f"{message}: {request.url.path}")
        )

    @app.exception_handler(RequestRejected)
    async def _rejected(request: Request, exc: RequestRejected) -> JSONResponse:
        return error_response(request.url.path, rejected(str(exc)))

    @app.exception_handler(RunnerFailure)
    async def _runner_failure(request: Request, exc: RunnerFailure) -> JSONResponse:
        return error_response(request.url.path, APIError(500, str(exc)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request.url.path, APIError(500, f"internal error: {exc!r}"))

    async def chat_response(raw: bytes) -> Response:
        from resin.server.openai import chat

        body, (model, gen_request, prompt, tool_choice) = await prepare_body(
            ctx, raw, lambda body: chat.prepare_chat(ctx, body)
        )
        return_ids = body.get("return_token_ids") is True
        generation = ctx.start(gen_request, "chatcmpl")
        return await generation_response(
            bool(body.get("stream")),
            lambda: chat.stream_chat(ctx, model, generation, prompt, tool_choice, body),
            lambda: chat.complete_chat(
                ctx, model, generation, prompt, tool_choice, return_token_ids=return_ids
            ),
            generation.abort,
            large=gen_request.num_top_logprobs is not None or gen_request.n > 1,
        )

    async def completion_response(raw: bytes) -> Response:
        from resin.server.openai import completions as legacy

        body, completion = await prepare_body(
            ctx, raw, lambda body: legacy.CompletionRequest(ctx, body)
        )
        completion.start(ctx)
        return await generation_response(
            bool(body.get("stream")),
            lambda: legacy.stream_completion(completion, body),
            lambda: legacy.complete(completion),
            completion.abort,
            large=completion.num_logprobs is not None
            or len(completion.requests) * completion.n > 1,
        )

    async def responses_response(raw: bytes) -> Response:
        from resin.server.openai import responses as responses_api
        from resin.server.openai.responses_request import prepare_response

        _, request = await prepare_body(ctx, raw, lambda body: prepare_response(ctx, body))
        return await responses_api.create_response(ctx, request)

    async def messages_response(raw: bytes) -> Response:
        from resin.server.anthropic import messages as messages_api

        _, request = await prepare_body(ctx, raw, lambda body: messages_api.prepare(ctx, body))
        return await messages_api.create_message(ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await unless_disconnected(request, chat_response(await read_raw(ctx, request)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await unless_disconnected(request, completion_response(await read_raw(ctx, request)))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await unless_disconnected(request, responses_response(await read_raw(ctx, request)))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await unless_disconnected(request, messages_response(await read_raw(ctx, request)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        from resin.server.anthropic import messages as messages_api

        raw = await read_raw(ctx, request)
        _, counted = await prepare_body(ctx, raw, lambda body: messages_api.count_tokens(ctx, body))
        return JSONResponse(counted)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        from resin.server.openai import tokenize as tokenize_api

        raw = await read_raw(ctx, request)
        _, tokens = await prepare_body(ctx, raw, lambda body: tokenize_api.tokenize(ctx, body))
        return JSONResponse(tokens)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        from resin.server.openai import tokenize as tokenize_api

        raw = await read_raw(ctx, request)
        _, text = await prepare_body(ctx, raw, lambda body: tokenize_api.detokenize(ctx, body))
        return JSONResponse(text)

    def openai_model(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "resin",
            "root": name,
            "parent": None,
            "max_model_len": ctx.max_model_len,
        }

    def anthropic_model(name: str) -> dict[str, Any]:
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ctx.created))
        return {"type": "model", "id": name, "display_name": name, "created_at": created_at}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        names = ctx.options.served_model_names
        if request.headers.get("anthropic-version"):
            data = [anthropic_model(name) for name in names]
            return JSONResponse(
                {
                    "data": data,
                    "has_more": False,
                    "first_id": data[0]["id"],
                    "last_id": data[-1]["id"],
                }
            )
        return JSONResponse({"object": "list", "data": [openai_model(name) for name in names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        """One served model (the SDKs' ``models.retrieve``), in the caller's API's shape; a
        name not served is a 404 in that shape too."""
        anthropic = bool(request.headers.get("anthropic-version"))
        # /v1/messages answers any claude-* name (Claude Code's), so an Anthropic lookup does
        served = model_id in ctx.options.served_model_names
        if not served and not (anthropic and model_id.startswith("claude")):
            error = model_not_found(model_id)
            body = error.anthropic_body() if anthropic else error.openai_body()
            return JSONResponse(body, status_code=404)
        return JSONResponse(anthropic_model(model_id) if anthropic else openai_model(model_id))

    @app.head("/health", include_in_schema=False)  # load balancers' probes
    @app.get("/health")
    async def health() -> Response:
        if not ctx.loop.alive:
            return JSONResponse({"error": "the engine loop is not running"}, status_code=503)
        return JSONResponse({})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": resin.__version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        text = ctx.loop.engine.metrics_text() + metrics.render()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
