"""Graceful shutdown on SIGTERM / SIGINT: stop accepting, let running requests finish for
``--shutdown-timeout`` seconds, then end the rest with an error in the OpenAI shape.

uvicorn's own shutdown closed every WebSocket at once (1012) and, past its grace period,
cancelled the request tasks: in-flight SSE streams ended mid-body with no error event and
no ``[DONE]``, and a non-streaming request got a plain-text 500 (issue 13). Here the engine
ends the requests instead, so each response finishes by its own path: an error event and
``[DONE]`` (SSE), a 503 JSON (non-streaming), an error message then a 1012 close (WebSocket).
A second Ctrl-C quits at once, quietly: one line, no traceback, no library teardown.

The process always ends on time, even with the engine thread stuck in a step (issue 26: a
hung step made SIGTERM wait forever and two Ctrl-Cs did nothing): the drain does not wait
for a stuck engine, the engine's stop is bounded, and a last-resort timer ends the process
(``os._exit``) ``EXIT_MARGIN_S`` after the drain and grace periods if something still
holds it; a second Ctrl-C ends it at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

import uvicorn
from sse_starlette.sse import AppStatus
from uvicorn.protocols.http.h11_impl import H11Protocol

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.request_book import EngineStoppingError

logger = logging.getLogger(__name__)

_POLL = 0.05
EXIT_MARGIN_S = 15.0  # the engine's bounded stop (10 s) and the interpreter's exit


def exit_after(seconds: float, status: int) -> None:
    """End the process after ``seconds`` unless it has ended by itself (a daemon timer)."""

    def end() -> None:
        logging.getLogger(__name__).error("shutdown: still running after its time; exiting now")
        logging.shutdown()
        os._exit(status)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float, grace: float = 5.0
    ) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout, self.grace = engine, drain_timeout, grace
        # A Ctrl-C ends the process with 130 (the shell's convention), whether or not uvicorn
        # re-raises it as KeyboardInterrupt: the re-raise reached cli/serve.py only now and then.
        self.interrupted = False
        # sse-starlette would cut every stream the moment the signal arrives; here the
        # engine ends them (end_all below), each with its error event and [DONE].
        AppStatus.disable_automatic_graceful_drain()

    def handle_exit(self, sig: int, frame) -> None:
        self.interrupted = self.interrupted or sig == signal.SIGINT
        if self.should_exit and sig == signal.SIGINT:
            # The operator asked twice: nothing is left worth waiting for (a traceback and
            # the native libraries' teardown warnings were all a second Ctrl-C printed).
            logger.warning("second Ctrl-C: exiting now")
            logging.shutdown()
            os._exit(130)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        """Stop accepting, give the running requests ``drain_timeout`` to finish, end the
        rest, let the responses close in ``grace``, then run the lifespan's shutdown."""
        exit_after(self.drain_timeout + self.grace + EXIT_MARGIN_S, 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._stop_accepting(sockets)
        await self._drain(loop, started)
        await self._close_connections(loop)
        if not self.force_exit:
            await self.lifespan.shutdown()

    def _stop_accepting(self, sockets) -> None:
        running = self.engine.num_open_streams
        if running:
            logger.info(
                "shutting down: waiting up to %g s for %d running request(s) to finish "
                "(Ctrl-C again to stop at once)",
                self.drain_timeout,
                running,
            )
        else:
            logger.info("shutting down: no request running")
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        self.engine.drain()  # new requests on open connections: 503 server_shutting_down
        for conn in self._connections(websocket=False):
            conn.shutdown()  # idle keep-alive sockets close now, busy ones after their response

    async def _drain(self, loop: asyncio.AbstractEventLoop, started: float) -> None:
        """Wait for the running requests (not for a stalled engine), then end what is left."""
        deadline = loop.time() + self.drain_timeout
        while (
            not self.force_exit
            and loop.time() < deadline
            and self.engine.stalled is None
            and (self.engine.num_open_streams or self._connections(websocket=False))
        ):
            await asyncio.sleep(_POLL)
        left = self.engine.num_open_streams
        if left:
            logger.warning(
                "shutdown: ending %d request(s) still running after %.1f s",
                left,
                loop.time() - started,
            )
            self.engine.end_all(
                EngineStoppingError(
                    "the server is shutting down and this request "
                    f"did not finish within {self.drain_timeout:g} s"
                )
            )

    async def _close_connections(self, loop: asyncio.AbstractEventLoop) -> None:
        """The responses end by themselves now; WebSockets get their error messages first,
        then close; tasks still running past the grace period are cancelled."""
        grace_end = loop.time() + self.grace
        while (
            not self.force_exit and loop.time() < grace_end and self._connections(websocket=False)
        ):
            await asyncio.sleep(_POLL)
        await asyncio.sleep(_POLL)
        for conn in self._connections(websocket=True):
            conn.shutdown()  # close code 1012: service restart
        while not self.force_exit and loop.time() < grace_end and self.server_state.tasks:
            await asyncio.sleep(_POLL)
        if self.server_state.tasks:
            logger.error(
                "shutdown: cancelling %d task(s) still running", len(self.server_state.tasks)
            )
            for task in self.server_state.tasks:
                task.cancel()

    def _connections(self, websocket: bool) -> list:
        return [c for c in self.server_state.connections if isinstance(c, H11Protocol) != websocket]
