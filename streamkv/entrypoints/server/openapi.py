"""``/openapi.json``: every route the server serves, with request schemas generated from the
request models (pages.py serves it, and renders it as ``/docs``).

The routes are listed here by hand, beside the code that serves them (app.py, pages.py,
openai/vllm_routes.py, prefixes.py, kv_view.py, websocket.py); a route of the app that this
list lacks fails tests/entrypoints/server/test_openapi_routes.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from streamkv import __version__
from streamkv.entrypoints.openai.chat_request import ChatCompletionRequest
from streamkv.entrypoints.openai.requests import CompletionRequest
from streamkv.entrypoints.openai.vllm_routes import DetokenizeRequest, TokenizeRequest

MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
)
_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


@dataclass(frozen=True, slots=True)
class Endpoint:
    method: str
    path: str
    summary: str
    body: str | None = None  # the request body's schema (a components/schemas name)
    media: str = "application/json"  # the 200 answer's
    answer: str = "the result"
    open: bool = False  # answered without the API key
    query: tuple[tuple[str, str], ...] = ()  # (name, description) of string query parameters


_SSE = "``text/event-stream`` with ``stream: true``"
_PAGE = {"media": "text/html", "answer": "the page", "open": True}  # a browser's, no key
_READY = {"media": "", "answer": "ready", "open": True}  # health checks
ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "post",
        "/v1/completions",
        "Text completion, whole or streamed (SSE)",
        "CompletionRequest",
        answer=f"a ``text_completion`` ({_SSE})",
    ),
    Endpoint(
        "post",
        "/v1/chat/completions",
        "Chat completion through the model's chat template",
        "ChatCompletionRequest",
        answer=f"a ``chat.completion`` ({_SSE})",
    ),
    Endpoint(
        "post",
        "/v1/chat/completions/batch",
        "vLLM's: several conversations with one set of parameters",
        "ChatCompletionBatchRequest",
        answer="one ``chat.completion`` whose choice ``index`` is the conversation's, usage summed",
    ),
    Endpoint(
        "post",
        "/invocations",
        "SageMaker's: a chat completion (``messages``) or a completion (``prompt``)",
        "InvocationsRequest",
        answer="as /v1/chat/completions or /v1/completions",
    ),
    Endpoint(
        "get",
        "/v1/models",
        "The served model, once per served name",
        answer='``{"object": "list", "data": [model card]}``',
    ),
    Endpoint(
        "post",
        "/tokenize",
        "Token ids of a prompt or of rendered chat messages",
        "TokenizeRequest",
        answer='``{"count", "max_model_len", "tokens", "token_strs"}``',
    ),
    Endpoint(
        "post", "/detokenize", "Text of token ids", "DetokenizeRequest", answer='``{"prompt"}``'
    ),
    Endpoint(
        "get", "/tokenizer_info", "vLLM's: the tokenizer's class, configuration and chat template"
    ),
    Endpoint(
        "get",
        "/load",
        "vLLM's: requests in the engine now (running, waiting or swapped)",
        answer='``{"server_load": n}``',
    ),
    Endpoint(
        "post",
        "/v1/prefixes",
        "Register a reserved shared prefix: computed once, its blocks pinned",
        "PrefixRequest",
        answer="the prefix",
    ),
    Endpoint(
        "get",
        "/v1/prefixes",
        "The registered reserved prefixes",
        answer='``{"object": "list", "data"}``',
    ),
    Endpoint(
        "delete",
        "/v1/prefixes/{prefix_id}",
        "Unregister a reserved prefix (404 for an unknown id)",
        answer='``{"id", "object", "deleted": true}``',
    ),
    Endpoint(
        "get",
        "/v1/kv/stream",
        "The live KV-cache view: snapshots as server-sent events",
        media="text/event-stream",
        answer="``kv_snapshot`` events (docs/api.md)",
        query=(
            (
                "token",
                "16 to 128 of [A-Za-z0-9_-]: requests whose request_id holds it are shown as "
                "the viewer's own; every other row is anonymous",
            ),
        ),
    ),
    Endpoint(
        "get",
        "/v1/chat/ws",
        "WebSocket chat: several generations on one socket (see the description)",
        media="",
        answer="switching protocols",
    ),
    Endpoint(
        "get",
        "/health",
        "200 once the model is loaded; 503 while loading, after a failure, shutting down",
        **_READY,
    ),
    Endpoint("get", "/ping", "SageMaker's health check: as /health", **_READY),
    Endpoint("post", "/ping", "SageMaker's health check: as /health", **_READY),
    Endpoint("get", "/version", "The server's version", answer='``{"version"}``', open=True),
    Endpoint(
        "get",
        "/metrics",
        "Prometheus metrics (vLLM's names)",
        media="text/plain",
        answer="the metrics",
        open=True,
    ),
    Endpoint("get", "/openapi.json", "This document", answer="OpenAPI 3.1", open=True),
    Endpoint("get", "/docs", "This document as an HTML page", **_PAGE),
    Endpoint("get", "/", "The chat page with the live KV-cache view", **_PAGE),
    Endpoint(
        "get",
        "/web/{path}",
        "The page's scripts, styles and vendored libraries",
        media="",
        answer="the file",
        open=True,
    ),
)

_WEBSOCKET = (
    "Chat over the WebSocket ``/v1/chat/ws`` (subprotocol ``streamkv``; from a browser the API key "
    "as a second subprotocol ``bearer.KEY``). Client: "
    '``{"type": "chat", "id", "messages", "params"}`` (``params``: ChatCompletionRequest\'s fields '
    "but n, best_of, use_beam_search, stream, stream_options, tools, tool_choice, prompt_logprobs, "
    'echo, return_token_ids) and ``{"type": "cancel", "id"}``. Server: ``delta`` messages '
    '(``{"type": "delta", "id", "text"}``; the first also carries ``request_id``, the engine\'s '
    "id of the generation), then one ``done`` (``finish_reason``, ``usage``) or one ``error`` "
    "(an OpenAI error)."
)

_FIELDS = {name: {"type": ["string", "null"]} for name in ("message", "type", "param", "code")}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": _FIELDS}}}
_PREFIX = {  # prefixes.py parses this body by hand (it has no model)
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "integer"}, "minItems": 1},
            ],
            "description": "the prefix: text (tokenized as a prompt's start) or token ids",
        },
        "add_special_tokens": {
            "type": "boolean",
            "default": True,
            "description": "text: with the BOS token",
        },
    },
}


def _schemas() -> dict[str, Any]:
    _, schemas = models_json_schema([(m, "validation") for m in MODELS], ref_template=_REF)
    defs = schemas.get("$defs", {})
    # The batch body is a chat's, but ``messages`` is a list of conversations.
    batch = copy.deepcopy(defs["ChatCompletionRequest"])
    batch["properties"]["messages"] = {
        "type": "array",
        "minItems": 1,
        "items": batch["properties"]["messages"],
        "description": "the conversations (n 1, stream false)",
    }
    batch["title"] = "ChatCompletionBatchRequest"
    return {
        **defs,
        "ChatCompletionBatchRequest": batch,
        "InvocationsRequest": {"oneOf": [_ref("ChatCompletionRequest"), _ref("CompletionRequest")]},
        "PrefixRequest": _PREFIX,
        "Error": _ERROR,
    }


def _operation(e: Endpoint) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": e.answer}
    if e.media:
        ok["content"] = {e.media: {}}
    op: dict[str, Any] = {
        "summary": e.summary,
        "responses": {"101" if e.path == "/v1/chat/ws" else "200": ok},
    }
    if e.path == "/v1/chat/ws":
        op["description"] = _WEBSOCKET
    if e.body:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(e.body)}},
        }
    params = [
        {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
        for n in _path_params(e.path)
    ]
    params += [
        {
            "name": n,
            "in": "query",
            "required": False,
            "description": d,
            "schema": {"type": "string"},
        }
        for n, d in e.query
    ]
    if params:
        op["parameters"] = params
    if e.open:
        op["security"] = []
    else:
        op["responses"]["4XX"] = {
            "description": "an OpenAI error; ``param`` names the field",
            "content": {"application/json": {"schema": _ref("Error")}},
        }
    return op


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def openapi_document(model_name: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for e in ENDPOINTS:
        paths.setdefault(e.path, {})[e.method] = _operation(e)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"streamkv ({model_name})",
            "version": __version__,
            "description": "OpenAI-compatible API. Unknown fields are ignored (and logged).",
        },
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
