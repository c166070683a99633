"""The body of one worker process (see executor/multiproc.py), started as
``python -m streamkv.executor.rank FD`` with FD its end of a socket pair to the engine (or,
for a rank on another host, its TCP connection to the engine, from executor/launcher.py).

It reads its setup (rank, config, rendezvous) as the first message, sets up
torch.distributed, builds this rank's Worker, then serves the engine's messages until told
to stop or until the engine's end of the pipe closes. A plain interpreter rather than
multiprocessing's spawn: spawn re-runs the user's main script in the child, which breaks
every script that builds an LLM at top level without an ``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.executor import ipc
from streamkv.executor.step_profile import StepProfiler
from streamkv.executor.supervisor import start_heartbeat
from streamkv.messages import StepFailed
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
    logging.basicConfig(level=setup.log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
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
    dist.init_process_group(backend, init_method=setup.init_method, rank=rank, world_size=tp, timeout=timeout)


def _serve(rank: int, worker, conn: Connection, decoder) -> None:
    profiler = StepProfiler.from_env(rank)  # opt-in: $STREAMKV_PROFILE_DIR (step_profile.py)
    conn.send_bytes(ipc.encode(ipc.Ready()))
    while True:
        try:
            msg = decoder.decode(conn.recv_bytes())
        except EOFError:  # the engine's process is gone
            return
        if isinstance(msg, ipc.Step):
            # Every rank answers every step, so the engine knows the step's fate on all of
            # them before it goes on: rank 0 with the output, the others with Ok, any rank
            # whose model or sampler raised (StepFailed) with a StepError, serving on.
            start = time.perf_counter()
            try:
                with profiler.step() if profiler is not None else contextlib.nullcontext():
                    out = worker.execute(msg.step)
            except StepFailed as e:
                conn.send_bytes(ipc.encode(ipc.StepError(str(e))))
                continue
            elapsed = time.perf_counter() - start
            conn.send_bytes(ipc.encode(ipc.Out(out, elapsed) if rank == 0 else ipc.Ok()))
        elif isinstance(msg, ipc.QueryBlocks):
            conn.send_bytes(ipc.encode(ipc.Blocks(*worker.num_available_blocks())))
        elif isinstance(msg, ipc.InitCache):
            worker.init_cache(msg.num_device_blocks, msg.num_cpu_blocks)
            conn.send_bytes(ipc.encode(ipc.Ok()))
        elif isinstance(msg, ipc.Shutdown):
            return
        else:
            raise ValueError(f"unexpected message {ipc.kind(msg)!r}")


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
