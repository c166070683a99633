"""A real ``streamkv serve`` subprocess on 127.0.0.1 and a free port, for end-to-end tests.
Each test module starts one (module-scoped fixtures) to keep the suite's time down."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

# A small KV pool and context keep startup and memory low; the tests need no more.
SMALL_ENGINE = ["--device", "cpu", "--num-kv-blocks", "256", "--num-swap-blocks", "64", "--max-model-len", "1024"]


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 15 s."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    port: int
    log_path: str
    proc: subprocess.Popen

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^((?:vllm|streamkv):\w+)(\{[^}]*\})? (\S+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def gauge(self, name: str) -> float:
        """``name`` without its prefix: vLLM's (``vllm:``) or streamkv's own (``streamkv:``)."""
        return next(v for k, v in self.metrics().items() if k.split("{")[0] in (f"vllm:{name}", f"streamkv:{name}"))

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request runs or waits and every KV block is free (no leak)."""
        deadline = time.monotonic() + timeout
        while True:
            m = {k.split("{")[0]: v for k, v in self.metrics().items()}
            idle = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
                    m["vllm:num_requests_swapped"], m["vllm:kv_cache_usage_perc"])
            if idle == (0, 0, 0, 0):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: running/waiting/swapped/kv = {idle}")
            time.sleep(0.1)


@contextlib.contextmanager
def run_server(*args: str, startup_timeout: float = 300.0, scheme: str = "http"):
    """``scheme="https"``: the server has --ssl-certfile (a self-signed one: not verified)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="streamkv-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "streamkv.entrypoints.cli", "--log-level", "WARNING", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--no-access-log", *SMALL_ENGINE, *args]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(f"{scheme}://127.0.0.1:{port}", port, log.name, proc)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2, verify=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {startup_timeout}s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        stop_process(proc)
        log.close()
        text = server.log()
        os.unlink(log.name)
        # A traceback in the server log means some request hit an unhandled error.
        assert "Traceback" not in text, text
