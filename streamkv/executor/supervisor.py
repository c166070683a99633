"""The multiprocess executor's hold on its rank processes (executor/multiproc.py): starting
and stopping them, and watching their heartbeats. Their replies are read by replies.py.

A rank is a fresh interpreter (``python -m streamkv.executor.rank FD``, see rank.py for why
not multiprocessing's spawn) holding one end of a socket pair to the engine and one of a
heartbeat pair. Stopping asks, then terminates and kills what is left, and reaps all; it is
apart from the executor so that the executor's finalizer holds only plain objects (a
finalizer that referenced the executor would keep it alive).

Heartbeats: every worker process sends one over its own socket pair, and a watcher thread in
the engine's process notices a worker that stops sending it. A dead worker closes its pipes,
which the executor's waits see at once. A frozen one (SIGSTOP, a deadlock, a hung driver
call) closes nothing: with a step timeout of 600 s, a worker stopped for 27 s left
``/health`` at 200 while every request stalled (issue 13). The watcher kills a worker that
has been silent for ``timeout`` seconds, which turns the freeze into a death the executor
reports as a WorkerError, and records why. The engine then restarts the workers and resumes
their requests (engine/async_engine.py, engine/recovery.py). The heartbeat is a thread of
its own in the worker, so a long step does not delay it; it only stops when the whole
process does. ``timeout`` must cover the worst pause a loaded machine gives a runnable
thread (default 5 s; beats every 0.5 s).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import streamkv
from streamkv.executor import ipc
from streamkv.executor.cluster import RankListener

logger = logging.getLogger(__name__)


# -- heartbeats ----------------------------------------------------------------------------
HEARTBEAT_ENV = "STREAMKV_HEARTBEAT_FD"
INTERVAL = 0.5
TIMEOUT = 5.0


def start_heartbeat(interval: float = INTERVAL) -> None:
    """Worker side: beat on the socket the executor passed in ``$STREAMKV_HEARTBEAT_FD``
    (nothing to do when started without one)."""
    fd = os.environ.pop(HEARTBEAT_ENV, None)
    if fd is None:
        return
    sock = socket.socket(fileno=int(fd))

    def beat() -> None:
        while True:
            try:
                sock.send(b".")
            except OSError:  # the engine's process is gone
                return
            time.sleep(interval)

    threading.Thread(target=beat, name="streamkv-heartbeat", daemon=True).start()


class Supervisor:
    """Engine side: one heartbeat socket per rank, watched by one thread."""

    def __init__(self, timeout: float = TIMEOUT) -> None:
        self.timeout = timeout
        self._socks: list[socket.socket] = []
        self._pids: list[int] = []
        self._failure: str | None = None
        self._killed: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_rank(self) -> socket.socket:
        """A new rank's heartbeat pair: ours is kept; the returned end goes to the worker
        (pass its fd, then close it here)."""
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        self._socks.append(ours)
        return theirs

    def add_remote(self, sock: socket.socket) -> None:
        """A rank on another host: its heartbeat connection (executor/cluster.py). Such a rank
        cannot be killed from here; a frozen one has its connection shut down instead, which
        its launcher answers by killing it (executor/launcher.py)."""
        sock.setblocking(False)
        self._socks.append(sock)

    def watch(self, pids: list[int | None]) -> None:
        """Start watching, once every rank is up (loading a model may pause a thread longer).
        ``pids``: one per rank, in the order the ranks were added; None for a remote rank."""
        self._pids = list(pids)
        self._thread = threading.Thread(target=self._run, name="streamkv-supervisor", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> str | None:
        """Why a worker was found dead or frozen; None while all are well."""
        return self._failure

    @property
    def killed(self) -> str | None:
        """Why the watcher killed a worker (frozen); None if it killed none."""
        return self._killed

    def stop(self, close: bool = True) -> None:
        """Stop watching; ``close=False`` keeps the heartbeat sockets open for ``close()``
        (a remote rank's launcher kills the rank when its heartbeat connection closes)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        if close:
            self.close()

    def close(self) -> None:
        for sock in self._socks:
            sock.close()

    def _run(self) -> None:
        last = [time.monotonic()] * len(self._socks)
        live = set(range(len(self._socks)))
        while live and not self._stop.is_set():
            readable, _, _ = select.select([self._socks[r] for r in live], [], [], INTERVAL)
            now = time.monotonic()
            for sock in readable:
                rank = self._socks.index(sock)
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    last[rank] = now
                else:  # its process ended; the executor sees the same on its own pipe
                    live.discard(rank)
                    pid = self._pids[rank]
                    self._record(f"worker rank {rank} ({f'pid {pid}' if pid else 'remote'}) exited")
            for rank in list(live):
                if now - last[rank] > self.timeout and not self._stop.is_set():
                    live.discard(rank)
                    pid = self._pids[rank]
                    self._killed = (
                        f"worker rank {rank} ({f'pid {pid}' if pid else 'remote'}) "
                        "sent no heartbeat for "
                        f"{now - last[rank]:.1f} s (frozen); "
                        f"{'killed it' if pid else 'dropped it, for its launcher to kill'}"
                    )
                    self._record(self._killed)
                    self._end(rank)

    def _end(self, rank: int) -> None:
        pid = self._pids[rank]
        if pid is None:
            try:
                self._socks[rank].shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        try:
            os.kill(pid, signal.SIGKILL)  # works on a stopped process too
        except ProcessLookupError:
            pass

    def _record(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
            logger.error("%s", message)


# -- starting and stopping ranks on this host ----------------------------------------------
def spawn_rank(supervisor: Supervisor) -> tuple[subprocess.Popen, Connection]:
    """A rank process on this host, waiting for its Setup on the returned connection."""
    ours, theirs = socket.socketpair()
    beat = supervisor.add_rank()
    env = dict(os.environ)
    env.pop("LOCAL_RANK", None)  # an engine started by torchrun: rank r here is GPU r
    env[HEARTBEAT_ENV] = str(beat.fileno())
    # The ranks import the same streamkv as this process, installed or not.
    root = str(Path(streamkv.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamkv.executor.rank", str(theirs.fileno())],
            pass_fds=(theirs.fileno(), beat.fileno()),
            env=env,
        )
    finally:
        theirs.close()
        beat.close()
    return proc, Connection(ours.detach())


def stop_ranks(
    procs: list, conns: list[Connection], tmpdir: str, supervisor: Supervisor, resources: list
) -> None:
    """``procs``: Popen for ranks started here, cluster.RemoteRank for ranks on other hosts
    (their launchers reap them; here they have exited once their connection closed)."""
    supervisor.stop(close=False)  # ranks exiting now are no failure
    bye = ipc.encode(ipc.Shutdown())
    for conn in conns:
        try:
            conn.send_bytes(bye)
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:  # e.g. stuck in a collective whose peer died
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # Last: a remote rank still alive is killed by its launcher when its heartbeat closes, and
    # ranks tearing down their process group may still need the store until they are gone.
    supervisor.close()
    for conn in conns:
        conn.close()
    for resource in resources:
        if isinstance(resource, RankListener):
            resource.close()
    resources.clear()  # the TCPStore stops with its last reference
    shutil.rmtree(tmpdir, ignore_errors=True)
