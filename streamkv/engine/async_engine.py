"""The asyncio face of the engine: one background thread owns the ``LLMEngine`` and runs
its step loop; the event loop only queues commands and reads per-request streams.

Why a thread and not ``run_in_executor`` per step: the engine is not thread-safe, so every
call into it (add, abort, step, stats) must come from one thread. Commands from the event
loop go into a deque and are applied between steps, which is also what makes an abort free
the request's blocks within one step.

Outputs are cumulative (text and token ids so far), so a stream keeps only the newest one:
a slow reader never builds a backlog, it just gets bigger deltas.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from streamkv.engine.llm_engine import LLMEngine
from streamkv.engine.tokenizer_lanes import TokenizerLanes
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


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


class Observer(Protocol):
    def on_output(self, stream: RequestStream, out: RequestOutput, now: float) -> None: ...

    def on_abort(self, stream: RequestStream, now: float) -> None: ...


class RequestStream:
    """The outputs of one request, newest only. Several streams may share one ``notify``
    event so that a response covering several prompts waits on all of them at once."""

    def __init__(self, request_id: str, notify: asyncio.Event, arrival: float) -> None:
        self.request_id = request_id
        self.notify = notify
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens_seen = 0
        self.finished = False  # no more outputs will come (finished, aborted or failed)
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None

    def put(self, out: RequestOutput) -> None:
        self._latest = out
        if out.finished:
            self.finished = True
        self.notify.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self.notify.set()

    def take(self) -> RequestOutput | None:
        """The newest output not yet taken (None if nothing new); raises the stream's error
        once every output before it was taken."""
        out, self._latest = self._latest, None
        if out is None and self._error is not None:
            raise self._error
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


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | None
    params: SamplingParams
    prompt_token_ids: list[int] | None
    arrival_time: float
    accepted: asyncio.Future


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the front end needs to validate requests, fixed once the model is loaded."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int
    usable_kv_blocks: int  # the pool minus the scheduler's watermark
    max_num_seqs: int
    prefix_caching: bool


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine], stats_interval: float = 0.25) -> None:
        self._build = build
        self._stats_interval = stats_interval
        self.engine: LLMEngine | None = None
        self.info: EngineInfo | None = None
        self.tokenizer: Any = None
        self.stats: dict = {}
        self.observers: list[Observer] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._commands: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}
        # Admission control: adds not yet applied by the engine thread, and the scheduler's
        # waiting queue as of the last callback from that thread (both read on the loop).
        self._pending_adds = 0
        self._engine_waiting = 0
        self._ready = asyncio.Event()
        self._dead: BaseException | None = None
        self._ready_or_dead: asyncio.Future | None = None
        self._stopping_error: EngineStoppingError | None = None  # set by drain()
        # Tokenization and chat templates run there, never on the event loop.
        self._tokenizer_lanes = TokenizerLanes()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Begin loading the model on the engine thread; returns at once."""
        self._loop = asyncio.get_running_loop()
        self._ready_or_dead = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="streamkv-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Until the model is loaded; raises EngineDeadError if loading failed."""
        await asyncio.shield(self._ready_or_dead)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._dead is None

    @property
    def dead(self) -> BaseException | None:
        return self._dead

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._tokenizer_lanes.shutdown()
        if self.engine is not None:
            self.engine.shutdown()

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        if self._stopping_error is not None:
            raise self._stopping_error
        if not self._ready.is_set():
            raise EngineNotReadyError("the model is still loading")

    def drain(self) -> None:
        """Refuse new requests from now on; running ones go on."""
        self._stopping_error = EngineStoppingError("the server is shutting down")

    def end_all(self, error: BaseException) -> None:
        """End every open stream with ``error`` and abort its request in the engine."""
        now = time.monotonic()
        for request_id in list(self._streams):
            stream = self._forget(request_id)
            stream.fail(error)
            self._commands.append(("abort", request_id))
            for obs in self.observers:
                obs.on_abort(stream, now)
        self._wakeup.set()

    @property
    def num_open_streams(self) -> int:
        """Requests queued or running whose streams are still open."""
        return len(self._streams)

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
        stream, accepted = self.submit(request_id, prompt_token_ids, params, prompt, notify, arrival)
        return await self.wait_accepted(stream, accepted)

    def reserve(self, count: int, max_queued: int | None) -> None:
        """Raise QueueFullError unless ``count`` more requests may wait. Call it and then
        ``submit`` without an ``await`` in between, so that the check and the count agree
        under a burst (checked, then counted after an await, ``--max-queue-len 4`` let 6 wait)."""
        self.check_alive()
        if max_queued is not None and self.num_queued + count > max_queued:
            raise QueueFullError(f"{self.num_queued} requests are waiting already (the limit is {max_queued})")

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
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival is None else arrival
        stream = RequestStream(request_id, notify or asyncio.Event(), arrival)
        accepted = self._loop.create_future()
        self._streams[request_id] = stream
        self._pending_adds += 1
        self._commands.append(_Add(request_id, prompt, params, prompt_token_ids, arrival, accepted))
        self._wakeup.set()
        return stream, accepted

    async def wait_accepted(self, stream: RequestStream, accepted: asyncio.Future) -> RequestStream:
        request_id = stream.request_id
        try:
            await accepted
        except BaseException:
            # Bad input, or the caller was cancelled: then _resolve aborts it once added.
            self._forget(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the engine's next step."""
        stream = self._forget(request_id)
        if stream is None:
            return
        stream.fail(RequestAbortedError(request_id))
        self._commands.append(("abort", request_id))
        self._wakeup.set()
        now = time.monotonic()
        for obs in self.observers:
            obs.on_abort(stream, now)

    def _forget(self, request_id: str) -> RequestStream | None:
        return self._streams.pop(request_id, None)

    @property
    def num_queued(self) -> int:
        """Requests waiting to be scheduled: queued here or in the scheduler's waiting queue."""
        return self._pending_adds + self._engine_waiting

    async def run_tokenizer(self, fn: Callable[[Any], T], size: int) -> T:
        """``fn(tokenizer)`` off the event loop, for an input of ``size`` characters (the
        lanes and their bounds: tokenizer_lanes.py). Raises TokenizerBusyError."""
        self.check_alive()
        return await self._tokenizer_lanes.run(fn, size)

    # -- event-loop side of the engine thread -----------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput], waiting: int) -> None:
        self._engine_waiting = waiting
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its reader meanwhile
            if out.finished:
                self._forget(out.request_id)
            for obs in self.observers:
                obs.on_output(stream, out, now)
            stream.put(out)

    def _resolve(self, results: list[tuple[_Add, BaseException | None]], waiting: int) -> None:
        self._pending_adds -= len(results)
        self._engine_waiting = waiting
        for add, error in results:
            if add.accepted.done():  # the caller gave up: do not leave the request running
                if error is None:
                    self._commands.append(("abort", add.request_id))
                    self._wakeup.set()
            elif error is None:
                add.accepted.set_result(None)
            else:
                add.accepted.set_exception(error)

    def _on_ready(self, engine: LLMEngine) -> None:
        self._ready.set()
        if not self._ready_or_dead.done():
            self._ready_or_dead.set_result(None)
        logger.info("engine ready: %s", self.info)

    def _on_dead(self, error: BaseException) -> None:
        self._dead = error
        dead = EngineDeadError(f"the engine is dead: {error}")
        if not self._ready_or_dead.done():
            self._ready_or_dead.set_exception(dead)
        for stream in list(self._streams.values()):
            stream.fail(dead)
        self._streams.clear()
        self._pending_adds = 0
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, _Add) and not cmd.accepted.done():
                cmd.accepted.set_exception(dead)

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._build()
            self.engine, self.tokenizer = engine, engine.tokenizer
            self._tokenizer_lanes.set_tokenizer(engine.tokenizer)
            self.info = _engine_info(engine)
            self.stats = engine.stats()
        except (OSError, ValueError) as e:  # a bad model path or configuration: no traceback
            logger.error("the engine failed to load: %s", e)
            self._loop.call_soon_threadsafe(self._on_dead, e)
            return
        except BaseException as e:
            logger.exception("the engine failed to load")
            self._loop.call_soon_threadsafe(self._on_dead, e)
            return
        self._loop.call_soon_threadsafe(self._on_ready, engine)
        last_stats, last_waiting = time.monotonic(), 0
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._apply_commands(engine)
                if not engine.has_unfinished_requests():
                    self.stats = engine.stats()
                    self._wakeup.wait()
                    continue
                outputs = engine.step()
                waiting = len(engine.scheduler.waiting)
                if outputs or waiting != last_waiting:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs, waiting)
                    last_waiting = waiting
                now = time.monotonic()
                if now - last_stats >= self._stats_interval:
                    self.stats, last_stats = engine.stats(), now
        except BaseException as e:
            logger.exception("the engine died in a step")
            self._loop.call_soon_threadsafe(self._on_dead, e)

    def call_on_engine_thread(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run ``fn(engine)`` on the engine thread between two steps (at once when idle): where
        engine state can be read safely. Keep it short, the next step waits; it hands its
        result back itself (``loop.call_soon_threadsafe``). Dropped if the engine dies."""
        self._commands.append(("call", fn))
        self._wakeup.set()

    def _apply_commands(self, engine: LLMEngine) -> None:
        results = []
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, _Add):
                try:
                    engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.prompt_token_ids, cmd.arrival_time)
                    results.append((cmd, None))
                except ValueError as e:
                    results.append((cmd, e))
            elif cmd[0] == "call":
                try:
                    cmd[1](engine)
                except Exception:  # an observer's bug must not kill the engine thread
                    logger.exception("a call on the engine thread failed")
            else:
                engine.abort_request(cmd[1])
        if results:
            self._loop.call_soon_threadsafe(self._resolve, results, len(engine.scheduler.waiting))


def _engine_info(engine: LLMEngine) -> EngineInfo:
    bm = engine.block_manager
    cfg = engine.config
    return EngineInfo(
        max_model_len=cfg.scheduler.max_model_len,
        vocab_size=engine.executor.hf_config["vocab_size"],
        block_size=bm.block_size,
        num_kv_blocks=bm.device.num_blocks,
        num_swap_blocks=bm.cpu.num_blocks,
        usable_kv_blocks=bm.device.num_blocks - bm.watermark_blocks,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        prefix_caching=cfg.cache.enable_prefix_caching,
    )
