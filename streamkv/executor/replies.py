"""Reading the ranks' replies (executor/multiproc.py), with every way a rank can fail.

``gather`` reads one reply from each rank, in rank order: a step that some rank failed (the
lockstep failure protocol: every rank answers every step); a rank that died, reported an
error or went silent; ranks that diverged. Ranks answer steps in the order they were sent, so
``StepPipe`` matches replies to the steps in flight by position alone.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import NoReturn

import msgspec

from streamkv.executor import ipc
from streamkv.executor.base import StepHandle
from streamkv.executor.cluster import RemoteRank
from streamkv.messages import StepFailed, StepOutput


def gather(
    conns: list[Connection],
    decoder: msgspec.msgpack.Decoder,
    reply: type,
    timeout: float | None,
    diverge_timeout: float,
    fail: Callable[[str], NoReturn],
    death: Callable[[int], str],
) -> list:
    """One ``reply`` message from each rank, in rank order (to a step, ranks other than 0
    answer Ok); raises WorkerError as soon as any rank reports an error or dies, or at the
    timeout (``fail`` raises it; ``death(rank)`` says what became of a rank whose pipe
    closed). A step that some rank failed (StepError) raises StepFailed once every rank
    answered, and the ranks that failed it may go on (Resume); ranks silent
    ``diverge_timeout`` seconds after another failed it have diverged from it (stuck in a
    collective it left): WorkerError. Only ranks yet to answer are read: the others'
    next messages answer the next step."""
    pending = set(range(len(conns)))
    replies: dict[int, ipc.FromWorker] = {}
    failed: dict[int, str] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            fail(_timeout_message(reply, pending, failed, timeout, diverge_timeout))
        for conn in wait([conns[r] for r in pending], left):
            rank = conns.index(conn)
            msg = _receive(conns, rank, decoder, fail, death)
            want = ipc.Ok if reply is ipc.Out and rank != 0 else reply
            if isinstance(msg, ipc.StepError) and reply is ipc.Out and rank in pending:
                failed[rank] = msg.message
                end = time.monotonic() + diverge_timeout
                deadline = end if deadline is None else min(deadline, end)
            elif not isinstance(msg, want) or rank not in pending:
                fail(
                    f"worker rank {rank} sent {ipc.kind(msg)!r} "
                    f"while {ipc.kind(want)!r} was awaited"
                )
            replies[rank] = msg
            pending.discard(rank)
    if failed:
        _resume_and_raise(conns, failed, fail, death)
    return [replies[r] for r in sorted(replies)]


def _timeout_message(
    reply: type,
    pending: set[int],
    failed: dict[int, str],
    timeout: float | None,
    diverge_timeout: float,
) -> str:
    """After a failed step the deadline is the divergence one: say so, not "no reply"."""
    if failed:
        return (
            f"worker rank(s) {sorted(failed)} failed "
            f"a step ({next(iter(failed.values()))}) "
            f"while rank(s) {sorted(pending)} did not "
            f"finish it within {diverge_timeout:.0f}s:"
            " the ranks diverged"
        )
    return (
        f"no {ipc.kind(reply)!r} reply from worker rank(s) {sorted(pending)} within {timeout:.0f}s"
    )


def _receive(
    conns: list[Connection],
    rank: int,
    decoder: msgspec.msgpack.Decoder,
    fail: Callable[[str], NoReturn],
    death: Callable[[int], str],
) -> ipc.FromWorker:
    """The next message from ``rank``; a closed pipe, an unreadable message or a reported
    error fails the gather (an error names a peer's death when there is one)."""
    try:
        msg = decoder.decode(conns[rank].recv_bytes())
    except (EOFError, OSError):  # its end of the pipe closed: the process is gone
        fail(death(rank))
    except msgspec.DecodeError as e:
        fail(f"worker rank {rank} sent a message that is none of the replies: {e}")
    if isinstance(msg, ipc.Error):
        text = (
            f"worker rank {rank} failed: {msg.message}\n--- worker traceback ---\n{msg.traceback}"
        )
        cause = _peer_death(conns, rank, death)
        fail(f"{cause}; then {text}" if cause else text)
    return msg


def _resume_and_raise(
    conns: list[Connection],
    failed: dict[int, str],
    fail: Callable[[str], NoReturn],
    death: Callable[[int], str],
) -> NoReturn:
    """Let the ranks that failed the step go on (Resume), then raise its StepFailed once,
    naming those ranks unless every rank failed it."""
    resume = ipc.encode(ipc.Resume())
    for rank in sorted(failed):
        try:
            conns[rank].send_bytes(resume)
        except OSError:
            fail(death(rank))
    rank, message = min(failed.items())
    raise StepFailed(
        message if len(failed) == len(conns) else f"{message} (on worker rank(s) {sorted(failed)})"
    )


def _peer_death(conns: list[Connection], rank: int, death: Callable[[int], str]) -> str | None:
    """A rank's error is often a peer's death seen from inside a collective: name the
    death, the real cause, when another rank's pipe is closed too."""
    others = [c for r, c in enumerate(conns) if r != rank]
    for conn in wait(others, 0.5):
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            return death(conns.index(conn))
    return None


def death_message(proc: subprocess.Popen | RemoteRank, rank: int) -> str:
    """What became of a rank whose pipe closed."""
    if isinstance(proc, RemoteRank):
        return f"{proc.describe()} closed its connection"
    try:
        code = proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        return f"worker rank {rank} (pid {proc.pid}) closed its pipe"
    if code < 0:
        return f"worker rank {rank} (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
    return f"worker rank {rank} (pid {proc.pid}) exited with code {code}"


# -- steps in flight ----------------------------------------------------------------------
class PipedStep(StepHandle):
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
