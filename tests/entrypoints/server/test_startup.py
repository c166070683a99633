"""Start-up and serving logs of ``streamkv serve`` (issue 14): the server listens early and
answers 503 on /health until one ``ready:`` line says a request can be served; on a CPU
there is no swap pool unless asked; a stats line follows while there is traffic."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import pytest

from load_tests.local_server import free_port, serve_command, stop_process

READY = re.compile(
    r"ready: http://127\.0\.0\.1:(\d+) \(model (\S+), (\d+) KV blocks of (\d+) tokens, "
    r"max context (\d+)\)"
)


@pytest.mark.slow
def test_ready_line_only_when_a_chat_succeeds_and_stats_follow():
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="streamkv-startup-", suffix=".log", delete=False)
    # No --num-swap-blocks: the CPU default (no swap pool) is under test too.
    cmd = serve_command(
        port,
        [
            "--device",
            "cpu",
            "--num-kv-blocks",
            "128",
            "--max-model-len",
            "512",
            "--log-stats-interval",
            "0.3",
            "--preemption-mode",
            "swap",
        ],
        log_level="INFO",
    )
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
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
        r = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=120,
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        assert 503 in statuses, statuses  # it listened while loading, and said so
        port_s, model, blocks, block_size, context = ready.groups()
        assert (int(port_s), model, int(blocks), int(block_size), int(context)) == (
            port,
            "SmolLM2-135M-Instruct",
            128,
            16,
            512,
        )
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
        assert re.search(
            r"prompt [\d.]+ tok/s, generation [\d.]+ tok/s "
            r"\| running \d+, waiting \d+, swapped \d+ "
            r"reqs \| KV cache [\d.]+% used \| prefix-cache hit rate ([\d.]+%|-)",
            line,
        ), line
    finally:
        stop_process(proc)
        out = text()
        log.close()
        os.unlink(log.name)
    assert "Traceback" not in out, out


def test_a_long_start_up_step_says_it_is_still_working(caplog):
    from streamkv.models.loader import phase

    with caplog.at_level("INFO", logger="streamkv.models.loader"):
        with phase("converting the tokenizer", every=0.05):
            time.sleep(0.18)
        with phase("a quick step"):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "converting the tokenizer…" and lines.count("a quick step…") == 1
    assert any(re.fullmatch(r"still converting the tokenizer \(\d s\)", line) for line in lines), (
        lines
    )
    assert not any("a quick step: done" in line for line in lines)  # said only when it took a while
    caplog.clear()
    with caplog.at_level("INFO", logger="streamkv.models.loader"):
        with phase("loading", every=0.05), phase("converting", every=0.05):
            time.sleep(0.18)  # only the inner step, the precise one, says it is still running
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("still converting") for line in lines), lines
    assert not any(line.startswith("still loading") for line in lines), lines


def run_to_exit(args: list[str], timeout: float) -> tuple[int, str, float]:
    """``streamkv serve ARGS`` until it exits by itself: (status, output, seconds)."""
    t0 = time.monotonic()
    r = subprocess.run(
        serve_command(free_port(), args, log_level="INFO"),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def test_a_port_in_use_fails_at_once_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run(
            serve_command(port, ["--device", "cpu"], log_level="INFO"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert (
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in out
        and "--port" in out
    ), out
    assert "loading the model" not in out and "Traceback" not in out, out
    assert took < 20, took  # the interpreter and imports only, no model load


@pytest.mark.slow
def test_a_kv_pool_smaller_than_one_request_refuses_to_start_naming_the_flags():
    status, out, _ = run_to_exit(
        ["--device", "cpu", "--num-kv-blocks", "16", "--max-model-len", "1024"], 300
    )
    assert status == 1, out
    assert (
        "the KV cache holds 256 tokens (16 blocks of 16), "
        "less than one request of the max context 1024"
    ) in out
    assert "--max-model-len" in out and "--num-kv-blocks" in out
    assert "ready: " not in out and "Traceback" not in out and "leaked" not in out, out


@pytest.mark.slow
def test_ctrl_c_says_what_it_waits_for_and_a_second_one_exits_at_once_quietly(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        serve_command(
            port,
            ["--device", "cpu", "--num-kv-blocks", "128", "--max-model-len", "512"],
            log_level="INFO",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    text = lambda: (tmp_path / "serve.log").read_text(errors="replace")  # noqa: E731
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "ready: " not in text():
            assert proc.poll() is None and time.monotonic() < deadline, text()
            time.sleep(0.1)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped generator would close the stream
            first = next(lines)
            assert r.status_code == 200 and first.startswith("data: {"), first  # running
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 10
            while "shutting down" not in text():
                assert time.monotonic() < deadline, text()
                time.sleep(0.05)
            assert (
                "waiting up to 30 s for 1 running request(s) "
                "to finish (Ctrl-C again to stop at once)"
            ) in text()
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            status = proc.wait(timeout=10)
        took = time.monotonic() - t0
    finally:
        stop_process(proc)
        log.close()
    out = text()
    assert status == 130 and took < 3, (status, took, out)
    assert "second Ctrl-C: exiting now" in out
    assert "Traceback" not in out and "leaked" not in out, out


@pytest.mark.slow
def test_one_ctrl_c_drains_then_ends_what_is_left_and_exits_quietly(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        serve_command(
            port,
            [
                "--device",
                "cpu",
                "--num-kv-blocks",
                "128",
                "--max-model-len",
                "512",
                "--shutdown-timeout",
                "1",
            ],
            log_level="INFO",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    text = lambda: (tmp_path / "serve.log").read_text(errors="replace")  # noqa: E731
    try:
        deadline = time.monotonic() + 300
        while "ready: " not in text():
            assert proc.poll() is None and time.monotonic() < deadline, text()
            time.sleep(0.1)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60
        ) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGINT)
            rest = list(lines)  # the stream ends with an error event and [DONE]
        status = proc.wait(timeout=30)
    finally:
        stop_process(proc)
        log.close()
    out = text()
    assert status == 130, out
    assert "data: [DONE]" in rest and any("shutting down" in line for line in rest), rest[-4:]
    assert re.search(r"ending 1 request\(s\) still running after 1\.\d s", out), out
    assert "Traceback" not in out and "leaked" not in out, out
