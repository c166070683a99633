"""One worker process per tensor-parallel rank (any size, 1 included).

The scheduler stays in the engine's process. Each step the executor encodes the StepInput
once (executor/ipc.py: typed msgspec structs, no pickle) and writes the same bytes into
every rank's pipe; the ranks run their shards in lock-step through torch.distributed's
collectives (gloo on CPU, NCCL on GPU with rank r on cuda:r) and rank 0 alone answers with
the StepOutput (the others with Ok).

``submit`` returns once the step is written (async scheduling): the engine sends step N+1
before it reads step N's reply. Ranks run steps in the order sent and answer in that order,
so replies are matched to steps by position alone: a handle's ``result()`` first reads the
replies of every step sent before it, and a control call all of them (replies.py). A step
planned that way takes its input tokens from step N's samples on the device; only rank 0
samples, so rank 0 broadcasts those tokens to the other ranks when a step needs them
(worker/token_broadcast.py).

At tensor_parallel_size 1 the process holds the whole model: the model's Python and
kernel-launch work then runs under another GIL, so the server's event loop stays
responsive while a step runs.

The ranks' processes are started, watched and stopped by supervisor.py; ranks on other hosts
hold a TCP connection instead of a socket pair (executor/cluster.py, launcher.py) and are
otherwise the same. Failures: every rank answers every step, so a step whose model or
sampler raised on any rank (StepFailed) fails on all of them together and the engine goes
on; a rank that fails a step alone while the others stay in it has diverged from them, which
ends the executor. A rank that raises anything else sends its traceback before it exits; a
rank that dies (killed, out of memory, a crash in C++) closes its end of the pipe, which
every wait for a reply watches. Either way the engine gets a WorkerError at once instead of
a hang. Once a rank failed, or a call was interrupted (Ctrl-C) with its reply unread, the
executor is dead: it stops the ranks and every later call raises. Shutdown asks the ranks to
exit, then terminates and kills what is left, and reaps them all; a finalizer does the same
if the executor is dropped or the interpreter exits without a shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import tempfile
import time
import weakref
from multiprocessing.connection import Connection

import torch

from streamkv.config import EngineConfig
from streamkv.executor import ipc
from streamkv.executor.base import Executor
from streamkv.executor.cluster import JoinTimeout, Placement, RemoteRank, rendezvous
from streamkv.executor.replies import PipedStep, StepPipe, death_message, gather
from streamkv.executor.supervisor import Supervisor, spawn_rank, stop_ranks
from streamkv.messages import StepFailed, StepInput, StepOutput
from streamkv.model_info import ModelInfo, check_tensor_parallel
from streamkv.models.loader import resolve_model_info
from streamkv.worker.worker import resolve_device

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker process failed or died; the executor serves nothing more."""


def verify_tensor_parallel(
    hf_config: dict, tp: int, device: torch.device, local_ranks: int | None = None
) -> None:
    """Refuse, before any process starts, a tensor-parallel size the model cannot split
    (from config numbers, without building the model here) or this host's GPUs cannot hold
    (its ``local_ranks``, default all: the other hosts' launchers check their own)."""
    check_tensor_parallel(hf_config, tp)
    local = tp if local_ranks is None else local_ranks
    if device.type == "cuda" and local > torch.cuda.device_count():
        raise ValueError(
            f"{local} worker rank(s) on this host need {local} GPUs, but "
            f"{torch.cuda.device_count()} are visible (tensor_parallel_size {tp})"
        )


class MultiprocExecutor(Executor):
    resolves_pending_tokens = True

    def __init__(
        self,
        config: EngineConfig,
        step_timeout: float | None = 600.0,
        load_timeout: float | None = None,
        model_info: ModelInfo | None = None,
        placement: Placement | None = None,
        diverge_timeout: float = 10.0,
    ) -> None:
        mc = config.model
        self.tp = mc.tensor_parallel_size
        self.step_timeout, self.diverge_timeout = step_timeout, diverge_timeout
        # Ranks on other hosts: given, or torchrun's MASTER_ADDR / MASTER_PORT / LOCAL_WORLD_SIZE.
        self.placement = placement or Placement.from_env(os.environ, self.tp)
        # Resolved once here (a GGUF is converted before the ranks race) and sent to every rank.
        self.model_info = model_info or resolve_model_info(mc)
        self.device = resolve_device(mc.device)  # resolved by the engine, unless built alone
        local = self.tp if self.placement is None else self.placement.local_ranks
        verify_tensor_parallel(self.model_info.hf_config, self.tp, self.device, local)
        self._decoder = ipc.engine_decoder()
        self._dead: str | None = None
        self._pipe = StepPipe(self._read_step_reply)  # steps sent, replies not read yet
        self._tmpdir = tempfile.mkdtemp(prefix="streamkv-tp-")
        self._procs: list[subprocess.Popen | RemoteRank] = []
        self._conns: list[Connection] = []
        self._resources: list = []  # the remote ranks' listener and store, dropped at shutdown
        # Set up before the first process starts, so that even a failure halfway through
        # starting them leaves nothing behind; it also runs at interpreter exit.
        # Heartbeats: a frozen rank is killed, so it fails like a dead one.
        self._supervisor = Supervisor()
        procs, conns, supervisor = self._procs, self._conns, self._supervisor
        self._finalizer = weakref.finalize(
            self, stop_ranks, procs, conns, self._tmpdir, supervisor, self._resources
        )
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        try:
            init_method = rendezvous(self.placement, self._tmpdir, self.tp, self._resources)
            setup = (
                dataclasses.asdict(config),
                self.model_info.to_dict(),
                backend,
                init_method,
                logging.getLogger().getEffectiveLevel(),
            )
            for rank in range(local):
                proc, conn = spawn_rank(self._supervisor)
                self._procs.append(proc)
                self._conns.append(conn)
                self._send_setup(rank, conn, setup)
            if local < self.tp:
                self._attach_remote(list(range(local, self.tp)), setup)
            self._gather(ipc.Ready, load_timeout)
            self._supervisor.watch(self.pids)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d worker process(es) ready (pids %s, %s)", self.tp, self.pids, backend)

    def _attach_remote(self, ranks: list[int], setup: tuple) -> None:
        try:
            joined = self._resources[0].accept(ranks, self.tp)  # the listener (cluster.rendezvous)
        except JoinTimeout as e:
            raise WorkerError(str(e)) from None
        for rank in ranks:
            conn, beat, handle = joined[rank]
            self._supervisor.add_remote(beat)
            self._procs.append(handle)
            self._conns.append(conn)
            self._send_setup(rank, conn, setup)

    def _send_setup(self, rank: int, conn: Connection, setup: tuple) -> None:
        """``setup``: (config, model info, backend, init_method, log level), the same for all."""
        conn.send_bytes(ipc.encode(ipc.Setup(rank, self.tp, *setup)))

    # -- the Executor interface -----------------------------------------------------------
    def num_available_blocks(self) -> tuple[int, int]:
        replies = self._call(ipc.QueryBlocks(), ipc.Blocks)
        # Every rank needs the same block ids, so the smallest pool decides.
        return min(r.num_device_blocks for r in replies), min(r.num_cpu_blocks for r in replies)

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self._call(ipc.InitCache(num_device_blocks, num_cpu_blocks), ipc.Ok)

    def execute(self, step: StepInput) -> StepOutput:
        return self.submit(step).result()

    def submit(self, step: StepInput) -> PipedStep:
        """Write the step to every rank and return: ``result()`` of the handle reads its reply."""
        start = time.perf_counter()  # before the ranks can start it (the IPC statistics)
        payload = ipc.encode(ipc.Step(step))
        try:
            self._broadcast(payload)
        except WorkerError:
            raise
        except BaseException:  # half sent, which the engine counts as held by the workers
            self._retire("a step was interrupted while being sent to the workers")
            raise
        return self._pipe.sent(start)

    def shutdown(self) -> None:
        self._dead = self._dead or "the executor was shut down"
        self._finalizer()

    def check_workers(self) -> None:
        """Raise WorkerError if a rank was found dead or frozen while no call was waiting."""
        if self._dead is None and self._supervisor.failure is not None:
            self._fail(self._supervisor.failure)

    # -- extras ---------------------------------------------------------------------------
    @property
    def pids(self) -> list[int | None]:
        """Local ranks' process ids; None for a rank on another host."""
        return [p.pid for p in self._procs]

    def ipc_stats(self) -> dict:
        """Mean per-step time from a step's submit to its reply, and in rank 0 from its launch
        to its samples; the difference is what the process boundary costs (encode, pipes,
        decode, wake-ups). Synchronous steps only: a step sent before the last one's reply
        was read also waits for that one."""
        p = self._pipe
        n = max(p.steps, 1)
        return {
            "steps": p.steps,
            "roundtrip_ms": 1e3 * p.roundtrip_s / n,
            "worker_ms": 1e3 * p.worker_s / n,
            "overhead_ms": 1e3 * (p.roundtrip_s - p.worker_s) / n,
        }

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, message: ipc.ToWorker, reply: type) -> list:
        """Send a control ``message`` to every rank and gather one ``reply`` from each, after
        the replies of the steps sent before it."""
        self._pipe.drain()
        try:
            self._broadcast(ipc.encode(message))
            return self._gather(reply, self.step_timeout)
        except WorkerError:
            raise
        except BaseException:
            self._interrupted(reply)
            raise

    def _read_step_reply(self) -> ipc.Out:
        """The oldest unread step's replies: rank 0's Out (the others answered Ok)."""
        if self._dead is not None:
            raise WorkerError(f"the workers are gone: {self._dead}")
        try:
            return self._gather(ipc.Out, self.step_timeout)[0]
        except (WorkerError, StepFailed):
            raise
        except BaseException:
            self._interrupted(ipc.Out)
            raise

    def _interrupted(self, reply: type) -> None:
        """A call broken off with its reply unread: a later read would take that reply."""
        self._retire(f"a call to the workers was interrupted while awaiting {ipc.kind(reply)!r}")

    def _retire(self, why: str) -> None:
        """Nothing more may be asked of these ranks."""
        self._dead = why
        self._finalizer()

    def _broadcast(self, payload: bytes) -> None:
        if self._dead is not None:
            raise WorkerError(f"the workers are gone: {self._dead}")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:  # a broken pipe: that rank is gone
                self._fail(self._death_message(rank))

    def _gather(self, reply: type, timeout: float | None) -> list:
        """One ``reply`` from each rank, in rank order (replies.gather)."""
        conns, decoder, death = self._conns, self._decoder, self._death_message
        return gather(conns, decoder, reply, timeout, self.diverge_timeout, self._fail, death)

    def _death_message(self, rank: int) -> str:
        return death_message(self._procs[rank], rank)

    def _fail(self, message: str):
        why = self._supervisor.killed  # a kill by the supervisor: say why it was killed
        if why is not None and why not in message:
            message = f"{why}: {message}"
        self._dead = message
        logger.error("%s; stopping the workers", message.splitlines()[0])
        for proc in self._procs:  # no graceful exit: the others may be stuck in a collective
            if proc.poll() is None:
                proc.terminate()
        self._finalizer()
        raise WorkerError(message)
