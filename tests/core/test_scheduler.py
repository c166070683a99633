"""Scheduler unit tests: exact assertions on what each step schedules (CPU, no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.core.step_plan import ScheduledSeq, SchedulerOutput
from streamkv.sequence import SequenceStatus
from tests.core.sched_helpers import Sim, make_bm, make_scheduler, per_request, plan


def test_fcfs_admission_within_the_token_budget():
    sim = Sim(make_scheduler(make_bm(num_blocks=64), budget=16))
    for rid, n in (("a", 6), ("b", 6), ("c", 6)):
        sim.add(rid, n)
    # a and b whole, c the 4 tokens left: admission is in arrival order.
    assert per_request(sim.step()) == {"a": 6, "b": 6, "c": 4}
    # Decodes first (a, b), then the rest of c's prompt.
    assert per_request(sim.step()) == {"a": 1, "b": 1, "c": 2}
    assert [g.request_id for g in sim.sched.running] == ["a", "b", "c"]


def test_max_num_seqs_caps_admission():
    sim = Sim(make_scheduler(make_bm(num_blocks=64), budget=64, max_num_seqs=2))
    for rid in "abc":
        sim.add(rid, 3)
    assert per_request(sim.step()) == {"a": 3, "b": 3}
    assert [g.request_id for g in sim.sched.waiting] == ["c"]


def test_long_prompt_is_split_across_steps_and_samples_at_its_end():
    sim = Sim(make_scheduler(make_bm(num_blocks=64), budget=8))
    group = sim.add("long", 20, max_tokens=2)
    chunks = []
    for _ in range(3):
        out = sim.step()
        chunks.append([(s.num_new_tokens, s.do_sample) for s in out.scheduled])
    assert chunks == [[(8, False)], [(8, False)], [(4, False)]]  # do_sample read after the step
    assert group.seqs[0].output_token_ids == [7]
    assert per_request(sim.step()) == {"long": 1}


def test_decodes_never_wait_behind_a_long_prompt():
    sim = Sim(make_scheduler(make_bm(num_blocks=64), budget=8))
    sim.add("old", 4, max_tokens=20)
    sim.step()
    sim.add("new", 40)
    steps = [per_request(sim.step()) for _ in range(5)]
    # Every step the decode takes its token first; the prompt fills the other 7.
    assert steps == [{"old": 1, "new": 7}] * 5


def test_prompt_chunks_go_oldest_first():
    sim = Sim(make_scheduler(make_bm(num_blocks=64), budget=8))
    sim.add("p1", 12)
    sim.add("p2", 12)
    assert per_request(sim.step()) == {"p1": 8}
    assert per_request(sim.step()) == {"p1": 4, "p2": 4}  # p1 finishes its prompt first
    assert per_request(sim.step()) == {"p1": 1, "p2": 7}


def test_newest_group_is_preempted_first_and_recomputed():
    # 4 blocks of 4 tokens; three 4-token prompts fill 3 blocks and each needs a new block
    # for its first decode: only one fits, so the two newest are preempted.
    sim = Sim(make_scheduler(make_bm(num_blocks=4, block_size=4), budget=64, mode="recompute"))
    for rid in "abc":
        sim.add(rid, 4, max_tokens=8)
    assert per_request(sim.step()) == {"a": 4, "b": 4, "c": 4}
    out = sim.step()
    assert per_request(out) == {"a": 1, "b": 1}
    assert out.num_preempted == 1 and [g.request_id for g in sim.sched.waiting] == ["c"]
    c = sim.sched.waiting[0]
    assert c.seqs[0].status is SequenceStatus.WAITING and c.seqs[0].num_computed_tokens == 0
    assert c.seqs[0].seq_id not in sim.bm.tables


def test_swapped_groups_resume_before_new_admissions():
    bm = make_bm(num_blocks=4, block_size=4, cpu_blocks=8)
    sim = Sim(make_scheduler(bm, budget=64, mode="swap"))
    for rid in "abc":
        sim.add(rid, 4, max_tokens=6)
    sim.step()
    out = sim.step()
    assert (
        out.num_preempted == 1
        and out.swap_out
        and [g.request_id for g in sim.sched.swapped] == ["c"]
    )
    sim.add("d", 2)
    # d is admitted only in a step that left no group swapped out.
    swapped_in = 0
    while "d" not in per_request(out := sim.step()):
        swapped_in += len(out.swap_in)
    assert swapped_in + len(out.swap_in) > 0 and not sim.sched.swapped
    sim.run()
    assert set(sim.finished) == {"a", "b", "c", "d"}
    bm.check_no_leaks()


@pytest.mark.parametrize(
    "mode, cpu_blocks", [("recompute", 0), ("auto", 0), ("recompute", 16), ("swap", 16)]
)
def test_issue_11_preempted_sampling_group_comes_back(mode, cpu_blocks):
    """Issue 11's first repro at the scheduler: Y (16 + 80), X (48, n=4, 12 out), Z after
    step 60, in 16 blocks of 8 tokens."""
    bm = make_bm(num_blocks=16, block_size=8, cpu_blocks=cpu_blocks)
    sim = Sim(make_scheduler(bm, budget=256, max_num_seqs=8, mode=mode))
    sim.add("Y", 16, max_tokens=80)
    x = sim.add("X", 48, max_tokens=12, n=4, token=50)
    sim.run(max_steps=2000, on_step=lambda s: s.steps == 60 and s.add("Z", 10, token=90))
    assert set(sim.finished) == {"X", "Y", "Z"}
    assert all(g.error is None for g in sim.finished.values())
    assert sorted(len(s.output_token_ids) for s in x.seqs) == [12] * 4
    assert x.num_preemptions > 0
    bm.check_no_leaks()


def test_recomputed_group_shares_its_prefix_and_recomputes_it_once():
    bm = make_bm(num_blocks=32, block_size=4)
    sim = Sim(make_scheduler(bm, budget=64, mode="recompute"))
    g = sim.add("x", 10, max_tokens=6, n=3)
    for _ in range(2):
        sim.step()  # the prompt, then one decode: each sample holds 12 tokens
    seqs = list(g.seqs)
    assert [len(s) for s in seqs] == [12, 12, 12]
    sim.sched.running.remove(g)
    sim.sched._preempt(g, SchedulerOutput(), alone=False)
    assert bm.tables == {} and sim.sched.waiting[0] is g
    out = sim.sched.schedule()
    # The first sample recomputes the shared prompt blocks (8 of its 10 tokens) alone ...
    assert plan(out) == [("x", seqs[0].seq_id, 8)]
    tables = [bm.tables[s.seq_id] for s in seqs]
    assert tables[1][:2] == tables[2][:2] == tables[0][:2]  # shared, counted once
    assert len({b for t in tables for b in t}) == 3 + 2 * 1
    _advance(out)
    # ... then every sample computes its own tail (4 tokens each), and they sample together.
    out = sim.sched.schedule()
    assert plan(out) == [("x", s.seq_id, 4) for s in seqs]
    assert all(s.do_sample for s in out.scheduled)


def _advance(out) -> None:
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens


def test_a_group_that_can_never_run_ends_with_an_error():
    # Admission (core/admission.py) refuses this in the engine; the scheduler's progress
    # guarantee still ends it rather than repeat an empty step.
    sim = Sim(make_scheduler(make_bm(num_blocks=64), budget=8, max_num_seqs=2))
    bad = sim.add("too-wide", 3, n=3)
    sim.add("ok", 3)
    sim.run(max_steps=50)
    assert bad.error and "never be admitted" in bad.error
    assert bad.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert sim.finished["ok"].error is None
    sim.bm.check_no_leaks()


def test_a_prompt_larger_than_the_pool_ends_with_an_error():
    sim = Sim(make_scheduler(make_bm(num_blocks=4, block_size=4), budget=64))
    big = sim.add("big", 17)
    sim.add("ok", 3)
    out = sim.step()
    assert out.failed == [big] and "pool" in big.error
    sim.run(max_steps=50)
    sim.bm.check_no_leaks()


def test_scheduled_seq_samples_only_at_the_end_of_its_tokens():
    sim = Sim(make_scheduler(make_bm(), budget=4, max_num_seqs=4))
    g = sim.add("a", 6)
    seq = g.seqs[0]
    assert not ScheduledSeq(g, seq, 4).do_sample and ScheduledSeq(g, seq, 6).do_sample


events = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "abort", "step", "step", "step"]),
        st.integers(1, 30),
        st.integers(1, 12),
        st.integers(1, 3),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=120, deadline=None)
@given(
    events=events,
    mode=st.sampled_from(["auto", "swap", "recompute"]),
    caching=st.booleans(),
    budget=st.sampled_from([8, 16, 64]),
    cpu_blocks=st.sampled_from([0, 6]),
)
def test_random_arrivals_aborts_and_finishes_always_drain(
    events, mode, caching, budget, cpu_blocks
):
    from streamkv.core.admission import EngineLimits, InvalidParameter, check_request

    bm = make_bm(num_blocks=12, block_size=4, cpu_blocks=cpu_blocks, caching=caching)
    sim = Sim(make_scheduler(bm, budget=budget, max_num_seqs=4, mode=mode))
    limits = EngineLimits(
        max_model_len=64,
        vocab_size=1000,
        block_size=4,
        num_kv_blocks=12,
        num_swap_blocks=cpu_blocks,
        usable_kv_blocks=12,
        max_num_seqs=4,
        prefix_caching=caching,
    )
    live: list[str] = []
    for i, (kind, size, out_len, n) in enumerate(events):
        if kind == "add":
            group = sim.add(f"r{i}", size, max_tokens=out_len, n=n, token=i % 3)
            try:  # what LLMEngine.add_request does first
                check_request(group.seqs[0].prompt_token_ids, group.sampling_params, limits)
            except InvalidParameter:
                sim.sched.waiting.remove(group)
                continue
            live.append(group.request_id)
        elif kind == "abort" and live:
            sim.sched.abort(live.pop(size % len(live)))
        else:
            sim.step()
    sim.run(max_steps=3000)
    assert not sim.sched.has_unfinished()
    # Only a swap-mode preemption without CPU room may fail an admitted request.
    for group in sim.finished.values():
        assert group.error is None, group.error  # swap without room falls back to recompute
    bm.check_no_leaks()


def test_num_decodes_counts_decoding_rows_not_a_prompts_one_token_chunk():
    """A prompt whose last chunk is one token samples like a decode but is prompt work: the
    step-cost fit and the step report must not count it as a decode row."""
    sim = Sim(make_scheduler(make_bm(num_blocks=64), budget=8))
    sim.add("a", 3, max_tokens=4)
    sim.add("b", 6, max_tokens=4)  # 5 of its 6 prompt tokens fit the first step's budget of 8
    first = sim.step()
    assert [s.num_new_tokens for s in first.scheduled] == [3, 5] and first.num_decodes == 0
    second = sim.step()  # a decodes; b computes its last prompt token
    assert sorted(s.num_new_tokens for s in second.scheduled) == [1, 1]
    assert second.num_decodes == 1
    third = sim.step()  # both decode
    assert third.num_decodes == 2


def test_swap_mode_without_swap_space_recomputes_instead_of_dropping():
    """preemption_mode="swap" with no CPU pool (a CPU's default): the preempted request is
    recomputed and finishes whole; before, it ended with "preempted with no CPU swap space"."""
    bm = make_bm(num_blocks=8, block_size=4, cpu_blocks=0)
    sim = Sim(make_scheduler(bm, budget=64, max_num_seqs=4, mode="swap"))
    for i in range(3):
        sim.add(f"r{i}", 6, max_tokens=12, token=i)
    sim.run()
    assert sim.sched.num_preemptions > 0
    for group in sim.finished.values():
        assert group.error is None and len(group.seqs[0].output_token_ids) == 12
    bm.check_no_leaks()
