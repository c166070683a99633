"""uvicorn's h11 protocol with the bounds one client must not exceed: a deadline for the
request head and for the body, a cap on open connections answered with a JSON 503, and
malformed requests answered in the OpenAI error shape instead of uvicorn's plain text.

uvicorn closes an idle keep-alive socket (``timeout_keep_alive``) but has no deadline for a
request that arrives slowly: a socket that sent nothing, or one byte a second, stayed open
forever (300 slowloris sockets all did, issue 13). Its ``limit_concurrency`` answers in plain
text, so the cap is kept here instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from streamkv.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    head_timeout: float = (
        10.0  # seconds from connect (or from a request's first byte) to its full head
    )
    body_timeout: float = 30.0  # seconds from the head to the body's last byte
    max_connections: int | None = None  # open HTTP + WebSocket connections


class _RecordingConnection(h11.Connection):
    """Keeps the protocol error that uvicorn catches, so the answer can name it."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise


def raw_response(e: APIError) -> bytes:
    """A complete HTTP/1.1 response, for answering outside h11's request cycle."""
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


class GuardedH11Protocol(H11Protocol):
    """One HTTP connection. Built by uvicorn as ``functools.partial(GuardedH11Protocol,
    limits=...)``."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.conn = _RecordingConnection(
            h11.SERVER, self.config.h11_max_incomplete_event_size or 16 * 1024
        )
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._over_limit = False

    # -- deadlines ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap:
            self._over_limit = True
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return self._disarm()
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm("head")  # a request has begun (or the head is incomplete)
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()  # idle from here: uvicorn's keep-alive timer takes over
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

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
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(
                raw_response(
                    APIError(
                        f"the request {phase} did not arrive within {seconds:g} s",
                        408,
                        code="request_timeout",
                    )
                )
            )
        self.transport.close()

    # -- the connection cap -----------------------------------------------------------------
    def handle_events(self) -> None:
        if self._over_limit and self.conn.their_state is h11.IDLE:
            # Answer the first request with a 503 once its head is in, without running it.
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                return self.send_400_response("invalid HTTP request")
            if event is h11.NEED_DATA:
                return
            self._disarm()
            cap = self.limits.max_connections
            logger.info(
                "refusing a connection: %d open, the limit is %s", len(self.connections), cap
            )
            self.transport.write(
                raw_response(
                    APIError(
                        f"the server has {cap} connections open, its limit; retry later",
                        503,
                        "service_unavailable_error",
                        code="too_many_connections",
                        headers={"retry-after": "1"},
                    )
                )
            )
            self.transport.close()
            return
        super().handle_events()

    # -- protocol errors ----------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        error = self.conn.last_error
        status = getattr(error, "error_status_hint", 400) if error is not None else 400
        detail = f": {error}" if error is not None and str(error) else ""
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(
                raw_response(
                    APIError(f"invalid HTTP request{detail}", status, code="invalid_http_request")
                )
            )
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
