"""vLLM's per-request intervals and per-step token histogram, counted on the engine thread
(RequestMetrics in engine/stats.py), on hand-made steps with known times (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streamkv.engine.stats import Buckets, RequestMetrics, one_two_five
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


def test_intervals_of_a_request_from_its_engine_times():
    m = RequestMetrics(max_model_len=1024)
    seqs = [Sequence(0, [1, 2, 3]), Sequence(1, [1, 2, 3])]
    group = SequenceGroup("r", seqs, SamplingParams(n=2, max_tokens=4), arrival_time=10.0)
    m.scheduled(group, 10.5)  # its first prompt step began at 10.5
    m.iteration(6)
    group.first_token_time = 11.25
    m.scheduled(group, 11.5)  # recomputed after a preemption: the first time stays
    m.iteration(2)
    for seq in seqs:
        seq.output_token_ids += [7, 8, 9]
        seq.status = SequenceStatus.FINISHED_LENGTH
    group.finished_time = 13.0
    m.finished(group)
    m.scheduled(group, 13.1)  # a step already in flight still carries it: counted once
    m.finished(group)
    m.iteration(0)
    snap = m.snapshot()

    def one(name):
        assert sum(snap[name]["counts"]) == 1, name
        return snap[name]["sum"]

    assert one("queue_time") == pytest.approx(0.5)
    assert one("prefill_time") == pytest.approx(0.75)
    assert one("decode_time") == pytest.approx(1.75)
    assert one("inference_time") == pytest.approx(2.5)
    assert (
        one("prompt_tokens"),
        one("generation_tokens"),
        one("params_n"),
        one("params_max_tokens"),
    ) == (3, 6, 2, 4)
    it = snap["iteration_tokens"]
    assert sum(it["counts"]) == 2 and it["sum"] == 8  # the empty step is no iteration


def test_engine_stats_feed_the_request_metrics_in_one_pass():
    """A request that starts and finishes in one step (max_tokens=1) is counted."""
    from streamkv.core.block_manager import BlockManager
    from streamkv.core.step_plan import ScheduledSeq, SchedulerOutput
    from streamkv.engine.stats import EngineStats

    bm = BlockManager(16, num_device_blocks=8, num_cpu_blocks=0)
    seq = Sequence(0, [1, 2, 3, 4])
    group = SequenceGroup("r", [seq], SamplingParams(max_tokens=1), arrival_time=1.0)
    stats = EngineStats(
        bm,
        SimpleNamespace(
            running=[],
            num_preemptions=0,
            num_swapped_out_blocks=0,
            num_swapped_in_blocks=0,
            waiting=(),
            swapped=(),
        ),
    )
    seq.output_token_ids.append(9)  # what the step's output processing did
    group.first_token_time = group.finished_time = 3.0
    stats.record_step(SchedulerOutput(scheduled=[ScheduledSeq(group, seq, 4)]), started=2.0)
    h = stats.request_metrics.snapshot()
    assert (h["queue_time"]["sum"], h["prefill_time"]["sum"], h["decode_time"]["sum"]) == (
        1.0,
        1.0,
        0.0,
    )
    # 4 prompt tokens and the token they sampled (vLLM counts it as generated).
    assert sum(h["iteration_tokens"]["counts"]) == 1 and h["iteration_tokens"]["sum"] == 4 + 1
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (4, 1)


def test_a_requests_first_token_counts_as_generated_once():
    """vLLM's generation_tokens_total counts every sampled token, the prefill's first one too;
    with async scheduling the next step may begin before that token is set: not counted twice."""
    from streamkv.core.block_manager import BlockManager
    from streamkv.core.step_plan import ScheduledSeq, SchedulerOutput
    from streamkv.engine.stats import EngineStats

    bm = BlockManager(16, num_device_blocks=8, num_cpu_blocks=0)
    seq = Sequence(0, [1, 2, 3])
    group = SequenceGroup("r", [seq], SamplingParams(max_tokens=3), arrival_time=1.0)
    stats = EngineStats(
        bm,
        SimpleNamespace(
            running=[],
            num_preemptions=0,
            num_swapped_out_blocks=0,
            num_swapped_in_blocks=0,
            waiting=(),
            swapped=(),
        ),
    )
    seq.output_token_ids.append(7)
    group.first_token_time = 2.5
    stats.record_step(SchedulerOutput(scheduled=[ScheduledSeq(group, seq, 3)]), started=2.0)
    seq.output_token_ids.append(8)  # the next step began (2.2) before the first token was set (2.5)
    stats.record_step(SchedulerOutput(scheduled=[ScheduledSeq(group, seq, 1)]), started=2.2)
    seq.output_token_ids.append(9)
    group.finished_time = 4.0
    stats.record_step(SchedulerOutput(scheduled=[ScheduledSeq(group, seq, 1)]), started=3.0)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (3, 3)
    assert stats.request_metrics.snapshot()["iteration_tokens"]["sum"] == 3 + 3
