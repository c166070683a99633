"""A watchdog on the engine thread: a step that runs past its limit is reported and broken.

Why: the worker heartbeat (executor/supervisor.py) sees a frozen worker, but nothing saw the
engine thread itself. When one request made a step spin (issue 26: ``top_p=1e-46``), every
stream stalled, ``/health`` kept answering 200, and only SIGKILL ended the server.

``StepWatchdog`` polls the step clock the engine thread keeps (``StepClock``). Past
``limit_s`` it reports the stall once (``/health`` then answers 503 with the reason) and
raises ``StepTimeout`` inside the engine thread (CPython's per-thread asynchronous
exception). That lands at the thread's next Python bytecode, so a step looping in Python or
between torch calls ends there; the engine thread then rebuilds the engine and resumes the
running requests, less the suspected ones (engine_thread.py). A thread stuck inside one long
native call cannot be interrupted: the report stands, and a shutdown still ends the process
on time (entrypoints/server/shutdown.py).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Default limit on one step. The slowest expected step is a full prefill chunk on the CPU
# box (~2 s for 2,048 tokens of the embedded model); a few times that, with margin for a
# loaded host.
STEP_TIMEOUT_S = 30.0
# The limit counts the engine thread's own CPU time in the step, not the wall clock: a burst
# of 4,000 requests on the 2-core box kept the engine thread waiting for the GIL (the event
# loop parsing requests) past 30 s of wall time in a healthy step, and the watchdog ended 206
# requests. A spinning step burns its thread's CPU; one blocked in a native call burns none
# and is reported after this many limits of wall time instead.
NATIVE_STALL_FACTOR = 10.0


def thread_cpu_clock(ident: int | None) -> Callable[[], float] | None:
    """A reader of thread ``ident``'s CPU seconds (Linux), or None where there is none."""
    try:
        clock = time.pthread_getcpuclockid(ident)
        time.clock_gettime(clock)
    except (AttributeError, OSError, TypeError):
        return None
    return lambda: time.clock_gettime(clock)


class StepTimeout(BaseException):
    """Raised inside the engine thread when its step ran past the watchdog's limit. A
    BaseException: no ``except Exception`` on the way may swallow it."""


class StepClock:
    """When the engine thread's current step began (None between steps). Written by the
    engine thread only; a float assignment is atomic, so the watchdog reads it unlocked."""

    __slots__ = ("started", "cpu_started")

    def __init__(self) -> None:
        self.started: float | None = None
        self.cpu_started = 0.0  # the engine thread's CPU seconds when the step began

    def begin(self) -> None:
        self.cpu_started = time.thread_time()
        self.started = time.monotonic()

    def end(self) -> None:
        self.started = None


class StepWatchdog:
    def __init__(
        self,
        clock: StepClock,
        limit_s: float,
        on_stall: Callable[[str], None],
        on_clear: Callable[[], None],
    ) -> None:
        self.clock, self.limit_s = clock, limit_s
        self._on_stall, self._on_clear = on_stall, on_clear
        self._target: int | None = None  # the engine thread's ident
        self._stop = threading.Event()
        self.stalled: str | None = None  # the reason, while a stall is reported

    def start(self, target: threading.Thread) -> None:
        self._target = target.ident
        threading.Thread(target=self._run, name="streamkv-step-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        poll = min(0.25, self.limit_s / 4)
        interrupted_step: float | None = None
        cpu = thread_cpu_clock(self._target)
        while not self._stop.wait(poll):
            started = self.clock.started
            if self.stalled is not None and started != interrupted_step:
                self.stalled = None  # the stuck step is over: the engine moves again
                self._on_clear()
            if started is None or started == interrupted_step:
                continue
            ran = time.monotonic() - started
            if ran < self.limit_s:
                continue
            busy = cpu() - self.clock.cpu_started if cpu is not None else ran
            if busy < self.limit_s and ran < NATIVE_STALL_FACTOR * self.limit_s:
                continue  # waiting (for the GIL, a worker, the device), not spinning
            self.stalled = (
                f"an engine step has run for {ran:.0f} s (the limit is {self.limit_s:g} s)"
            )
            logger.error("watchdog: %s; interrupting it", self.stalled)
            self._on_stall(self.stalled)
            interrupted_step = started
            _raise_in(self._target, StepTimeout)


def _raise_in(ident: int | None, exc: type[BaseException]) -> None:
    """Raise ``exc`` in thread ``ident`` at its next bytecode (a no-op if it has ended)."""
    if ident is None:
        return
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc))
    if n > 1:  # cannot happen with a valid ident; undo rather than hit several threads
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
