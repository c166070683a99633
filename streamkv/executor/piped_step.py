"""Steps in flight to the multiprocess executor's ranks (executor/multiproc.py): each step's
handle, and the queue that reads their replies in the order the steps were sent.

The executor writes step N+1 to the ranks before it reads step N's reply (async
scheduling). The ranks run steps in that order and answer in that order, so replies are
matched to steps by position alone: reading one step's reply first reads those of every
step sent before it, and a control call reads all of them before its own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from streamkv.executor import ipc
from streamkv.messages import StepFailed, StepOutput


class PipedStep:
    """A step written to every rank. ``result()`` returns its StepOutput or raises its
    StepFailed (or the executor's WorkerError)."""

    __slots__ = ("_pipe", "sent", "done", "output", "error")

    def __init__(self, pipe: StepPipe, sent: float) -> None:
        self._pipe = pipe
        self.sent = sent  # time.perf_counter() when its sending began
        self.done = False
        self.output: StepOutput | None = None
        self.error: StepFailed | None = None

    def result(self) -> StepOutput:
        while not self.done:
            self._pipe.read_next()
        if self.error is not None:
            raise self.error
        return self.output


class StepPipe:
    """``read_reply()`` reads the oldest unread step's replies from every rank and returns
    rank 0's Out, or raises StepFailed (that step failed) or anything else (the executor is
    dead: every later read raises too)."""

    def __init__(self, read_reply: Callable[[], ipc.Out]) -> None:
        self._read_reply = read_reply
        self._unread: deque[PipedStep] = deque()  # oldest first
        self.steps, self.roundtrip_s, self.worker_s = 0, 0.0, 0.0

    def sent(self, start: float) -> PipedStep:
        """The handle of the step just written, whose sending began at ``start``
        (time.perf_counter())."""
        handle = PipedStep(self, start)
        self._unread.append(handle)
        return handle

    def drain(self) -> None:
        """Read every unread step's replies (before a control call's)."""
        while self._unread:
            self.read_next()

    def read_next(self) -> None:
        step = self._unread[0]
        try:
            out = self._read_reply()
        except StepFailed as e:
            step.error = e
        else:
            step.output = out.output
            self.steps += 1
            self.roundtrip_s += time.perf_counter() - step.sent
            self.worker_s += out.worker_s
        self._unread.popleft()
        step.done = True
