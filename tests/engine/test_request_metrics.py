"""vLLM's per-request intervals and per-step token histogram, counted on the engine thread
(engine/request_metrics.py), on hand-made steps with known times (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streamkv.engine.request_metrics import Buckets, RequestMetrics, one_two_five
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus


def test_one_two_five_buckets_stop_at_the_limit():
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_bucket_bounds_are_inclusive_and_the_last_bucket_is_past_them():
    b = Buckets((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 9.0):
        b.observe(v)
    assert b.counts == [2, 2, 1] and b.total == 14.0


def _step(*groups):
    return SimpleNamespace(scheduled=[SimpleNamespace(group=g) for g in groups for _ in g.seqs])


def test_intervals_of_a_request_from_its_engine_times():
    m = RequestMetrics(max_model_len=1024)
    seqs = [Sequence(0, [1, 2, 3]), Sequence(1, [1, 2, 3])]
    group = SequenceGroup("r", seqs, SamplingParams(n=2, max_tokens=4), arrival_time=10.0)
    m.record_step(_step(group), num_tokens=6, started=10.5)  # first scheduled at 10.5
    group.first_token_time = 11.25
    m.record_step(_step(group), num_tokens=2, started=11.5)  # a later start changes nothing
    for seq in seqs:
        seq.output_token_ids += [7, 8, 9]
        seq.status = SequenceStatus.FINISHED_LENGTH
    group.finished_time = 13.0
    m.record_step(_step(group), num_tokens=2, started=12.9)
    m.record_step(_step(group), num_tokens=0, started=13.1)  # a finished group counts once
    snap = m.snapshot()

    def one(name):
        assert sum(snap[name]["counts"]) == 1, name
        return snap[name]["sum"]

    assert one("queue_time") == pytest.approx(0.5)
    assert one("prefill_time") == pytest.approx(0.75)
    assert one("decode_time") == pytest.approx(1.75)
    assert one("inference_time") == pytest.approx(2.5)
    assert (one("prompt_tokens"), one("generation_tokens"), one("params_n"), one("params_max_tokens")) == (3, 6, 2, 4)
    it = snap["iteration_tokens"]
    assert sum(it["counts"]) == 3 and it["sum"] == 10  # the empty step is no iteration
