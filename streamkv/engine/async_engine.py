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
from typing import Any, TypeVar

from streamkv.engine.llm_engine import EngineInfo, LLMEngine
from streamkv.engine.recovery import (
    EngineRestartedError,
    RestartBudget,
    ResumeBase,
    ends_early,
    resumable,
    resume_request,
    splice,
)
from streamkv.engine.request_stream import (
    EngineDeadError,
    EngineNotReadyError,
    EngineRecoveringError,
    EngineStoppingError,
    Observer,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from streamkv.engine.serving_logs import StatsLogger, log_request
from streamkv.engine.tokenizer_lanes import TokenizerLanes
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import RequestOutput

logger = logging.getLogger(__name__)
_IDLE_PROBE_S = 1.0
T = TypeVar("T")


# Re-exported: the front end imports the stream and its errors from here.
__all__ = ["AsyncEngine", "EngineDeadError", "EngineInfo", "EngineNotReadyError", "EngineRecoveringError",
           "EngineStoppingError", "Observer", "QueueFullError", "RequestAbortedError", "RequestStream"]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | None
    params: SamplingParams
    prompt_token_ids: list[int] | None
    arrival_time: float
    accepted: asyncio.Future


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine], stats_interval: float = 0.25,
                 restarts: RestartBudget | None = None, log_stats_interval: float | None = None,
                 log_requests: bool = False) -> None:
        self._build = build
        # The operator's log (engine/serving_logs.py): a stats line every log_stats_interval
        # seconds (None: none), one line per request with log_requests.
        self._stats_logger = StatsLogger(log_stats_interval) if log_stats_interval is not None else None
        self._log_requests = log_requests
        # Worker processes that die are restarted (a new engine from ``build``) and the
        # running requests resume by recompute (engine/recovery.py), within this budget.
        self._restarts = restarts or RestartBudget()
        self._recovering: str | None = None  # why, while the workers restart
        self._adds: dict[str, _Add] = {}  # each open request as first submitted
        self._resumed: dict[str, ResumeBase] = {}  # resumed requests: what came before
        self._died: asyncio.Future | None = None
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
        self._died = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="streamkv-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Until the model is loaded; raises EngineDeadError if loading failed."""
        await asyncio.shield(self._ready_or_dead)

    async def wait_dead(self) -> BaseException:
        """Until the engine dies for good (after loading, or when restarts run out)."""
        return await asyncio.shield(self._died)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._dead is None and self._recovering is None

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
        if self._recovering is not None:
            raise EngineRecoveringError(f"the workers are being restarted after a failure ({self._recovering})")

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
        self._adds[request_id] = add = _Add(request_id, prompt, params, prompt_token_ids, arrival, accepted)
        self._commands.append(add)
        self._wakeup.set()
        if self._log_requests:
            log_request(request_id, prompt_token_ids, params, prompt)
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
        self._adds.pop(request_id, None)
        self._resumed.pop(request_id, None)
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
            base = self._resumed.get(out.request_id)
            if base is not None:
                spliced = splice(base, out)
                if ends_early(out, spliced):  # a stop string straddled the restart: end it there
                    self._commands.append(("abort", out.request_id))
                    self._wakeup.set()
                out = spliced
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
        logger.debug("engine ready: %s", self.info)  # the server logs its own "ready:" line

    def _on_recovering(self, why: str) -> None:
        self._recovering = why

    def _on_restarted(self, handed: threading.Event) -> None:
        """Loop side of a restart: every request the old engine had taken goes into the new
        one from where its stream stands (requests not yet taken are still queued)."""
        taken = [(self._adds[rid], stream) for rid, stream in self._streams.items()
                 if rid in self._adds and _was_taken(self._adds[rid].accepted)]
        resumes = []
        for add, stream in taken:
            if not resumable(add.params):
                self._forget(add.request_id)
                stream.fail(EngineRestartedError(
                    "the workers were restarted and a request with n > 1, best_of or beam search cannot resume"))
                continue
            ids, params, base = resume_request(add.prompt_token_ids, add.params, stream.last, self.tokenizer)
            if base is not None:
                self._resumed[add.request_id] = base
            accepted = self._loop.create_future()
            accepted.add_done_callback(lambda f, s=stream: f.exception() and s.fail(EngineDeadError(str(f.exception()))))
            resumes.append(_Add(add.request_id, add.prompt, params, ids, add.arrival_time, accepted))
        self._pending_adds += len(resumes)
        self._commands.extendleft(reversed(resumes))  # before anything queued meanwhile
        self._recovering = None
        logger.info("the workers are back; %d request(s) resume by recompute", len(resumes))
        self._wakeup.set()
        handed.set()

    def _on_dead(self, error: BaseException) -> None:
        self._dead = error
        self._recovering = None
        if not self._died.done():
            self._died.set_result(error)
        self._adds.clear()
        self._resumed.clear()
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
            self.info = engine.info()
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
        while engine is not None:
            try:
                return self._serve(engine)
            except BaseException as e:
                if self._stopping or not _workers_failed(e):
                    logger.exception("the engine died in a step")
                    self._loop.call_soon_threadsafe(self._on_dead, e)
                    return
                engine = self._restart(engine, e)

    def _serve(self, engine: LLMEngine) -> None:
        last_stats, last_waiting = time.monotonic(), 0
        while not self._stopping:
            self._wakeup.clear()
            self._apply_commands(engine)
            if not engine.has_unfinished_requests():
                self.stats = engine.stats()
                self._log_stats(time.monotonic())
                self._wakeup.wait(_IDLE_PROBE_S)
                # Idle, a worker can die or freeze too: /health should say so at once,
                # not when the next request's step fails.
                probe = getattr(engine.executor, "check_workers", None)
                if probe is not None:
                    probe()
                continue
            outputs = engine.step()
            waiting = engine.num_waiting()
            if outputs or waiting != last_waiting:
                self._loop.call_soon_threadsafe(self._dispatch, outputs, waiting)
                last_waiting = waiting
            now = time.monotonic()
            if now - last_stats >= self._stats_interval:
                self.stats, last_stats = engine.stats(), now
                self._log_stats(now)

    def _log_stats(self, now: float) -> None:
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(self.stats, now)

    def _restart(self, old: LLMEngine, error: BaseException) -> LLMEngine | None:
        """A new engine (new worker processes, KV pools built again) in place of ``old``;
        None once the restart budget is spent (then the engine is dead)."""
        start = time.monotonic()
        logger.error("the worker processes failed: %s; restarting them", str(error).splitlines()[0])
        self._loop.call_soon_threadsafe(self._on_recovering, str(error).splitlines()[0])
        try:
            old.shutdown()
        except Exception:  # noqa: BLE001 - what is left of the old workers is killed anyway
            logger.exception("stopping the failed workers")
        while not self._stopping:
            if not self._restarts.take():
                b = self._restarts
                why = RuntimeError(f"the workers failed {b.limit} times within {b.window:g} s; last: {error}")
                logger.error("giving up: %s", why)
                self._loop.call_soon_threadsafe(self._on_dead, why)
                return None
            try:
                engine = self._build()
                break
            except BaseException as e:  # noqa: BLE001 - counted against the budget
                logger.exception("restarting the workers failed")
                error = e
                time.sleep(1.0)
        else:
            return None
        self.engine, self.stats = engine, engine.stats()
        logger.warning("worker processes restarted in %.1f s", time.monotonic() - start)
        handed = threading.Event()
        self._loop.call_soon_threadsafe(self._on_restarted, handed)
        handed.wait()  # the resumed requests are queued before the next step
        return engine

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
            self._loop.call_soon_threadsafe(self._resolve, results, engine.num_waiting())


def _workers_failed(error: BaseException) -> bool:
    """A worker process died, froze or reported an error: restart. Anything else in a step
    (the in-process executor's device gone, a bug in the engine) is fatal."""
    try:
        from streamkv.executor.multiproc import WorkerError
    except ImportError:  # pragma: no cover - no torch: no worker processes either
        return False
    return isinstance(error, WorkerError)


def _was_taken(accepted: asyncio.Future) -> bool:
    return accepted.done() and not accepted.cancelled() and accepted.exception() is None
