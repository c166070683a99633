"""The event loop's side of a request: its stream of outputs (``RequestStream``, the errors its
reader may get) and the loop's book of open requests (``RequestBook``): each one's stream, its
submission as first made (a restart resumes it from there), what came before a resume and
the parts it runs as (one per sample of a request of several: engine/recovery.py), and the
counts that admission control reads.

Only the event loop touches the book. The engine thread reaches it through the loop
(``call_soon_threadsafe``) with outputs and verdicts; the book answers with commands.
Outputs are cumulative (text and token ids so far), so a stream keeps only the newest one:
a slow reader never builds a backlog, it just gets bigger deltas.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from streamkv.engine.engine_commands import EngineCommands, Submission, Verdicts
from streamkv.engine.recovery import Resumed, resume
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


class RequestBook:
    def __init__(self, commands: EngineCommands, observers: list[Observer]) -> None:
        self._commands = commands
        self._observers = observers
        self._streams: dict[str, RequestStream] = {}
        self._subs: dict[str, Submission] = {}  # each open request as first submitted
        self._resumed: dict[str, Resumed] = {}  # resumed requests: what came before, their parts
        # The engine's id of a resumed request's part -> the request's.
        self._parts: dict[str, str] = {}
        # Admission control: submissions the engine thread has not applied yet, and the
        # scheduler's waiting queue as of the last callback from that thread.
        self._pending = 0
        self._engine_waiting = 0

    @property
    def num_open(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Requests waiting to be scheduled: queued here or in the scheduler's waiting queue."""
        return self._pending + self._engine_waiting

    def open(self, sub: Submission, notify: asyncio.Event) -> RequestStream:
        """A stream for ``sub``, which goes to the engine thread at once."""
        if sub.request_id in self._streams:
            raise ValueError(f"request id {sub.request_id!r} is already in use")
        stream = RequestStream(sub.request_id, notify, sub.arrival_time, self._commands.unread)
        self._streams[sub.request_id] = stream
        self._pending += 1
        self._subs[sub.request_id] = sub
        self._commands.submit(sub)
        return stream

    def forget(self, request_id: str) -> RequestStream | None:
        self._commands.unread.discard(request_id)
        self._subs.pop(request_id, None)
        self._drop_parts(request_id)
        return self._streams.pop(request_id, None)

    def _drop_parts(self, request_id: str) -> None:
        resumed = self._resumed.pop(request_id, None)
        for part_id in resumed.parts if resumed is not None else ():
            self._parts.pop(part_id, None)

    def _engine_ids(self, request_id: str) -> list[str]:
        """The requests the engine runs for this one: itself, or its resumed samples."""
        resumed = self._resumed.get(request_id)
        return [request_id] if resumed is None else list(resumed.running)

    def abort(self, request_id: str) -> None:
        self.end(request_id, RequestAbortedError(request_id))

    def end(self, request_id: str, error: BaseException) -> None:
        """End an open request with ``error``, in the engine too."""
        engine_ids = self._engine_ids(request_id)
        stream = self.forget(request_id)
        if stream is None:
            return
        stream.fail(error)
        for engine_id in engine_ids:
            self._commands.abort(engine_id)
        now = time.monotonic()
        for obs in self._observers:
            obs.on_abort(stream, now)

    def end_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self.end(request_id, error)

    # -- from the engine thread ---------------------------------------------------------------
    def dispatch(self, outputs: list[RequestOutput], waiting: int) -> None:
        self._engine_waiting = waiting
        now = time.monotonic()
        for out in outputs:
            request_id = self._parts.get(out.request_id, out.request_id)
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted by its reader meanwhile
            resumed = self._resumed.get(request_id)
            if resumed is not None:
                out, ended = resumed.join(out)
                for part_id in ended:  # a stop string straddled the restart, or a part failed
                    self._commands.abort(part_id)
                if out is None:
                    continue  # from a part that had ended
            if out.finished:
                self.forget(request_id)
            for obs in self._observers:
                obs.on_output(stream, out, now)
            stream.put(out)

    def resolve(self, verdicts: Verdicts, waiting: int) -> None:
        self._pending -= len(verdicts)
        self._engine_waiting = waiting
        for sub, error in verdicts:
            if sub.accepted.done():  # the caller gave up: do not leave the request running
                if error is None:
                    self._commands.abort(sub.request_id)
            elif error is None:
                sub.accepted.set_result(None)
            else:
                sub.accepted.set_exception(error)

    # -- faults -------------------------------------------------------------------------------
    def end_suspects(self, error: BaseException) -> list[str]:
        """After the watchdog broke a stuck step: end the requests that may have caused it.
        The engine stepped fine before they came, so the suspects are the requests taken that
        have no output yet; if every one has some, all of them (any could be it). Returns
        their ids; the rest resume (``resume_all``)."""
        taken = [
            rid
            for rid in self._streams
            if rid in self._subs and _was_taken(self._subs[rid].accepted)
        ]
        fresh = [rid for rid in taken if self._streams[rid].last is None]
        suspects = fresh or taken
        for rid in suspects:
            self.forget(rid).fail(error)
        return suspects

    def resume_all(self, loop: asyncio.AbstractEventLoop, tokenizer: Any) -> int:
        """After a worker restart: every request the old engine had taken goes into the new
        one from where its stream stands, as one request or one per sample still running
        (recovery.resume); those not yet taken are still queued. Returns how many resume."""
        taken = [
            (self._subs[rid], stream)
            for rid, stream in self._streams.items()
            if rid in self._subs and _was_taken(self._subs[rid].accepted)
        ]
        resumes = []
        for sub, stream in taken:
            rid = sub.request_id
            self._drop_parts(rid)  # resumed before: its parts ran on the old engine
            parts, resumed = resume(
                rid, sub.prompt_token_ids, sub.params, stream.last, tokenizer, self._streams
            )
            if resumed is not None:
                self._resumed[rid] = resumed
                self._parts.update((part.request_id, rid) for part in parts)
            for part in parts:
                accepted = loop.create_future()
                accepted.add_done_callback(lambda f, r=rid: self._refused(r, f))
                resumes.append(
                    Submission(
                        part.request_id,
                        sub.prompt,
                        part.params,
                        part.prompt_token_ids,
                        sub.arrival_time,
                        accepted,
                    )
                )
        self._pending += len(resumes)
        self._commands.resubmit_first(resumes)
        return len(taken)

    def _refused(self, request_id: str, accepted: asyncio.Future) -> None:
        """The new engine refused a resumed request or one of its parts: the request ends."""
        if not accepted.cancelled() and accepted.exception() is not None:
            self.end(request_id, EngineDeadError(str(accepted.exception())))

    def fail_all(self, dead: EngineDeadError) -> None:
        """The engine is dead: every stream ends with ``dead``, every queued submission too."""
        self._subs.clear()
        self._resumed.clear()
        self._parts.clear()
        for stream in list(self._streams.values()):
            stream.fail(dead)
        self._streams.clear()
        self._pending = 0
        self._commands.fail_submissions(dead)


def _was_taken(accepted: asyncio.Future) -> bool:
    return accepted.done() and not accepted.cancelled() and accepted.exception() is None
