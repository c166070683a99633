"""The heartbeat watcher on real processes: a stopped (SIGSTOP) worker is killed within the
timeout and the reason recorded; a worker that exits is recorded at once; a healthy one is
left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from streamkv.executor.supervisor import HEARTBEAT_ENV, Supervisor

WORKER = (
    "from streamkv.executor.supervisor import start_heartbeat; start_heartbeat(0.1); import time; "
    "print('beating', flush=True); time.sleep(60)"
)


def spawn(sup: Supervisor) -> subprocess.Popen:
    theirs = sup.add_rank()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            pass_fds=(theirs.fileno(),),
            stdout=subprocess.PIPE,
            env={**os.environ, HEARTBEAT_ENV: str(theirs.fileno())},
        )
    finally:
        theirs.close()
    assert proc.stdout.readline() == b"beating\n"
    return proc


def wait_for(cond, timeout: float) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


def test_frozen_worker_is_killed_and_a_healthy_one_is_not():
    sup = Supervisor(timeout=1.0)
    procs = [spawn(sup), spawn(sup)]
    try:
        sup.watch([p.pid for p in procs])
        time.sleep(1.5)
        assert sup.failure is None and all(p.poll() is None for p in procs)
        procs[1].send_signal(signal.SIGSTOP)
        took = wait_for(lambda: procs[1].poll() is not None, 10)
        assert took < 1.0 + 1.5 and procs[1].returncode == -signal.SIGKILL
        assert "rank 1" in sup.failure and "frozen" in sup.failure and sup.killed == sup.failure
        assert procs[0].poll() is None
    finally:
        sup.stop()
        for p in procs:
            p.kill()
            p.wait()


def test_exited_worker_is_recorded_at_once():
    sup = Supervisor(timeout=30.0)
    proc = spawn(sup)
    try:
        sup.watch([proc.pid])
        proc.kill()
        wait_for(lambda: sup.failure is not None, 5)
        assert "rank 0" in sup.failure and "exited" in sup.failure and sup.killed is None
    finally:
        sup.stop()
        proc.wait()
