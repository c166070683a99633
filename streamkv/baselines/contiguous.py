"""The paper's baselines: Orca-style contiguous KV reservations behind the BlockManager's
interface, so that a benchmark run (``--kv-allocation``) swaps the memory manager and keeps
everything else. At admission a request reserves one contiguous run of KV slots per sequence,
sized by the policy, and keeps it until it ends:

    orca-max     max_model_len slots
    orca-pow2    the next power of two of prompt + output (capped at max_model_len)
    orca-oracle  exactly prompt + output
    ft-max       max_model_len slots, and FasterTransformer-style request-level batching

"Output" is ``max_tokens`` (capped so the sequence fits max_model_len); the harness sends
``ignore_eos`` and the workload's true output length, so this *is* the oracle's knowledge. A
request that stops early leaves the rest of its run unused: internal fragmentation, as in Orca.

No new kernels: a run is the consecutive block ids ``[start, start + k)`` of the block pool,
and a table the prefix of its run reached so far, so the paged kernels read one contiguous
span. Runs are whole blocks (up to ``block_size - 1`` slots of rounding per sequence, counted
as internal fragmentation). Free space is a real first-fit allocator over block ids, so holes
between runs (external fragmentation) form as in any contiguous allocator.

Parallel sampling and beam search: a group reserves ``best_of`` runs at admission, as Orca
must. A forked child reads its parent's blocks until its first ``ensure_slots`` binds a spare
run and copies them into it (block copies, the copy-on-write path: they run before the
parent's next write). Reservations cover every token a request can reach, so the scheduler
never preempts for them and swapping is not offered.

Request-level batching (ft-max): a batch is the requests admitted while nothing else holds
memory; once any has computed a token, ``can_allocate`` answers LATER, and finished requests'
runs are kept (as a static batch's buffers are) until the whole batch has ended.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from streamkv.baselines.first_fit import FirstFitAllocator, Run
from streamkv.core.block_manager import AllocStatus
from streamkv.core.block_pool import BlockPool, NoFreeBlocksError, cdiv
from streamkv.core.kv_waste import KVUsage, KVWaste, final_len, table_waste
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus

ORCA_POLICIES = ("orca-max", "orca-pow2", "orca-oracle", "ft-max")


def reservation_slots(policy: str, final: int, max_model_len: int) -> int:
    if policy in ("orca-max", "ft-max"):
        return max(max_model_len, final)
    if policy == "orca-pow2":
        return min(1 << (final - 1).bit_length(), max(max_model_len, final))
    if policy == "orca-oracle":
        return final
    raise ValueError(f"unknown contiguous policy {policy!r}; expected one of {ORCA_POLICIES}")


@dataclass(slots=True)
class _Family:
    """The sequences of one request and the runs it reserved but has not bound yet."""

    run_blocks: int
    members: int = 0
    spares: list[Run] | None = None


class ContiguousBlockManager:
    enable_prefix_caching = False
    watermark_blocks = 0  # runs never grow, so no headroom is kept for growth

    def __init__(
        self,
        policy: str,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        max_model_len: int,
    ) -> None:
        reservation_slots(policy, 1, max_model_len)  # validates the policy name
        self.policy, self.block_size, self.max_model_len = policy, block_size, max_model_len
        self.request_batching = policy == "ft-max"
        self._batch_closed = False
        self._retired: list[Run] = []  # request batching: ended requests' runs, until it ends
        self.device = FirstFitAllocator(num_device_blocks)
        self.cpu = BlockPool(num_cpu_blocks)  # stays empty: see can_swap_out
        self.tables: dict[int, list[int]] = {}
        self.cpu_tables: dict[int, list[int]] = {}
        self.runs: dict[int, Run] = {}  # bound sequences
        self._family_of: dict[int, int] = {}
        self._families: dict[int, _Family] = {}
        self._unbound: set[int] = set()  # forked children still reading the parent's blocks
        self._plan: dict[int, tuple[int, int, int]] = {}  # seq -> (family, run blocks, spares)
        self.num_cow_copies = 0  # blocks copied into a forked child's own run
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    def reset_prefix_cache(self) -> None:
        """Nothing to forget: contiguous runs share no prompt prefixes."""

    # -- admission ----------------------------------------------------------------------
    def run_blocks_for(self, group: SequenceGroup) -> int:
        final = final_len(
            len(group.seqs[0].prompt_token_ids), group.sampling_params, self.max_model_len
        )
        return cdiv(reservation_slots(self.policy, final, self.max_model_len), self.block_size)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Plans the group's reservation (``allocate`` carries it out): one run per waiting
        sequence, plus spares up to ``best_of`` for the samples or beams it will fork."""
        seqs = group.live_seqs(SequenceStatus.WAITING)
        k = self.run_blocks_for(group)
        count = max(len(seqs), group.sampling_params.best_of or 1)
        if k * count > self.device.num_blocks:
            return AllocStatus.NEVER
        if self.request_batching and self._batch_closed and (self._families or self._retired):
            return AllocStatus.LATER
        family = seqs[0].seq_id
        for i, seq in enumerate(seqs):
            self._plan[seq.seq_id] = (family, k, count - len(seqs) if i == 0 else 0)
        return AllocStatus.OK if self.device.can_fit([k] * count) else AllocStatus.LATER

    def allocate(self, seq: Sequence) -> int:
        if seq.seq_id in self.tables:
            raise RuntimeError(f"sequence {seq.seq_id} already has a block table")
        family_id, k, spares = self._plan.pop(
            seq.seq_id, (seq.seq_id, cdiv(len(seq), self.block_size), 0)
        )
        if not self.device.can_fit([k] * (1 + spares)):
            raise NoFreeBlocksError(f"no room for {1 + spares} run(s) of {k} blocks")
        family = self._families.setdefault(family_id, _Family(k, spares=[]))
        run = self.device.allocate(k)
        family.spares.extend(self.device.allocate(k) for _ in range(spares))
        family.members += 1
        self._family_of[seq.seq_id] = family_id
        self.runs[seq.seq_id] = run
        self.tables[seq.seq_id] = run.blocks(cdiv(len(seq), self.block_size))
        seq.num_computed_tokens = 0
        return 0

    def allocate_group(self, seqs: list[Sequence]) -> int:
        """A group preempted by recompute comes back: contiguous runs cannot share, so each
        sequence gets its own run and recomputes all of its tokens (no shared tokens)."""
        for seq in seqs:
            self.allocate(seq)
        return 0

    # -- growth (within the run) and forks ----------------------------------------------
    def _family(self, seq: Sequence) -> _Family:
        return self._families[self._family_of[seq.seq_id]]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        if seq.seq_id in self._unbound:
            family = self._family(seq)
            return 0 if family.spares else family.run_blocks
        return 0

    def can_append_slots(self, demands: Iterable[tuple[Sequence, int]]) -> bool:
        spare: dict[int, int] = {}
        sizes = []
        for seq, _ in demands:
            if seq.seq_id not in self._unbound:
                continue
            fid = self._family_of[seq.seq_id]
            family = self._families[fid]
            spare.setdefault(fid, len(family.spares))
            if spare[fid]:
                spare[fid] -= 1
            else:
                sizes.append(family.run_blocks)
        return self.device.can_fit(sizes)

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        copies: list[tuple[int, int]] = []
        if seq.seq_id in self._unbound:
            family = self._family(seq)
            run = family.spares.pop() if family.spares else self.device.allocate(family.run_blocks)
            view = self.tables[seq.seq_id]
            own = run.blocks(len(view))
            copies = [(src, dst) for src, dst in zip(view, own) if src != dst]
            self.num_cow_copies += len(copies)
            self.runs[seq.seq_id], self.tables[seq.seq_id] = run, own
            self._unbound.discard(seq.seq_id)
        if seq.num_computed_tokens:
            self._batch_closed = True
        run, table = self.runs[seq.seq_id], self.tables[seq.seq_id]
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        if need > run.num_blocks:
            raise RuntimeError(
                f"sequence {seq.seq_id} outgrew its reservation ({need} > {run.num_blocks} blocks)"
            )
        table.extend(range(run.start + len(table), run.start + need))
        return copies

    def mark_computed(self, seq: Sequence) -> None:
        return None  # no prefix cache

    def fork(self, parent: Sequence, child: Sequence) -> None:
        fid = self._family_of[parent.seq_id]
        self._family_of[child.seq_id] = fid
        self._families[fid].members += 1
        self.tables[child.seq_id] = list(self.tables[parent.seq_id])
        self._unbound.add(child.seq_id)

    def free(self, seq: Sequence) -> None:
        self._plan.pop(seq.seq_id, None)
        self.tables.pop(seq.seq_id, None)
        self._unbound.discard(seq.seq_id)
        fid = self._family_of.pop(seq.seq_id, None)
        if fid is None:
            return
        family = self._families[fid]
        family.members -= 1
        run = self.runs.pop(seq.seq_id, None)
        if run is not None:
            family.spares.append(run)  # a later fork of this request may bind it
        if family.members == 0:
            del self._families[fid]
            if self.request_batching:
                self._retired.extend(family.spares)
                if self._families:
                    return
                family.spares, self._retired = self._retired, []
                self._batch_closed = False
            for spare in family.spares:
                self.device.free(spare)

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    # -- no swapping: a reservation never needs to make room mid-request ----------------
    def can_swap_out(self, group: SequenceGroup) -> bool:
        return False

    can_swap_in = can_swap_out

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        raise RuntimeError("contiguous KV allocation does not swap")

    swap_in = swap_out

    # -- accounting ---------------------------------------------------------------------
    def spare_blocks(self) -> int:
        """Blocks reserved for sequences a request has yet to fork (or bind)."""
        return sum(r.num_blocks for f in self._families.values() for r in f.spares)

    def retired_blocks(self) -> int:
        """Request batching: blocks of ended requests held until their batch ends."""
        return sum(r.num_blocks for r in self._retired)

    def external_fragmentation_blocks(self) -> int:
        """Free blocks outside the largest hole: free, but too scattered for a run that
        the largest hole cannot take."""
        return self.device.num_free - self.device.largest_free

    def num_shared_blocks(self) -> int:
        return len({b for s in self._unbound for b in self.tables[s]})

    def num_pinned_blocks(self) -> int:
        return 0  # no reserved prefixes

    def kv_usage(self, groups: list[SequenceGroup], max_model_len: int) -> KVUsage:
        """The groups' KV by slot kind (core/kv_waste.py): the blocks their tables reach,
        and every slot this allocator holds or has made unusable."""
        held = table_waste(self.tables, groups, self.block_size, max_model_len)
        return KVUsage(held, self._waste(groups, max_model_len))

    def _waste(self, groups: list[SequenceGroup], max_model_len: int) -> KVWaste:
        """O(sequences): a run's slots split by arithmetic. A forked child not yet bound
        reads its parent's run; the run it will take is a spare, counted as reserved."""
        bs, w = self.block_size, KVWaste()
        for group in groups:
            for seq in group.seqs:
                run = self.runs.get(seq.seq_id)
                if run is None:
                    continue
                slots = run.num_blocks * bs
                final = final_len(len(seq.prompt_token_ids), group.sampling_params, max_model_len)
                written = min(final - 1, slots)
                w.token += seq.num_computed_tokens
                w.reserved += max(written - seq.num_computed_tokens, 0)
                w.internal += slots - max(written, seq.num_computed_tokens)
        w.reserved += self.spare_blocks() * bs
        w.internal += self.retired_blocks() * bs  # request batching: held by ended requests
        w.external = self.external_fragmentation_blocks() * bs
        return w

    def num_logical_blocks(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def check_no_leaks(self) -> None:
        if self.tables or self._families or self.runs or self._retired:
            raise AssertionError(
                f"tables left: {list(self.tables)}, families: {list(self._families)}"
            )
        self.device.check_whole()
        self.cpu.check_whole()
