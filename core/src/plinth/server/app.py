"""The FastAPI app: routes, error handling, API keys, the body-size limit and metrics.

``build_app(engine, settings)`` takes a started ``EngineClient``
(``AsyncLLM``) and returns an ASGI app; the app uses only that interface.
Several apps can live in one process (each has its own metrics registry).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plinth import __version__
from plinth.engine.interfaces import EngineClient, KVTransferView
from plinth.errors import RequestError
from plinth.server import anthropic_api, openai_api, openapi, responses_api
from plinth.server.errors import APIError, error_bytes, error_response, is_anthropic_path, validation_message
from plinth.server.generation import GenerationPipeline
from plinth.server.metrics import CONTENT_TYPE
from plinth.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from plinth.server.serving import ServerSettings, ServingContext

if TYPE_CHECKING:
    from prometheus_client import Counter

log = logging.getLogger("plinth.server")

API_KEY_ENV = "PLINTH_API_KEY"

#: routes that need the API key (when one is set); /health, /ready, /metrics and /version stay open
def _protected(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


async def _send_error(send: Send, path: str, err: APIError) -> None:
    body = error_bytes(path, err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    """API keys and the request-body limit, before FastAPI parses anything.

    A body over the limit (by Content-Length, or counted as it arrives) is a
    413; the body is otherwise read here once and replayed to the app, so
    later ``receive`` calls see only the client's disconnect.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body = max_body

    def _authorized(self, scope: Scope, api_key: str) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = None
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        elif is_anthropic_path(scope["path"]) and "x-api-key" in headers:
            given = headers["x-api-key"].strip()
        return given is not None and hmac.compare_digest(given.encode(), api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.api_key and _protected(path) and scope.get("method") != "OPTIONS" and not self._authorized(scope, self.api_key):
            anthropic = is_anthropic_path(path)
            how = "an x-api-key header or a Bearer token" if anthropic else "an Authorization: Bearer header"
            return await _send_error(
                send, path, APIError(401, f"a valid API key is required ({how})", code="invalid_api_key")
            )
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = APIError(
            413, f"the request body is larger than the limit of {self.max_body} bytes", code="request_too_large"
        )
        for k, v in scope.get("headers", []):
            if k.lower() == b"content-length":
                try:
                    if int(v) > self.max_body:
                        return await _send_error(send, path, too_large)
                except ValueError:
                    return await _send_error(send, path, APIError(400, "invalid Content-Length header"))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body:
                return await _send_error(send, path, too_large)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class MetricsMiddleware:
    """Counts every HTTP answer by method, route and status."""

    ROUTES = {
        "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/v1/messages", "/v1/messages/count_tokens",
        "/health", "/ready", "/metrics", "/tokenize", "/detokenize", "/version",
    }  # fmt: skip

    def __init__(self, app: ASGIApp, *, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope["path"]
            route = path if path in self.ROUTES else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
            self.counter.labels(scope.get("method", ""), route, str(status[0])).inc()


class KVSaveBarrierMiddleware:
    """On a prefill instance (``kv_role`` kv_producer): hold the last body
    message of a generation request until the KV pages handed to the
    connector have been stored (at most the connector's deadline), so the
    decode instance the proxy calls next finds them."""

    def __init__(self, app: ASGIApp, *, transfer: KVTransferView) -> None:
        self.app = app
        self.transfer = transfer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                import anyio.to_thread

                if not await anyio.to_thread.run_sync(self.transfer.wait_saves):
                    log.warning("KV saves still running after %.1fs; answering anyway", self.transfer.deadline_s)
            await send(message)

        await self.app(scope, receive, send_wrapper)


def build_app(engine: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings(served_model_names=["default"])
    if settings.api_key is None:
        settings.api_key = os.environ.get(API_KEY_ENV) or None
    ctx = ServingContext(engine, settings)
    app = FastAPI(
        title="plinth",
        version=__version__,
        description="OpenAI- and Anthropic-compatible LLM server",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    # every generating route goes through the one pipeline; the route modules hold their protocol's shapes
    pipeline = GenerationPipeline(ctx)
    app.include_router(openai_api.router(openai_api.OpenAIServing(ctx, pipeline)))
    app.include_router(anthropic_api.router(anthropic_api.AnthropicServing(ctx, pipeline)))
    app.include_router(responses_api.router(responses_api.ResponsesServing(ctx, pipeline)))
    transfer = engine.kv_transfer()
    add_service_routes(app, ctx, transfer)
    # the document states the errors, this server's model names and limits (server/openapi.py)
    openapi.install(app, settings.served_model_names, engine.max_model_len, engine.model_config.vocab_size)
    add_middleware(app, ctx, transfer)
    return app


def install_error_handlers(app: FastAPI) -> None:
    """Errors in the protocol's shape: never a 500 for bad input."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(request.url.path, APIError.from_request_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = validation_message(list(exc.errors()))
        return error_response(request.url.path, APIError(400, message, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        err = APIError(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None)
        err.headers.update(exc.headers or {})  # 405 carries Allow
        return error_response(request.url.path, err)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return error_response(request.url.path, err)


def add_service_routes(app: FastAPI, ctx: ServingContext, transfer: KVTransferView | None) -> None:
    """/health, /ready, /metrics, /version, /tokenize and /detokenize."""
    engine, settings = ctx.engine, ctx.settings

    # GET and HEAD as one route, so a 405 names both in Allow (openapi.py gives the two operations their ids)
    @app.api_route("/health", methods=["GET", "HEAD"], response_model=HealthResponse)
    async def health() -> Response:
        """503 with the reason when the engine loop is gone (a dead rank);
        200 with ``"status": "degraded"`` and the reason when the KV
        connector's store is unhealthy or its circuit is open (the server
        still serves: those tokens are recomputed); 200 ``ok`` otherwise
        (draining too: the process is alive)."""
        ok, why = engine.health()
        if not ok:
            return JSONResponse({"status": why}, status_code=503)
        if transfer is not None:
            ok, why = transfer.health()
            if not ok:
                return JSONResponse({"status": "degraded", "kv_connector": why})
        return JSONResponse({"status": "ok"})

    @app.api_route("/ready", methods=["GET", "HEAD"], response_model=HealthResponse)
    async def ready() -> Response:
        """503 with the reason while new requests are refused (draining, failed)."""
        ok, why = engine.accepting()
        if not ok:
            return JSONResponse({"status": why}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        if ctx.metrics is None:
            raise APIError(404, "metrics are disabled (start the server with --enable-metrics)", code="not_found")
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        from plinth.api import PLUGIN_API_VERSION

        try:
            described = json.loads(json.dumps(engine.describe(), default=str))
        except Exception as exc:  # describe() is informational
            described = {"error": f"{type(exc).__name__}: {exc}", "max_model_len": engine.max_model_len}
        return VersionResponse(
            version=__version__, plugin_api=PLUGIN_API_VERSION, models=settings.served_model_names, engine=described
        )

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(req.model)
        if req.messages:
            _, ids = ctx.chat_prompt(
                openai_api.chat_messages(req.messages, native_tool_calls=ctx.native_tool_calls),
                add_generation_prompt=req.add_generation_prompt,
            )
        else:
            ids = ctx.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=engine.max_model_len,
            tokens=ids,
            token_strs=[ctx.token_str(t) for t in ids] if req.return_token_strs else None,
        )

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(req.model)
        ids = ctx.check_prompt_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(ids, skip_special_tokens=False))


def add_middleware(app: FastAPI, ctx: ServingContext, transfer: KVTransferView | None) -> None:
    """The last added runs first: metrics, then the guard (API key, body size), then the KV save barrier."""
    settings = ctx.settings
    if transfer is not None and getattr(transfer, "role", "") == "kv_producer":
        app.add_middleware(KVSaveBarrierMiddleware, transfer=transfer)
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body=settings.max_request_body_bytes)
    if ctx.metrics is not None:
        app.add_middleware(MetricsMiddleware, counter=ctx.metrics.http_requests)
