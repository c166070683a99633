"""streamkv/bench/serve_client.py: vLLM benchmark_serving's figures from per-request results
(TTFT, TPOT excluding the first token, ITL, throughput, goodput under SLOs, answers by
status), and `streamkv bench serve --help`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamkv.bench.serve_client import Result, parse_goodput, summarize


def test_summary_figures_and_goodput():
    results = [
        Result(
            ok=True,
            prompt_len=10,
            output_tokens=11,
            ttft=0.5,
            latency=1.5,
            itl=[0.1] * 10,
            status=200,
        ),
        Result(
            ok=True,
            prompt_len=20,
            output_tokens=5,
            ttft=2.0,
            latency=2.4,
            itl=[0.1] * 4,
            status=200,
        ),
        Result(ok=False, error="HTTP 429: queue full", status=429),
    ]
    s = summarize(2.0, results, parse_goodput(["ttft:1000", "tpot:200"]))
    assert (s["completed"], s["failed"], s["statuses"]) == (2, 1, {"200": 2, "429": 1})
    assert s["total_output_tokens"] == 16 and s["output_throughput"] == 8.0
    assert s["median_ttft_ms"] == pytest.approx(1250.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)  # (1.0 / 10 + 0.4 / 4) / 2
    assert s["goodput_req_s"] == 0.5  # the second misses the TTFT target


def test_goodput_spec_is_checked():
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


@pytest.mark.parametrize(
    "cmd", [["benchmarks/bench_serve.py"], ["-m", "streamkv.entrypoints.cli", "bench", "serve"]]
)
def test_bench_serve_help(cmd):
    out = subprocess.run(
        [sys.executable, *cmd, "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--request-rate" in out and "--offline" in out and "--goodput" in out
