"""Block tables: the logical-to-physical map of every sequence's KV cache.

Every decoding algorithm is expressed with the same few calls: ``allocate`` maps a prompt
(reusing cached prefix blocks), ``ensure_slots`` grows a table one block at a time and copies
a shared last block before it is written (copy-on-write), ``fork`` shares a table, ``free``
drops one; a preempted group is swapped or re-admitted whole (core/preempted_groups.py).
Reserved prefixes (core/reserved_prefix.py) are pinned blocks that ``allocate`` maps first,
with the prefix cache on or off. Every chain of content keys starts from the sequence's
``cache_root`` (its cache_salt's root, or None), never from None itself: a salted sequence
meets only its own tenant's blocks (reserved prefixes, public text, excepted).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

from streamkv.config import CacheConfig
from streamkv.core.block_pool import BlockPool, block_key, cdiv
from streamkv.core.kv_waste import KVUsage, table_waste
from streamkv.core.preempted_groups import PreemptedGroups
from streamkv.core.reserved_prefix import ReservedPrefixes
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from streamkv.baselines.contiguous import ContiguousBlockManager


class AllocStatus(enum.Enum):
    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()
    # The next block the prefix cache misses is being computed by a running sequence with the
    # same tokens before it: admitted now, the request would compute its own copy in the same
    # step; a step later it maps that block instead.
    SHARE_LATER = enum.auto()


class BlockManager(PreemptedGroups):
    policy = "paged"  # the kv_allocation this manager serves

    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        enable_prefix_caching: bool = False,
        watermark: float = 0.01,
    ) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks, enable_caching=enable_prefix_caching)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.reserved = ReservedPrefixes(self.device, block_size)
        self.tables: dict[int, list[int]] = {}  # device tables
        self.cpu_tables: dict[int, list[int]] = {}  # tables of swapped-out sequences
        # Content keys of each sequence's full blocks, in order (prefix caching).
        self._keys: dict[int, list[bytes]] = {}
        # Full prompt blocks allocated but not computed yet: key -> the sequence computing it,
        # and each such sequence's keys from its first uncomputed block (admission waits for
        # them rather than computing the same block twice in one step).
        self._computing: dict[bytes, int] = {}
        self._pending: dict[int, list[bytes]] = {}
        # Leaders of groups re-admitted by allocate_group: seq id -> blocks shared with the
        # group that it is still filling (no copy-on-write: the sharers expect that KV).
        self._filling: dict[int, int] = {}
        self.num_cow_copies = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # tokens looked up, found

    # -- prompt allocation --------------------------------------------------------------
    def _walk_prefix(self, seq: Sequence, claim: bool = False) -> tuple[list[int], bytes | None]:
        """Blocks already computed for a prefix of ``seq``: a reserved prefix's pinned blocks,
        then cached blocks; never the block of its last token, which must be computed to
        produce logits. Also the key of the first full block that missed (None if none did).
        ``claim``: ``seq`` is being allocated (see ReservedPrefixes.match)."""
        if getattr(seq, "skip_prefix_cache", False):  # it needs every prompt token computed
            return [], None
        tokens = seq.all_token_ids
        limit = (len(tokens) - 1) // self.block_size
        hits = (
            self.reserved.match(seq.seq_id, tokens, limit, claim) if self.reserved.prefixes else []
        )
        if not self.enable_prefix_caching:
            return hits, None
        key = seq.cache_root
        for i in range(limit):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            key = block_key(key, chunk)
            if i < len(hits):
                continue  # a reserved block: the chain of keys goes on past it
            block = self.device.lookup(key, chunk)
            if block is None:
                return hits, key
            hits.append(block)
        return hits, None

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether ``group``'s waiting sequences fit now (a group of several: _group_cost)."""
        seqs = group.live_seqs(SequenceStatus.WAITING)
        if not seqs:
            return AllocStatus.OK
        leader = seqs[0]
        total = cdiv(len(leader), self.block_size) if len(seqs) == 1 else self._group_cost(seqs)
        if total > self.device.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        hits, miss = self._walk_prefix(leader)
        if miss is not None and self._computing.get(miss, leader.seq_id) != leader.seq_id:
            return AllocStatus.SHARE_LATER
        # Hits on evictable blocks take them out of the free count too.
        needed = total - len(hits) + sum(1 for b in hits if self.device.ref_counts[b] == 0)
        if self.device.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq: Sequence) -> int:
        """Map ``seq``'s tokens to blocks; returns how many tokens were prefix-cache hits."""
        if seq.seq_id in self.tables:
            raise RuntimeError(f"sequence {seq.seq_id} already has a block table")
        hits = self._walk_prefix(seq, claim=True)[0]
        for block in hits:
            self.device.incref(block)
        table = list(hits)
        for _ in range(cdiv(len(seq), self.block_size) - len(hits)):
            table.append(self.device.allocate())
        self.tables[seq.seq_id] = table
        self._keys[seq.seq_id] = []
        hit_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            keys = self._chain_keys(seq, len(seq) // self.block_size)
            self._keys[seq.seq_id], pending = keys[: len(hits)], keys[len(hits) :]
            if pending:
                self._pending[seq.seq_id] = pending
                for key in pending:
                    self._computing.setdefault(key, seq.seq_id)
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += hit_tokens
        seq.num_computed_tokens = hit_tokens
        return hit_tokens

    def _chain_keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        keys: list[bytes] = []
        key = seq.cache_root
        for i in range(num_blocks):
            chunk = [seq.token_at(j) for j in range(i * self.block_size, (i + 1) * self.block_size)]
            key = block_key(key, chunk)
            keys.append(key)
        return keys

    # -- growth and copy-on-write -------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks ``ensure_slots(seq, num_new_tokens)`` would take (growth plus a
        copy-on-write of a shared block)."""
        table = self.tables[seq.seq_id]
        computed, size = seq.num_computed_tokens, self.block_size
        first = computed // size
        if computed + num_new_tokens <= len(table) * size and (
            first >= len(table) or self.device.ref_counts[table[first]] <= 1
        ):
            return 0  # in place, nothing shared (_needs_cow): most decode steps
        grow = max(0, cdiv(computed + num_new_tokens, size) - len(table))
        return grow + (1 if self._needs_cow(seq, table, first) else 0)

    def _needs_cow(self, seq: Sequence, table: list[int], first: int) -> bool:
        if first >= len(table) or self.device.ref_counts[table[first]] <= 1:
            return False
        filling = self._filling.get(seq.seq_id)
        if filling is None:
            return True
        if first < filling:
            return False
        del self._filling[seq.seq_id]  # the shared prefix is written: sharing is ordinary again
        return True

    def can_append_slots(self, demands: Iterable[tuple[Sequence, int]]) -> bool:
        return sum(self.blocks_needed(seq, n) for seq, n in demands) <= self.device.num_free

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give ``seq`` slots for its next ``num_new_tokens`` tokens.

        Returns the (src, dst) block copies needed first: only the block holding the first
        new token can be shared (full blocks are never written again), so at most one.
        """
        table = self.tables[seq.seq_id]
        copies: list[tuple[int, int]] = []
        first = seq.num_computed_tokens // self.block_size
        # The ref-count test first: it rules out a copy for most rows without the call.
        if (
            first < len(table)
            and self.device.ref_counts[table[first]] > 1
            and self._needs_cow(seq, table, first)
        ):
            src, dst = table[first], self.device.allocate()
            self.device.decref(src)
            table[first] = dst
            copies.append((src, dst))
            self.num_cow_copies += 1
        while len(table) * self.block_size < seq.num_computed_tokens + num_new_tokens:
            table.append(self.device.allocate())
        return copies

    def mark_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s newly completed full blocks in the prefix cache (and pin a
        reserved prefix that ``seq`` computes)."""
        if self.reserved.computing:
            self.reserved.computed(seq.seq_id, self.tables[seq.seq_id], seq.num_computed_tokens)
        if not self.enable_prefix_caching:
            return
        keys = self._keys[seq.seq_id]
        table = self.tables[seq.seq_id]
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        pending = self._pending.get(seq.seq_id)
        while len(keys) < full:
            i = len(keys)
            chunk = tuple(
                seq.token_at(j) for j in range(i * self.block_size, (i + 1) * self.block_size)
            )
            if pending:  # keyed at allocation, in order
                key = pending.pop(0)
                if self._computing.get(key) == seq.seq_id:
                    del self._computing[key]
            else:
                key = block_key(keys[-1] if keys else seq.cache_root, chunk)
            keys.append(key)
            self.device.register(table[i], key, chunk)

    # -- sharing ------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = self.tables[parent.seq_id]
        for block in table:
            self.device.incref(block)
        self.tables[child.seq_id] = list(table)
        self._keys[child.seq_id] = list(self._keys.get(parent.seq_id, []))

    def free(self, seq: Sequence) -> None:
        self._filling.pop(seq.seq_id, None)
        for key in self._pending.pop(seq.seq_id, ()):
            if self._computing.get(key) == seq.seq_id:
                del self._computing[key]
        if self.reserved.computing:
            self.reserved.forget(seq.seq_id)
        for pool, tables in ((self.device, self.tables), (self.cpu, self.cpu_tables)):
            for block in tables.pop(seq.seq_id, ()):
                pool.decref(block)
        self._keys.pop(seq.seq_id, None)

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    # -- accounting ---------------------------------------------------------------------
    def num_shared_blocks(self) -> int:
        return self.device.num_shared

    def num_logical_blocks(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def num_pinned_blocks(self) -> int:
        return self.reserved.num_pinned_blocks()

    def kv_usage(self, groups: list[SequenceGroup], max_model_len: int) -> KVUsage:
        """The groups' KV by slot kind (core/kv_waste.py): the blocks their tables reach
        are all the slots they hold."""
        held = table_waste(self.tables, groups, self.block_size, max_model_len)
        return KVUsage(held, held)

    def reset_prefix_cache(self) -> None:
        self.device.reset_prefix_cache()

    def check_no_leaks(self) -> None:
        """Raise unless no table is left and the only references are reserved-prefix pins."""
        if self.tables or self.cpu_tables:
            raise AssertionError(f"tables left: {list(self.tables)} {list(self.cpu_tables)}")
        if self._computing or self._pending:
            raise AssertionError(f"blocks still marked in computation: {len(self._computing)}")
        self.device.check_whole(self.reserved.pins())
        self.cpu.check_whole()


def create_block_manager(
    cache: CacheConfig, num_device_blocks: int, num_cpu_blocks: int, max_model_len: int
) -> BlockManager | ContiguousBlockManager:
    """The engine's block manager for ``cache.kv_allocation``: this one for "paged", else one
    of the paper's baselines, imported here only when a run asks for one (benchmark use) so
    that core never loads the laboratory."""
    if cache.kv_allocation == "paged":
        return BlockManager(
            cache.block_size, num_device_blocks, num_cpu_blocks, cache.enable_prefix_caching
        )
    from streamkv.baselines.contiguous import ContiguousBlockManager

    return ContiguousBlockManager(
        cache.kv_allocation, cache.block_size, num_device_blocks, num_cpu_blocks, max_model_len
    )
