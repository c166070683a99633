"""A request's stream of outputs (newest only) and the errors its reader may get."""

from __future__ import annotations

import asyncio
from typing import Protocol

from streamkv.sequence import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine failed to load or crashed in a step; it serves nothing more."""


class EngineNotReadyError(RuntimeError):
    """The model is still loading."""


class RequestAbortedError(Exception):
    """Raised to a stream's reader when the request was aborted (cancel, disconnect)."""


class EngineStoppingError(RuntimeError):
    """The server is shutting down: no new requests, and the drain timeout ended this one."""


class QueueFullError(RuntimeError):
    """``max_queued`` requests wait already."""


class EngineRecoveringError(RuntimeError):
    """The worker processes failed and are being restarted; retry shortly."""


class Observer(Protocol):
    def on_output(self, stream: RequestStream, out: RequestOutput, now: float) -> None: ...

    def on_abort(self, stream: RequestStream, now: float) -> None: ...


class RequestStream:
    """The outputs of one request, newest only. Several streams may share one ``notify``
    event so that a response covering several prompts waits on all of them at once."""

    def __init__(
        self, request_id: str, notify: asyncio.Event, arrival: float, unread: set[str] | None = None
    ) -> None:
        self.request_id = request_id
        self.notify = notify
        self._unread = unread  # EngineCommands.unread: this request while an output waits here
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens_seen = 0
        self.finished = False  # no more outputs will come (finished, aborted or failed)
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self.last: RequestOutput | None = None  # newest output put, taken or not (for resuming)

    def put(self, out: RequestOutput) -> None:
        self._latest = self.last = out
        if out.finished:
            self.finished = True
        elif self._unread is not None:
            self._unread.add(self.request_id)
        self.notify.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self.notify.set()

    def take(self) -> RequestOutput | None:
        """The newest output not yet taken (None if nothing new); raises the stream's error
        once every output before it was taken."""
        out, self._latest = self._latest, None
        if out is None:
            if self._error is not None:
                raise self._error
        elif self._unread is not None:
            self._unread.discard(self.request_id)
        return out

    @property
    def drained(self) -> bool:
        return self.finished and self._latest is None and self._error is None

    async def __aiter__(self):
        while True:
            out = self.take()
            if out is not None:
                yield out
                if out.finished:
                    return
            elif self.finished:
                return
            else:
                self.notify.clear()
                await self.notify.wait()
