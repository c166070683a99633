"""Starting and stopping an executor's rank processes.

A rank is a fresh interpreter (``python -m streamkv.executor.rank FD``, see rank.py for why
not multiprocessing's spawn) holding one end of a socket pair to the engine and one of a
heartbeat pair (supervisor.py). Stopping asks, then terminates and kills what is left, and
reaps all; it is apart from the executor so that the executor's finalizer holds only plain
objects (a finalizer that referenced the executor would keep it alive).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import streamkv
from streamkv.executor import ipc
from streamkv.executor.cluster import RankListener
from streamkv.executor.supervisor import HEARTBEAT_ENV, Supervisor


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
