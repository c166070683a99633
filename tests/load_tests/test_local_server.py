"""load_tests/local_server.py without a real server: the command it builds, and that start-up
fails with the process's own log when the process exits."""

from __future__ import annotations

import sys

import pytest

from load_tests import local_server as ls


def test_serve_command_binds_loopback_and_keeps_the_callers_flags():
    cmd = ls.serve_command(1234, ["--device", "cpu"], log_level="INFO")
    assert cmd[:3] == [sys.executable, "-m", "streamkv.entrypoints.cli"]
    assert cmd[cmd.index("--log-level") + 1] == "INFO" and cmd.index("serve") > cmd.index(
        "--log-level"
    )
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[-2:] == ["--device", "cpu"]


def test_a_server_that_exits_at_start_fails_with_its_log(monkeypatch, tmp_path):
    # A "server" that prints and exits 3 at once: the error carries its exit code and output.
    monkeypatch.setattr(
        ls,
        "serve_command",
        lambda port, args, log_level="WARNING": [
            sys.executable,
            "-c",
            "print('boom at start'); raise SystemExit(3)",
        ],
    )
    log = tmp_path / "serve.log"
    with pytest.raises(RuntimeError, match=r"exited with 3:\nboom at start"):
        with ls.local_server([], log_path=str(log), startup_timeout=30):
            pass
    assert log.read_text().startswith("boom at start")


def test_stop_process_kills_what_ignores_sigterm():
    import subprocess

    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout.readline() == b"up\n"
    ls.stop_process(proc, grace=0.5)
    assert proc.returncode == -9
