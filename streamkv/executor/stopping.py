"""Stopping an executor's ranks: ask, then terminate and kill what is left, and reap all.

Kept apart from the executor so that its finalizer holds only these plain objects (a
finalizer that referenced the executor would keep it alive).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from multiprocessing.connection import Connection

from streamkv.executor import ipc
from streamkv.executor.cluster import RankListener
from streamkv.executor.supervisor import Supervisor


def stop_ranks(procs: list, conns: list[Connection], tmpdir: str, supervisor: Supervisor, resources: list) -> None:
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
