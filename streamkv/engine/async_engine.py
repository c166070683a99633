"""The asyncio face of the engine: one background thread owns the ``LLMEngine`` and runs
its step loop (engine/engine_thread.py); the event loop only queues commands for it
(engine/engine_commands.py) and keeps the open requests' streams (engine/request_book.py).

This class is what the front end holds: the engine's lifecycle and health as the event loop
sees them (loading, ready, draining, restarting workers, dead), and the request calls.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from streamkv.core.admission import EngineLimits
from streamkv.engine.engine_commands import EngineCommands, Submission
from streamkv.engine.engine_thread import EngineThread, LoopSide
from streamkv.engine.llm_engine import LLMEngine
from streamkv.engine.recovery import EngineRestartedError, RestartBudget
from streamkv.engine.request_book import (
    EngineDeadError,
    EngineNotReadyError,
    EngineRecoveringError,
    EngineStoppingError,
    Observer,
    QueueFullError,
    RequestBook,
    RequestStream,
)
from streamkv.engine.serving_logs import StatsLogger, log_request
from streamkv.engine.tokenizer_lanes import TokenizerLanes
from streamkv.engine.watchdog import STEP_TIMEOUT_S
from streamkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """``build``: a function that builds the engine, called on the engine thread."""

    def __init__(
        self,
        build: Callable[[], LLMEngine],
        stats_interval: float = 0.25,
        restarts: RestartBudget | None = None,
        log_stats_interval: float | None = None,
        log_requests: bool = False,
        step_timeout_s: float = STEP_TIMEOUT_S,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self._log_requests = log_requests  # one line per request (engine/serving_logs.py)
        self.observers: list[Observer] = []
        self._commands = EngineCommands()
        self._book = RequestBook(self._commands, self.observers)
        # Tokenization and chat templates run there, never on the event loop.
        self._tokenizer_lanes = TokenizerLanes()
        side = LoopSide(
            ready=self._on_ready,
            dead=self._on_dead,
            recovering=self._on_recovering,
            restarted=self._on_restarted,
            outputs=self._book.dispatch,
            verdicts=self._book.resolve,
            stalled=self._on_stalled,
        )
        # Dead workers are restarted (a new engine from ``build``) within the restart budget,
        # and the running requests resume by recompute (engine/recovery.py).
        self._thread = EngineThread(
            build,
            self._commands,
            side,
            self._tokenizer_lanes,
            restarts or RestartBudget(),
            stats_interval,
            StatsLogger(log_stats_interval) if log_stats_interval is not None else None,
            step_timeout_s,
        )
        self._stop_timeout_s = stop_timeout_s  # stop() waits no longer for a stuck engine thread
        self._stalled: str | None = None  # why, while the watchdog sees a step past its limit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = asyncio.Event()
        self._ready_or_dead: asyncio.Future | None = None
        self._died: asyncio.Future | None = None
        self._dead: BaseException | None = None
        self._recovering: str | None = None  # why, while the workers restart
        self._stopping_error: EngineStoppingError | None = None  # set by drain()

    # -- what the engine thread publishes -----------------------------------------------------
    @property
    def engine(self) -> LLMEngine | None:
        return self._thread.engine

    @property
    def info(self) -> EngineLimits | None:
        return self._thread.info

    @property
    def tokenizer(self) -> Any:
        return self._thread.tokenizer

    @property
    def stats(self) -> dict:
        return self._thread.stats

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Begin loading the model on the engine thread; returns at once."""
        self._loop = asyncio.get_running_loop()
        self._ready_or_dead = self._loop.create_future()
        self._died = self._loop.create_future()
        self._thread.start(self._loop)

    async def wait_ready(self) -> None:
        """Until the model is loaded; raises EngineDeadError if loading failed."""
        await asyncio.shield(self._ready_or_dead)

    async def wait_dead(self) -> BaseException:
        """Until the engine dies for good (after loading, or when restarts run out)."""
        return await asyncio.shield(self._died)

    @property
    def ready(self) -> bool:
        return (
            self._ready.is_set()
            and self._dead is None
            and self._recovering is None
            and self._stalled is None
        )

    @property
    def stalled(self) -> str | None:
        """Why the engine thread is stuck in a step (the watchdog's report), else None."""
        return self._stalled

    @property
    def dead(self) -> BaseException | None:
        return self._dead

    async def stop(self) -> None:
        self._thread.stop()
        # Polled, not joined on an executor thread: a stuck engine thread must not hold the
        # shutdown (and the interpreter's exit, which joins executor threads) forever.
        deadline = time.monotonic() + self._stop_timeout_s
        while self._thread.started and not self._thread.join(0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._tokenizer_lanes.shutdown()
        if self._thread.started and not self._thread.join(0):
            why = "the engine thread is still in a step after %g s; stopping without it"
            logger.error(why, self._stop_timeout_s)
            return  # its workers end with this process (they watch their parent)
        if self.engine is not None:
            self.engine.shutdown()

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        if self._stopping_error is not None:
            raise self._stopping_error
        if not self._ready.is_set():
            raise EngineNotReadyError("the model is still loading")
        if self._recovering is not None:
            raise EngineRecoveringError(
                f"the workers are being restarted after a failure ({self._recovering})"
            )
        if self._stalled is not None:
            raise EngineRecoveringError(f"the engine is stuck: {self._stalled}")

    def drain(self) -> None:
        """Refuse new requests from now on; running ones go on."""
        self._stopping_error = EngineStoppingError("the server is shutting down")

    def end_all(self, error: BaseException) -> None:
        """End every open stream with ``error`` and abort its request in the engine."""
        self._book.end_all(error)

    @property
    def num_open_streams(self) -> int:
        """Requests queued or running whose streams are still open."""
        return self._book.num_open

    # -- requests -------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        notify: asyncio.Event | None = None,
        arrival: float | None = None,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises the
        engine's ValueError for bad input, EngineDeadError / EngineNotReadyError."""
        stream, accepted = self.submit(
            request_id, prompt_token_ids, params, prompt, notify, arrival
        )
        return await self.wait_accepted(stream, accepted)

    def reserve(self, count: int, max_queued: int | None) -> None:
        """Raise QueueFullError unless ``count`` more requests may wait. Call it and then
        ``submit`` without an ``await`` in between, so that the check and the count agree
        under a burst (checked, then counted after an await, ``--max-queue-len 4`` let 6 wait)."""
        self.check_alive()
        if max_queued is not None and self.num_queued + count > max_queued:
            raise QueueFullError(
                f"{self.num_queued} requests are waiting already (the limit is {max_queued})"
            )

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        notify: asyncio.Event | None = None,
        arrival: float | None = None,
    ) -> tuple[RequestStream, asyncio.Future]:
        """The synchronous half of ``add_request``: queued and counted at once; await
        ``wait_accepted(stream, future)`` for the engine's verdict."""
        self.check_alive()
        arrival = time.monotonic() if arrival is None else arrival
        accepted = self._loop.create_future()
        sub = Submission(request_id, prompt, params, prompt_token_ids, arrival, accepted)
        stream = self._book.open(sub, notify or asyncio.Event())
        if self._log_requests:
            log_request(request_id, prompt_token_ids, params, prompt)
        return stream, sub.accepted

    async def wait_accepted(self, stream: RequestStream, accepted: asyncio.Future) -> RequestStream:
        try:
            await accepted
        except BaseException:
            # Bad input, or the caller was cancelled: then the book aborts it once added.
            self._book.forget(stream.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the engine's next step."""
        self._book.abort(request_id)

    @property
    def num_queued(self) -> int:
        """Requests waiting to be scheduled: queued here or in the scheduler's waiting queue."""
        return self._book.num_queued

    async def run_tokenizer(self, fn: Callable[[Any], T], size: int) -> T:
        """``fn(tokenizer)`` off the event loop, for an input of ``size`` characters (the
        lanes and their bounds: tokenizer_lanes.py). Raises TokenizerBusyError."""
        self.check_alive()
        return await self._tokenizer_lanes.run(fn, size)

    async def run_on_engine(self, fn: Callable[[LLMEngine], T], timeout: float) -> T:
        """``fn(engine)`` between two steps (at once when idle), where engine state can be read
        safely; keep it short, the next step waits (EngineCommands.run)."""
        return await self._commands.run(fn, timeout)

    # -- what the engine thread tells the loop (called on the loop) -------------------------
    def _on_ready(self) -> None:
        self._ready.set()
        if not self._ready_or_dead.done():
            self._ready_or_dead.set_result(None)
        logger.debug("engine ready: %s", self.info)  # the server logs its own "ready:" line

    def _on_recovering(self, why: str) -> None:
        self._recovering = why

    def _on_stalled(self, why: str | None) -> None:
        self._stalled = why

    def _on_restarted(self, handed: threading.Event, stalled: str | None = None) -> None:
        if stalled is not None:
            self._stalled = None
            why = f"{stalled}; the engine was restarted and this request, suspected of causing it,"
            ended = self._book.end_suspects(EngineRestartedError(f"{why} was ended"))
            logger.error(
                "watchdog: ended %d request(s) suspected of stalling the engine: %s",
                len(ended),
                ", ".join(ended),
            )
        resumed = self._book.resume_all(self._loop, self.tokenizer)
        self._recovering = None
        logger.info("the workers are back; %d request(s) resume by recompute", resumed)
        handed.set()

    def _on_dead(self, error: BaseException) -> None:
        self._dead = error
        self._recovering = None
        if not self._died.done():
            self._died.set_result(error)
        dead = EngineDeadError(f"the engine is dead: {error}")
        if not self._ready_or_dead.done():
            self._ready_or_dead.set_exception(dead)
        self._book.fail_all(dead)
