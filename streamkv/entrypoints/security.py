"""API-key and Origin checks, shared by the HTTP routes and the WebSocket handshake."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from streamkv.entrypoints.openai_protocol import APIError

# Browsers cannot set headers on a WebSocket, so the key may also come as a subprotocol
# ``bearer.<key>`` next to ``streamkv`` (the key must then be a valid HTTP token).
BEARER_SUBPROTOCOL = "bearer."


def check_api_key(key: str | None, headers: Headers, subprotocols: Iterable[str] = ()) -> None:
    if key is None:
        return
    offered = []
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token:
        offered.append(token.strip())
    offered.extend(p[len(BEARER_SUBPROTOCOL):] for p in subprotocols if p.startswith(BEARER_SUBPROTOCOL))
    expected = key.encode()
    # Constant-time comparison: the time taken does not reveal how much of a guess matched.
    if not any(hmac.compare_digest(o.encode(), expected) for o in offered):
        raise APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                       "authentication_error", code="invalid_api_key")


def origin_allowed(origin: str | None, scheme: str, host: str | None, allowed: Iterable[str]) -> bool:
    """No Origin header (a non-browser client) passes; a browser's Origin must be the
    server's own (same scheme family, same host:port) or listed in ``allowed``."""
    if origin is None:
        return True
    allowed = tuple(allowed)
    if "*" in allowed or origin in allowed:
        return True
    if origin == "null" or host is None:
        return False
    parts = urlsplit(origin)
    own_scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    return parts.scheme == own_scheme and parts.netloc.lower() == host.lower()


def check_origin(headers: Headers, scheme: str, allowed: Iterable[str]) -> None:
    if not origin_allowed(headers.get("origin"), scheme, headers.get("host"), allowed):
        raise APIError("cross-origin request refused (see --allowed-origins)", 403, "permission_error",
                       code="origin_not_allowed")


class HeaderLimit:
    """ASGI middleware: refuse a request whose headers total more than ``limit`` bytes.
    uvicorn's h11 limit only bounds a head that arrives in pieces; a head that arrives in
    one read is parsed whole, so the size is checked again here."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.limit:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = APIError(f"request headers exceed {self.limit} bytes", 431,
                                code="headers_too_large").body()
                await JSONResponse(body, status_code=431)(scope, receive, send)
                return
        await self.app(scope, receive, send)
