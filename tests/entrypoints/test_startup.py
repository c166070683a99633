"""Start-up and serving logs of ``streamkv serve`` (issue 14): the server listens early and
answers 503 on /health until one ``ready:`` line says a request can be served; on a CPU
there is no swap pool unless asked; a stats line follows while there is traffic."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import httpx
import pytest

from load_tests.local_server import free_port, serve_command, stop_process

READY = re.compile(r"ready: http://127\.0\.0\.1:(\d+) \(model (\S+), (\d+) KV blocks of (\d+) tokens, "
                   r"max context (\d+)\)")


@pytest.mark.slow
def test_ready_line_only_when_a_chat_succeeds_and_stats_follow():
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="streamkv-startup-", suffix=".log", delete=False)
    # No --num-swap-blocks: the CPU default (no swap pool) is under test too.
    cmd = serve_command(port, ["--device", "cpu", "--num-kv-blocks", "128", "--max-model-len", "512",
                               "--log-stats-interval", "0.3", "--preemption-mode", "swap"], log_level="INFO")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url, statuses = f"http://127.0.0.1:{port}", []

    def text() -> str:
        with open(log.name, errors="replace") as f:
            return f.read()

    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, text()
            assert time.monotonic() < deadline, text()
            ready = READY.search(text())  # read before asking: a line already written must hold
            try:
                status = httpx.get(f"{url}/health", timeout=5).status_code
            except httpx.TransportError:
                status = None
            statuses.append(status)
            if ready:
                break
            if status == 200:
                # Healthy between reading the log and the answer: the engine became ready
                # meanwhile, and the line follows on the same event loop at once.
                time.sleep(1.0)
                ready = READY.search(text())
                assert ready, text()
                break
            assert status in (None, 503), (status, text())
            time.sleep(0.05)
        # The line is written: a chat succeeds at once.
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert 503 in statuses, statuses  # it listened while loading, and said so
        port_s, model, blocks, block_size, context = ready.groups()
        assert (int(port_s), model, int(blocks), int(block_size), int(context)) == (
            port, "SmolLM2-135M-Instruct", 128, 16, 512)
        out = text()
        assert out.count("ready: ") == 1
        assert "Uvicorn running on" not in out and f"listening on http://127.0.0.1:{port}" in out
        assert out.index("listening on") < out.index("ready: ")
        assert "0 CPU swap blocks" in out  # no CPU->CPU swap pool by default on a CPU
        assert "--preemption-mode swap with no CPU swap blocks" in out  # and swap mode is told so
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'num_cpu_blocks="0"' in metrics
        deadline = time.monotonic() + 10
        while "streamkv.stats: prompt" not in text() and time.monotonic() < deadline:
            time.sleep(0.1)
        line = next(ln for ln in text().splitlines() if "streamkv.stats: prompt" in ln)
        assert re.search(r"prompt [\d.]+ tok/s, generation [\d.]+ tok/s \| running \d+, waiting \d+, swapped \d+ "
                         r"reqs \| KV cache [\d.]+% used \| prefix-cache hit rate ([\d.]+%|-)", line), line
    finally:
        stop_process(proc)
        out = text()
        log.close()
        os.unlink(log.name)
    assert "Traceback" not in out, out
