"""The body of one worker process (see executor/multiproc.py), started as
``python -m streamkv.executor.rank FD`` with FD its end of a socket pair to the engine.

It reads its setup (rank, config, rendezvous) as the first message, sets up
torch.distributed, builds this rank's Worker, then serves the engine's messages until told
to stop or until the engine's end of the pipe closes. A plain interpreter rather than
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
from multiprocessing.connection import Connection

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.executor import ipc
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
    conn = Connection(fd)
    _, rank, tp, config_data, info_data, backend, init_method, log_level = ipc.loads(conn.recv_bytes())
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        import torch

        config = config_from_dict(config_data)
        if tp > 1:
            import torch.distributed as dist

            # Rendezvous goes through a file; the collectives' own sockets stay on loopback.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            if backend == "gloo":
                # The ranks share this machine's cores: without this each would start one
                # thread per core and they would fight over them.
                torch.set_num_threads(max(1, torch.get_num_threads() // tp))
            else:
                torch.cuda.set_device(rank)
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp)
        from streamkv.worker.worker import Worker

        worker = Worker(config, rank, ModelInfo.from_dict(info_data))
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it
        _report_and_exit(conn, e)
    try:
        _serve(rank, worker, conn)
    except BaseException as e:  # noqa: BLE001
        # No process-group clean-up: a collective may be half done, and the engine
        # terminates the other ranks anyway.
        _report_and_exit(conn, e)
    if tp > 1:
        torch.distributed.destroy_process_group()


def _serve(rank: int, worker, conn: Connection) -> None:
    conn.send_bytes(ipc.dumps(("ready",)))
    decoder = ipc.StepDecoder()
    while True:
        try:
            msg = ipc.loads(conn.recv_bytes())
        except EOFError:  # the engine's process is gone
            return
        kind = msg[0]
        if kind == "step":
            step = decoder.decode(msg)
            start = time.perf_counter()
            out = worker.execute(step)
            elapsed = time.perf_counter() - start
            if rank == 0:
                conn.send_bytes(ipc.dumps(("out", ipc.encode_output(out), elapsed)))
        elif kind == "blocks":
            conn.send_bytes(ipc.dumps(("blocks", *worker.num_available_blocks())))
        elif kind == "init_cache":
            worker.init_cache(msg[1], msg[2])
            conn.send_bytes(ipc.dumps(("ok",)))
        elif kind == "shutdown":
            return
        else:
            raise ValueError(f"unknown message {kind!r}")


def _report_and_exit(conn: Connection, error: BaseException) -> None:
    try:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        conn.send_bytes(ipc.dumps(("error", f"{type(error).__name__}: {error}", text)))
    except OSError:
        pass  # the engine is gone too
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
