"""EngineStats' sampled memory figures against a direct computation (no model)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from streamkv.core.block_manager import BlockManager
from streamkv.core.step_plan import ScheduledSeq, SchedulerOutput
from streamkv.engine.stats import EngineStats
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup


def direct_utilization(bm: BlockManager, groups: list[SequenceGroup]) -> tuple[float, float]:
    """Every block once, filled to the most tokens any of its sharers has computed."""
    fill: dict[int, int] = {}
    for group in groups:
        for seq in group.seqs:
            for i, block in enumerate(bm.tables[seq.seq_id]):
                filled = min(max(seq.num_computed_tokens - i * bm.block_size, 0), bm.block_size)
                fill[block] = max(fill.get(block, 0), filled)
    util = sum(fill.values()) / (len(fill) * bm.block_size)
    return util, 1 - len(fill) / bm.num_logical_blocks()


@pytest.mark.parametrize("seed", range(5))
def test_sampled_utilization_and_sharing_match_a_direct_count(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([4, 16])
    bm = BlockManager(bs, num_device_blocks=4096, num_cpu_blocks=0)
    groups, next_id = [], 0
    for g in range(12):
        parent = Sequence(next_id, [rng.randrange(100) for _ in range(rng.randrange(1, 90))])
        next_id += 1
        bm.allocate(parent)
        parent.num_computed_tokens = len(parent)
        seqs = [parent]
        for _ in range(rng.randrange(0, 3)):  # parallel samples share the prompt's blocks
            child = parent.fork(next_id, sample_index=len(seqs))
            next_id += 1
            bm.fork(parent, child)
            seqs.append(child)
        for seq in seqs:  # then each grows on its own (copy-on-write of the shared tail)
            for _ in range(rng.randrange(0, 2 * bs)):
                bm.ensure_slots(seq, 1)
                seq.output_token_ids.append(1)
                seq.num_computed_tokens += 1
            if rng.random() < 0.3:  # a slot reserved but not computed yet
                bm.ensure_slots(seq, 1)
                seq.output_token_ids.append(1)
        groups.append(SequenceGroup(str(g), seqs, SamplingParams(n=len(seqs))))
    stats = EngineStats(bm, SimpleNamespace(running=groups))
    out = SchedulerOutput(scheduled=[ScheduledSeq(g, s, 1) for g in groups for s in g.seqs])
    stats.record_step(out)  # the first step samples the memory figures
    util, saving = direct_utilization(bm, groups)
    assert stats._util_steps == 1 and stats._saving_steps == 1
    assert stats._util_sum == pytest.approx(util)
    assert stats._saving_sum == pytest.approx(saving)
    assert 0 < util <= 1 and saving > 0  # forks share blocks, so some saving is there
    assert stats.num_generation_tokens == sum(
        1 for g in groups for s in g.seqs if s.output_token_ids
    )
