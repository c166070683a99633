"""The harness's own measurement: metrics on hand-built records, the open loop's overhead
against a fake driver (no server), and the simulated-engine path end to end."""

from __future__ import annotations

import asyncio
import math

import pytest

from load_tests.arrivals import arrival_times
from load_tests.kv import snapshot_from_metrics, window
from load_tests.metrics import parse_slo, summarize
from load_tests.report import format_summary
from load_tests.runner import RequestRecord, run_open_loop
from load_tests.workloads import BenchRequest


def test_metrics_by_hand():
    # Arrives at 1.0; tokens delivered at 1.5 (first), 1.7, 2.1; 3 tokens.
    a = RequestRecord(
        0, 10, 3, 1, scheduled=1.0, sent=1.0, chunk_times=[1.5, 1.7, 2.1], end=2.1, output_tokens=3
    )
    b = RequestRecord(
        1, 20, 4, 2, scheduled=2.0, sent=2.01, chunk_times=[2.2, 3.0], end=3.0, output_tokens=8
    )
    bad = RequestRecord(2, 5, 4, 1, scheduled=2.5, sent=2.5, end=2.6, error="HTTPError: boom")
    s = summarize([a, b, bad], duration=4.0, slo=parse_slo(["ttft:400"]))
    assert (s["completed"], s["errors"], s["incomplete"]) == (2, 1, 0)
    assert s["ttft_ms"]["mean"] == pytest.approx((500 + 200) / 2)
    # TPOT: a (1.1 - 0.5) / 2 = 300 ms; b: 4 tokens per sample, (1.0 - 0.2) / 3 ms.
    assert s["tpot_ms"]["mean"] == pytest.approx((300 + 800 / 3) / 2)
    assert s["itl_ms"]["p50"] == pytest.approx(400)
    # Normalized latency: a 1.1 s / 3 tokens, b 1.0 s / 4 tokens per sample.
    assert s["normalized_latency_s"] == pytest.approx((1.1 / 3 + 1.0 / 4) / 2)
    assert s["goodput"] == pytest.approx(1 / 4.0)  # only b's TTFT (200 ms) meets 400 ms
    assert s["output_throughput"] == pytest.approx(11 / 4.0)
    assert s["send_lag_ms"]["p99"] == pytest.approx(10, abs=0.5)
    text = format_summary(
        {"label": "x", "request_rate": 1.0, "burstiness": 1.0, "summary": s, "kv": None}
    )
    assert "Normalized latency (s/token):" in text and "HTTPError: boom" in text


class FakeDriver:
    """Streams ``tokens`` chunks ``gap`` seconds apart, as a quick server would."""

    def __init__(self, tokens: int = 4, gap: float = 0.002) -> None:
        self.tokens, self.gap, self.in_flight, self.peak = tokens, gap, 0, 0

    async def send(self, req, rec, clock) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            for _ in range(self.tokens):
                await asyncio.sleep(self.gap)
                rec.chunk_times.append(clock())
            rec.output_tokens = self.tokens
        finally:
            self.in_flight -= 1


def test_open_loop_keeps_up_with_400_requests_per_second():
    reqs = [BenchRequest([1, 2, 3], 4) for _ in range(800)]
    arrivals = arrival_times(len(reqs), 400.0, seed=3)
    driver = FakeDriver()
    records, duration = asyncio.run(run_open_loop(driver, reqs, arrivals, max_duration=30.0))
    s = summarize(records, duration)
    assert s["completed"] == 800
    assert s["request_throughput"] >= 200  # the bar, with the CPU shared
    assert s["send_lag_ms"]["p50"] < 20
    assert driver.peak > 1  # open loop: requests overlap, nobody waits for a reply to send


def test_time_limit_cancels_and_counts_incomplete():
    reqs = [BenchRequest([1], 4) for _ in range(20)]
    arrivals = [0.01 * i for i in range(20)]
    records, duration = asyncio.run(
        run_open_loop(FakeDriver(tokens=1000, gap=0.01), reqs, arrivals, 0.3)
    )
    s = summarize(records, duration)
    assert s["incomplete"] == 20 and s["completed"] == 0 and duration == pytest.approx(0.3, abs=0.2)


def test_kv_window_from_two_scrapes():
    def scrape(samples, tok, batched, steps):
        return "\n".join(
            [
                'streamkv:kv_memory_share_sum_total{model_name="m",kind="token",'
                f'kv_allocation="orca-max"}} {tok}',
                'streamkv:kv_memory_share_sum_total{model_name="m",kind="reserved",'
                'kv_allocation="orca-max"} 0.0',
                'streamkv:kv_memory_share_sum_total{model_name="m",kind="internal",'
                'kv_allocation="orca-max"} 0.0',
                'streamkv:kv_memory_share_sum_total{model_name="m",kind="external",'
                'kv_allocation="orca-max"} 0.0',
                f'streamkv:kv_memory_samples_total{{model_name="m"}} {samples}',
                f'streamkv:batched_requests_sum_total{{model_name="m"}} {batched}',
                f'streamkv:batched_steps_total{{model_name="m"}} {steps}',
            ]
        )

    w = window(
        snapshot_from_metrics(scrape(10, 2.0, 30, 10)),
        snapshot_from_metrics(scrape(14, 3.0, 70, 20)),
    )
    assert w["shares"]["token"] == pytest.approx(0.25) and w[
        "avg_batched_requests"
    ] == pytest.approx(4.0)
    assert w["kv_allocation"] == "orca-max"
    assert snapshot_from_metrics("streamkv:other 1") is None


@pytest.mark.slow
def test_simulated_sweep_orders_the_systems(tmp_path):
    """The real engine on a step-time model: at a rate where paged keeps up, orca-max's
    queue explodes, and it holds less KV memory as tokens; request-level batching (ft-max)
    batches fewer requests still."""
    from load_tests.bench import main

    results = {}
    for alloc in ("paged", "orca-max", "ft-max"):
        out = tmp_path / f"{alloc}.json"
        rc = main(
            [
                "--backend",
                "offline",
                "--simulate",
                "--num-kv-blocks",
                "200",
                "--num-swap-blocks",
                "0",
                "--max-model-len",
                "1024",
                "--no-enable-prefix-caching",
                "--kv-allocation",
                alloc,
                "--workload",
                "alpaca",
                "--num-requests",
                "150",
                "--request-rate",
                "8",
                "--disable-tqdm",
                "--json-out",
                str(out),
            ]
        )
        assert rc == 0
        import json

        results[alloc] = json.loads(out.read_text())["runs"][0]
    paged, orca = results["paged"], results["orca-max"]
    ft = results["ft-max"]
    assert (
        paged["summary"]["completed"]
        == orca["summary"]["completed"]
        == ft["summary"]["completed"]
        == 150
    )
    assert ft["kv"]["avg_batched_requests"] < orca["kv"]["avg_batched_requests"]
    assert paged["summary"]["normalized_latency_s"] < orca["summary"]["normalized_latency_s"]
    assert paged["kv"]["shares"]["token"] > 0.8 > 0.5 > orca["kv"]["shares"]["token"]
    assert paged["kv"]["avg_batched_requests"] > orca["kv"]["avg_batched_requests"]
    assert not math.isnan(paged["summary"]["ttft_ms"]["p50"])
    # Orca (Max) fits 200 // 64 = 3 reservations of 1,024 slots: every measure of its batch
    # (per step, weighted by step time, while requests arrive) stays within that.
    for key in ("avg_batched_requests", "time_avg_batched_seqs"):
        assert 1 <= orca["kv"][key] <= 3
    assert 1 <= orca["kv"]["while_arriving"]["avg_batched_requests"] <= 3
    assert (
        orca["kv"]["while_arriving"]["samples"] < orca["kv"]["samples"]
    )  # a window inside the run


def test_plots_are_written(tmp_path):
    from load_tests.plot import main as plot_main

    def result(label, lat, token):
        runs = [
            {
                "request_rate": r,
                "summary": {"normalized_latency_s": lat * r, "ttft_ms": {"p50": 1.0}},
                "kv": {
                    "samples": 3,
                    "avg_batched_requests": 2.0 * r,
                    "shares": {
                        "token": token,
                        "reserved": 0.1,
                        "internal": 0.9 - token,
                        "external": 0.0,
                    },
                },
            }
            for r in (1.0, 2.0, math.inf)
        ]
        path = tmp_path / f"{label}.json"
        path.write_text(__import__("json").dumps({"label": label, "runs": runs}))
        return str(path)

    files = [result("paged", 0.1, 0.9), result("orca-max", 0.5, 0.2)]
    for kind in ("latency", "waste", "batched"):
        out = tmp_path / f"{kind}.png"
        assert plot_main([kind, *files, "--out", str(out)]) == 0
        assert out.read_bytes()[:4] == b"\x89PNG"


def test_saved_workloads_load_back(tmp_path):
    from load_tests.bench import load_requests

    path = tmp_path / "w.json"
    path.write_text('[{"prompt_ids": [1, 2, 3], "output_len": 5, "n": 2, "beam_width": 0}]')
    assert load_requests(str(path)) == [BenchRequest([1, 2, 3], 5, 2, 0)]
    path.write_text('[{"prompt": "x"}]')
    with pytest.raises(SystemExit, match="not a --save-workload file"):
        load_requests(str(path))


def test_sustained_rate_interpolates_the_crossing():
    from load_tests.report import markdown_table, sustained_rate

    def res(label, lats):
        return {
            "label": label,
            "runs": [
                {
                    "request_rate": r,
                    "summary": {"normalized_latency_s": y},
                    "kv": {
                        "avg_batched_requests": 3.0,
                        "shares": dict.fromkeys(
                            ("token", "reserved", "internal", "external"), 0.25
                        ),
                    },
                }
                for r, y in lats
            ],
        }

    paged = res("paged", [(1, 0.1), (2, 0.3), (4, 0.9)])  # crosses 0.5 a third of the way to 4
    orca = res("orca", [(1, 0.2), (2, 1.5)])
    assert sustained_rate(paged, 0.5) == pytest.approx(2 + 2 / 3)
    assert sustained_rate(orca, 0.5) == pytest.approx(1 + 0.3 / 1.3)
    assert sustained_rate(res("never", [(1, 0.7)]), 0.5) is None
    assert sustained_rate(res("always", [(1, 0.1), (3, 0.2)]), 0.5) == 3
    table = markdown_table([paged, orca], 0.5, 2)
    assert "| orca | 1.23 | 2.17x |" in table and "25.0 / 25.0 / 25.0 / 25.0" in table
