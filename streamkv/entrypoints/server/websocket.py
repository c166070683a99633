"""/v1/chat/ws: chat over one WebSocket, several generations at once (protocol: docs/api.md).

Client → ``{"type":"chat","id",…,"messages":[…],"params":{…}}`` and ``{"type":"cancel","id"}``;
server → ``delta`` / ``done`` / ``error`` messages carrying the same ``id``. Each chat runs in
its own task; cancel aborts that one, and closing the socket aborts them all.

The first message after the engine accepted a chat carries ``request_id``, the engine's id
(``chatcmpl-`` + ``params.request_id`` as on HTTP, else ``chatcmpl-ws-`` + a random hex), so
that a client can find its generation elsewhere (the KV view marks rows whose id holds the
viewer's token: the page puts it in ``params.request_id``). A chat that ends in an error
leaves a warning in the log with that id, as an HTTP error leaves an access-log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from streamkv.entrypoints.openai.chat_request import ChatCompletionRequest
from streamkv.entrypoints.openai.chat_serving import ChatServing
from streamkv.entrypoints.openai.errors import ENGINE_ERRORS, APIError, engine_error, request_failed
from streamkv.entrypoints.openai.protocol import parse_json_body, validate
from streamkv.entrypoints.openai.serving import OpenAIServing
from streamkv.entrypoints.openai.streaming import usage_of
from streamkv.entrypoints.server.security import check_api_key, check_origin, check_subprotocols

logger = logging.getLogger(__name__)

SUBPROTOCOL = "streamkv"
_CHAT_KEYS = {"type", "id", "messages", "params"}
# The socket streams one sample's text: no sample counts, no tool calls, no prompt logprobs.
_PARAMS_NOT_ALLOWED = (
    "messages",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "use_beam_search",
    "tools",
    "tool_choice",
    "prompt_logprobs",
    "echo",
    "return_token_ids",
)


class ChatSocket:
    def __init__(
        self, ws: WebSocket, serving: OpenAIServing, chat: ChatServing, max_active: int
    ) -> None:
        self.ws, self.serving, self.chat, self.max_active = ws, serving, chat, max_active
        self.tasks: dict[str | int, asyncio.Task] = {}
        self.cancelled: set[str | int] = set()
        self._send_lock = asyncio.Lock()

    async def send(self, msg: dict) -> None:
        text = json.dumps(msg, ensure_ascii=False, separators=(",", ":"))
        try:
            async with self._send_lock:
                await self.ws.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the socket is closing; run() cancels everything

    async def error(
        self, mid, e: APIError, rid: str | None = None, head: dict | None = None
    ) -> None:
        # A client's mistake as much as the server's trouble: HTTP's show in the access log.
        logger.warning(
            "WebSocket chat %r (request %s) failed: %d %s%s: %s",
            mid,
            rid or "not started",
            e.status,
            e.code or e.type,
            f" ({e.param})" if e.param else "",
            e.message,
        )
        await self.send({"type": "error", "id": mid, **e.body(), **(head or {})})

    async def run(self) -> None:
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                raw = (
                    msg.get("bytes")
                    if msg.get("text") is None
                    else msg["text"].encode("utf-8", "surrogatepass")
                )
                await self.handle(raw or b"")
        finally:
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def handle(self, raw: bytes) -> None:
        try:
            msg = parse_json_body(raw)
        except APIError as e:
            return await self.error(None, e)
        mid, kind = msg.get("id"), msg.get("type")
        if (
            isinstance(mid, bool)
            or not isinstance(mid, (str, int))
            or (isinstance(mid, str) and not 0 < len(mid) <= 200)
        ):
            return await self.error(
                None,
                APIError(
                    "'id' must be a non-empty string (at most 200 characters) or an integer",
                    param="id",
                ),
            )
        if kind == "cancel":
            task = self.tasks.get(mid)
            if task is None:
                return await self.error(
                    mid,
                    APIError("no running generation has this id", param="id", code="unknown_id"),
                )
            self.cancelled.add(mid)
            task.cancel()
        elif kind == "chat":
            if mid in self.tasks:
                return await self.error(
                    mid,
                    APIError(
                        "a generation with this id is already running",
                        param="id",
                        code="duplicate_id",
                    ),
                )
            if len(self.tasks) >= self.max_active:
                return await self.error(
                    mid,
                    APIError(
                        f"at most {self.max_active} generations may run on one socket",
                        429,
                        "rate_limit_error",
                        code="too_many_generations",
                    ),
                )
            extra = sorted(set(msg) - _CHAT_KEYS)
            if extra:
                return await self.error(
                    mid, APIError(f"unrecognized field: '{extra[0]}'", param=extra[0])
                )
            self.tasks[mid] = asyncio.create_task(
                self.generate(mid, msg.get("messages"), msg.get("params"))
            )
        else:
            await self.error(mid, APIError('\'type\' must be "chat" or "cancel"', param="type"))

    async def generate(self, mid, messages, params) -> None:
        streams, num_prompt, last, rid = [], 0, None, None
        head: dict = {}  # what the generation's first message carries besides its own fields

        async def send(msg: dict) -> None:
            await self.send({**msg, **head})
            head.clear()

        try:
            body = {**_socket_params(params), "messages": messages, "stream": True}
            req = validate(ChatCompletionRequest, body)
            sampling = req.params()
            ids = await self.chat.prompt(req)
            num_prompt = len(ids)
            rid = f"chatcmpl-{req.request_id or 'ws-' + uuid.uuid4().hex}"
            streams, _ = await self.serving.start(rid, [ids], sampling)
            head["request_id"] = rid
            sent = 0
            async for out in streams[0]:
                last = out
                if out.error:
                    raise request_failed(out.error)
                text = out.outputs[0].text if out.outputs else ""
                if len(text) > sent:
                    await send({"type": "delta", "id": mid, "text": text[sent:]})
                    sent = len(text)
            c = last.outputs[0]
            await send(_done(mid, c.finish_reason, num_prompt, len(c.token_ids)))
        except asyncio.CancelledError:
            if mid not in self.cancelled:
                raise  # the socket closed
            num_out = len(last.outputs[0].token_ids) if last is not None and last.outputs else 0
            await send(_done(mid, "abort", num_prompt, num_out))
        except APIError as e:
            await self.error(mid, e, rid, head)
        except ENGINE_ERRORS as e:
            await self.error(mid, engine_error(e), rid, head)
        except Exception:
            logger.exception("WebSocket chat %r (request %s) failed", mid, rid or "not started")
            await send(
                {
                    "type": "error",
                    "id": mid,
                    **APIError("internal error", 500, "internal_error").body(),
                }
            )
        finally:
            self.serving.abort_all(streams)
            self.tasks.pop(mid, None)
            self.cancelled.discard(mid)


def _socket_params(params) -> dict:
    """A chat's ``params``, checked: the sampling fields of an HTTP chat body, less those the
    socket cannot stream (_PARAMS_NOT_ALLOWED)."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise APIError("'params' must be an object", param="params")
    bad = next((k for k in _PARAMS_NOT_ALLOWED if k in params), None)
    if bad is not None:
        raise APIError(f"'params.{bad}' is not available on the WebSocket", param=f"params.{bad}")
    return params


def _done(mid, finish_reason: str | None, num_prompt: int, num_out: int) -> dict:
    return {
        "type": "done",
        "id": mid,
        "finish_reason": finish_reason,
        "usage": usage_of(num_prompt, num_out),
    }


async def chat_ws(ws: WebSocket) -> None:
    state, config = ws.app.state, ws.app.state.config
    offered = ws.scope.get("subprotocols", ())
    client = ws.client.host if ws.client else ""
    try:
        check_subprotocols(offered)
        local = ws.scope["server"][0] if ws.scope.get("server") else None
        check_origin(ws.headers, ws.url.scheme, config.hosts, config.allowed_origins, local)
        check_api_key(config.api_key, ws.headers, offered, config.auth_failures, client)
        state.engine.check_alive()
    except (APIError, *ENGINE_ERRORS) as e:
        if not isinstance(e, APIError):
            e = engine_error(e)
        # A refused handshake is the client's business, not a server fault: INFO, not ERROR.
        logger.info("refused a WebSocket handshake from %s: %s", client or "?", e.message)
        await ws.send_denial_response(JSONResponse(e.body(), e.status, e.headers))
        return
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    await ChatSocket(ws, state.serving, state.chat, state.config.ws_max_active).run()
