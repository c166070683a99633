"""Iteration-level FCFS scheduler: chunked prefill under one token budget, all-or-nothing
preemption (swap or recompute).

There are no prefill and decode phases, only sequences whose computed tokens catch up with
their length. Each step has one token budget (``max_num_batched_tokens``), spent in order:

1. running groups that decode (one token per sequence), oldest first;
2. running groups still computing their prompt, oldest first, each taking a chunk of what is
   left, so a long prompt is split across steps and decodes never wait behind it whole;
3. swapped groups, resumed before any new admission;
4. waiting groups, FCFS, whose prompts take the rest of the budget (again as chunks).

When a running group cannot get its slots, the newest group not yet scheduled this step is
preempted whole (or the group itself, when none is left); nothing new is admitted in a step
that preempted.

``auto`` preempts by swap or recompute, whichever a cost model measured per device says is
cheaper (core/preemption.py). A group of several sequences (samples, beams) keeps its sharing:
swapped, a block shared inside it moves once; recomputed (``allocate_group``), its first
sequence recomputes their shared prefix while the others wait a step, so its cost at
re-admission counts shared blocks once (issue 11: costed apart, it waited forever).

Progress guarantee: a step that schedules nothing, swaps nothing and preempts nothing while
requests remain ends one request with an error (the head of the waiting queue when nothing
runs), so ``LLM.generate`` can never loop without progress.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from streamkv.config import SchedulerConfig
from streamkv.core.block_manager import AllocStatus, BlockManager
from streamkv.core.preemption import auto_mode, load_costs
from streamkv.core.step_plan import ScheduledSeq, SchedulerOutput, decode_rows, demands
from streamkv.sequence import SequenceGroup, SequenceStatus

_arrival = attrgetter("arrival_time")  # the FCFS order key (a C call, not a lambda per group)
_TOO_BIG = "the request needs more KV-cache blocks than the whole pool has"
_NEVER_FITS = (
    "the request can never be admitted: it does not fit the empty KV-cache pool within "
    "max_num_seqs and the token budget"
)
_STUCK = (
    "the scheduler could not make progress with this request (its blocks cannot be brought "
    "back within the pool)"
)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config, self.bm = config, block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0
        self.preemption_costs = load_costs(config.preemption_cost_profile)
        # Preempted by the last schedule(): one may still finish by the step in flight (async).
        self._preempted: list[SequenceGroup] = []

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

    def finish_group(
        self, group: SequenceGroup, status: SequenceStatus, error: str | None = None
    ) -> None:
        for seq in group.seqs:
            if not seq.status.finished:
                seq.status = status
            self.bm.free(seq)
        if error is not None:
            group.error = error

    def free_finished_seqs(self) -> None:
        """Drop finished sequences' blocks and finished groups from the running list."""
        still = []
        free = self.bm.free
        for group in self.running:
            seqs = group.seqs
            if len(seqs) == 1:  # the common case, without the loops (per group per step)
                if seqs[0].status.finished:
                    free(seqs[0])
                else:
                    still.append(group)
                continue
            for seq in seqs:
                if seq.status.finished:
                    free(seq)
            if not group.finished:
                still.append(group)
        self.running = still
        for group in self._preempted:
            if group.finished:
                queue = self.waiting if group in self.waiting else self.swapped
                if group in queue:
                    queue.remove(group)
                    self.finish_group(group, SequenceStatus.FINISHED_STOPPED)
        self._preempted = []

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._preempted = []
        budget, num_seqs = self._schedule_running(out)
        if out.num_preempted == 0:
            budget, num_seqs = self._resume_swapped(out, budget, num_seqs)
        if out.num_preempted == 0 and not self.swapped:
            self._admit_waiting(out, budget, num_seqs)
        self.running.sort(key=lambda g: g.arrival_time)
        idle = not (out.scheduled or out.swap_in or out.failed or out.num_preempted)
        if idle and self.has_unfinished() and not self._awaiting_step():
            self._no_progress(out)
        return out

    def _awaiting_step(self) -> bool:
        """Async scheduling: a running sequence awaits the token the step in flight samples for
        it, so that step's outputs will change what can run: an empty step now is no stall."""
        return any(
            s.num_uncomputed_tokens == 0 or s.has_pending
            for g in self.running
            for s in g.seqs
            if s.status is SequenceStatus.RUNNING
        )

    def _schedule_running(self, out: SchedulerOutput) -> tuple[int, int]:
        num_seqs, bm, max_seqs = 0, self.bm, self.config.max_num_seqs
        decodes, prefills = [], []
        for group in sorted(self.running, key=_arrival):
            (prefills if decode_rows(group) is None else decodes).append(group)
        budget = self.config.token_budget
        queue = decodes + prefills
        running = self.running = []
        scheduled, i = out.scheduled, 0
        while i < len(queue):
            group = queue[i]
            i += 1
            seqs = group.seqs
            if len(seqs) == 1 and seqs[0].status is SequenceStatus.RUNNING:
                # The common case, one running sequence: the general path below without its
                # lists. It falls through to that path only to preempt.
                seq = seqs[0]
                computed, n_prompt = seq.num_computed_tokens, len(seq.prompt_token_ids)
                n = min(n_prompt + len(seq.output_token_ids) + seq.num_pending - computed, budget)
                if n <= 0 or num_seqs >= max_seqs:
                    running.append(group)
                    continue
                need = bm.blocks_needed(seq, n)
                if not need or need <= bm.device.num_free:
                    # _schedule_group for one sequence, inline (per row per step).
                    copies = bm.ensure_slots(seq, n)
                    if copies:
                        out.copies.extend(copies)
                    scheduled.append(ScheduledSeq(group, seq, n))
                    if n == 1 and computed >= n_prompt:
                        out.num_decodes += 1
                    running.append(group)
                    budget -= n
                    num_seqs += 1
                    continue
            seqs = group.live_seqs(SequenceStatus.RUNNING)
            want = demands(group, seqs, budget)
            if want is None or num_seqs + len(seqs) > max_seqs:
                running.append(group)  # keeps its blocks; runs when the budget allows
                continue
            while not bm.can_append_slots(want):
                if i < len(queue):
                    newest = max(range(i, len(queue)), key=lambda k: queue[k].arrival_time)
                    victim = queue.pop(newest)
                else:
                    victim = group
                self._preempt(victim, out, alone=victim is group and not self.running)
                if victim is group:
                    break
            else:
                budget -= self._schedule_group(group, want, out)
                num_seqs += len(seqs)
        return budget, num_seqs

    def _schedule_group(self, group: SequenceGroup, want, out: SchedulerOutput) -> int:
        for seq, n in want:
            out.copies.extend(self.bm.ensure_slots(seq, n))
            out.scheduled.append(ScheduledSeq(group, seq, n))
            if n == 1 and seq.num_computed_tokens >= len(seq.prompt_token_ids):
                out.num_decodes += 1
        self.running.append(group)
        return sum(n for _, n in want)  # taken from the step's token budget

    def _resume_swapped(self, out: SchedulerOutput, budget: int, num_seqs: int) -> tuple[int, int]:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs(SequenceStatus.SWAPPED)
            if num_seqs + len(seqs) > self.config.max_num_seqs or not self.bm.can_swap_in(group):
                break
            want = demands(group, seqs, budget)
            if want is None:
                break
            self.swapped.popleft()
            mapping = self.bm.swap_in(group)
            out.swap_in.extend(mapping)
            self.num_swapped_in_blocks += len(mapping)
            budget -= self._schedule_group(group, want, out)
            num_seqs += len(seqs)
        return budget, num_seqs

    def _admit_waiting(self, out: SchedulerOutput, budget: int, num_seqs: int) -> None:
        # Requests whose next prompt block a running sequence is computing right now wait a
        # step and then map it (AllocStatus.SHARE_LATER): a burst that shares a system prompt
        # computes it once, whatever the arrival order. They keep their place in the queue.
        deferred: list[SequenceGroup] = []
        while self.waiting and budget > 0 and len(deferred) < self.config.max_num_seqs:
            group = self.waiting[0]
            status = self.bm.can_allocate(group)
            if status == AllocStatus.NEVER:
                self._fail(self.waiting.popleft(), out, _TOO_BIG)
                continue
            if status == AllocStatus.SHARE_LATER:
                deferred.append(self.waiting.popleft())
                continue
            seqs = group.live_seqs(SequenceStatus.WAITING)
            future_seqs = max(len(seqs), group.sampling_params.best_of or 1)
            if status == AllocStatus.LATER or num_seqs + future_seqs > self.config.max_num_seqs:
                break
            self.waiting.popleft()
            if len(seqs) == 1:
                self.bm.allocate(seqs[0])
                group.num_shared_tokens = 0
            else:
                group.num_shared_tokens = self.bm.allocate_group(seqs)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            want = demands(group, seqs, budget)
            if want is None:  # admitted; computes from the next step on
                self.running.append(group)
                break
            budget -= self._schedule_group(group, want, out)
            num_seqs += future_seqs
        self.waiting.extendleft(reversed(deferred))

    def _fail(self, group: SequenceGroup, out: SchedulerOutput, error: str) -> None:
        self.finish_group(group, SequenceStatus.FINISHED_ABORTED, error)
        out.failed.append(group)

    def _no_progress(self, out: SchedulerOutput) -> None:
        """Nothing could run this step and nothing will change by waiting: end one request
        with an error rather than repeat the same empty step forever."""
        if self.waiting and not self.running and not self.swapped:
            self._fail(self.waiting.popleft(), out, _NEVER_FITS)
            return
        queue = self.swapped or self.running
        if queue:
            group = queue[0]
            queue.remove(group)
            self._fail(group, out, _STUCK)

    # -- preemption ---------------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, alone: bool) -> None:
        seqs, bm = group.live_seqs(SequenceStatus.RUNNING), self.bm
        pool = bm.device.num_blocks - bm.watermark_blocks
        if alone and len({b for s in seqs for b in bm.tables[s.seq_id]}) + len(seqs) > pool:
            self._fail(group, out, _TOO_BIG)
            return
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = auto_mode(self.preemption_costs, self.bm, group, seqs)
        out.num_preempted += 1
        self._preempted.append(group)
        self.num_preemptions += 1
        group.num_preemptions += 1
        if mode == "swap" and self.bm.can_swap_out(group):
            mapping = self.bm.swap_out(group)
            out.swap_out.extend(mapping)
            self.num_swapped_out_blocks += len(mapping)
            self.swapped.appendleft(group)
            return
        # Recompute, also for "swap" when the CPU pool is full or absent (none by default on a
        # CPU): a request that can be recomputed is never dropped for want of swap space.
        for seq in seqs:
            self.bm.free(seq)
            seq.reset_for_recompute()
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)
