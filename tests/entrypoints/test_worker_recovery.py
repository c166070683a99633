"""Issue 13, cases 1 and 2, on a real server with the model in a worker process (mp): a worker
killed (SIGKILL) or frozen (SIGSTOP) mid-stream is detected, /health turns 503, the worker is
restarted and the stream continues with the text a fault-free run gives: no error event, no
text lost or repeated."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import run_server

pytestmark = pytest.mark.slow

BODY = {"prompt": "The history of the sea:", "max_tokens": 40, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    with run_server("--distributed-executor-backend", "mp") as s:
        yield s


def worker_pids(pid: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    ranks = []
    for p in pids:
        with open(f"/proc/{p}/cmdline", "rb") as f:
            if b"streamkv.executor.rank" in f.read():
                ranks.append(p)
    return ranks


def stream_with_fault(server, fault: signal.Signals) -> tuple[str, list[dict], list[int], float]:
    """Stream BODY, send ``fault`` to the worker after the 5th chunk; the text, the events,
    the /health codes seen meanwhile, and how long the stream stalled at the fault."""
    events, health, stop_polling = [], [], threading.Event()

    def poll() -> None:
        while not stop_polling.is_set():
            try:
                health.append(httpx.get(f"{server.url}/health", timeout=5).status_code)
            except httpx.TransportError:
                health.append(0)
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    stall, last = 0.0, time.monotonic()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            stall, last = max(stall, now - last), now
            events.append(line[6:])
            if len(events) == 5:
                (pid,) = worker_pids(server.proc.pid)
                os.kill(pid, fault)
                poller.start()
    stop_polling.set()
    poller.join()
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks), events[-3:]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks, health, stall


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_worker_fault_mid_stream_is_recovered_with_the_same_text(server, fault):
    expected = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=300).json()["choices"][0]["text"]
    before = worker_pids(server.proc.pid)
    text, chunks, health, stall = stream_with_fault(server, fault)
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert 503 in health and health[-1] == 200  # unhealthy while recovering, healthy after
    assert worker_pids(server.proc.pid) != before  # a new worker process
    # The stall covers detection (at once for SIGKILL, the 5 s heartbeat timeout for SIGSTOP),
    # starting a worker and loading the model again, and recomputing the prompt.
    assert stall < 120
    assert httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=300).json()["choices"][0]["text"] == expected
