"""A compact picture of the paged KV cache at one instant (the paper's Figures 6 and 7):
the state of every physical block, each live sequence's block table, the event counters,
and the headline numbers. Built for the live view (entrypoints/server/kv_view.py).

It only reads the block manager, its pools and the scheduler, through their attributes;
it must run where they cannot change underneath it (the engine thread, between steps).
Its size is bounded whatever the pool: blocks beyond ``max_cells`` are drawn several to a
cell, and at most ``max_requests`` requests with ``max_table`` table entries each are kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from streamkv.core.block_manager import BlockManager
from streamkv.core.block_pool import BlockPool
from streamkv.core.scheduler import Scheduler

# One letter per block state, in rising order of what a cell holding several blocks shows:
# a cell is drawn as the most notable state among its blocks. New states (another kind of
# pin, a block being written) extend this table; the page reads its legend from here.
STATES: tuple[tuple[str, str], ...] = (
    (".", "free"),
    ("c", "cached"),  # ref count 0 but still holding a prefix-cache entry: free to reuse
    ("u", "used"),  # ref count 1
    ("s", "shared"),  # ref count > 1: copy-on-write on the next write into it
    ("p", "pinned"),  # a pinned prefix, kept resident
)
MAX_CELLS = 4096
MAX_REQUESTS = 32
MAX_TABLE = 64
MAX_REF_COUNTS = 256


@dataclass(slots=True)
class SeqRow:
    seq_id: int
    status: str  # running or swapped (then ``table`` holds CPU block ids)
    num_tokens: int
    num_computed_tokens: int
    table: list[int]  # logical block i -> physical block table[i]
    num_blocks: int  # the whole table's length; ``table`` may be cut to ``max_table``


@dataclass(slots=True)
class RequestRow:
    request_id: str
    seqs: list[SeqRow]


@dataclass(slots=True)
class PoolPicture:
    num_blocks: int
    blocks_per_cell: int
    cells: str  # one state letter per cell


@dataclass(slots=True)
class KVSnapshot:
    block_size: int
    device: PoolPicture
    cpu: PoolPicture
    ref_counts: dict[int, int]  # block -> ref count of shared blocks (the first MAX_REF_COUNTS)
    requests: list[RequestRow]
    num_requests_left_out: int
    counters: dict[str, int]
    headline: dict[str, float | int]
    legend: dict[str, str] = field(default_factory=lambda: dict(STATES))

    def as_dict(self) -> dict:
        """JSON-ready, built by hand: ``dataclasses.asdict`` deep-copies, several times slower."""

        def pool(p: PoolPicture) -> dict:
            return {
                "num_blocks": p.num_blocks,
                "blocks_per_cell": p.blocks_per_cell,
                "cells": p.cells,
            }

        return {
            "block_size": self.block_size,
            "device": pool(self.device),
            "cpu": pool(self.cpu),
            "ref_counts": {str(b): rc for b, rc in self.ref_counts.items()},
            "requests": [
                {
                    "request_id": r.request_id,
                    "seqs": [
                        {
                            "seq_id": s.seq_id,
                            "status": s.status,
                            "num_tokens": s.num_tokens,
                            "num_computed_tokens": s.num_computed_tokens,
                            "table": s.table,
                            "num_blocks": s.num_blocks,
                        }
                        for s in r.seqs
                    ],
                }
                for r in self.requests
            ],
            "num_requests_left_out": self.num_requests_left_out,
            "counters": self.counters,
            "headline": self.headline,
            "legend": self.legend,
        }


def _optional_blocks(pool: BlockPool, names: Iterable[str]) -> set[int]:
    """Block ids from the first of ``names`` that ``pool`` has: a collection, or a method
    returning one. Pools without it (no prefix cache, no pins yet) give none."""
    for name in names:
        value = getattr(pool, name, None)
        if value is None:
            continue
        if callable(value):
            value = value()
        return set(value)
    return set()


def cached_free_blocks(pool: BlockPool) -> set[int]:
    return _optional_blocks(pool, ("evictable_blocks", "_evictable"))


def pinned_blocks(pool: BlockPool) -> set[int]:
    return _optional_blocks(pool, ("pinned_blocks", "pinned"))


# Blocks are ranked in a bytearray (a byte per block, the index into STATES) so that a pool
# of tens of thousands of blocks is drawn by C loops: a snapshot runs between engine steps.
FREE, CACHED, USED, SHARED, PINNED = range(len(STATES))
_TO_LETTER = bytes(ord(STATES[i][0]) if i < len(STATES) else i for i in range(256))
_RANK_OF_REF_COUNT = bytes([FREE, USED] + [SHARED] * 254)


def block_ranks(pool: BlockPool) -> bytearray:
    counts = pool.ref_counts
    try:
        raw = bytes(counts)
    except ValueError:  # a ref count above 255 (a prefix shared by that many sequences)
        raw = bytes(min(rc, 255) for rc in counts)
    ranks = bytearray(raw.translate(_RANK_OF_REF_COUNT))
    for block in cached_free_blocks(pool):
        if ranks[block] == FREE:
            ranks[block] = CACHED
    for block in pinned_blocks(pool):
        ranks[block] = PINNED
    return ranks


def picture(ranks: bytes | bytearray, max_cells: int) -> PoolPicture:
    n = len(ranks)
    per_cell = max(1, -(-n // max_cells))
    if per_cell > 1:
        padded = bytes(ranks) + bytes(-n % per_cell)
        ranks = bytes(map(max, *(padded[i::per_cell] for i in range(per_cell))))
    return PoolPicture(n, per_cell, bytes(ranks).translate(_TO_LETTER).decode("ascii"))


def _memory_use(bm: BlockManager, scheduler: Scheduler) -> tuple[int, int, int]:
    """Over the blocks of running sequences: (distinct physical blocks, tokens written into
    them, table entries pointing at them). A block counts the most tokens any of its
    sharers wrote (a shared block is full, or the same partial prefix in every sharer)."""
    size = bm.block_size
    full: set[int] = set()  # set.update of table slices: C loops, the bulk of the work
    partial: dict[int, int] = {}
    logical = 0
    for group in scheduler.running:
        for seq in group.seqs:
            table = bm.tables.get(seq.seq_id)
            if table is None:
                continue
            logical += len(table)
            computed = seq.num_computed_tokens
            n_full = min(computed // size, len(table))
            full.update(table[:n_full])
            for i in range(n_full, len(table)):
                filled = min(max(computed - i * size, 0), size)
                if filled > partial.get(table[i], -1):
                    partial[table[i]] = filled
    tokens = len(full) * size + sum(n for b, n in partial.items() if b not in full)
    distinct = len(full) + sum(1 for b in partial if b not in full)
    return distinct, tokens, logical


def _request_rows(bm: BlockManager, groups: list, max_table: int) -> list[RequestRow]:
    rows = []
    for group in groups:
        seqs = []
        for seq in group.seqs:
            swapped = seq.seq_id in bm.cpu_tables
            table = bm.cpu_tables.get(seq.seq_id) if swapped else bm.tables.get(seq.seq_id)
            if table is None:
                continue  # finished, or waiting to be recomputed: it holds no blocks
            seqs.append(
                SeqRow(
                    seq.seq_id,
                    "swapped" if swapped else "running",
                    len(seq),
                    seq.num_computed_tokens,
                    list(table[:max_table]),
                    len(table),
                )
            )
        if seqs:
            rows.append(RequestRow(group.request_id, seqs))
    return rows


def take_snapshot(
    bm: BlockManager,
    scheduler: Scheduler,
    *,
    max_cells: int = MAX_CELLS,
    max_requests: int = MAX_REQUESTS,
    max_table: int = MAX_TABLE,
) -> KVSnapshot:
    device, cpu, size = bm.device, bm.cpu, bm.block_size
    ranks = block_ranks(device)
    groups = list(scheduler.running) + list(scheduler.swapped)
    distinct, tokens, logical = _memory_use(bm, scheduler)
    shared: dict[int, int] = {}
    block = ranks.find(SHARED)
    while block >= 0 and len(shared) < MAX_REF_COUNTS:
        shared[block] = device.ref_counts[block]
        block = ranks.find(SHARED, block + 1)
    free, cached = ranks.count(FREE), ranks.count(CACHED)
    used = device.num_blocks - free - cached
    queries = bm.prefix_cache_queries
    headline = {
        "kv_usage": used / device.num_blocks if device.num_blocks else 0.0,
        # Slots reserved in blocks of running sequences that hold no token yet.
        "waste": 1 - tokens / (distinct * size) if distinct else 0.0,
        # Table entries that point at a block another entry already points at.
        "sharing_savings": 1 - distinct / logical if logical else 0.0,
        "prefix_cache_hit_rate": bm.prefix_cache_hits / queries if queries else 0.0,
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "swapped": len(scheduler.swapped),
        "free_blocks": free,
        "cached_blocks": cached,
        "used_blocks": used,
        "shared_blocks": ranks.count(SHARED),
        "pinned_blocks": ranks.count(PINNED),
        "cpu_used_blocks": cpu.num_used,
    }
    counters = {
        "cow_copies": bm.num_cow_copies,
        "preemptions": scheduler.num_preemptions,
        "swapped_out_blocks": scheduler.num_swapped_out_blocks,
        "swapped_in_blocks": scheduler.num_swapped_in_blocks,
        "evictions": device.num_evictions,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": bm.prefix_cache_hits,
    }
    return KVSnapshot(
        block_size=bm.block_size,
        device=picture(ranks, max_cells),
        cpu=picture(block_ranks(cpu), max_cells),
        ref_counts=shared,
        requests=_request_rows(bm, groups[:max_requests], max_table),
        num_requests_left_out=max(0, len(groups) - max_requests),
        counters=counters,
        headline=headline,
    )
