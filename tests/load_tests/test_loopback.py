"""One short run of the harness against a real ``streamkv serve`` on loopback, over both the
HTTP+SSE API and the WebSocket, with the server's KV figures read from /metrics."""

from __future__ import annotations

import json

import pytest

from load_tests.bench import main
from tests.entrypoints.conftest import run_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with run_server("--no-enable-prefix-caching") as s:
        yield s


@pytest.mark.parametrize("backend", ["openai", "websocket"])
def test_short_run_against_the_server(server, backend, tmp_path):
    out = tmp_path / "run.json"
    rc = main(
        [
            "--backend",
            backend,
            "--url",
            server.url,
            "--workload",
            "alpaca",
            "--length-scale",
            "0.1",
            "--num-requests",
            "4",
            "--request-rate",
            "8",
            "--max-duration",
            "120",
            "--disable-tqdm",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["label"] == "paged"  # read from the server's /metrics
    run = result["runs"][0]
    s = run["summary"]
    assert (s["completed"], s["errors"], s["incomplete"]) == (4, 0, 0)
    assert s["ttft_ms"]["p50"] > 0 and s["e2e_ms"]["p50"] >= s["ttft_ms"]["p50"]
    assert s["total_output_tokens"] >= 4
    assert run["kv"]["samples"] > 0 and 0 < run["kv"]["shares"]["token"] <= 1
    server.wait_idle()


def test_a_baseline_allocation_behind_the_server(tmp_path):
    """``serve --kv-allocation orca-oracle``: the harness reads the system's name and its KV
    split from /metrics."""
    out = tmp_path / "orca.json"
    with run_server("--no-enable-prefix-caching", "--kv-allocation", "orca-oracle") as s:
        rc = main(
            [
                "--backend",
                "openai",
                "--url",
                s.url,
                "--workload",
                "alpaca",
                "--length-scale",
                "0.1",
                "--num-requests",
                "3",
                "--request-rate",
                "8",
                "--max-duration",
                "120",
                "--disable-tqdm",
                "--json-out",
                str(out),
            ]
        )
        s.wait_idle()
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["label"] == "orca-oracle"
    run = result["runs"][0]
    assert run["summary"]["completed"] == 3 and run["kv"]["kv_allocation"] == "orca-oracle"
    assert run["kv"]["shares"]["token"] < 1.0  # a reservation holds more than its tokens


def test_non_loopback_targets_are_refused():
    with pytest.raises(SystemExit, match="loopback"):
        main(["--backend", "openai", "--url", "http://10.0.0.1:8000", "--num-requests", "1"])
