"""The Orca baselines' contiguous allocator: reservation sizes, first-fit holes (external
fragmentation), forks into spare runs, and no block ever held twice or leaked."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamkv.baselines.contiguous import ContiguousBlockManager, reservation_slots
from streamkv.baselines.first_fit import FirstFitAllocator, Run
from streamkv.config import CacheConfig
from streamkv.core.block_manager import AllocStatus, BlockManager, create_block_manager
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus


def _group(seq_id: int, prompt_len: int, max_tokens: int, **kw) -> SequenceGroup:
    seq = Sequence(seq_id, list(range(prompt_len)))
    return SequenceGroup(
        str(seq_id), [seq], SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    )


def _admit(bm: ContiguousBlockManager, group: SequenceGroup) -> AllocStatus:
    status = bm.can_allocate(group)
    if status == AllocStatus.OK:
        for seq in group.live_seqs(SequenceStatus.WAITING):
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
    return status


@pytest.mark.parametrize(
    ("policy", "slots"), [("orca-max", 256), ("orca-pow2", 128), ("orca-oracle", 100)]
)
def test_reservation_sizes(policy, slots):
    assert reservation_slots(policy, 100, 256) == slots
    bm = ContiguousBlockManager(policy, 4, 1000, 0, max_model_len=256)
    group = _group(0, 30, 70)  # final length 100
    assert _admit(bm, group) == AllocStatus.OK
    seq = group.seqs[0]
    assert bm.runs[seq.seq_id].num_blocks == slots // 4
    assert bm.tables[seq.seq_id] == list(range(8))  # the prompt's blocks, the run's prefix
    assert bm.device.num_free == 1000 - slots // 4


def test_pow2_is_capped_and_rounding_is_whole_blocks():
    assert reservation_slots("orca-pow2", 600, 1024) == 1024
    assert reservation_slots("orca-pow2", 1500, 2048) == 2048
    assert reservation_slots("orca-pow2", 1500, 1800) == 1800
    bm = ContiguousBlockManager("orca-oracle", 16, 100, 0, max_model_len=2048)
    assert bm.run_blocks_for(_group(0, 10, 7)) == 2  # 17 slots -> two 16-slot blocks


def test_first_fit_holes_cause_external_fragmentation():
    bm = ContiguousBlockManager("orca-oracle", 1, 30, 0, max_model_len=64)
    groups = [_group(i, 5, 5) for i in range(3)]  # 10 blocks each: the pool is full
    for g in groups:
        assert _admit(bm, g) == AllocStatus.OK
    assert bm.device.num_free == 0
    bm.free(groups[0].seqs[0])
    bm.free(groups[2].seqs[0])
    # 20 blocks free, but as two holes of 10: a request for 12 cannot be placed.
    assert bm.device.num_free == 20 and bm.device.largest_free == 10
    assert bm.external_fragmentation_blocks() == 10
    assert _admit(bm, _group(9, 6, 6)) == AllocStatus.LATER
    bm.free(groups[1].seqs[0])  # the middle run goes: the holes coalesce into one
    assert bm.device.largest_free == 30 and bm.external_fragmentation_blocks() == 0
    assert _admit(bm, _group(9, 6, 6)) == AllocStatus.OK


def test_a_run_larger_than_the_pool_is_never_admitted():
    bm = ContiguousBlockManager("orca-max", 16, 10, 0, max_model_len=2048)
    assert bm.can_allocate(_group(0, 5, 5)) == AllocStatus.NEVER


def test_parallel_samples_reserve_best_of_runs_and_forks_copy_into_them():
    bm = ContiguousBlockManager("orca-oracle", 4, 100, 0, max_model_len=256)
    group = _group(0, 10, 10, n=3)  # 20 slots = 5 blocks per sample
    assert _admit(bm, group) == AllocStatus.OK
    assert bm.device.num_free == 100 - 15 and bm.spare_blocks() == 10
    parent = group.seqs[0]
    bm.ensure_slots(parent, 10)
    parent.num_computed_tokens = 10
    parent.output_token_ids.append(1)
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    assert bm.blocks_needed(child, 1) == 0  # a spare waits for it
    assert bm.can_append_slots([(parent, 1), (child, 1)])
    copies = bm.ensure_slots(child, 1)
    own = bm.runs[child.seq_id]
    assert [src for src, _ in copies] == bm.tables[parent.seq_id][:3]
    assert [dst for _, dst in copies] == own.blocks(3) == bm.tables[child.seq_id]
    assert bm.spare_blocks() == 5 and bm.num_cow_copies == 3
    for seq in (parent, child):
        bm.free(seq)
    bm.check_no_leaks()


def test_a_dropped_beam_returns_its_run_to_the_request_until_it_ends():
    bm = ContiguousBlockManager("orca-oracle", 4, 40, 0, max_model_len=256)
    group = _group(0, 8, 8, n=2, use_beam_search=True, temperature=0.0)
    _admit(bm, group)
    a = group.seqs[0]
    bm.ensure_slots(a, 8)
    a.num_computed_tokens = 8
    b = a.fork(1, 0)
    bm.fork(a, b)
    bm.ensure_slots(b, 1)
    bm.free(a)  # beam a dropped: its run stays with the request
    assert bm.device.num_free == 40 - 8 and bm.spare_blocks() == 4
    c = b.fork(2, 0)
    bm.fork(b, c)
    assert bm.can_append_slots([(b, 1), (c, 1)])
    bm.ensure_slots(c, 1)
    bm.free(b)
    bm.free(c)
    bm.check_no_leaks()


def test_factory_selects_by_kv_allocation():
    paged = create_block_manager(CacheConfig(), 10, 2, 128)
    assert isinstance(paged, BlockManager)
    orca = create_block_manager(
        CacheConfig(kv_allocation="orca-pow2", enable_prefix_caching=False), 10, 2, 128
    )
    assert isinstance(orca, ContiguousBlockManager) and orca.policy == "orca-pow2"


def test_core_does_not_load_the_baselines():
    # The engine's core chooses a baseline without depending on it: it imports this package
    # only when a run asks for one (a fresh interpreter: this test's imports load it here).
    code = (
        "import importlib, pkgutil, sys, streamkv.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__): "
        "importlib.import_module(f'streamkv.core.{m.name}')\n"
        "print(sorted(k for k in sys.modules if k.startswith('streamkv.baselines')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_config_refuses_unknown_policy_and_prefix_caching():
    with pytest.raises(ValueError, match="kv_allocation must be one of"):
        CacheConfig(kv_allocation="orca").verify()
    with pytest.raises(ValueError, match="no prefix cache"):
        CacheConfig(kv_allocation="orca-max").verify()


def test_allocator_refuses_double_free():
    alloc = FirstFitAllocator(10)
    run = alloc.allocate(4)
    alloc.free(run)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(run)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(Run(2, 4))  # overlaps the free hole


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "step", "fork", "free"]),
        st.integers(0, 10**6),
        st.integers(1, 30),
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None)
@example(
    ops=[
        ("admit", 8, 1),
        ("step", 0, 1),
        ("fork", 0, 1),
        *[("admit", 0, 1)] * 7,
        ("step", 1, 1),
        ("free", 0, 1),
        ("fork", 0, 1),
        ("step", 818, 1),
    ],
    policy="orca-pow2",
    block_size=1,
)
@given(
    ops=ops,
    policy=st.sampled_from(["orca-max", "orca-pow2", "orca-oracle", "ft-max"]),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_random_operations_never_hand_out_a_block_twice(ops, policy, block_size):
    bm = ContiguousBlockManager(policy, block_size, 64, 0, max_model_len=40)
    live: dict[int, Sequence] = {}
    next_id = 0
    for op, pick, n in ops:
        ids = sorted(live)
        if op == "admit":
            group = _group(
                next_id, min(n, 39), max(1, 40 - n) if pick % 2 else 1 + pick % 8, n=1 + pick % 3
            )
            next_id += 1
            if _admit(bm, group) == AllocStatus.OK:
                live[group.seqs[0].seq_id] = group.seqs[0]
        elif op == "step" and ids:
            seq = live[ids[pick % len(ids)]]
            if seq.num_computed_tokens < 38 and bm.can_append_slots([(seq, 1)]):
                k = min(seq.num_uncomputed_tokens, 38 - seq.num_computed_tokens)
                # A step stays within the reservation, as the engine's max_tokens keeps it: a
                # bound sequence's run, or for a child still reading its parent's blocks the
                # run it will bind (every run of a family has the family's size). The child
                # used to be let through unbounded, so a step on it could outgrow the run.
                run = bm.runs.get(seq.seq_id)
                blocks = run.num_blocks if run is not None else bm._family(seq).run_blocks
                if k > 0 and len(seq) < 39 and blocks * block_size > len(seq):
                    bm.ensure_slots(seq, k)
                    seq.num_computed_tokens += k
                    seq.output_token_ids.append(0)
        elif op == "fork" and ids:
            parent = live[ids[pick % len(ids)]]
            family = bm._families[bm._family_of[parent.seq_id]]
            if parent.seq_id not in bm._unbound and family.spares:
                child = parent.fork(next_id, 1)
                next_id += 1
                bm.fork(parent, child)
                live[child.seq_id] = child
        elif op == "free" and ids:
            bm.free(live.pop(ids[pick % len(ids)]))
        # Invariants: bound runs and spare runs are disjoint, tables lie in their runs, and the
        # allocator's free count is the pool minus everything reserved.
        held = [b for r in bm.runs.values() for b in r.blocks()]
        held += [b for f in bm._families.values() for r in f.spares for b in r.blocks()]
        held += [b for r in bm._retired for b in r.blocks()]  # request batching
        assert len(held) == len(set(held)), "a block is reserved twice"
        assert bm.device.num_free == 64 - len(held)
        for sid, table in bm.tables.items():
            if sid not in bm._unbound:
                assert set(table) <= set(bm.runs[sid].blocks())
    for seq in live.values():
        bm.free(seq)
    bm.check_no_leaks()


def test_request_level_batching_admits_only_between_batches():
    bm = ContiguousBlockManager("ft-max", 4, 100, 0, max_model_len=32)  # 8 blocks per request
    a, b, late = _group(0, 6, 4), _group(1, 6, 20), _group(2, 6, 4)
    assert _admit(bm, a) == AllocStatus.OK and _admit(bm, b) == AllocStatus.OK  # one batch
    for g in (a, b):
        bm.ensure_slots(g.seqs[0], 6)
        g.seqs[0].num_computed_tokens = 6
    bm.ensure_slots(a.seqs[0], 1)  # the batch's second step: it is closed now
    assert _admit(bm, late) == AllocStatus.LATER  # memory is free, but the batch runs on
    bm.free(a.seqs[0])  # a ends first; its run stays with the batch
    assert bm.device.num_free == 100 - 16 and bm.retired_blocks() == 8
    assert _admit(bm, late) == AllocStatus.LATER
    bm.free(b.seqs[0])  # the longest request ends: the batch's memory all goes back
    assert bm.device.num_free == 100 and bm.retired_blocks() == 0
    assert _admit(bm, late) == AllocStatus.OK
    bm.free(late.seqs[0])
    bm.check_no_leaks()


def test_a_recomputed_group_comes_back_with_a_run_per_sequence():
    bm = ContiguousBlockManager("orca-oracle", 4, 100, 0, max_model_len=64)
    group = _group(0, 8, 8, n=3)
    parent = group.seqs[0]
    child = Sequence(1, parent.prompt_token_ids, output_token_ids=[1, 2])
    parent.output_token_ids = [1, 3]
    group.seqs.append(child)  # two live samples, both waiting after a recompute
    assert bm.can_allocate(group) == AllocStatus.OK
    assert bm.allocate_group(group.seqs) == 0
    runs = [bm.runs[s.seq_id] for s in group.seqs]
    assert [r.num_blocks for r in runs] == [4, 4] and runs[0].start != runs[1].start
    assert bm.spare_blocks() == 4  # the third sample's run, reserved with the group
    for seq in group.seqs:
        bm.free(seq)
    bm.check_no_leaks()


def test_the_kv_snapshot_draws_runs_and_holes():
    from types import SimpleNamespace

    from streamkv.core.kv_snapshot import take_snapshot

    bm = ContiguousBlockManager("orca-oracle", 1, 12, 0, max_model_len=64)
    groups = [_group(i, 2, 2) for i in range(3)]  # runs of 4 at [0, 4), [4, 8), [8, 12)
    for g in groups:
        _admit(bm, g)
    bm.free(groups[1].seqs[0])
    assert list(bm.device.ref_counts) == [1] * 4 + [0] * 4 + [1] * 4
    sched = SimpleNamespace(
        running=[groups[0], groups[2]],
        waiting=[],
        swapped=[],
        num_preemptions=0,
        num_swapped_out_blocks=0,
        num_swapped_in_blocks=0,
    )
    snap = take_snapshot(bm, sched).as_dict()
    assert snap["device"]["cells"] == "uuuu....uuuu"  # two runs and the hole between them
