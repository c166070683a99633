"""The event loop's book of open requests: each one's stream, its submission as first made
(a restart resumes it from there), what came before a resume, and the counts that admission
control reads.

Only the event loop touches the book. The engine thread reaches it through the loop
(``call_soon_threadsafe``) with outputs and verdicts; the book answers with commands.
Outputs are cumulative (text and token ids so far), so a stream keeps only the newest one:
a slow reader never builds a backlog, it just gets bigger deltas.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from streamkv.engine.engine_commands import EngineCommands, Submission, Verdicts
from streamkv.engine.recovery import (
    EngineRestartedError,
    ResumeBase,
    ends_early,
    resumable,
    resume_request,
    splice,
)
from streamkv.engine.request_stream import (
    EngineDeadError,
    Observer,
    RequestAbortedError,
    RequestStream,
)
from streamkv.sequence import RequestOutput


class RequestBook:
    def __init__(self, commands: EngineCommands, observers: list[Observer]) -> None:
        self._commands = commands
        self._observers = observers
        self._streams: dict[str, RequestStream] = {}
        self._subs: dict[str, Submission] = {}  # each open request as first submitted
        self._resumed: dict[str, ResumeBase] = {}  # resumed requests: what came before
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
        self._resumed.pop(request_id, None)
        return self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        stream = self.forget(request_id)
        if stream is None:
            return
        stream.fail(RequestAbortedError(request_id))
        self._commands.abort(request_id)
        now = time.monotonic()
        for obs in self._observers:
            obs.on_abort(stream, now)

    def end_all(self, error: BaseException) -> None:
        now = time.monotonic()
        for request_id in list(self._streams):
            stream = self.forget(request_id)
            stream.fail(error)
            self._commands.abort(request_id)
            for obs in self._observers:
                obs.on_abort(stream, now)

    # -- from the engine thread ---------------------------------------------------------------
    def dispatch(self, outputs: list[RequestOutput], waiting: int) -> None:
        self._engine_waiting = waiting
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its reader meanwhile
            base = self._resumed.get(out.request_id)
            if base is not None:
                spliced = splice(base, out)
                if ends_early(out, spliced):  # a stop string straddled the restart: end it there
                    self._commands.abort(out.request_id)
                out = spliced
            if out.finished:
                self.forget(out.request_id)
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
        taken = [rid for rid in self._streams if rid in self._subs and _was_taken(self._subs[rid].accepted)]
        fresh = [rid for rid in taken if self._streams[rid].last is None]
        suspects = fresh or taken
        for rid in suspects:
            self.forget(rid).fail(error)
        return suspects

    def resume_all(self, loop: asyncio.AbstractEventLoop, tokenizer: Any) -> int:
        """After a worker restart: every request the old engine had taken goes into the new
        one from where its stream stands (those not yet taken are still queued). Returns how
        many resume; the others (n > 1, best_of, beam search) end with an error."""
        taken = [(self._subs[rid], stream) for rid, stream in self._streams.items()
                 if rid in self._subs and _was_taken(self._subs[rid].accepted)]
        resumes = []
        for sub, stream in taken:
            if not resumable(sub.params):
                self.forget(sub.request_id)
                stream.fail(EngineRestartedError(
                    "the workers were restarted and a request with n > 1, best_of or beam search cannot resume"))
                continue
            ids, params, base = resume_request(sub.prompt_token_ids, sub.params, stream.last, tokenizer)
            if base is not None:
                self._resumed[sub.request_id] = base
            accepted = loop.create_future()
            accepted.add_done_callback(lambda f, s=stream: f.exception() and s.fail(EngineDeadError(str(f.exception()))))
            resumes.append(Submission(sub.request_id, sub.prompt, params, ids, sub.arrival_time, accepted))
        self._pending += len(resumes)
        self._commands.resubmit_first(resumes)
        return len(resumes)

    def fail_all(self, dead: EngineDeadError) -> None:
        """The engine is dead: every stream ends with ``dead``, every queued submission too."""
        self._subs.clear()
        self._resumed.clear()
        for stream in list(self._streams.values()):
            stream.fail(dead)
        self._streams.clear()
        self._pending = 0
        self._commands.fail_submissions(dead)


def _was_taken(accepted: asyncio.Future) -> bool:
    return accepted.done() and not accepted.cancelled() and accepted.exception() is None
