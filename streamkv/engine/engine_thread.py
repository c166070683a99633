"""The engine thread: it builds the ``LLMEngine``, applies the event loop's commands between
steps, steps, and hands outputs back to the loop; failed worker processes are restarted in
a new engine, within a budget (engine/recovery.py). A step that runs past its limit is
interrupted by a watchdog (engine/watchdog.py) and handled like a worker failure, except that
the requests suspected of causing it end with an error instead of resuming.

Why a thread and not ``run_in_executor`` per step: the engine is not thread-safe, so every
call into it (add, abort, step, stats) must come from one thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamkv.core.admission import EngineLimits
from streamkv.engine.engine_commands import EngineCommands, Verdicts
from streamkv.engine.llm_engine import LLMEngine
from streamkv.engine.recovery import RestartBudget
from streamkv.engine.reserved_prefixes import carry_prefixes
from streamkv.engine.serving_logs import StatsLogger
from streamkv.engine.tokenizer_lanes import TokenizerLanes
from streamkv.engine.watchdog import STEP_TIMEOUT_S, StepClock, StepTimeout, StepWatchdog
from streamkv.heap import refreeze_heap
from streamkv.sequence import RequestOutput

# The async engine's lines keep the one logger name they had before it was split in modules.
logger = logging.getLogger("streamkv.engine.async_engine")
_IDLE_PROBE_S = 1.0
# The engine thread and the event loop share the GIL. Each time the engine thread comes back
# from a blocking call (the step's IPC, a device sync) it waits for the loop to give the GIL
# up, by default after 5 ms of Python's switch interval: under a burst that convoy added
# several milliseconds to every step. The interval is set when the thread starts;
# STREAMKV_GIL_SWITCH_INTERVAL_MS overrides it (docs/benchmarks.md "Serving").
GIL_SWITCH_INTERVAL_MS = float(os.environ.get("STREAMKV_GIL_SWITCH_INTERVAL_MS", "0.5"))


@dataclass(slots=True)
class LoopSide:
    """What the engine thread tells the event loop; each is called on the loop."""

    ready: Callable[[], None]
    dead: Callable[[BaseException], None]
    recovering: Callable[[str], None]  # why
    # Set the event once the resumed requests are queued; the str: why the step was
    # interrupted (the watchdog), None after a worker failure.
    restarted: Callable[[threading.Event, str | None], None]
    stalled: Callable[[str | None], None]  # a step runs past its limit (why), or None: no more
    outputs: Callable[[list[RequestOutput], int], None]  # and the scheduler's waiting count
    verdicts: Callable[[Verdicts, int], None]  # on the submissions applied, and the same count


class EngineThread:
    """Owns the engine on its thread. ``engine``, ``info``, ``tokenizer`` and ``stats`` are
    written there and only read elsewhere."""

    def __init__(
        self,
        build: Callable[[], LLMEngine],
        commands: EngineCommands,
        side: LoopSide,
        lanes: TokenizerLanes,
        restarts: RestartBudget,
        stats_interval: float,
        stats_logger: StatsLogger | None,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        self._build = build
        self._commands = commands
        self._side = side
        self._lanes = lanes
        self._restarts = restarts
        self._stats_interval = stats_interval
        self._stats_logger = stats_logger
        self.engine: LLMEngine | None = None
        self.info: EngineLimits | None = None
        self.tokenizer: Any = None
        self.stats: dict = {}
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._clock = StepClock()
        self._watchdog = StepWatchdog(
            self._clock,
            step_timeout_s,
            lambda why: self._post(side.stalled, why),
            lambda: self._post(side.stalled, None),
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_MS / 1e3)
        self._thread = threading.Thread(target=self._run, name="streamkv-engine", daemon=True)
        self._thread.start()
        self._watchdog.start(self._thread)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stop(self) -> None:
        """The thread ends after its current step (``join`` to wait for it)."""
        self._stopping = True
        self._commands.wake()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (at most ``timeout`` s); whether it has."""
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._watchdog.stop()
        return not self._thread.is_alive()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        try:
            engine = self._build()
            self.engine, self.tokenizer = engine, engine.tokenizer
            self._lanes.set_tokenizer(engine.tokenizer)
            self.info = engine.info()
            self.stats = engine.stats()
        except (OSError, ValueError) as e:  # a bad model path or configuration: no traceback
            logger.error("the engine failed to load: %s", e)
            self._post(self._side.dead, e)
            return
        except BaseException as e:
            logger.exception("the engine failed to load")
            self._post(self._side.dead, e)
            return
        self._post(self._side.ready)
        while engine is not None:
            try:
                return self._serve(engine)
            except StepTimeout as e:
                if self._stopping:
                    return
                engine = self._restart(
                    engine, e, self._watchdog.stalled or "an engine step ran past its limit"
                )
            except BaseException as e:
                if self._stopping or not _workers_failed(e):
                    logger.exception("the engine died in a step")
                    self._post(self._side.dead, e)
                    return
                engine = self._restart(engine, e)

    def _serve(self, engine: LLMEngine) -> None:
        last_stats, last_waiting = time.monotonic(), 0

        def emit(outputs: list[RequestOutput]) -> None:  # mid-step: the device runs the next one
            self._post(self._side.outputs, outputs, engine.num_waiting())

        while not self._stopping:
            verdicts = self._commands.apply(engine)
            if verdicts:
                self._post(self._side.verdicts, verdicts, engine.num_waiting())
            if not engine.has_unfinished_requests():
                self.stats = engine.stats()
                self._log_stats(time.monotonic())
                self._commands.wait(_IDLE_PROBE_S)
                # Idle, a worker can die or freeze too: /health should say so at once,
                # not when the next request's step fails.
                engine.executor.check_workers()
                continue
            self._clock.begin()
            outputs = engine.step(unread=self._commands.unread, emit=emit)
            self._clock.end()
            waiting = engine.num_waiting()
            if outputs or waiting != last_waiting:
                self._post(self._side.outputs, outputs, waiting)
                last_waiting = waiting
            now = time.monotonic()
            if now - last_stats >= self._stats_interval:
                self.stats, last_stats = engine.stats(), now
                self._log_stats(now)

    def _log_stats(self, now: float) -> None:
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(self.stats, now)

    def _restart(
        self, old: LLMEngine, error: BaseException, stalled: str | None = None
    ) -> LLMEngine | None:
        """A new engine (new worker processes, KV pools built again) in place of ``old``;
        None once the restart budget is spent (then the engine is dead). ``stalled``: the
        watchdog interrupted a step (why); ``old`` may be mid-step, so it is rebuilt too."""
        self._clock.end()
        if stalled is not None:
            error = RuntimeError(stalled)
        start = time.monotonic()
        what = "an engine step stalled" if stalled is not None else "the worker processes failed"
        logger.error("%s: %s; restarting them", what, str(error).splitlines()[0])
        self._post(self._side.recovering, str(error).splitlines()[0])
        try:
            old.shutdown()
        except Exception:  # noqa: BLE001 - what is left of the old workers is killed anyway
            logger.exception("stopping the failed workers")
        while not self._stopping:
            if not self._restarts.take():
                b = self._restarts
                why = RuntimeError(
                    f"the workers failed {b.limit} times within {b.window:g} s; last: {error}"
                )
                logger.error("giving up: %s", why)
                self._post(self._side.dead, why)
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
        try:  # before the resumed requests: they may start with a reserved prefix
            carried = carry_prefixes(old, engine)
            if carried:
                logger.info(
                    "reserved prefixes registered again after the restart: %s", ", ".join(carried)
                )
        except Exception:  # noqa: BLE001 - the engine serves on without them
            logger.exception("reserved prefixes could not be carried over the restart")
        self.engine, self.stats = engine, engine.stats()
        refreeze_heap()  # the old in-process worker's release thawed the heap (heap.py)
        logger.warning("worker processes restarted in %.1f s", time.monotonic() - start)
        handed = threading.Event()
        self._post(self._side.restarted, handed, stalled)
        handed.wait()  # the resumed requests are queued before the next step
        return engine


def _workers_failed(error: BaseException) -> bool:
    """A worker process died, froze or reported an error: restart. Anything else in a step
    (the in-process executor's device gone, a bug in the engine) is fatal."""
    try:
        from streamkv.executor.multiproc import WorkerError
    except ImportError:  # pragma: no cover - no torch: no worker processes either
        return False
    return isinstance(error, WorkerError)
