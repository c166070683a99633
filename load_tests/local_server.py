"""A ``streamkv serve`` subprocess on 127.0.0.1: start it, wait until /health answers 200,
stop it. One copy for the load tools (guidellm_crosscheck, loadgen --start-server) and the
end-to-end tests (tests/entrypoints/conftest.py builds its fixtures on it); the tests import
this module, never the other way round."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

STOP_GRACE_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_command(port: int, args: Sequence[str], log_level: str = "WARNING") -> list[str]:
    """``streamkv serve`` on 127.0.0.1:``port`` with this interpreter, no access log."""
    return [
        sys.executable,
        "-m",
        "streamkv.entrypoints.cli",
        "--log-level",
        log_level,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        *args,
    ]


@dataclass(slots=True)
class LocalServer:
    url: str
    port: int
    log_path: str
    proc: subprocess.Popen

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def wait_healthy(
    server: LocalServer, timeout: float, verify: bool = True, poll: float = 0.2
) -> None:
    """Until /health answers 200; RuntimeError (with the server's log) if the process exits
    first or ``timeout`` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/health", timeout=2, verify=verify).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{server.log()}")
        time.sleep(poll)


@contextlib.contextmanager
def local_server(
    args: Sequence[str],
    *,
    port: int | None = None,
    log_path: str | None = None,
    env: dict[str, str] | None = None,
    startup_timeout: float = 300.0,
    scheme: str = "http",
    log_level: str = "WARNING",
    cpus: set[int] | None = None,
) -> Iterator[LocalServer]:
    """A healthy server for the block's length, stopped (SIGTERM, then SIGKILL) at its end.
    ``port`` None: a free one. ``log_path`` None: a temporary file, left for the caller to
    read after the block (``LocalServer.log_path``). ``env`` is added to this process's.
    ``scheme="https"``: the server has --ssl-certfile (self-signed: /health is not verified).
    ``cpus``: the server process and its threads run on these CPUs only."""
    port = free_port() if port is None else port
    if log_path is None:
        with tempfile.NamedTemporaryFile(
            "w", prefix="streamkv-serve-", suffix=".log", delete=False
        ) as f:
            log_path = f.name
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log_path, "w") as log:
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        proc = subprocess.Popen(
            serve_command(port, args, log_level),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            preexec_fn=pin,
        )
    server = LocalServer(f"{scheme}://127.0.0.1:{port}", port, log_path, proc)
    try:
        wait_healthy(server, startup_timeout, verify=scheme == "http")
        yield server
    finally:
        stop_process(proc)
