"""uvicorn's httptools protocol with the bounds one client must not exceed: a deadline for the
request head and for the body, a cap on the head's size and on open connections, and
malformed requests answered in the OpenAI error shape instead of uvicorn's plain text.

uvicorn closes an idle keep-alive socket (``timeout_keep_alive``) but has no deadline for a
request that arrives slowly: a socket that sent nothing, or one byte a second, stayed open
forever (300 slowloris sockets all did, issue 13). Its httptools protocol bounds no head
size, and its ``limit_concurrency`` answers in plain text, so those are kept here too.

Why httptools (uvicorn's C parser) and not h11 (its pure-Python one): under a burst the
event loop sends one SSE body per running stream per engine step, and h11 frames each send
in Python. 200 streams x 300 events on loopback took 1.20 s of server CPU with h11 and
0.80 s with httptools (docs/benchmarks.md "Where the served time goes"); the loop's time is
the engine thread's GIL time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from streamkv.entrypoints.openai.protocol import APIError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    head_timeout: float = 10.0  # seconds from connect (or a request's first byte) to its head
    body_timeout: float = 30.0  # seconds from the head to the body's last byte
    max_connections: int | None = None  # open HTTP + WebSocket connections
    max_head_bytes: int = 16 * 1024  # request line + headers


def raw_response(e: APIError) -> bytes:
    """A complete HTTP/1.1 response, for answering outside uvicorn's request cycle."""
    body = json.dumps(e.body()).encode()
    reason = _REASONS.get(e.status, "Error").encode()
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: "
        b"application/json\r\ncontent-length: %d\r\nconnection: close\r\n"
        % (e.status, reason, len(body))
    )
    head += b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in (e.headers or {}).items())
    return head + b"\r\n" + body


_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; the protocol answers ``error``."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class GuardedHttpProtocol(HttpToolsProtocol):
    """One HTTP connection. Built by uvicorn as ``functools.partial(GuardedHttpProtocol,
    limits=...)``."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._over_limit = False
        self._head_bytes = 0  # of the request being parsed: its URL and headers
        self._awaiting_head = True  # no complete head since the last request ended
        self._raw_head_bytes = 0  # received while awaiting a head (a head in pieces)
        self._refused: APIError | None = None  # why a parser callback stopped the parse
        self._unparsed = b""  # an over-limit connection's bytes, until its head is in

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap:
            self._over_limit = True
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        if self._over_limit:
            return self._refuse_when_head_in(data)
        self._unset_keepalive_if_required()
        if self._awaiting_head:
            self._raw_head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._disarm()  # a WebSocket from here (its own protocol and limits)
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as e:
            refused, self._refused = self._refused, None
            detail = f": {e}" if str(e) else ""
            self._answer_and_close(
                refused
                or APIError(f"invalid HTTP request{detail}", 400, code="invalid_http_request")
            )
            return
        # The parser holds a head's pieces until a header line ends: bound what it holds.
        if self._awaiting_head and self._raw_head_bytes > self.limits.max_head_bytes:
            self._answer_and_close(self._head_too_large())

    # -- the head's size and the deadlines (parser callbacks) ---------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._arm("head")  # a request has begun

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() == "1.1" and not any(
            name == b"host" for name, _ in self.headers
        ):
            self._refused = APIError(
                "an HTTP/1.1 request must carry a Host header", 400, code="invalid_http_request"
            )
            raise _Refused(self._refused)
        self._awaiting_head = False
        self._arm("body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._awaiting_head, self._raw_head_bytes = True, 0
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._disarm()  # idle from here: uvicorn's keep-alive timer takes over
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_head_bytes:
            self._refused = self._head_too_large()
            raise _Refused(self._refused)

    def _head_too_large(self) -> APIError:
        return APIError(
            f"the request head is over {self.limits.max_head_bytes} bytes",
            431,
            code="headers_too_large",
        )

    def _arm(self, phase: str) -> None:
        if self._phase == phase:
            return
        self._disarm()
        seconds = self.limits.head_timeout if phase == "head" else self.limits.body_timeout
        if self._over_limit:
            seconds = min(seconds, 1.0)  # a refused client gets its 503 or goes, fast
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        logger.info(
            "closing the connection from %s: request %s not received within %g s",
            client,
            phase,
            seconds,
        )
        self._answer_and_close(
            APIError(
                f"the request {phase} did not arrive within {seconds:g} s",
                408,
                code="request_timeout",
            )
        )

    # -- the connection cap -----------------------------------------------------------------
    def _refuse_when_head_in(self, data: bytes) -> None:
        """Over the cap: answer 503 once the first request's head is in, without parsing
        it or running it (or at once if the head grows past its size limit)."""
        self._unparsed += data
        if b"\r\n\r\n" not in self._unparsed and len(self._unparsed) <= self.limits.max_head_bytes:
            return
        cap = self.limits.max_connections
        logger.info("refusing a connection: %d open, the limit is %s", len(self.connections), cap)
        self._answer_and_close(
            APIError(
                f"the server has {cap} connections open, its limit; retry later",
                503,
                "service_unavailable_error",
                code="too_many_connections",
                headers={"retry-after": "1"},
            )
        )

    def _answer_and_close(self, error: APIError) -> None:
        """Answer ``error`` unless a response has begun on this connection, then close it."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(raw_response(error))
        self.transport.close()


class QuietDenialWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol logs "ASGI callable returned without completing
    handshake" at ERROR after every denial response it has itself sent (a refused key,
    Origin or Host): once the denial is out, that is the handshake's answer."""

    async def send(self, message) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get(
            "more_body", False
        ):
            self.handshake_complete = True
