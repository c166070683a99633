"""Capacity points and the step-cost fit (docs/paper.md, "The calibrated model"): the sustained
completion rate, the bounded step sample, and a fit that recovers known constants."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from load_tests.capacity import completed_req_s, figures
from load_tests.fit_steps import fit_step_cost
from load_tests.runner import RequestRecord
from load_tests.steps import StepRecord, StepRecorder, records_from_dict
from streamkv.messages import SeqStep, StepInput


def record(i: int, scheduled: float, end: float | None) -> RequestRecord:
    return RequestRecord(i, 10, 10, 1, scheduled, sent=scheduled, end=end, output_tokens=10)


def test_completed_req_s_reads_the_steady_rate_not_the_ramp_or_drain():
    # 100 requests all at once; the first 10 take 10 s to come out (a ramp), then one every
    # 0.2 s (5 req/s), then the last 10 in a slow drain.
    ends = (
        [1.0 * i for i in range(10)]
        + [10 + 0.2 * i for i in range(80)]
        + [30 + 5.0 * i for i in range(10)]
    )
    recs = [record(i, 0.01 * i, e) for i, e in enumerate(ends)]
    assert completed_req_s(recs) == pytest.approx(5.0)
    assert figures(recs)["overloaded"]  # offered 100 req/s


def test_completed_req_s_skips_unfinished_and_needs_ten():
    recs = [record(i, 0.0, None if i % 2 else float(i)) for i in range(18)]
    assert completed_req_s(recs) is None
    assert not figures(recs)["overloaded"]


def step(contexts: list[int], computed: list[int]) -> StepInput:
    return StepInput(
        seqs=[SeqStep(i, [1] * c, n - c) for i, (n, c) in enumerate(zip(contexts, computed))]
    )


def test_recorder_pairs_a_call_with_the_steps_submitted_in_it():
    class Exec:
        def submit(self, s):
            return s

    rec, ex = StepRecorder(block_size=16, capacity=10), Exec()
    rec.attach(ex)
    rec.stepped(0.5)  # nothing submitted: nothing recorded
    ex.submit(step([17, 100], [1, 100]))
    rec.stepped(0.02)
    ex.submit(step([5], [1]))
    ex.submit(step([33], [1]))  # two steps in one call are one record
    rec.stepped(0.03)
    assert rec.kept == [StepRecord(0.02, 2, 101, 117, 2 + 7), StepRecord(0.03, 2, 2, 38, 1 + 3)]
    assert records_from_dict(json.loads(json.dumps(rec.as_dict()))) == rec.kept


def test_recorder_memory_is_bounded_and_counts_every_step():
    rec = StepRecorder(block_size=16, capacity=50, seed=1)
    for i in range(5000):
        rec._pending.append(StepRecord(0.0, 1, 1, i, 1))
        rec.stepped(0.001)
    assert len(rec.kept) == 50 and rec.seen == 5000
    assert rec.total_seconds == pytest.approx(5.0)
    # A uniform sample of the run, not its first 50 steps.
    assert np.mean([r.context for r in rec.kept]) == pytest.approx(2500, rel=0.3)


def synthetic(
    n: int, base_ms, token_ms, kv_us, block_us, seed=0, vary_blocks=False
) -> list[StepRecord]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seqs = rng.randint(1, 64)
        computed = seqs + (rng.choice([0, 0, 0, rng.randint(16, 2000)]))
        context = seqs * rng.randint(50, 1500)
        bs = rng.choice([1, 4, 16, 64, 256]) if vary_blocks else 16
        blocks = context // bs + seqs // 2
        t = (base_ms + token_ms * computed) / 1e3 + (kv_us * context + block_us * blocks) / 1e6
        out.append(StepRecord(t * (1 + rng.gauss(0, 0.01)), seqs, computed, context, blocks))
    return out


def test_fit_recovers_known_constants_through_noise_and_outliers():
    recs = synthetic(2000, base_ms=11.0, token_ms=0.05, kv_us=0.3, block_us=0.0)
    for r in recs[:20]:  # a few compile stalls
        r.seconds += 2.0
    fit = fit_step_cost(recs)
    assert fit.base_ms == pytest.approx(11.0, rel=0.02)
    assert fit.per_token_ms == pytest.approx(0.05, rel=0.02)
    assert fit.per_kv_token_us == pytest.approx(0.3, rel=0.05)
    assert fit.dropped >= 20 and fit.rms_rel_err < 0.02 and fit.r2 > 0.99


def test_fit_with_the_block_term_fixed_or_fitted():
    recs = synthetic(2000, base_ms=8.0, token_ms=0.04, kv_us=0.2, block_us=1.5, seed=2)
    fixed = fit_step_cost(recs, block_us=1.5)
    assert (fixed.base_ms, fixed.per_kv_token_us) == pytest.approx((8.0, 0.2), rel=0.05)
    # Leaving out a real per-block cost shows as a worse fit, not a silent one.
    assert fit_step_cost(recs, block_us=0.0).per_kv_token_us > 0.25
    free = fit_step_cost(
        synthetic(2000, 8.0, 0.04, 0.2, 1.5, seed=3, vary_blocks=True), fit_blocks=True
    )
    assert free.per_block_us == pytest.approx(1.5, rel=0.05)
    assert free.per_kv_token_us == pytest.approx(0.2, rel=0.05)


def test_fit_refuses_too_few_steps():
    with pytest.raises(ValueError, match="too few"):
        fit_step_cost(synthetic(3, 10.0, 0.1, 0.5, 0.0))


def test_simulated_capacity_point_end_to_end(tmp_path):
    """The whole path on the simulated model: a point JSON with the issue's fields and step
    records from which the fit recovers the simulator's own constants."""
    from load_tests import bench
    from load_tests.fit_steps import load_records

    argv = [
        "--backend",
        "offline",
        "--simulate",
        "--model",
        "opt-13b",
        "--num-kv-blocks",
        "200",
        "--num-swap-blocks",
        "0",
        "--block-size",
        "16",
        "--max-model-len",
        "2048",
        "--no-enable-prefix-caching",
        "--disable-tqdm",
        "--workload",
        "alpaca",
        "--num-requests",
        "60",
        "--request-rate",
        "200",
        "--sim-base-ms",
        "12",
        "--sim-token-ms",
        "0.05",
        "--sim-kv-us",
        "0.4",
        "--sim-block-us",
        "2",
        "--record-steps",
        "300",
        "--point-dir",
        str(tmp_path / "h200"),
        "--figure",
        "12",
        "--json-out",
        str(tmp_path / "sweep.json"),
    ]
    assert bench.main(argv) == 0
    (path,) = (tmp_path / "h200").iterdir()
    point = json.loads(path.read_text())
    for key in (
        "figure",
        "system",
        "workload",
        "num_requests",
        "request_rate",
        "completed_req_s",
        "normalized_latency_s_per_token",
        "device",
        "steps",
    ):
        assert point[key] is not None, key
    assert (point["system"], point["workload"], point["num_requests"]) == ("paged", "alpaca", 60)
    assert point["overloaded"] and point["completed_req_s"] < point["offered_req_s"]
    assert point["steps"]["steps"] >= len(point["steps"]["rows"]) > 10
    fit = fit_step_cost(load_records(str(path)), block_us=2.0)
    assert (fit.base_ms, fit.per_token_ms, fit.per_kv_token_us) == pytest.approx(
        (12, 0.05, 0.4), rel=1e-3
    )
