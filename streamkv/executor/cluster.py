"""Ranks on more than one host: the engine's side.

The engine stays on one host. It starts ranks ``0 .. local_ranks - 1`` itself, as on one
host, and waits for the others to join through a TCP listener at ``master_addr:master_port``:
one launcher per other host (``streamkv worker``, executor/launcher.py) opens two connections
per rank it serves, a control one (then exactly the messages a local rank's pipe carries:
Setup, the broadcast steps, replies) and a heartbeat one (supervisor.py). Every message is a
typed msgspec record (executor/ipc.py); nothing is unpickled.

torch.distributed meets through a TCPStore the engine hosts on an ephemeral port of the same
address, named in every rank's Setup; a restarted executor hosts a fresh one, so no key of a
dead generation is ever read. NCCL (GPUs) or gloo (CPU) then connect the ranks directly.

Trust: the listener, the store and the collectives are plain TCP, like torch.distributed's
own. Bind ``master_addr`` to a private cluster network. With $STREAMKV_CLUSTER_TOKEN set on
every host, a join without the same token is refused (compared in constant time).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection

from streamkv.executor import ipc

logger = logging.getLogger(__name__)

TOKEN_ENV = "STREAMKV_CLUSTER_TOKEN"
JOIN_TIMEOUT = 600.0  # the other hosts' launchers may start after the engine


class JoinTimeout(RuntimeError):
    """Not every remote rank joined in time."""


@dataclass(slots=True, frozen=True)
class Placement:
    """Where the ranks live: ``local_ranks`` on this host, the rest on other hosts."""

    master_addr: str
    master_port: int
    local_ranks: int
    token: str = ""
    join_timeout: float = JOIN_TIMEOUT

    @classmethod
    def from_env(cls, env: Mapping[str, str], tp: int) -> Placement | None:
        """torchrun's variables: MASTER_ADDR and MASTER_PORT (both, or neither: one host),
        LOCAL_WORLD_SIZE (ranks on this host; default all of them)."""
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not addr and not port:
            return None
        if not addr or not port:
            raise ValueError(
                "MASTER_ADDR and MASTER_PORT must be set together (ranks on several hosts)"
            )
        local = int(env.get("LOCAL_WORLD_SIZE") or tp)
        return cls.checked(addr, int(port), local, tp, env.get(TOKEN_ENV, ""))

    @classmethod
    def checked(
        cls,
        addr: str,
        port: int,
        local: int,
        tp: int,
        token: str = "",
        join_timeout: float = JOIN_TIMEOUT,
    ) -> Placement:
        if not 1 <= local <= tp:
            raise ValueError(
                f"LOCAL_WORLD_SIZE {local} must be 1..tensor_parallel_size ({tp}): rank 0 runs "
                "on the engine's host"
            )
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT {port} is not a TCP port")
        return cls(addr, port, local, token, join_timeout)


class RemoteRank:
    """Stands in for the Popen of a rank that runs on another host. It is never signalled from
    here (its launcher kills and reaps it); it has exited once its connection reads EOF."""

    def __init__(self, rank: int, host: str, launcher_pid: int, conn: Connection) -> None:
        self.rank, self.host, self.launcher_pid, self._conn = rank, host, launcher_pid, conn
        self.pid = None
        self.returncode: int | None = None

    def describe(self) -> str:
        return f"worker rank {self.rank} (on {self.host}, launcher pid {self.launcher_pid})"

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.describe(), timeout)
            try:
                if self._conn.poll(left):
                    self._conn.recv_bytes()  # a late reply: not awaited any more
            except (EOFError, OSError):
                self.returncode = 0
        return self.returncode

    def terminate(self) -> None:
        """Nothing to do from here: the engine's Shutdown or closed connections end it."""

    def kill(self) -> None:
        self.returncode = -9  # given up on; its launcher kills it once its heartbeat closes


def rendezvous(placement: Placement | None, tmpdir: str, tp: int, resources: list) -> str:
    """torch.distributed's meeting point for one executor: a file on one host, else a
    TCPStore hosted here (kept in ``resources`` with, when ranks live elsewhere, the
    listener they join through, first)."""
    if placement is None:
        return f"file://{tmpdir}/rendezvous"
    import torch.distributed as dist

    if placement.local_ranks < tp:
        resources.append(RankListener(placement))
    store = dist.TCPStore(placement.master_addr, 0, None, True, wait_for_workers=False)
    resources.append(store)
    return f"tcp://{placement.master_addr}:{store.port}"


class RankListener:
    """The engine's listener for remote ranks, for one executor (one generation)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        try:
            self._sock = socket.create_server((placement.master_addr, placement.master_port))
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot listen for worker ranks at MASTER_ADDR:MASTER_PORT "
                f"{placement.master_addr}:{placement.master_port}: {e.strerror}",
            ) from e
        self._decoder = ipc.join_decoder()
        if not placement.token:
            logger.warning(
                "ranks join %s:%d without a token: set %s on every host to refuse strangers",
                placement.master_addr,
                placement.master_port,
                TOKEN_ENV,
            )

    def close(self) -> None:
        self._sock.close()

    def accept(
        self, ranks: list[int], tp: int
    ) -> dict[int, tuple[Connection, socket.socket, RemoteRank]]:
        """Each of ``ranks``' (control connection, heartbeat socket, handle), once all joined."""
        control: dict[int, tuple[Connection, RemoteRank]] = {}
        beats: dict[int, socket.socket] = {}
        deadline = time.monotonic() + self.placement.join_timeout
        while len(control) < len(ranks) or len(beats) < len(ranks):
            left = deadline - time.monotonic()
            missing = sorted(r for r in ranks if r not in control or r not in beats)
            if left <= 0:
                p = self.placement
                raise JoinTimeout(
                    f"worker rank(s) {missing} did not join {p.master_addr}:{p.master_port} within "
                    f"{p.join_timeout:.0f}s: start `streamkv worker --master-addr {p.master_addr} "
                    f"--master-port {p.master_port} --ranks "
                    f"{','.join(map(str, missing))}` on their host"
                )
            self._sock.settimeout(min(left, 1.0))
            try:
                sock, peer = self._sock.accept()
            except TimeoutError:
                continue
            joined = self._handshake(sock, peer, ranks, tp, control, beats)
            if joined is None:
                continue
            msg, conn = joined
            if msg.channel == "control":
                control[msg.rank] = (conn, RemoteRank(msg.rank, msg.host, msg.launcher_pid, conn))
            else:
                beats[msg.rank] = socket.socket(fileno=os.dup(conn.fileno()))
                conn.close()
            logger.info("worker rank %d joined from %s (%s)", msg.rank, msg.host, msg.channel)
        return {r: (control[r][0], beats[r], control[r][1]) for r in ranks}

    def _handshake(
        self, sock: socket.socket, peer, ranks: list[int], tp: int, control: dict, beats: dict
    ) -> tuple[ipc.Join, Connection] | None:
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock.detach())
        try:
            if not conn.poll(10.0):
                raise ValueError("sent nothing")
            msg = self._decoder.decode(conn.recv_bytes(maxlength=4096))
        except Exception as e:  # noqa: BLE001 - a stranger's bytes: refuse, keep listening
            logger.warning("refused a connection from %s: %s", peer, e)
            conn.close()
            return None
        problem = self._problem(msg, ranks, tp, control if msg.channel == "control" else beats)
        if problem is not None:
            logger.warning("refused rank %d from %s (%s): %s", msg.rank, msg.host, peer, problem)
            try:
                conn.send_bytes(ipc.encode(ipc.Error(problem, "")))
            except OSError:
                pass
            conn.close()
            return None
        conn.send_bytes(ipc.encode(ipc.Joined()))
        return msg, conn

    def _problem(self, msg: ipc.Join, ranks: list[int], tp: int, taken: dict) -> str | None:
        if not hmac.compare_digest(msg.token.encode(), self.placement.token.encode()):
            return f"wrong cluster token (set the same {TOKEN_ENV} on every host)"
        if msg.world_size and msg.world_size != tp:
            return (
                f"WORLD_SIZE {msg.world_size} differs from the engine's tensor_parallel_size {tp}"
            )
        if msg.channel not in ("control", "heartbeat"):
            return f"unknown channel {msg.channel!r}"
        if msg.rank not in ranks:
            return (
                f"rank {msg.rank} is not one of the remote ranks "
                f"{ranks} (ranks 0..{ranks[0] - 1} run here)"
            )
        if msg.rank in taken:
            return f"rank {msg.rank} already joined ({msg.channel})"
        return None
