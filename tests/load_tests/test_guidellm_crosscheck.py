"""The GuideLLM cross-check's parsing and comparison, on a recorded GuideLLM report (no
GuideLLM, no server: CI does not install it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load_tests import crosscheck_stats as cs
from load_tests import guidellm_crosscheck as gc
from load_tests.runner import RequestRecord

REPORT = Path(__file__).with_name("guidellm_report.json")


def test_guidellm_figures_from_a_recorded_report():
    fig = cs.guidellm_figures(json.loads(REPORT.read_text()))
    assert (fig["completed"], fig["errors"]) == (6, 0)
    # GuideLLM's own medians, as it reported them (the lower of the two middle values of 6).
    assert fig["ttft_ms"] == pytest.approx(2155.159, abs=1e-3)
    assert fig["itl_ms"] == pytest.approx(620.636, abs=1e-3)
    # Recomputed from its per-request timings: the usual median (mean of the middle two).
    assert fig["ttft_sent_ms"] == pytest.approx((2155.159 + 2184.273) / 2, abs=1e-2)
    assert fig["itl_per_request_ms"] == pytest.approx((620.636 + 688.536) / 2, abs=1e-2)
    # From the scheduled arrival a request waits longer than from its send, never less.
    assert fig["ttft_sched_ms"] >= fig["ttft_sent_ms"]
    assert (fig["prompt_tokens"], fig["output_tokens"]) == (32, 8)


def _record(i: int, scheduled: float, sent: float, chunks: list[float]) -> RequestRecord:
    rec = RequestRecord(
        i, prompt_len=4, output_len=len(chunks), n=1, scheduled=scheduled, sent=sent
    )
    rec.chunk_times, rec.end, rec.output_tokens = chunks, chunks[-1] + 0.01, len(chunks)
    return rec


def test_harness_figures_under_both_definitions():
    # Request 0: sent 0.1 s late, tokens 1.0 s apart after the first; request 1 on time,
    # with one long gap (another request's prefill) among short ones.
    recs = [_record(0, 0.0, 0.1, [0.5, 1.5, 2.5]), _record(1, 1.0, 1.0, [1.2, 1.4, 2.4, 2.6])]
    fig = cs.harness_figures(recs, 2.61)
    assert fig["ttft_sched_ms"] == pytest.approx((500 + 200) / 2)
    assert fig["ttft_sent_ms"] == pytest.approx((400 + 200) / 2)
    assert fig["ttft_ms"] == pytest.approx(fig["ttft_sched_ms"])  # ours counts from the schedule
    # Pooled gaps 1.0, 1.0, 0.2, 1.0, 0.2 -> median 1.0; per request 1.0 and 1.4 / 3 -> mean of
    # the two.
    assert fig["itl_ms"] == pytest.approx(1000)
    assert fig["itl_per_request_ms"] == pytest.approx((1000 + 1400 / 3) / 2)


def test_compare_takes_each_clients_median_and_pair_ratios():
    runs = [
        {"client": c, **{m: v for m in cs.METRICS}}
        for c, v in (
            ("guidellm", 100.0),
            ("harness", 105.0),
            ("guidellm", 200.0),
            ("harness", 180.0),
            ("guidellm", 110.0),
            ("harness", 110.0),
        )
    ]
    s = cs.compare(runs)["ttft_ms"]
    assert (s["guidellm"], s["harness"]) == (110.0, 110.0)
    assert s["ratio"] == pytest.approx(1.0)
    assert s["pair_ratios"] == pytest.approx([1.05, 0.9, 1.0])
    assert s["pair_ratio_median"] == pytest.approx(1.0)


def test_skips_with_a_message_without_guidellm(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gc, "DEFAULT_GUIDELLM", str(tmp_path / "missing"))
    monkeypatch.delenv("GUIDELLM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gc.find_guidellm(None) is None
    assert gc.main(["--json-out", str(tmp_path / "out.json")]) == 0
    assert "skipped: GuideLLM is not installed" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()


def test_runs_keep_per_request_values_under_one_definition():
    recs = [_record(0, 0.0, 0.1, [0.5, 1.5, 2.5]), _record(1, 1.0, 1.0, [1.2, 1.4, 2.4, 2.6])]
    fig = cs.harness_figures(recs, 2.61)
    assert fig["ttft_sent_values"] == pytest.approx([400, 200])
    assert fig["itl_per_request_values"] == pytest.approx([1000, 1400 / 3])
    g = cs.guidellm_figures(json.loads(REPORT.read_text()))
    assert len(g["ttft_sent_values"]) == len(g["itl_per_request_values"]) == 6
    assert cs._median(g["ttft_sent_values"]) == pytest.approx(g["ttft_sent_ms"])


def test_pooled_ratio_interval_and_run_spread():
    # Ours reads 10% above GuideLLM in every run; GuideLLM's second run is 20% slower than its
    # first.
    g = [[100.0 + i for i in range(20)], [120.0 + i for i in range(20)]]
    runs = [{"client": "guidellm", "ttft_sent_values": v, "itl_per_request_values": v} for v in g]
    runs += [
        {
            "client": "harness",
            "ttft_sent_values": [1.1 * x for x in v],
            "itl_per_request_values": [1.1 * x for x in v],
        }
        for v in g
    ]
    p = cs.pooled(runs)["ttft_sent"]
    assert p["ratio"] == pytest.approx(1.1)
    assert p["ci95"][0] < 1.1 < p["ci95"][1] and p["ci95"][1] - p["ci95"][0] < 0.3
    assert p["requests"] == {"guidellm": 40, "harness": 40}
    assert p["run_spread"]["guidellm"] == pytest.approx(129.5 / 109.5)
    # An interval that excludes 1 for clients that differ by more than the noise.
    shifted = [
        {**r, "ttft_sent_values": [2 * x for x in r["ttft_sent_values"]]}
        if r["client"] == "harness"
        else r
        for r in runs
    ]
    lo, hi = cs.pooled(shifted)["ttft_sent"]["ci95"]
    assert lo > 1.5
    assert "ttft_sent" in cs.format_pooled(cs.pooled(runs))


def test_saved_runs_are_summarized_across_files(tmp_path, capsys):
    def run(client, pair, value):
        return {
            "client": client,
            "pair": pair,
            **{m: value for m in cs.METRICS},
            "ttft_sent_values": [value] * 3,
            "itl_per_request_values": [value] * 3,
        }

    # File 1: pairs agree (1.0, 1.0); file 2: one pair straddles a change of load (2.0).
    files = []
    for i, pairs in enumerate([[(100, 100), (200, 200)], [(100, 100), (100, 200)]]):
        runs = [
            r
            for p, (g, h) in enumerate(pairs)
            for r in (run("guidellm", p, g), run("harness", p, h))
        ]
        path = tmp_path / f"c{i}.json"
        path.write_text(json.dumps({"load_average": [1.0, 1.0, 1.0], "runs": runs}))
        files.append(str(path))
    assert cs.main(files) == 0
    out = capsys.readouterr().out
    assert "all 4 pairs, ttft_ms: median 1.000, range 1.00-2.00, 3 within 10%" in out
