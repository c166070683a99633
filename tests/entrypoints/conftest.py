"""A real ``streamkv serve`` subprocess on 127.0.0.1 and a free port, for end-to-end tests.
Each test module starts one (module-scoped fixtures) to keep the suite's time down. Starting,
waiting for health and stopping are load_tests/local_server.py's (shared with the load tools)."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from dataclasses import dataclass

import httpx

from load_tests.local_server import LocalServer, free_port, local_server, stop_process

__all__ = ["SMALL_ENGINE", "Server", "free_port", "run_server", "stop_process"]

# A small KV pool and context keep startup and memory low; the tests need no more.
SMALL_ENGINE = [
    "--device",
    "cpu",
    "--num-kv-blocks",
    "256",
    "--num-swap-blocks",
    "64",
    "--max-model-len",
    "1024",
]


@dataclass(slots=True)
class Server(LocalServer):
    """A LocalServer with the readings the tests make of it."""

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
        return next(
            v
            for k, v in self.metrics().items()
            if k.split("{")[0] in (f"vllm:{name}", f"streamkv:{name}")
        )

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request runs or waits and every KV block is free (no leak)."""
        deadline = time.monotonic() + timeout
        while True:
            m = {k.split("{")[0]: v for k, v in self.metrics().items()}
            idle = (
                m["vllm:num_requests_running"],
                m["vllm:num_requests_waiting"],
                m["vllm:num_requests_swapped"],
                m["vllm:kv_cache_usage_perc"],
            )
            if idle == (0, 0, 0, 0):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"server not idle after {timeout}s: running/waiting/swapped/kv = {idle}"
                )
            time.sleep(0.1)


@contextlib.contextmanager
def run_server(
    *args: str, startup_timeout: float = 300.0, scheme: str = "http", log_level: str = "WARNING"
):
    """``scheme="https"``: the server has --ssl-certfile (a self-signed one: not verified).
    ``log_level`` is given before the command, so it wins over a --config file's."""
    with tempfile.NamedTemporaryFile(
        "w", prefix="streamkv-serve-", suffix=".log", delete=False
    ) as f:
        log_path = f.name
    try:
        with local_server(
            [*SMALL_ENGINE, *args],
            log_path=log_path,
            startup_timeout=startup_timeout,
            scheme=scheme,
            log_level=log_level,
        ) as s:
            yield Server(s.url, s.port, s.log_path, s.proc)
    finally:
        with open(log_path, errors="replace") as f:
            text = f.read()
        os.unlink(log_path)
        # A traceback in the server log means some request hit an unhandled error.
        assert "Traceback" not in text, text
