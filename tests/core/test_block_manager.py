"""Block manager invariants under random operation sequences (hypothesis), plus targeted
copy-on-write, prefix-cache and swap cases."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.core.block_manager import AllocStatus, BlockManager
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus


def _check_refcounts(bm: BlockManager) -> None:
    for pool, tables in ((bm.device, bm.tables), (bm.cpu, bm.cpu_tables)):
        expected = Counter(b for t in tables.values() for b in t)
        for block in range(pool.num_blocks):
            assert pool.ref_counts[block] == expected.get(block, 0), (block, pool.ref_counts[block])
        # The shared-block count is kept incrementally; it must equal a scan.
        assert pool.num_shared == sum(1 for rc in pool.ref_counts if rc > 1)
        free = list(pool._free) + list(pool._evictable)
        assert len(free) == len(set(free)), "a block is in the free list twice"
        assert not set(free) & set(expected), "a referenced block is free"


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "fork", "free", "swap_out", "swap_in"]),
        st.integers(0, 10**6),
        st.integers(1, 40),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), caching=st.booleans())
def test_random_operations_keep_refcounts_exact(ops, block_size, caching):
    bm = BlockManager(
        block_size,
        num_device_blocks=24,
        num_cpu_blocks=24,
        enable_prefix_caching=caching,
        watermark=0.0,
    )
    seqs: dict[int, Sequence] = {}
    swapped: dict[int, Sequence] = {}
    next_id = 0
    for op, pick, n in ops:
        live = sorted(seqs)
        if op == "alloc":
            seq = Sequence(next_id, [t % 3 for t in range(n)])  # few distinct tokens: cache hits
            next_id += 1
            group = SequenceGroup(str(seq.seq_id), [seq], SamplingParams())
            if bm.can_allocate(group) == AllocStatus.OK:
                bm.allocate(seq)
                seq.status = SequenceStatus.RUNNING
                seqs[seq.seq_id] = seq
        elif op == "append" and live:
            seq = seqs[live[pick % len(live)]]
            # The uncomputed tail becomes computed, then one new token is appended.
            k = seq.num_uncomputed_tokens
            if bm.can_append_slots([(seq, k)]):
                bm.ensure_slots(seq, k)
                seq.num_computed_tokens += k
                bm.mark_computed(seq)
                seq.output_token_ids.append(pick % 3)
        elif op == "fork" and live:
            parent = seqs[live[pick % len(live)]]
            child = parent.fork(next_id, 1)
            next_id += 1
            bm.fork(parent, child)
            seqs[child.seq_id] = child
        elif op == "free" and live:
            bm.free(seqs.pop(live[pick % len(live)]))
        elif op == "swap_out" and live:
            seq = seqs[live[pick % len(live)]]
            group = SequenceGroup("g", [seq], SamplingParams())
            if bm.can_swap_out(group):
                bm.swap_out(group)
                swapped[seq.seq_id] = seqs.pop(seq.seq_id)
        elif op == "swap_in" and swapped:
            sid = sorted(swapped)[pick % len(swapped)]
            group = SequenceGroup("g", [swapped[sid]], SamplingParams())
            if bm.can_swap_in(group):
                bm.swap_in(group)
                seqs[sid] = swapped.pop(sid)
        _check_refcounts(bm)
    for seq in list(seqs.values()) + list(swapped.values()):
        bm.free(seq)
    bm.check_no_leaks()


def test_copy_on_write_copies_only_the_shared_last_block():
    bm = BlockManager(4, 16, 16, watermark=0.0)
    parent = Sequence(0, list(range(6)))  # blocks: [0..3], [4,5,_,_]
    bm.allocate(parent)
    parent.num_computed_tokens = 6
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    assert bm.tables[0] == bm.tables[1]
    parent.output_token_ids.append(7)
    child.output_token_ids.append(8)
    copies_p = bm.ensure_slots(parent, 1)
    copies_c = bm.ensure_slots(child, 1)
    assert len(copies_p) == 1 and copies_c == []  # the second writer owns the block alone now
    assert bm.tables[0][0] == bm.tables[1][0]  # the full prompt block stays shared
    assert bm.tables[0][1] != bm.tables[1][1]
    assert copies_p[0] == (bm.tables[1][1], bm.tables[0][1])
    for s in (parent, child):
        bm.free(s)
    bm.check_no_leaks()


def test_prefix_cache_hit_requires_identical_tokens_and_keeps_last_token():
    bm = BlockManager(4, 16, 0, enable_prefix_caching=True, watermark=0.0)
    a = Sequence(0, list(range(12)))
    bm.allocate(a)
    a.num_computed_tokens = 12
    bm.mark_computed(a)
    bm.free(a)
    b = Sequence(1, list(range(12)))  # fully cached: the last block is still computed
    assert bm.allocate(b) == 8
    c = Sequence(2, list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.allocate(c) == 8
    assert bm.tables[1][:2] == bm.tables[2][:2]
    d = Sequence(3, [0, 1, 2, 99] + list(range(4, 12)))
    assert bm.allocate(d) == 0  # same later blocks, different first block: chained key misses
    for s in (b, c, d):
        bm.free(s)
    bm.check_no_leaks()


def test_evictable_cached_blocks_are_reused_under_pressure():
    bm = BlockManager(4, 4, 0, enable_prefix_caching=True, watermark=0.0)
    a = Sequence(0, list(range(16)))
    bm.allocate(a)
    a.num_computed_tokens = 16
    bm.mark_computed(a)
    bm.free(a)
    assert bm.device.num_free == 4  # all cached, all evictable
    b = Sequence(1, list(range(100, 116)))
    bm.allocate(b)
    assert bm.device.num_evictions == 4
    bm.free(b)
    bm.check_no_leaks()


def test_swap_keeps_sharing_within_a_group():
    bm = BlockManager(4, 16, 16, watermark=0.0)
    p = Sequence(0, list(range(8)))
    bm.allocate(p)
    p.status = SequenceStatus.RUNNING
    c = p.fork(1, 1)
    bm.fork(p, c)
    group = SequenceGroup("g", [p, c], SamplingParams(n=2))
    mapping = bm.swap_out(group)
    assert len(mapping) == 2  # shared blocks move once
    assert bm.cpu.num_free == 14
    back = bm.swap_in(group)
    assert len(back) == 2 and bm.tables[0] == bm.tables[1]
    for s in (p, c):
        bm.free(s)
    bm.check_no_leaks()


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "step", "fork", "free"]),
            st.integers(0, 10**6),
            st.integers(1, 12),
        ),
        max_size=50,
    ),
    block_size=st.sampled_from([1, 2, 4]),
    caching=st.booleans(),
)
def test_blocks_needed_is_what_ensure_slots_takes(ops, block_size, caching):
    """blocks_needed's in-place shortcut (the new tokens fit the table, the block written is
    not shared) and its general path both count exactly the free blocks ensure_slots then
    takes, for decodes and chunks, after forks (copy-on-write) and cache hits; the block
    written is then never shared."""
    bm = BlockManager(
        block_size,
        num_device_blocks=32,
        num_cpu_blocks=0,
        enable_prefix_caching=caching,
        watermark=0.0,
    )
    seqs: dict[int, Sequence] = {}
    next_id = 0
    for op, pick, n in ops:
        live = sorted(seqs)
        if op == "alloc":
            seq = Sequence(next_id, [t % 2 for t in range(n)])
            next_id += 1
            if bm.can_allocate(SequenceGroup("g", [seq], SamplingParams())) == AllocStatus.OK:
                bm.allocate(seq)
                seqs[seq.seq_id] = seq
        elif op == "step" and live:
            seq = seqs[live[pick % len(live)]]
            k = min(seq.num_uncomputed_tokens, 1 + pick % 5)  # a chunk or a decode
            need, free = bm.blocks_needed(seq, k), bm.device.num_free
            if need <= free:
                copies = bm.ensure_slots(seq, k)
                assert free - bm.device.num_free == need and len(copies) <= 1
                table = bm.tables[seq.seq_id]
                assert len(table) * block_size >= seq.num_computed_tokens + k
                assert (
                    bm.device.ref_counts[table[seq.num_computed_tokens // block_size]] == 1
                )  # not shared
                seq.num_computed_tokens += k
                bm.mark_computed(seq)
                if seq.num_uncomputed_tokens == 0:
                    seq.output_token_ids.append(pick % 2)
        elif op == "fork" and live:
            parent = seqs[live[pick % len(live)]]
            child = parent.fork(next_id, 1)
            next_id += 1
            bm.fork(parent, child)
            seqs[child.seq_id] = child
        elif op == "free" and live:
            bm.free(seqs.pop(live[pick % len(live)]))
        _check_refcounts(bm)
    for seq in seqs.values():
        bm.free(seq)
    bm.check_no_leaks()
