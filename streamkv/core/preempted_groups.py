"""The block manager's side of preemption, off a plain request's path: a group preempted by
swap moves between the device and CPU pools whole, and one preempted by recompute comes back
with its sharing kept. A mixin of BlockManager (core/block_manager.py), whose tables, pools
and per-sequence calls it works with: whole groups here, single sequences there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamkv.core.block_pool import cdiv
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from streamkv.core.block_pool import BlockPool


class PreemptedGroups:
    # The host's state this works on; it also calls the host's allocate and _chain_keys.
    block_size: int
    device: BlockPool
    cpu: BlockPool
    tables: dict[int, list[int]]
    cpu_tables: dict[int, list[int]]
    watermark_blocks: int
    enable_prefix_caching: bool
    _filling: dict[int, int]
    _keys: dict[int, list[bytes]]

    # -- recompute: re-admission with the shared prefix ----------------------------------
    def _group_cost(self, seqs: list[Sequence]) -> int:
        """The blocks ``allocate_group`` takes for a group of several (parallel samples or
        beams preempted by recompute): the prefix all its sequences share once, plus each
        one's own tail."""
        shared = self.shared_prefix_blocks(seqs)
        return sum(cdiv(len(s), self.block_size) for s in seqs) - shared * (len(seqs) - 1)

    def shared_prefix_blocks(self, seqs: list[Sequence]) -> int:
        """Full blocks of the token prefix that all of ``seqs`` have in common, leaving every
        sequence at least one token to compute (its logits are needed)."""
        first = seqs[0]
        common = min(len(s) for s in seqs) - 1
        for seq in seqs[1:]:
            if seq.prompt_token_ids != first.prompt_token_ids:
                return 0
            a, b = first.output_token_ids, seq.output_token_ids
            i = 0
            while i < len(a) and i < len(b) and a[i] == b[i]:
                i += 1
            common = min(common, len(first.prompt_token_ids) + i)
        return common // self.block_size

    def allocate_group(self, seqs: list[Sequence]) -> int:
        """Map a group preempted by recompute so that it keeps its sharing: the leader
        (``seqs[0]``) maps all its tokens; the others map the leader's blocks of their common
        prefix and only their own tails. Returns the shared tokens, which the others treat as
        computed: the scheduler lets the leader compute them before the others start."""
        shared = self.shared_prefix_blocks(seqs)
        self.allocate(seqs[0])
        if shared:
            self._filling[seqs[0].seq_id] = shared
        leader_table = self.tables[seqs[0].seq_id]
        for seq in seqs[1:]:
            if seq.seq_id in self.tables:
                raise RuntimeError(f"sequence {seq.seq_id} already has a block table")
            table = leader_table[:shared]
            for block in table:
                self.device.incref(block)
            for _ in range(cdiv(len(seq), self.block_size) - shared):
                table.append(self.device.allocate())
            self.tables[seq.seq_id] = table
            self._keys[seq.seq_id] = (
                self._chain_keys(seq, shared) if self.enable_prefix_caching else []
            )
            seq.num_computed_tokens = shared * self.block_size
        return shared * self.block_size

    # -- swap: whole groups ----------------------------------------------------------------
    def can_swap_out(self, group: SequenceGroup) -> bool:
        seqs = group.live_seqs(SequenceStatus.RUNNING)
        return len({b for s in seqs for b in self.tables[s.seq_id]}) <= self.cpu.num_free

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move every running sequence of ``group`` to the CPU pool; returns (device, cpu)."""
        src, dst = (self.device, self.tables), (self.cpu, self.cpu_tables)
        return self._move(group, SequenceStatus.RUNNING, SequenceStatus.SWAPPED, src, dst)

    def can_swap_in(self, group: SequenceGroup) -> bool:
        seqs = group.live_seqs(SequenceStatus.SWAPPED)
        needed = len({b for s in seqs for b in self.cpu_tables[s.seq_id]}) + len(seqs)
        return self.device.num_free - needed >= self.watermark_blocks

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Bring a swapped group back to the device pool; returns (cpu, device)."""
        src, dst = (self.cpu, self.cpu_tables), (self.device, self.tables)
        return self._move(group, SequenceStatus.SWAPPED, SequenceStatus.RUNNING, src, dst)

    def _move(self, group, from_status, to_status, src, dst) -> list[tuple[int, int]]:
        """Re-home a group's tables from one pool to the other. A block shared inside the
        group moves once and stays shared on the other side."""
        (src_pool, src_tables), (dst_pool, dst_tables) = src, dst
        mapping: dict[int, int] = {}
        for seq in group.live_seqs(from_status):
            table = []
            for block in src_tables.pop(seq.seq_id):
                if block not in mapping:
                    mapping[block] = dst_pool.allocate()
                else:
                    dst_pool.incref(mapping[block])
                table.append(mapping[block])
                src_pool.decref(block)
            dst_tables[seq.seq_id] = table
            seq.status = to_status
        return list(mapping.items())
