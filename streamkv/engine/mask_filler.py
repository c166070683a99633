"""Fills a step's token masks on a thread of its own, while the engine's thread goes on with
the next step's scheduling and building (engine/step_pipeline.py).

xgrammar's batched fill releases the GIL for the whole native call, so the fill and the
engine's Python run at the same time. What costs is the GIL *handoff*: a thread that wants
the GIL while another runs Python waits up to the switch interval (5 ms) for it. So the
start is a handshake (``start`` waits until the worker holds the job, which it hands to the
native call at once, releasing the GIL), and the end is the engine's ``MaskFill.words``,
whose wait releases the GIL for the worker to return. A thread that was merely notified
would wait for the engine's thread to give up the GIL: a first try that way ran 0.49x of
unconstrained on the H200 (docs/benchmarks.md, "Session 6").

The worker exits after an idle second and is started again when needed, so an engine that
is dropped leaves no thread behind for long.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

IDLE_EXIT_S = 1.0


class MaskFill:
    """One batched fill in flight: ``words()`` waits for it and returns the masks."""

    __slots__ = ("matchers", "_words", "taken", "done", "error")

    def __init__(self, matchers: list, words: np.ndarray) -> None:
        self.matchers, self._words = matchers, words
        self.taken = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def words(self) -> np.ndarray:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self._words


class MaskFiller:
    """Runs ``fill(matchers, words)`` (xgrammar's batch fill) for one job at a time."""

    def __init__(self, fill: Callable[[list, np.ndarray], None]) -> None:
        self._fill = fill
        self._cond = threading.Condition()
        self._job: MaskFill | None = None
        self._running = False

    def start(self, matchers: list, words: np.ndarray) -> MaskFill:
        job = MaskFill(matchers, words)
        with self._cond:
            if self._job is not None:
                raise RuntimeError("a mask fill was started while another one waited to be taken")
            self._job = job
            if not self._running:
                self._running = True
                threading.Thread(target=self._serve, name="streamkv-mask-fill", daemon=True).start()
            self._cond.notify()
        job.taken.wait()  # the handshake: the worker now runs the native call, without the GIL
        return job

    def _serve(self) -> None:
        while True:
            with self._cond:
                if self._job is None:
                    self._cond.wait(IDLE_EXIT_S)
                if self._job is None:
                    self._running = False
                    return
                job, self._job = self._job, None
            job.taken.set()
            try:
                self._fill(job.matchers, job._words)
            except BaseException as e:  # handed to the engine's thread by words()
                job.error = e
            job.done.set()
