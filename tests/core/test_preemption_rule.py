"""preemption_mode=auto (core/preemption.py): the cost formulas, the rule, the constants file,
and the scheduler following it."""

from __future__ import annotations

import json

import pytest

from streamkv.baselines.contiguous import ContiguousBlockManager
from streamkv.core.preemption import COSTS_FILE, PreemptionCosts, auto_mode, choose, load_costs
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.core.sched_helpers import Sim, make_bm, make_scheduler

# A GPU-like shape: a per-block transfer cost dominates at tiny blocks (the paper's Fig 19a).
GPU = PreemptionCosts(
    call_ms=0.02, block_us=30.0, token_us=0.3, fixed_ms=4.0, token_ms=0.002, quad_ns=0.5
)
SWAP_CHEAP = PreemptionCosts(call_ms=0.0, block_us=0.0, token_us=0.0, fixed_ms=100.0, token_ms=1.0)
RECOMPUTE_CHEAP = PreemptionCosts(
    call_ms=100.0, block_us=1e3, token_us=1e3, fixed_ms=0.0, token_ms=0.0
)


def test_formulas():
    c = PreemptionCosts(
        call_ms=1.0, block_us=100.0, token_us=10.0, fixed_ms=2.0, token_ms=0.5, quad_ns=1000.0
    )
    assert c.swap_ms(10, 16) == pytest.approx(2 * (1.0 + 10 * (100 + 160) / 1000))
    assert c.recompute_ms(100) == pytest.approx(2.0 + 50.0 + 100 * 100 * 1000 / 1e6)


def test_rule_follows_block_size_and_context():
    # 2048 tokens: at block size 1 that is 2048 transfers (~123 ms) against a ~10 ms prefill.
    assert GPU.swap_ms(2048, 1) > 100 > GPU.recompute_ms(2048)
    assert choose(GPU, 2048, 1, 2048, cpu_free_blocks=10**6) == "recompute"
    assert choose(GPU, 8, 256, 2048, cpu_free_blocks=10**6) == "swap"
    # No CPU room: recompute, however cheap a swap would be.
    assert choose(SWAP_CHEAP, 8, 256, 2048, cpu_free_blocks=7) == "recompute"
    assert choose(SWAP_CHEAP, 8, 256, 2048, cpu_free_blocks=8) == "swap"


def test_costs_file(tmp_path):
    shipped = load_costs()  # the shipped file loads, and its default profile exists
    assert shipped.swap_ms(1, 16) >= 0 and shipped.recompute_ms(1) >= 0
    data = json.loads(COSTS_FILE.read_text())
    assert data["default"] in data["profiles"]
    path = tmp_path / "costs.json"
    path.write_text(
        json.dumps(
            {
                "default": "a",
                "profiles": {
                    "a": {
                        "call_ms": 1,
                        "block_us": 2,
                        "token_us": 3,
                        "fixed_ms": 4,
                        "token_ms": 5,
                        "source": "x",
                    },
                    "b": {"call_ms": 9, "block_us": 2, "token_us": 3, "fixed_ms": 4, "token_ms": 5},
                },
            }
        )
    )
    assert load_costs(None, path).call_ms == 1 and load_costs("b", path).call_ms == 9
    with pytest.raises(ValueError, match="no preemption cost profile 'c'"):
        load_costs("c", path)


def _running(bm, seq_id: int, length: int) -> tuple[SequenceGroup, Sequence]:
    seq = Sequence(seq_id, [1 + (seq_id + i) % 7 for i in range(length)])
    group = SequenceGroup(str(seq_id), [seq], SamplingParams(max_tokens=4))
    bm.allocate(seq)
    seq.status = SequenceStatus.RUNNING
    return group, seq


def test_auto_mode_counts_the_group_and_its_room():
    bm = make_bm(num_blocks=32, block_size=4, cpu_blocks=4)
    group, seq = _running(bm, 1, 16)  # 4 blocks
    assert auto_mode(SWAP_CHEAP, bm, group, [seq]) == "swap"
    assert auto_mode(RECOMPUTE_CHEAP, bm, group, [seq]) == "recompute"
    small_cpu = make_bm(num_blocks=32, block_size=4, cpu_blocks=3)
    group, seq = _running(small_cpu, 2, 16)
    assert auto_mode(SWAP_CHEAP, small_cpu, group, [seq]) == "recompute"
    # A contiguous baseline never swaps.
    cbm = ContiguousBlockManager("orca-oracle", 4, 32, 8, 256)
    group, seq = _running(cbm, 3, 16)
    assert auto_mode(SWAP_CHEAP, cbm, group, [seq]) == "recompute"


def test_auto_mode_discounts_a_reserved_prefix():
    # 20 tokens in 5 blocks, 16 of them a pinned prefix: recomputing redoes 4 tokens (0.04 ms),
    # less than the swap (0.08 ms); counted whole (0.2 ms) it would have swapped.
    costs = PreemptionCosts(call_ms=0.0, block_us=0.0, token_us=2.0, fixed_ms=0.0, token_ms=0.01)
    assert costs.recompute_ms(4) < costs.swap_ms(5, 4) < costs.recompute_ms(20)
    bm = make_bm(num_blocks=32, block_size=4, cpu_blocks=32)
    prefix = bm.reserved.add(list(range(50, 66)))
    computer = Sequence(0, list(prefix.token_ids))
    bm.allocate(computer)
    bm.ensure_slots(computer, 16)
    computer.num_computed_tokens = 16
    bm.mark_computed(computer)
    bm.free(computer)
    seq = Sequence(1, list(prefix.token_ids) + [1, 2, 3, 4])
    group = SequenceGroup("1", [seq], SamplingParams(max_tokens=4))
    assert bm.allocate(seq) == 16
    seq.status = SequenceStatus.RUNNING
    assert auto_mode(costs, bm, group, [seq]) == "recompute"
    plain = make_bm(num_blocks=32, block_size=4, cpu_blocks=32)
    group, seq = _running(plain, 2, 20)
    assert auto_mode(costs, plain, group, [seq]) == "swap"


@pytest.mark.parametrize("costs, mode", [(SWAP_CHEAP, "swap"), (RECOMPUTE_CHEAP, "recompute")])
def test_scheduler_preempts_by_the_rule(costs, mode):
    bm = make_bm(num_blocks=4, block_size=4, cpu_blocks=8)
    sched = make_scheduler(bm, budget=64, mode="auto")
    sched.preemption_costs = costs
    sim = Sim(sched)
    for rid in "abc":
        sim.add(rid, 4, max_tokens=6)
    sim.step()
    out = sim.step()
    assert out.num_preempted == 1
    assert bool(out.swap_out) is (mode == "swap")
    assert [g.request_id for g in (sched.swapped if mode == "swap" else sched.waiting)] == ["c"]
    sim.run()
    assert set(sim.finished) == {"a", "b", "c"}
    bm.check_no_leaks()


def test_each_device_kind_gets_the_profile_measured_on_it():
    from streamkv.core.preemption import device_profile, load_costs

    assert device_profile("cuda") == "cuda" and device_profile("cpu") == "cpu"
    assert device_profile("mps") is None  # nothing measured there: the file's default
    # On the H200 a block-16 swap of 2,000 tokens beats recomputing them; not so at block 1.
    gpu = load_costs("cuda")
    assert gpu.swap_ms(125, 16) < gpu.recompute_ms(2000) < gpu.swap_ms(2000, 1)
