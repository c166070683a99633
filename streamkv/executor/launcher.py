"""``streamkv worker``: serve some tensor-parallel ranks of an engine that runs on another host.

One launcher per host besides the engine's. For each of its ranks it opens the two
connections the engine's listener expects (executor/cluster.py: control, heartbeat), then
starts the rank as the engine would locally (``python -m streamkv.executor.rank FD``, the
control connection as FD), so a remote rank runs exactly the code of a local one.

It stays up across engine restarts: when its ranks have exited (the engine stopped them, or
restarted after a failure) it joins again, the next executor's ranks, until the engine is
unreachable for ``--wait`` seconds. It keeps its own end of each rank's heartbeat
connection: the engine closes that connection when it drops the rank (shutdown, or a frozen
rank), and a rank still alive ``GRACE`` seconds later is killed here, the host that can.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from streamkv.executor import ipc
from streamkv.executor.cluster import TOKEN_ENV
from streamkv.executor.supervisor import HEARTBEAT_ENV

logger = logging.getLogger(__name__)

GRACE = 3.0  # a dropped rank's time to exit by itself (a Shutdown is on its way)
RETRY = 0.2


class JoinRefused(RuntimeError):
    """The engine answered a join with an error (a wrong rank, token or world size)."""


@dataclass(slots=True, frozen=True)
class LaunchSpec:
    master_addr: str
    master_port: int
    ranks: tuple[int, ...]
    token: str = ""
    world_size: int = 0  # 0: not given (the engine's tensor_parallel_size decides)
    wait: float = 600.0  # how long to wait for the engine, at start and after each generation
    once: bool = False  # serve one generation only (no rejoin after the ranks exit)


def parse_ranks(text: str) -> tuple[int, ...]:
    """``2,3`` or ``2-3``."""
    ranks: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        ranks += range(int(lo), int(hi or lo) + 1)
    if not ranks or min(ranks) < 1 or len(set(ranks)) != len(ranks):
        raise ValueError(
            f"--ranks {text!r}: distinct ranks >= 1 (rank 0 runs on the engine's host)"
        )
    return tuple(ranks)


def run(spec: LaunchSpec) -> int:
    """Serve generations until the engine is gone: 0 if at least one ran, else 1."""
    served = 0
    while True:
        try:
            procs = _start_generation(spec)
        except JoinRefused as e:
            logger.error("the engine refused rank(s) %s: %s", list(spec.ranks), e)
            return 1
        except TimeoutError:
            logger.info(
                "no engine at %s:%d for %.0fs; exiting",
                spec.master_addr,
                spec.master_port,
                spec.wait,
            )
            return 0 if served else 1
        served += 1
        codes = _supervise(procs)
        logger.info("rank(s) %s exited with %s", list(spec.ranks), codes)
        if spec.once:
            return 0 if all(c == 0 for c in codes) else 1


def _start_generation(spec: LaunchSpec) -> list[tuple[subprocess.Popen, socket.socket]]:
    deadline = time.monotonic() + spec.wait
    joined = [
        (rank, _join(spec, rank, "control", deadline), _join(spec, rank, "heartbeat", deadline))
        for rank in spec.ranks
    ]
    root = str(Path(__file__).resolve().parent.parent.parent)
    procs = []
    for local, (rank, control, beat) in enumerate(joined):
        env = dict(os.environ)
        env.update(
            {
                HEARTBEAT_ENV: str(beat.fileno()),
                "LOCAL_RANK": str(local),
                "RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(len(joined)),
            }
        )
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamkv.executor.rank", str(control.fileno())],
            pass_fds=(control.fileno(), beat.fileno()),
            env=env,
        )
        control.close()  # the rank's now; the heartbeat socket stays open here too (see above)
        procs.append((proc, beat))
        logger.info("rank %d started (pid %d)", rank, proc.pid)
    return procs


def _join(spec: LaunchSpec, rank: int, channel: str, deadline: float) -> socket.socket:
    """A connection to the engine's listener that it accepted as ``rank``'s ``channel``."""
    from multiprocessing.connection import Connection

    hello = ipc.encode(
        ipc.Join(rank, channel, spec.token, spec.world_size, socket.gethostname(), os.getpid())
    )
    decoder = ipc.join_reply_decoder()
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError
        try:
            sock = socket.create_connection((spec.master_addr, spec.master_port), timeout=5.0)
        except OSError:  # not listening (yet, or any more)
            time.sleep(RETRY)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        conn = Connection(os.dup(sock.fileno()))
        try:
            conn.send_bytes(hello)
            reply = decoder.decode(conn.recv_bytes(maxlength=65536)) if conn.poll(30.0) else None
        except (OSError, EOFError):  # a listener closing down (the previous generation's)
            reply = None
        finally:
            conn.close()
        if isinstance(reply, ipc.Joined):
            return sock
        sock.close()
        if isinstance(reply, ipc.Error):
            raise JoinRefused(reply.message)
        time.sleep(RETRY)


def _supervise(procs: list[tuple[subprocess.Popen, socket.socket]]) -> list[int]:
    """Wait for every rank to exit; kill one the engine dropped that outlives GRACE."""
    dropped: dict[int, float] = {}
    while any(p.poll() is None for p, _ in procs):
        live = [
            (i, beat) for i, (p, beat) in enumerate(procs) if p.poll() is None and i not in dropped
        ]
        readable, _, _ = select.select([b for _, b in live], [], [], 0.5) if live else ([], [], [])
        for i, beat in live:
            if beat in readable:
                try:
                    data = beat.recv(4096)
                except OSError:
                    data = b""
                if not data:  # the engine never writes here: this is its end closing
                    dropped[i] = time.monotonic()
        for i, since in dropped.items():
            proc = procs[i][0]
            if proc.poll() is None and time.monotonic() - since > GRACE:
                logger.warning(
                    "rank pid %d outlived its engine connection by %.0fs; killing it",
                    proc.pid,
                    GRACE,
                )
                proc.kill()
        if not live:
            time.sleep(0.1)
    for _, beat in procs:
        beat.close()
    return [p.wait() for p, _ in procs]


# -- the command ---------------------------------------------------------------------------
def add_worker_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("worker", help="serve tensor-parallel ranks of an engine on another host")
    p.add_argument(
        "--master-addr",
        default=os.environ.get("MASTER_ADDR"),
        help="the engine host's address (default $MASTER_ADDR)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=os.environ.get("MASTER_PORT"),
        help="the engine's rank listener port (default $MASTER_PORT)",
    )
    p.add_argument(
        "--ranks",
        default=os.environ.get("RANK"),
        help="the ranks this host serves, e.g. 2,3 or 2-3 (default $RANK: one rank, as torchrun "
        "starts one process per rank)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=600.0,
        help="seconds to wait for the engine, at start and after each restart, before exiting",
    )
    p.add_argument(
        "--once", action="store_true", help="exit when the ranks exit instead of joining again"
    )
    p.set_defaults(func=cmd_worker)
    return p


def cmd_worker(args: argparse.Namespace) -> int:
    missing = [n for n in ("master_addr", "master_port", "ranks") if getattr(args, n) in (None, "")]
    if missing:
        raise SystemExit(
            f"streamkv worker needs {', '.join('--' + m.replace('_', '-') for m in missing)} "
            "(or $MASTER_ADDR, $MASTER_PORT, $RANK)"
        )
    try:
        ranks = parse_ranks(str(args.ranks))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    spec = LaunchSpec(
        args.master_addr,
        int(args.master_port),
        ranks,
        os.environ.get(TOKEN_ENV, ""),
        int(os.environ.get("WORLD_SIZE") or 0),
        args.wait,
        args.once,
    )
    return run(spec)


def main(argv: list[str] | None = None) -> int:
    """``python -m streamkv.executor.launcher --master-addr A ...``: the same as
    ``streamkv worker``."""
    parser = argparse.ArgumentParser(prog="python -m streamkv.executor.launcher")
    add_worker_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["worker", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
