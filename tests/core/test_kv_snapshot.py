"""The KV-cache snapshot against a real BlockManager and Scheduler: block states, block
tables, sharing, copy-on-write, the prefix cache, swapping, and the size bounds."""

from __future__ import annotations

import itertools
import json

from streamkv.config import SchedulerConfig
from streamkv.core.block_manager import BlockManager
from streamkv.core.kv_snapshot import MAX_CELLS, STATES, cached_free_blocks, take_snapshot
from streamkv.core.scheduler import Scheduler
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4


def make(
    num_blocks: int = 32, cpu_blocks: int = 16, caching: bool = False
) -> tuple[BlockManager, Scheduler]:
    bm = BlockManager(BS, num_blocks, cpu_blocks, enable_prefix_caching=caching, watermark=0.0)
    return bm, Scheduler(SchedulerConfig(max_num_seqs=64), bm)


_ids = itertools.count()


def run_prompt(sched: Scheduler, rid: str, tokens: list[int]) -> SequenceGroup:
    """Admit a request and compute its prompt, as one engine step would."""
    group = SequenceGroup(rid, [Sequence(next(_ids), list(tokens))], SamplingParams(max_tokens=8))
    sched.add(group)
    for s in sched.schedule().scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.bm.mark_computed(s.seq)
    return group


def test_an_idle_pool_is_all_free():
    bm, sched = make()
    snap = take_snapshot(bm, sched)
    assert snap.device.cells == "." * 32 and snap.device.blocks_per_cell == 1
    assert snap.cpu.cells == "." * 16
    assert snap.requests == [] and snap.ref_counts == {}
    h = snap.headline
    assert (h["used_blocks"], h["free_blocks"], h["kv_usage"], h["waste"], h["running"]) == (
        0,
        32,
        0.0,
        0.0,
        0,
    )
    assert snap.legend == dict(STATES)


def test_a_running_request_shows_its_block_table_and_waste():
    bm, sched = make()
    group = run_prompt(sched, "r1", list(range(10)))  # 10 tokens: blocks of 4, 4, 2
    seq = group.seqs[0]
    snap = take_snapshot(bm, sched)
    table = bm.tables[seq.seq_id]
    assert [r.request_id for r in snap.requests] == ["r1"]
    row = snap.requests[0].seqs[0]
    assert (row.table, row.num_blocks, row.status, row.num_tokens, row.num_computed_tokens) == (
        table,
        3,
        "running",
        10,
        10,
    )
    assert sorted(i for i, c in enumerate(snap.device.cells) if c == "u") == sorted(table)
    h = snap.headline
    assert h["used_blocks"] == 3 and h["kv_usage"] == 3 / 32 and h["running"] == 1
    assert h["waste"] == 1 - 10 / 12  # two empty slots in the last block
    assert h["sharing_savings"] == 0.0


def test_forked_samples_share_blocks_until_copy_on_write():
    bm, sched = make()
    group = run_prompt(sched, "n4", list(range(10)))
    parent = group.seqs[0]
    for i in range(1, 4):  # n=4: three more samples share the prompt's blocks
        child = parent.fork(next(_ids), i)
        bm.fork(parent, child)
        group.seqs.append(child)
    snap = take_snapshot(bm, sched)
    table = bm.tables[parent.seq_id]
    assert snap.ref_counts == {b: 4 for b in table}
    assert snap.device.cells.count("s") == 3 and snap.headline["shared_blocks"] == 3
    assert len(snap.requests[0].seqs) == 4
    assert snap.headline["sharing_savings"] == 1 - 3 / 12
    # Each sample's next token goes into the shared, partly filled last block: copy-on-write.
    for seq in group.seqs[1:]:
        seq.output_token_ids.append(1)
        bm.ensure_slots(seq, 1)
    snap = take_snapshot(bm, sched)
    assert snap.counters["cow_copies"] == 3
    # The full blocks stay shared; the last is the parent's alone, beside three copies.
    assert snap.ref_counts == {table[0]: 4, table[1]: 4}
    assert snap.device.cells.count("s") == 2 and snap.device.cells.count("u") == 4


def test_finished_prefix_blocks_are_cached_and_hit():
    bm, sched = make(caching=True)
    prompt = list(range(10))
    group = run_prompt(sched, "a", prompt)
    sched.finish_group(group, SequenceStatus.FINISHED_STOPPED)
    sched.free_finished_seqs()
    snap = take_snapshot(bm, sched)
    # The two full blocks stay in the prefix cache, free to reuse; the partial one is free.
    assert snap.device.cells.count("c") == 2 == snap.headline["cached_blocks"]
    assert cached_free_blocks(bm.device) == {i for i, c in enumerate(snap.device.cells) if c == "c"}
    assert snap.headline["used_blocks"] == 0 and snap.headline["kv_usage"] == 0.0
    run_prompt(sched, "b", prompt)
    snap = take_snapshot(bm, sched)
    assert snap.counters["prefix_cache_hits"] == 8 and snap.counters["prefix_cache_queries"] == 20
    assert snap.headline["prefix_cache_hit_rate"] == 8 / 20
    assert snap.device.cells.count("c") == 0 and snap.headline["used_blocks"] == 3


def test_a_swapped_group_moves_to_the_cpu_picture():
    bm, sched = make()
    group = run_prompt(sched, "s", list(range(10)))
    sched.running.remove(group)
    bm.swap_out(group)
    sched.swapped.append(group)
    snap = take_snapshot(bm, sched)
    assert snap.device.cells == "." * 32
    assert snap.cpu.cells.count("u") == 3 and snap.headline["cpu_used_blocks"] == 3
    row = snap.requests[0].seqs[0]
    assert row.status == "swapped" and row.table == bm.cpu_tables[group.seqs[0].seq_id]
    assert snap.headline["swapped"] == 1 and snap.headline["running"] == 0


def test_pinned_blocks_are_drawn_when_the_pool_has_pins():
    bm, sched = make()
    run_prompt(sched, "p", list(range(10)))
    pinned = bm.tables[sched.running[0].seqs[0].seq_id][:2]
    bm.device.pinned_blocks = set(pinned)  # the attribute a pinning pool exposes
    snap = take_snapshot(bm, sched)
    assert [i for i, c in enumerate(snap.device.cells) if c == "p"] == sorted(pinned)
    assert snap.headline["pinned_blocks"] == 2


def test_a_large_pool_stays_bounded():
    bm, sched = make(num_blocks=30_000, cpu_blocks=1000)
    for i in range(40):
        run_prompt(sched, f"r{i}", [i] * 400)  # 100 blocks each
    parent = sched.running[0].seqs[0]
    child = parent.fork(next(_ids), 1)
    bm.fork(parent, child)
    sched.running[0].seqs.append(child)
    snap = take_snapshot(bm, sched)
    assert len(snap.device.cells) <= MAX_CELLS and snap.device.blocks_per_cell == 8
    assert snap.device.num_blocks == 30_000
    # A cell shows the most notable of its blocks: the shared prompt wins over used.
    first = bm.tables[parent.seq_id][0]
    assert snap.device.cells[first // 8] == "s"
    assert snap.headline["used_blocks"] == 40 * 100 and snap.headline["shared_blocks"] == 100
    assert len(snap.requests) == 32 and snap.num_requests_left_out == 8
    assert all(len(s.table) == 64 and s.num_blocks == 100 for r in snap.requests for s in r.seqs)
    size = len(json.dumps(snap.as_dict()))
    assert size < 40_000, size


def test_as_dict_holds_every_field():
    from dataclasses import fields

    bm, sched = make()
    run_prompt(sched, "d", list(range(10)))
    snap = take_snapshot(bm, sched)
    d = snap.as_dict()
    assert set(d) == {f.name for f in fields(snap)}
    assert set(d["requests"][0]["seqs"][0]) == {f.name for f in fields(snap.requests[0].seqs[0])}
    assert json.loads(json.dumps(d))["device"]["cells"] == snap.device.cells
