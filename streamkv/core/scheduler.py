"""Iteration-level FCFS scheduler with all-or-nothing preemption (swap or recompute).

Every step: running groups keep going (oldest first); when one cannot get a slot, the
newest running group is preempted whole. Swapped groups resume before any waiting group is
admitted, and nothing new is admitted in a step that had to preempt.

``auto`` preemption: a group with one live sequence is recomputed (a re-prefill is cheap
and needs no CPU memory); a group with several (parallel samples, beams) is swapped, since
recomputing it would lose the blocks its sequences share. When the CPU pool has no room,
``auto`` falls back to recompute while ``swap`` aborts that group alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from streamkv.config import SchedulerConfig
from streamkv.core.block_manager import AllocStatus, BlockManager
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int

    @property
    def do_sample(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    failed: list[SequenceGroup] = field(default_factory=list)  # ended with an error
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_in or self.swap_out or self.copies)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # -- queues -------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str) -> SequenceGroup | None:
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self.finish_group(group, SequenceStatus.FINISHED_ABORTED)
                    return group
        return None

    def finish_group(self, group: SequenceGroup, status: SequenceStatus, error: str | None = None) -> None:
        for seq in group.seqs:
            if not seq.status.finished:
                seq.status = status
            self.bm.free(seq)
        if error is not None:
            group.error = error

    def free_finished_seqs(self) -> None:
        """Drop finished sequences' blocks and finished groups from the running list."""
        still = []
        for group in self.running:
            for seq in group.seqs:
                if seq.status.finished:
                    self.bm.free(seq)
            if not group.finished:
                still.append(group)
        self.running = still

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.token_budget
        num_seqs = 0
        queue = deque(sorted(self.running, key=lambda g: g.arrival_time))
        self.running = []
        bm, max_seqs = self.bm, self.config.max_num_seqs
        while queue:
            group = queue.popleft()
            seqs = group.seqs
            if len(seqs) == 1 and seqs[0].status is SequenceStatus.RUNNING:
                # The common case, one running sequence: the general path below without its
                # lists and generators. It falls through to that path only to preempt.
                seq = seqs[0]
                n = min(len(seq) - seq.num_computed_tokens, budget)
                if n <= 0 or num_seqs >= max_seqs:
                    self.running.append(group)
                    continue
                if bm.blocks_needed(seq, n) <= bm.device.num_free:
                    self._schedule_group(group, ((seq, n),), out)
                    budget -= n
                    num_seqs += 1
                    continue
            seqs = group.live_seqs(SequenceStatus.RUNNING)
            demands = self._demands(seqs, budget)
            if demands is None or num_seqs + len(seqs) > self.config.max_num_seqs:
                self.running.append(group)  # keeps its blocks; runs when the budget allows
                continue
            while not self.bm.can_append_slots(demands):
                victim = queue.pop() if queue else group
                self._preempt(victim, out, alone=not queue and not self.running)
                if victim is group:
                    break
            else:
                self._schedule_group(group, demands, out)
                budget -= sum(n for _, n in demands)
                num_seqs += len(seqs)

        if out.num_preempted == 0:
            budget, num_seqs = self._resume_swapped(out, budget, num_seqs)
        if out.num_preempted == 0 and not self.swapped:
            self._admit_waiting(out, budget, num_seqs)
        self.running.sort(key=lambda g: g.arrival_time)
        return out

    def _demands(self, seqs: list[Sequence], budget: int) -> list[tuple[Sequence, int]] | None:
        """Tokens each sequence computes this step, or None when the budget is spent."""
        demands = []
        for seq in seqs:
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                return None
            budget -= n
            demands.append((seq, n))
        return demands

    def _schedule_group(self, group: SequenceGroup, demands, out: SchedulerOutput) -> None:
        for seq, n in demands:
            out.copies.extend(self.bm.ensure_slots(seq, n))
            out.scheduled.append(ScheduledSeq(group, seq, n))
        self.running.append(group)

    def _resume_swapped(self, out: SchedulerOutput, budget: int, num_seqs: int) -> tuple[int, int]:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs(SequenceStatus.SWAPPED)
            if num_seqs + len(seqs) > self.config.max_num_seqs or not self.bm.can_swap_in(group):
                break
            demands = self._demands(seqs, budget)
            if demands is None:
                break
            self.swapped.popleft()
            mapping = self.bm.swap_in(group)
            out.swap_in.extend(mapping)
            self.num_swapped_in_blocks += len(mapping)
            self._schedule_group(group, demands, out)
            budget -= sum(n for _, n in demands)
            num_seqs += len(seqs)
        return budget, num_seqs

    def _admit_waiting(self, out: SchedulerOutput, budget: int, num_seqs: int) -> None:
        while self.waiting and budget > 0:
            group = self.waiting[0]
            error = self._infeasible(group)
            status = AllocStatus.NEVER if error else self.bm.can_allocate(group)
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                self.finish_group(
                    group,
                    SequenceStatus.FINISHED_ABORTED,
                    error or "the prompt needs more KV-cache blocks than the whole pool has",
                )
                out.failed.append(group)
                continue
            seqs = group.live_seqs(SequenceStatus.WAITING)
            future_seqs = max(len(seqs), group.sampling_params.best_of or 1)
            if status == AllocStatus.LATER or num_seqs + future_seqs > self.config.max_num_seqs:
                break
            self.waiting.popleft()
            for seq in seqs:
                self.bm.allocate(seq)
                seq.status = SequenceStatus.RUNNING
            demands = self._demands(seqs, budget)
            if demands is None:  # admitted; computes from the next step on
                self.running.append(group)
                break
            self._schedule_group(group, demands, out)
            budget -= sum(n for _, n in demands)
            num_seqs += future_seqs

    def _infeasible(self, group: SequenceGroup) -> str | None:
        longest = max(len(s) for s in group.live_seqs())
        if longest > self.config.max_model_len:
            return (
                f"the prompt has {longest} tokens, more than max_model_len "
                f"({self.config.max_model_len})"
            )
        return None

    # -- preemption ---------------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, alone: bool) -> None:
        seqs = group.live_seqs(SequenceStatus.RUNNING)
        if alone and self._needs_more_than_pool(seqs):
            self.finish_group(
                group,
                SequenceStatus.FINISHED_ABORTED,
                "the request needs more KV-cache blocks than the whole pool has",
            )
            out.failed.append(group)
            return
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "recompute" if len(seqs) == 1 else "swap"
            if mode == "swap" and not self.bm.can_swap_out(group):
                mode = "recompute"
        out.num_preempted += 1
        self.num_preemptions += 1
        group.num_preemptions += 1
        if mode == "recompute":
            for seq in seqs:
                self.bm.free(seq)
                seq.reset_for_recompute()
                seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(group)
        elif self.bm.can_swap_out(group):
            mapping = self.bm.swap_out(group)
            out.swap_out.extend(mapping)
            self.num_swapped_out_blocks += len(mapping)
            self.swapped.appendleft(group)
        else:
            self.finish_group(
                group, SequenceStatus.FINISHED_ABORTED, "preempted with no CPU swap space left"
            )
            out.failed.append(group)

    def _needs_more_than_pool(self, seqs: list[Sequence]) -> bool:
        blocks = len({b for s in seqs for b in self.bm.tables[s.seq_id]}) + len(seqs)
        return blocks > self.bm.device.num_blocks - self.bm.watermark_blocks
