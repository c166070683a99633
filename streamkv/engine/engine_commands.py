"""What the event loop asks of the engine thread: add a request, abort one, run a short call.

The engine is not thread-safe, so the event loop never calls it: it queues a command here
and wakes the engine thread, which applies every queued command between two steps. That is
also what makes an abort free the request's blocks within one step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from streamkv.engine.llm_engine import LLMEngine
from streamkv.sampling_params import SamplingParams

# The async engine's lines keep the one logger name they had before it was split in modules.
logger = logging.getLogger("streamkv.engine.async_engine")
T = TypeVar("T")


@dataclass(slots=True)
class Submission:
    """A request as the event loop hands it to the engine."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    prompt_token_ids: list[int] | None
    arrival_time: float
    accepted: asyncio.Future  # the engine's verdict, resolved on the event loop


Verdicts = list[tuple[Submission, BaseException | None]]


class EngineCommands:
    """A queue from the event loop to the engine thread, and the event that wakes it."""

    def __init__(self) -> None:
        # A deque: append and popleft are atomic, the two threads need no lock.
        self._queue: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        # Requests whose last output the loop has not read yet (RequestStream keeps it, the
        # engine thread reads it): the engine builds no new snapshot for them until it is
        # read, since outputs are cumulative and the reader would skip to the newest anyway.
        # Under a burst this halved the outputs built and dispatched per step. A set's add,
        # discard and `in` are atomic under the GIL: no lock.
        self.unread: set[str] = set()

    # -- the event loop's side --------------------------------------------------------------
    def submit(self, sub: Submission) -> None:
        self._queue.append(sub)
        self._wakeup.set()

    def resubmit_first(self, subs: list[Submission]) -> None:
        """After a restart: these go in before anything queued meanwhile."""
        self._queue.extendleft(reversed(subs))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self._queue.append(("abort", request_id))
        self._wakeup.set()

    async def run(self, fn: Callable[[LLMEngine], T], timeout: float) -> T:
        """``fn(engine)`` on the engine thread between two steps, its result or exception
        handed back here; TimeoutError if no answer within ``timeout`` s (dead, long step)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def call(engine: LLMEngine) -> None:
            try:
                result, error = fn(engine), None
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                result, error = None, e
            loop.call_soon_threadsafe(settle, result, error)

        self._queue.append(("call", call))
        self._wakeup.set()
        return await asyncio.wait_for(done, timeout)

    def wake(self) -> None:
        self._wakeup.set()

    def fail_submissions(self, error: BaseException) -> None:
        """The engine is dead: drop every command, failing the submissions not yet decided."""
        while self._queue:
            cmd = self._queue.popleft()
            if isinstance(cmd, Submission) and not cmd.accepted.done():
                cmd.accepted.set_exception(error)

    # -- the engine thread's side -----------------------------------------------------------
    def wait(self, timeout: float) -> None:
        self._wakeup.wait(timeout)

    def apply(self, engine: LLMEngine) -> Verdicts:
        """Every queued command, in order; the verdict on each submission (None: accepted)."""
        self._wakeup.clear()
        verdicts: Verdicts = []
        while self._queue:
            cmd = self._queue.popleft()
            if isinstance(cmd, Submission):
                # A grammar compiles on its own thread; the submission comes back here when
                # it is done (a compile on this thread stalled every stream: issue 26).
                if engine.defer_until_compiled(cmd.params, lambda c=cmd: self.submit(c)):
                    continue
                try:
                    engine.add_request(
                        cmd.request_id,
                        cmd.prompt,
                        cmd.params,
                        cmd.prompt_token_ids,
                        cmd.arrival_time,
                    )
                    verdicts.append((cmd, None))
                except ValueError as e:
                    verdicts.append((cmd, e))
            elif cmd[0] == "call":
                try:
                    cmd[1](engine)
                except Exception:  # an observer's bug must not kill the engine thread
                    logger.exception("a call on the engine thread failed")
            else:
                engine.abort_request(cmd[1])
        return verdicts
