"""Who may talk to the server: the Host check (DNS rebinding), the Origin check (browsers),
the API key with a per-client cap on failed attempts. Shared by HTTP routes and the
WebSocket handshake; ``Guard`` applies the checks every request needs before routing."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from streamkv.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)

# Browsers cannot set headers on a WebSocket, so the key may also come as a subprotocol
# ``bearer.<key>`` next to ``streamkv`` (the key must then be a valid HTTP token).
BEARER_SUBPROTOCOL = "bearer."
MAX_SUBPROTOCOLS = 8  # offered per handshake; more is refused before any is looked at
MAX_BEARER_OFFERS = 2  # keys tried per handshake: one guess, plus one spare for a key change
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def split_host(value: str) -> tuple[str, int | None]:
    """``Host``-style ``name[:port]`` → (lower-case name without brackets or final dot, port)."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:  # a name, or a bare IPv6 address
        name, port = value, ""
    return name.rstrip("."), int(port) if port.isdigit() else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """The names this server answers to. A DNS-rebinding page reaches a loopback server
    under the attacker's own name (``Host: evil.com``), so any other name is refused:
    loopback names, the bind address, the address the connection arrived on, and
    ``--allowed-hosts`` (``.example.com`` also matches its subdomains; ``*`` turns the
    check off)."""

    names: frozenset[str] = frozenset(LOOPBACK_NAMES)
    any_host: bool = False

    @classmethod
    def build(cls, bind_host: str | None, extra: Iterable[str] = ()) -> HostPolicy:
        extra = [e.strip().lower().rstrip(".") for e in extra if e.strip()]
        names = set(LOOPBACK_NAMES) | {e for e in extra if e != "*"}
        if bind_host:
            names.add(split_host(bind_host)[0])
        return cls(frozenset(names), "*" in extra)

    @property
    def loopback_only(self) -> bool:
        """Whether only loopback names reach this server (bound to loopback, no extra hosts)."""
        return not self.any_host and self.names <= frozenset(LOOPBACK_NAMES)

    def allows(self, name: str, local_addr: str | None = None) -> bool:
        if self.any_host or name in self.names or name.endswith(".localhost"):
            return True
        # An IP literal cannot be rebound: it is the address the client meant to reach.
        if local_addr is not None and _is_ip(name) and name == local_addr.lower():
            return True
        return any(n.startswith(".") and (name.endswith(n) or name == n[1:]) for n in self.names)


def check_host(policy: HostPolicy, headers: Headers, local_addr: str | None) -> None:
    host = headers.get("host")
    # h11 refuses HTTP/1.1 without Host; an HTTP/1.0 client without one is no browser.
    if host is not None and not policy.allows(split_host(host)[0], local_addr):
        raise APIError(
            f"this server does not answer to the host name {host[:100]!r} (see --allowed-hosts)",
            421,
            "permission_error",
            code="host_not_allowed",
        )


def origin_allowed(
    origin: str | None,
    scheme: str,
    host: str | None,
    policy: HostPolicy,
    allowed: Iterable[str],
    local_addr: str | None = None,
) -> bool:
    """No Origin header (a non-browser client) passes; a browser's Origin must be listed in
    ``allowed`` or be this server itself: an allowed host name (never merely whatever the
    request's Host says) on the port the request came to, in the same scheme family."""
    if origin is None:
        return True
    allowed = tuple(allowed)
    if "*" in allowed or origin in allowed:
        return True
    if origin == "null" or host is None:
        return False
    parts = urlsplit(origin)
    own_scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    if parts.scheme != own_scheme or parts.hostname is None:
        return False
    default = 443 if own_scheme == "https" else 80
    try:
        origin_port = parts.port or default
    except ValueError:
        return False
    host_port = split_host(host)[1] or default
    return origin_port == host_port and policy.allows(parts.hostname.rstrip("."), local_addr)


def check_origin(
    headers: Headers,
    scheme: str,
    policy: HostPolicy,
    allowed: Iterable[str],
    local_addr: str | None = None,
) -> None:
    if not origin_allowed(
        headers.get("origin"), scheme, headers.get("host"), policy, allowed, local_addr
    ):
        raise APIError(
            "cross-origin request refused (see --allowed-origins)",
            403,
            "permission_error",
            code="origin_not_allowed",
        )


@dataclass(slots=True)
class AuthFailures:
    """Failed API-key attempts per client address in a sliding window: past ``limit`` the
    client gets 429 without its key being compared, so guessing costs it real time.
    At most ``max_clients`` addresses are tracked (the oldest is dropped)."""

    limit: int = 10
    window: float = 60.0
    max_clients: int = 10_000
    _seen: dict[str, deque] = field(default_factory=dict)

    def check(self, client: str, now: float) -> None:
        times = self._seen.get(client)
        while times and now - times[0] > self.window:
            times.popleft()
        if times is not None and len(times) >= self.limit:
            retry = max(1, int(self.window - (now - times[0])) + 1)
            raise APIError(
                f"too many failed authentication attempts; retry in {retry} s",
                429,
                "rate_limit_error",
                code="too_many_auth_failures",
                headers={"retry-after": str(retry)},
            )

    def record(self, client: str, now: float) -> None:
        if client not in self._seen and len(self._seen) >= self.max_clients:
            self._seen.pop(next(iter(self._seen)))
        self._seen.setdefault(client, deque()).append(now)


def check_api_key(
    key: str | None,
    headers: Headers,
    subprotocols: Iterable[str] = (),
    failures: AuthFailures | None = None,
    client: str = "",
) -> None:
    if key is None:
        return
    now = time.monotonic()
    if failures is not None:
        failures.check(client, now)
    offered = []
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token:
        offered.append(token.strip())
    bearers = [
        p[len(BEARER_SUBPROTOCOL) :] for p in subprotocols if p.startswith(BEARER_SUBPROTOCOL)
    ]
    offered.extend(bearers[:MAX_BEARER_OFFERS])
    expected = key.encode()
    # Constant-time comparison: the time taken does not reveal how much of a guess matched.
    if not any(hmac.compare_digest(o.encode(), expected) for o in offered):
        if failures is not None:
            failures.record(client, now)
        raise APIError(
            "invalid or missing API key (send 'Authorization: Bearer <key>')",
            401,
            "authentication_error",
            code="invalid_api_key",
        )


def check_subprotocols(offered: list[str]) -> None:
    if len(offered) > MAX_SUBPROTOCOLS:
        raise APIError(
            f"at most {MAX_SUBPROTOCOLS} WebSocket subprotocols may be offered",
            400,
            code="too_many_subprotocols",
        )


async def refuse(scope, receive, send, e: APIError) -> None:
    """Answer an HTTP request or a WebSocket handshake with ``e`` in the OpenAI shape."""
    if scope["type"] == "websocket":
        ws = WebSocket(scope, receive, send)
        if "websocket.http.response" in scope.get("extensions", {}):
            await ws.send_denial_response(JSONResponse(e.body(), e.status, e.headers))
        else:  # a server without denial responses turns this into a bare 403
            await ws.close(1008)
        return
    await JSONResponse(e.body(), e.status, e.headers)(scope, receive, send)


class Guard:
    """ASGI middleware run before routing, on HTTP and WebSocket alike: the Host check, and
    a cap on the size of the request head (uvicorn's h11 limit only bounds a head that
    arrives in pieces; a head that arrives in one read is parsed whole)."""

    def __init__(self, app, policy: HostPolicy, header_limit: int) -> None:
        self.app, self.policy, self.header_limit = app, policy, header_limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            try:
                size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
                if size > self.header_limit:
                    raise APIError(
                        f"request headers exceed {self.header_limit} bytes",
                        431,
                        code="headers_too_large",
                    )
                server = scope.get("server")
                check_host(self.policy, Headers(scope=scope), server[0] if server else None)
            except APIError as e:
                client = scope.get("client")
                logger.info(
                    "refused %s %s from %s: %s",
                    scope["type"],
                    scope.get("path"),
                    client[0] if client else "?",
                    e.message,
                )
                await refuse(scope, receive, send, e)
                return
        await self.app(scope, receive, send)
