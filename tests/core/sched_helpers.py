"""Small helpers for the scheduler's unit tests: requests, a block manager, a scheduler, and a
model-free step loop that plays the engine's part (advance computed counts, sample a token
where the scheduler says so, fork a prompt's parallel samples, end at max_tokens)."""

from __future__ import annotations

import itertools

from streamkv.config import SchedulerConfig
from streamkv.core.block_manager import BlockManager
from streamkv.core.scheduler import Scheduler
from streamkv.core.step_plan import SchedulerOutput
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus


def make_bm(
    num_blocks: int = 16, block_size: int = 4, cpu_blocks: int = 0, caching: bool = False
) -> BlockManager:
    return BlockManager(
        block_size, num_blocks, cpu_blocks, enable_prefix_caching=caching, watermark=0.0
    )


def make_scheduler(
    bm: BlockManager, budget: int = 64, max_num_seqs: int = 8, mode: str = "auto"
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, preemption_mode=mode
    )
    config.verify()
    return Scheduler(config, bm)


class Sim:
    """The engine's bookkeeping around ``Scheduler.schedule`` without a model: every sampled
    token is ``7``, and a prompt of a ``best_of`` > 1 request forks into its samples."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler
        self.bm = scheduler.bm
        self._ids = itertools.count(10_000)
        self._arrival = itertools.count()
        self.finished: dict[str, SequenceGroup] = {}
        self.steps = 0

    def add(
        self,
        rid: str,
        prompt_len: int,
        max_tokens: int = 4,
        n: int = 1,
        token: int = 1,
        prompt: list[int] | None = None,
    ) -> SequenceGroup:
        ids = prompt if prompt is not None else [token + i % 5 for i in range(prompt_len)]
        params = SamplingParams(
            n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=max_tokens, ignore_eos=True
        )
        group = SequenceGroup(
            rid, [Sequence(next(self._ids), ids)], params, arrival_time=float(next(self._arrival))
        )
        self.sched.add(group)
        return group

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.steps += 1
        for s in out.scheduled:
            seq, group = s.seq, s.group
            sample = s.do_sample
            seq.num_computed_tokens += s.num_new_tokens
            self.bm.mark_computed(seq)
            if not sample or seq.status.finished:
                continue
            p = group.sampling_params
            if not seq.output_token_ids and len(group.seqs) == 1:
                for j in range(1, p.best_of):
                    child = seq.fork(next(self._ids), sample_index=j)
                    self.bm.fork(seq, child)
                    group.seqs.append(child)
                    self._append(group, child, 7 + j)
            self._append(group, seq, 7)
        self.sched.free_finished_seqs()
        for group in [*{id(s.group): s.group for s in out.scheduled}.values(), *out.failed]:
            if group.finished:
                self.finished[group.request_id] = group
        return out

    def _append(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        seq.append_token(token, -1.0, None)
        if len(seq.output_token_ids) >= group.sampling_params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH

    def run(self, max_steps: int = 10_000, on_step=None) -> None:
        while self.sched.has_unfinished():
            if self.steps >= max_steps:
                raise AssertionError(
                    f"no drain after {max_steps} steps: waiting "
                    f"{[g.request_id for g in self.sched.waiting]}, running "
                    f"{[g.request_id for g in self.sched.running]}"
                )
            if on_step is not None:
                on_step(self)
            self.step()


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, sequence id, tokens) for every scheduled sequence, in order."""
    return [(s.group.request_id, s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def per_request(out: SchedulerOutput) -> dict[str, int]:
    tokens: dict[str, int] = {}
    for s in out.scheduled:
        tokens[s.group.request_id] = tokens.get(s.group.request_id, 0) + s.num_new_tokens
    return tokens
