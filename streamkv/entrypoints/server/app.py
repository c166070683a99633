"""``streamkv serve``: the Starlette app (OpenAI HTTP API with SSE, WebSocket chat, metrics,
the demo page) on uvicorn (asyncio's loop; --loop uvloop). The model loads on the engine
thread after the server is up; until then /health answers 503.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from streamkv import __version__
from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.openai.chat_serving import ChatServing
from streamkv.entrypoints.openai.errors import ENGINE_ERRORS, APIError, engine_error
from streamkv.entrypoints.openai.protocol import RequestTypes, parse_json_body
from streamkv.entrypoints.openai.serving import OpenAIServing
from streamkv.entrypoints.openai.vllm_routes import TokenizeServing, VLLMRoutes, model_permission
from streamkv.entrypoints.server.kv_view import KVView
from streamkv.entrypoints.server.lifespan import make_lifespan
from streamkv.entrypoints.server.metrics import ServerMetrics
from streamkv.entrypoints.server.pages import WEB_DIR, page_routes
from streamkv.entrypoints.server.prefixes import PrefixAdmin
from streamkv.entrypoints.server.security import (
    AuthFailures,
    Guard,
    HostPolicy,
    check_api_key,
    check_origin,
)
from streamkv.entrypoints.server.websocket import chat_ws

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    model_name: str
    # More names the model answers to (vLLM's --served-model-name A B ...: A is model_name).
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    hosts: HostPolicy = field(default_factory=HostPolicy)
    auth_failures: AuthFailures = field(default_factory=AuthFailures, repr=False)
    max_body_bytes: int = 2 * 2**20
    max_header_bytes: int = 16 * 1024
    max_queue_len: int | None = None
    sse_keepalive: float = 15.0
    ws_max_active: int = 8
    # tool_choice "auto" parses the model's Hermes-style calls (--enable-auto-tool-choice).
    auto_tool_choice: bool = True
    # Logprobs name tokens "token_id:ID" by default (--return-tokens-as-token-ids).
    tokens_as_ids: bool = False
    web_dir: Path | None = WEB_DIR
    on_load_failure: Callable[[], None] | None = field(default=None, repr=False)
    # Awaited once the model is loaded (serve logs its "ready:" line there).
    on_ready: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)
    # The live KV view (/v1/kv/stream). None: on only when the server listens on loopback
    # alone, as its rows, even anonymous, show other users' activity (issue 26).
    kv_view: bool | None = None
    # Request bodies' types as OpenAI checks them ("5" is not 5) rather than vLLM's coercion
    # (--strict-request-types).
    strict_request_types: bool = False
    # --error-format: "vllm" puts the error class and the status in type / code.
    error_format: str = "openai"
    # --tools-system-prompt: tools a template ignores go into a system message.
    tools_system_prompt: bool = True


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# A JSON body sent as a form (curl -d without -H) is refused, as vLLM (FastAPI) refuses it.
_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


async def read_json(request: Request, limit: int) -> dict:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() in _FORM_TYPES:
        raise APIError(
            "the request body must be JSON, sent with 'Content-Type: application/json'",
            code="invalid_content_type",
        )
    too_large = f"the request body is larger than {limit} bytes"
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise APIError(too_large, 413, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(too_large, 413, code="request_too_large")
        chunks.append(chunk)
    return parse_json_body(b"".join(chunks))


def build_app(engine: AsyncEngine, config: ServerConfig) -> Starlette:
    serving = OpenAIServing(
        engine,
        config.model_name,
        config.max_queue_len,
        config.sse_keepalive,
        config.model_aliases,
        config.tokens_as_ids,
    )
    chat = ChatServing(engine, serving, config.auto_tool_choice)
    tokens = TokenizeServing(engine, serving.check_model)
    metrics = ServerMetrics(engine, config.model_name)
    api = _api_wrapper(config)
    kv_on = config.kv_view if config.kv_view is not None else config.hosts.loopback_only
    kv_view = KVView(engine, enabled=kv_on)
    health = _health(engine)
    routes = [
        Route("/health", health),
        Route("/version", _version),
        Route("/metrics", _prometheus(metrics)),
        Route("/v1/models", api(_models(engine, config), body=False)),
        Route("/v1/completions", api(serving.completions), methods=["POST"]),
        Route("/v1/chat/completions", api(chat.completions), methods=["POST"]),
        Route("/tokenize", api(tokens.tokenize), methods=["POST"]),
        Route("/detokenize", api(tokens.detokenize), methods=["POST"]),
        WebSocketRoute("/v1/chat/ws", chat_ws),
        Route("/v1/kv/stream", api(kv_view.stream, body=False)),  # the live KV-cache view
        *PrefixAdmin(engine).routes(api),  # reserved shared prefixes (prefixes.py)
        # /ping, /invocations, /load, ... (openai/vllm_routes.py)
        *VLLMRoutes(engine, serving, chat, health).routes(api),
        *page_routes(config.model_name, config.web_dir),  # /, /web, /openapi.json, /docs
    ]
    app = Starlette(
        routes=routes,
        middleware=_middleware(config),
        lifespan=make_lifespan(engine, metrics, config.on_load_failure, config.on_ready),
        exception_handlers={HTTPException: _on_http_error, Exception: _on_crash},
    )
    app.state.engine, app.state.serving, app.state.chat = engine, serving, chat
    app.state.metrics, app.state.config = metrics, config
    return app


def _health(engine: AsyncEngine):
    async def health(request: Request) -> Response:
        try:
            engine.check_alive()
        except ENGINE_ERRORS as e:
            return error_response(engine_error(e))
        return Response(status_code=200)

    return health


async def _version(request: Request) -> Response:
    return JSONResponse({"version": __version__})


def _models(engine: AsyncEngine, config: ServerConfig):
    async def models(request: Request) -> Response:
        cards = []
        for name in (config.model_name, *config.model_aliases):
            card = {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "streamkv",
                "root": config.model_name,
                "parent": None,
                "permission": [model_permission()],
            }
            if engine.info is not None:
                card["max_model_len"] = engine.info.max_model_len
            cards.append(card)
        return JSONResponse({"object": "list", "data": cards})

    return models


def _prometheus(metrics: ServerMetrics):
    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return prometheus


def _api_wrapper(config: ServerConfig):
    """``api(handler, auth=True, body=True)``: ``handler`` as an endpoint that checks a POST's
    origin and (``auth``) the API key, passes the JSON body (``body``), and answers errors in
    the OpenAI shape."""

    hosts, origins = config.hosts, config.allowed_origins
    key, failures = config.api_key, config.auth_failures

    def api(handler, auth: bool = True, body: bool = True):
        async def endpoint(request: Request) -> Response:
            try:
                local = request.scope["server"][0] if request.scope.get("server") else None
                if request.method == "POST":
                    check_origin(request.headers, request.url.scheme, hosts, origins, local)
                if auth:
                    client = request.client.host if request.client else ""
                    check_api_key(key, request.headers, failures=failures, client=client)
                if body:
                    return await handler(request, await read_json(request, config.max_body_bytes))
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except ENGINE_ERRORS as e:
                return error_response(engine_error(e))
            except ClientDisconnect:
                return Response(status_code=499)

        return endpoint

    return api


def _middleware(config: ServerConfig) -> list[Middleware]:
    """Outermost first: the host and header guard, the request-type checks, then CORS for the
    allowed cross origins (if any)."""
    middleware = [
        Middleware(Guard, policy=config.hosts, header_limit=config.max_header_bytes),
        Middleware(
            RequestTypes,
            strict=config.strict_request_types,
            error_format=config.error_format,
            tools_prompt=config.tools_system_prompt,
        ),
    ]
    cross = [o for o in config.allowed_origins if o]
    if cross:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=cross,
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
            )
        )
    return middleware


async def _on_http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(str(exc.detail), exc.status_code, kind))


async def _on_crash(request: Request, exc: Exception) -> Response:
    # Logged with its traceback here; the client only learns that it was our fault.
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError("internal server error", 500, "internal_error"))
