"""The body of one worker process (see executor/multiproc.py), started as
``python -m streamkv.executor.rank FD`` with FD its end of a socket pair to the engine (or,
for a rank on another host, its TCP connection to the engine, from executor/launcher.py).

It reads its setup (rank, config, rendezvous) as the first message, sets up
torch.distributed, builds this rank's Worker, then serves the engine's messages until told
to stop or until the engine's end of the pipe closes (with $STREAMKV_PROFILE_DIR set, it
profiles some of the steps: executor/step_profile.py). A plain interpreter rather than
multiprocessing's spawn: spawn re-runs the user's main script in the child, which breaks
every script that builds an LLM at top level without an ``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.executor import ipc
from streamkv.executor.step_profile import StepProfiler
from streamkv.executor.supervisor import start_heartbeat
from streamkv.heap import freeze_heap
from streamkv.messages import StepFailed, StepOutput
from streamkv.model_info import ModelInfo


def config_from_dict(data: dict) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(**data["model"]),
        cache=CacheConfig(**data["cache"]),
        scheduler=SchedulerConfig(**data["scheduler"]),
    )


def main(fd: int) -> None:
    # Ctrl-C reaches the whole process group: the engine decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start_heartbeat()  # from its own thread, so that a long step does not delay it
    conn = Connection(fd)
    decoder = ipc.worker_decoder()
    setup = decoder.decode(conn.recv_bytes())
    if not isinstance(setup, ipc.Setup):
        raise ValueError(f"expected the setup message first, got {ipc.kind(setup)!r}")
    rank, tp = setup.rank, setup.tp
    logging.basicConfig(
        level=setup.log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"
    )
    try:
        import torch

        config = config_from_dict(setup.config)
        if tp > 1:
            _init_distributed(setup)
        from streamkv.worker.worker import Worker

        worker = Worker(config, rank, ModelInfo.from_dict(setup.model_info))
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it
        _report_and_exit(conn, e)
    try:
        _serve(rank, worker, conn, decoder)
    except BaseException as e:  # noqa: BLE001
        # No process-group clean-up: a collective may be half done, and the engine
        # terminates the other ranks anyway.
        _report_and_exit(conn, e)
    if tp > 1:
        torch.distributed.destroy_process_group()
    # Not a normal interpreter exit: with the store on another host gone, finalizing the
    # store client and the gloo pairs can block in C++ for minutes. Nothing is left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init_distributed(setup: ipc.Setup) -> None:
    import torch
    import torch.distributed as dist

    rank, tp, backend = setup.rank, setup.tp, setup.backend
    # On one host LOCAL_RANK is unset and rank r is GPU r; a launcher on another host numbers
    # its own ranks from 0 (executor/launcher.py).
    local = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", tp))
    if backend == "gloo":
        # The ranks share this machine's cores: without this each would start one thread per
        # core and they would fight over them.
        torch.set_num_threads(max(1, torch.get_num_threads() // local_ranks))
    else:
        torch.cuda.set_device(local)
    timeout = timedelta(seconds=600)
    if setup.init_method.startswith("tcp://"):
        # Ranks on several hosts: the engine hosts the store (executor/cluster.py), and the
        # collectives use whatever interface reaches the other hosts (GLOO_/NCCL_SOCKET_IFNAME
        # choose one).
        host, _, port = setup.init_method.removeprefix("tcp://").rpartition(":")
        store = dist.TCPStore(host, int(port), tp, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=tp, timeout=timeout)
        return
    # One host: rendezvous through a file, the collectives' own sockets on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend, init_method=setup.init_method, rank=rank, world_size=tp, timeout=timeout
    )


# With one step in flight on the device, how often to look whether it is done and whether the
# next step came (to launch it behind this one): a GPU rank answers a lone step at most this
# late. With two in flight it waits in ``result()``: the engine sends no third step before it
# has read the first one's reply.
_POLL_S = 1e-4


@dataclass(slots=True)
class _Launched:
    """A step launched on this rank whose reply is not sent yet."""

    started: float  # time.perf_counter() at launch
    handle: Any = None  # Worker.launch's LaunchedStep; None: the launch raised StepFailed
    output: StepOutput | None = None  # read already (a profiled step)
    error: str | None = None  # StepFailed's message

    def ready(self) -> bool:
        return self.handle is None or self.output is not None or self.handle.ready()


def _serve(rank: int, worker, conn: Connection, decoder) -> None:
    """Steps run in the order they come and are answered in that order. A step that comes
    while the one before still runs on the device (async scheduling, on a GPU) is launched
    behind it before that one is answered, so the device does not wait for this process.
    Every rank answers every step, so the engine knows the step's fate on all of them before
    it goes on: rank 0 with the output, the others with Ok, any rank whose model or sampler
    raised (StepFailed) with a StepError, serving on. A rank that answered StepError runs no
    later step before the engine's Resume (ipc.Resume says why)."""
    profiler = StepProfiler.from_env(rank)  # opt-in: $STREAMKV_PROFILE_DIR
    conn.send_bytes(ipc.encode(ipc.Ready()))
    launched: deque[_Launched] = deque()
    held: deque[ipc.Step] = deque()  # steps that came while a Resume was due
    resumes_due = 0
    while True:
        if held and not resumes_due:
            msg = held.popleft()
        else:
            if launched:
                alone = len(launched) == 1
                if alone and not launched[0].ready() and not conn.poll(_POLL_S):
                    continue
                if not alone or launched[0].ready():
                    resumes_due += _answer(rank, conn, launched.popleft())
                    continue
            try:
                msg = decoder.decode(conn.recv_bytes())
            except EOFError:  # the engine's process is gone
                return
        if isinstance(msg, ipc.Step):
            if resumes_due:
                held.append(msg)
                continue
            launched.append(_launch(worker, msg, profiler))
            if launched[-1].error is not None:  # answered now, after those before: Resume due
                resumes_due += _answer_all(rank, conn, launched)
            continue
        if isinstance(msg, ipc.Resume):
            if not resumes_due:
                raise ValueError("a Resume came, but this rank failed no step")
            resumes_due -= 1
            continue
        # A control call: its reply follows every step's.
        resumes_due += _answer_all(rank, conn, launched)
        if not _control(worker, conn, msg):
            return


def _control(worker, conn: Connection, msg) -> bool:
    """Answer a message other than Step or Resume; whether to serve on (False: Shutdown)."""
    if isinstance(msg, ipc.QueryBlocks):
        conn.send_bytes(ipc.encode(ipc.Blocks(*worker.num_available_blocks())))
    elif isinstance(msg, ipc.InitCache):
        worker.init_cache(msg.num_device_blocks, msg.num_cpu_blocks)
        freeze_heap()
        conn.send_bytes(ipc.encode(ipc.Ok()))
    elif isinstance(msg, ipc.Shutdown):
        return False
    else:
        raise ValueError(f"unexpected message {ipc.kind(msg)!r}")
    return True


def _launch(worker, msg: ipc.Step, profiler: StepProfiler | None) -> _Launched:
    step = _Launched(time.perf_counter())
    try:
        if profiler is None:
            step.handle = worker.launch(msg.step)
        else:  # profiled steps run alone, launch to samples (StepProfiler)
            with profiler.step():
                step.handle = worker.launch(msg.step)
                step.output = step.handle.result()
    except StepFailed as e:
        step.handle, step.error = None, str(e)
    return step


def _answer(rank: int, conn: Connection, step: _Launched) -> bool:
    """Send a launched step's reply, once its samples are in; whether it was a StepError."""
    if step.error is None and step.output is None:
        try:
            step.output = step.handle.result()
        except StepFailed as e:
            step.error = str(e)
    if step.error is not None:
        conn.send_bytes(ipc.encode(ipc.StepError(step.error)))
        return True
    if rank == 0:
        elapsed = time.perf_counter() - step.started
        conn.send_bytes(ipc.encode(ipc.Out(step.output, elapsed)))
    else:
        conn.send_bytes(ipc.encode(ipc.Ok()))
    return False


def _answer_all(rank: int, conn: Connection, launched: deque[_Launched]) -> int:
    """Answer every launched step, in order; how many of the answers were StepErrors."""
    errors = 0
    while launched:
        errors += _answer(rank, conn, launched.popleft())
    return errors


def _report_and_exit(conn: Connection, error: BaseException) -> None:
    try:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        conn.send_bytes(ipc.encode(ipc.Error(f"{type(error).__name__}: {error}", text)))
    except OSError:
        pass  # the engine is gone too
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
