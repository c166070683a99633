"""Requests that arrive together share their common prefix (core/block_manager.py
``AllocStatus.SHARE_LATER``): while one of them computes a block of the common prompt, the
others wait a step and map it from the prefix cache, instead of computing their own copies in
the same step. Requests with other prompts are admitted past them."""

from __future__ import annotations

from tests.core.sched_helpers import Sim, make_bm, make_scheduler

PREFIX = [100 + i for i in range(40)]  # 10 full blocks of 4


def prompt(i: int) -> list[int]:
    return PREFIX + [500 + 10 * i + k for k in range(6)]


def test_a_burst_with_a_common_system_prompt_computes_it_once():
    bm = make_bm(num_blocks=64, block_size=4, caching=True)
    sim = Sim(make_scheduler(bm, budget=256, max_num_seqs=8))
    for i in range(4):
        sim.add(f"r{i}", 0, max_tokens=3, prompt=prompt(i))
    first = sim.step()
    assert [s.group.request_id for s in first.scheduled] == ["r0"]  # the others wait one step
    assert [g.request_id for g in sim.sched.waiting] == ["r1", "r2", "r3"]  # in their order
    second = sim.step()
    computed = {s.group.request_id: s.num_new_tokens for s in second.scheduled}
    # Each maps r0's 10 blocks and computes only its own 6 tokens.
    assert computed == {"r0": 1, "r1": 6, "r2": 6, "r3": 6}
    sim.run()
    assert bm.prefix_cache_hits == 3 * len(PREFIX)
    bm.check_no_leaks()


def test_other_prompts_are_admitted_past_a_waiting_sharer():
    bm = make_bm(num_blocks=64, block_size=4, caching=True)
    sim = Sim(make_scheduler(bm, budget=256, max_num_seqs=8))
    sim.add("a", 0, max_tokens=2, prompt=prompt(0))
    sim.add("b", 0, max_tokens=2, prompt=prompt(1))
    sim.add("c", 0, max_tokens=2, prompt=[7] * 30)
    first = sim.step()
    assert sorted(s.group.request_id for s in first.scheduled) == ["a", "c"]
    sim.run()
    bm.check_no_leaks()


def test_a_sharer_no_longer_waits_once_the_computing_request_is_gone():
    """If the request computing the shared blocks is aborted, the waiting one computes them."""
    bm = make_bm(num_blocks=64, block_size=4, caching=True)
    sim = Sim(make_scheduler(bm, budget=16, max_num_seqs=8))  # the prefix takes 3 steps
    sim.add("a", 0, max_tokens=2, prompt=prompt(0))
    sim.add("b", 0, max_tokens=2, prompt=prompt(1))
    sim.step()
    assert [g.request_id for g in sim.sched.waiting] == ["b"]
    sim.sched.abort("a")
    out = sim.step()
    assert [s.group.request_id for s in out.scheduled] == ["b"]
    sim.run()
    bm.check_no_leaks()


def test_without_prefix_caching_nothing_waits():
    bm = make_bm(num_blocks=64, block_size=4, caching=False)
    sim = Sim(make_scheduler(bm, budget=256, max_num_seqs=8))
    for i in range(3):
        sim.add(f"r{i}", 0, max_tokens=2, prompt=prompt(i))
    assert len(sim.step().scheduled) == 3
    sim.run()
    bm.check_no_leaks()
