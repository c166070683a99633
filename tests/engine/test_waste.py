"""KV waste accounting (the paper's Fig 2) against hand-computed examples, the batched-request
average (Fig 13), and the contiguous baselines end to end on the real model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streamkv.baselines.contiguous import ContiguousBlockManager
from streamkv.core.block_manager import BlockManager
from streamkv.core.step_plan import ScheduledSeq, SchedulerOutput
from streamkv.engine.stats import EngineStats
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup


def _running(seq_id: int, prompt_len: int, max_tokens: int) -> SequenceGroup:
    """A request whose prompt is computed and whose first token is sampled."""
    seq = Sequence(seq_id, list(range(prompt_len)), output_token_ids=[7])
    return SequenceGroup(str(seq_id), [seq], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _sample(bm, groups) -> EngineStats:
    stats = EngineStats(bm, SimpleNamespace(running=groups), max_model_len=64)
    stats.record_step(SchedulerOutput(scheduled=[ScheduledSeq(g, g.seqs[0], 1) for g in groups]))
    return stats


def test_paged_waste_by_hand():
    # Block size 4. A: prompt 6, 3 to generate -> K/V for 8 tokens ever; 6 computed in 2 blocks:
    #   block 0 full (4 token), block 1 holds 2 and will hold 2 more (2 reserved).
    # B: prompt 5, 2 to generate -> 6 ever; block 0 full, block 1 holds 1 (token), 1 more
    #   will come (reserved), 2 never (internal). Total 16 slots: 11 / 3 / 2 / 0.
    bm = BlockManager(4, 16, 0)
    groups = [_running(0, 6, 3), _running(1, 5, 2)]
    for g in groups:
        seq = g.seqs[0]
        bm.allocate(seq)
        seq.num_computed_tokens = len(seq.prompt_token_ids)
    stats = _sample(bm, groups)
    assert stats.waste_shares() == pytest.approx(
        {"token": 11 / 16, "reserved": 3 / 16, "internal": 2 / 16, "external": 0.0}
    )


def test_contiguous_waste_by_hand():
    # Block size 1, pool 20, orca-oracle. X (3 slots) at [0, 3), A (9) at [3, 12), B (7) at
    # [12, 19), one slot free at 19; X ends: holes of 3 and 1, so 1 free slot is external.
    # A: 6 token, 2 reserved (8 ever), 1 internal (its last token's slot, never written).
    # B: 5 token, 1 reserved (6 ever), 1 internal. Total 17: 11 / 3 / 2 / 1.
    bm = ContiguousBlockManager("orca-oracle", 1, 20, 0, max_model_len=64)
    x = _running(9, 2, 1)
    groups = [_running(0, 6, 3), _running(1, 5, 2)]
    for g in [x, *groups]:
        bm.can_allocate(g)
        bm.allocate(g.seqs[0])
        g.seqs[0].num_computed_tokens = len(g.seqs[0].prompt_token_ids)
    assert [bm.runs[g.seqs[0].seq_id].start for g in [x, *groups]] == [0, 3, 12]
    bm.free(x.seqs[0])
    stats = _sample(bm, groups)
    assert stats.waste_shares() == pytest.approx(
        {"token": 11 / 17, "reserved": 3 / 17, "internal": 2 / 17, "external": 1 / 17}
    )


def test_orca_max_waste_is_mostly_internal():
    bm = ContiguousBlockManager("orca-max", 1, 200, 0, max_model_len=64)
    g = _running(0, 6, 3)
    bm.can_allocate(g)
    bm.allocate(g.seqs[0])
    g.seqs[0].num_computed_tokens = 6
    shares = _sample(bm, [g]).waste_shares()
    assert shares == pytest.approx(
        {"token": 6 / 64, "reserved": 2 / 64, "internal": 56 / 64, "external": 0.0}
    )


def test_batched_requests_count_groups_not_sequences():
    bm = BlockManager(4, 64, 0)
    parallel = SequenceGroup("p", [Sequence(0, [1, 2]), Sequence(1, [1, 2])], SamplingParams(n=2))
    single = SequenceGroup("s", [Sequence(2, [1, 2])], SamplingParams())
    stats = EngineStats(bm, SimpleNamespace(running=[]))
    both = [ScheduledSeq(parallel, s, 1) for s in parallel.seqs] + [
        ScheduledSeq(single, single.seqs[0], 1)
    ]
    stats.record_step(SchedulerOutput(scheduled=both))
    stats.record_step(SchedulerOutput(scheduled=both[2:]))
    stats.record_step(SchedulerOutput())  # nothing ran: not a batch
    assert stats.batched_requests_sum / stats.batched_steps == pytest.approx(1.5)


def _engine(kv_allocation: str, num_kv_blocks: int):
    from streamkv.engine.llm_engine import LLMEngine
    from streamkv.entrypoints.llm import engine_config

    config = engine_config(
        None,
        device="cpu",
        block_size=16,
        num_kv_blocks=num_kv_blocks,
        num_swap_blocks=16,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    config.cache.kv_allocation = kv_allocation
    return LLMEngine(config)


@pytest.mark.slow
def test_baselines_give_paged_outputs_and_waste_more():
    """Same greedy tokens under every allocation (the kernels read contiguous runs through the
    same block tables); the reservation policies hold more memory per token, in the order of
    the paper's Fig 2."""
    prompts = [[5 + i, 17, 300 + 7 * i, 42] * (2 + i) for i in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(4)
    ]
    params.append(
        SamplingParams(temperature=0, n=2, best_of=2, max_tokens=5, ignore_eos=True, seed=1)
    )
    prompts.append([9, 8, 7, 6, 5])
    results, token_share = {}, {}
    for kind in ("paged", "orca-oracle", "orca-max"):  # orca-pow2 sits between: unit tests
        engine = _engine(kind, num_kv_blocks=80)
        for i, (ids, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), None, p, prompt_token_ids=ids)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    outs[out.request_id] = [c.token_ids for c in out.outputs]
        engine.block_manager.check_no_leaks()
        results[kind] = outs
        stats = engine.stats()
        token_share[kind] = stats["kv_token_share"]
        assert stats["kv_waste_samples"] > 0 and stats["avg_batched_requests"] >= 1
        assert sum(
            stats[f"kv_{k}_share"] for k in ("token", "reserved", "internal", "external")
        ) == pytest.approx(1.0)
        engine.shutdown()
    for kind in ("orca-oracle", "orca-max"):
        assert results[kind] == results["paged"], kind
    assert token_share["paged"] > token_share["orca-oracle"] > token_share["orca-max"]
