"""Engine counters and time-averaged memory figures (the paper's utilization and sharing
metrics). Counters are exact; the memory figures walk every running sequence's block table,
O(blocks) Python work, so they are sampled every ``MEMORY_SAMPLE_EVERY`` steps (the first
step included) rather than on the step path every time.

KV waste (the paper's Fig 2): at each sample the block manager sorts the slots that requests
hold into token / reserved / internal / external (core/kv_waste.py); shares are averaged
over the sampled steps. Also averaged, over every step that ran something: the number of
requests batched together (the paper's Fig 13).

Per-step and per-request histograms (``RequestMetrics``) follow vLLM's definitions and ride
on the same pass over a step; the server exports them as ``vllm:*`` metrics
(entrypoints/server/metrics.py). The intervals of a request (vLLM's docs/design/metrics.md,
"Interval Calculations"):

    arrival ── queue ── first scheduled ── prefill ── first token ── decode ── finished
                        └──────────────────── inference ──────────────────────┘

"First scheduled" is the start of the first step that ran the request: a request
preempted later keeps it (its recomputation counts as inference time, not queueing).
"""

from __future__ import annotations

import bisect
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamkv.core.block_manager import BlockManager
from streamkv.core.kv_waste import WASTE_KINDS, KVWaste
from streamkv.core.scheduler import Scheduler
from streamkv.core.step_plan import SchedulerOutput
from streamkv.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from streamkv.baselines.contiguous import ContiguousBlockManager

# 256 sequences of 1k tokens are 16k table entries: a few ms of Python, against a decode step
# of ~10 ms on an H200 with CUDA graphs. Every 8th step keeps the average within reach.
MEMORY_SAMPLE_EVERY = 8


class EngineStats:
    def __init__(
        self,
        bm: BlockManager | ContiguousBlockManager,
        scheduler: Scheduler,
        max_model_len: int | None = None,
    ) -> None:
        self.bm, self.scheduler = bm, scheduler
        # None: final lengths are not capped by the context (tests without a config).
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.waste_share_sums = dict.fromkeys(WASTE_KINDS, 0.0)
        self.waste_samples = 0
        self.batched_requests_sum = 0
        self.batched_steps = 0
        self.peak_kv_blocks_used = 0
        self.steps = 0
        self._util_sum = 0.0
        self._util_steps = 0
        self._saving_sum = 0.0
        self._saving_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._first_sampled: weakref.WeakSet[Sequence] = weakref.WeakSet()  # record_step's
        # vLLM's per-step and per-request histograms (queue / prefill / decode times, ...).
        self.request_metrics = RequestMetrics(self.max_model_len)

    def record_step(self, sched: SchedulerOutput, started: float | None = None) -> None:
        """``started``: when the step began (time.monotonic()), the requests' first-scheduled
        time; None takes the time of this call."""
        self.steps += 1
        rm, start = self.request_metrics, started if started is not None else time.monotonic()
        # Generation tokens are sampled tokens, as vLLM counts them: a decode row's one, and
        # the first token a prompt's last chunk samples (its first_token_time is set by this
        # step's outputs, after ``start``; once per group: with async scheduling the next
        # step began before it was set). Everything else (prompts, chunks, recomputation)
        # is prompt work. The request metrics ride on this one pass (a step of 256 requests
        # is walked once).
        generated = prompt = requests = 0
        last_group = None
        for s in sched.scheduled:
            n, first = s.num_new_tokens, s.group.first_token_time
            if first is not None and first >= start and s.seq not in self._first_sampled:
                self._first_sampled.add(s.seq)
                prompt += n
                generated += 1
                rm.scheduled(s.group, start)
            elif n == 1 and s.seq.output_token_ids:
                generated += 1
            else:
                prompt += n
                rm.scheduled(s.group, start)  # a request's first step is prompt work
            if s.group is not last_group:  # a group's sequences are scheduled side by side
                requests += 1
                last_group = s.group
                if last_group.finished_time is not None:
                    rm.finished(last_group)
        if requests:
            self.batched_requests_sum += requests
            self.batched_steps += 1
        self.num_generation_tokens += generated
        self.num_prompt_tokens += prompt
        rm.iteration(prompt + generated)
        used = self.bm.device.num_used
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, used)
        if not self.bm.tables or (self.steps - 1) % MEMORY_SAMPLE_EVERY:
            return
        self._sample_memory()

    def _sample_memory(self) -> None:
        """The KV figures of this step, asked of the block manager."""
        usage = self.bm.kv_usage(self.scheduler.running, self.max_model_len)
        self._record_waste(usage.waste)
        held = usage.tables  # its slots: the distinct blocks the tables reach, whole
        if held.total:
            self._util_sum += held.token / held.total
            self._util_steps += 1
        logical = self.bm.num_logical_blocks()
        if logical:
            num_blocks = held.total // self.bm.block_size
            self._saving_sum += 1 - num_blocks / logical
            self._saving_steps += 1

    def _record_waste(self, waste: KVWaste) -> None:
        if waste.total == 0:
            return
        for kind, share in waste.shares().items():
            self.waste_share_sums[kind] += share
        self.waste_samples += 1

    def waste_shares(self) -> dict[str, float]:
        """Time-averaged share of the held KV memory of each kind (0s before any sample)."""
        n = self.waste_samples
        return {k: v / n if n else 0.0 for k, v in self.waste_share_sums.items()}

    def as_dict(self) -> dict:
        bm = self.bm
        shares = self.waste_shares()
        return {
            "num_kv_blocks": bm.device.num_blocks,
            "num_free_kv_blocks": bm.device.num_free,
            "num_swap_blocks": bm.cpu.num_blocks,
            "num_free_swap_blocks": bm.cpu.num_free,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped_out_blocks": self.scheduler.num_swapped_out_blocks,
            "num_swapped_in_blocks": self.scheduler.num_swapped_in_blocks,
            "peak_kv_blocks_used": self.peak_kv_blocks_used,
            "kv_utilization": self._util_sum / self._util_steps if self._util_steps else 0.0,
            "num_cow_copies": bm.num_cow_copies,
            "num_shared_blocks": bm.num_shared_blocks(),
            # Reserved prefixes' blocks, never evicted (core/reserved_prefix.py).
            "num_pinned_kv_blocks": bm.num_pinned_blocks(),
            "sharing_savings": self._saving_sum / self._saving_steps if self._saving_steps else 0.0,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "kv_allocation": bm.policy,
            **{f"kv_{kind}_share": shares[kind] for kind in WASTE_KINDS},
            # Raw sums and counts, so a client can average over its own window (differences).
            "kv_waste_share_sums": dict(self.waste_share_sums),
            "kv_waste_samples": self.waste_samples,
            "avg_batched_requests": self.batched_requests_sum / self.batched_steps
            if self.batched_steps
            else 0.0,
            "batched_requests_sum": self.batched_requests_sum,
            "batched_steps": self.batched_steps,
            "histograms": self.request_metrics.snapshot(),
        }


# -- vLLM's histograms ---------------------------------------------------------------------
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards built for vLLM read ours.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
TIMES = ("queue_time", "prefill_time", "decode_time", "inference_time")


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class Buckets:
    """A histogram's counts per bucket (the last one past every bound) and its sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # a bound is inclusive (le)
        self.total += value

    def snapshot(self) -> dict:
        return {"bounds": self.bounds, "counts": list(self.counts), "sum": self.total}


class RequestMetrics:
    def __init__(self, max_model_len: int) -> None:
        tokens = one_two_five(max_model_len)
        self.iteration_tokens = Buckets(ITERATION_TOKEN_BUCKETS)
        self.hists: dict[str, Buckets] = {name: Buckets(REQUEST_LATENCY_BUCKETS) for name in TIMES}
        self.hists.update(
            {
                name: Buckets(tokens)
                for name in ("prompt_tokens", "generation_tokens", "params_max_tokens")
            }
        )
        self.hists["params_n"] = Buckets(PARAMS_N_BUCKETS)
        # Aborted requests never finish here: a weak key lets them go with their group.
        self._first_scheduled: weakref.WeakKeyDictionary[SequenceGroup, float] = (
            weakref.WeakKeyDictionary()
        )
        self._counted: weakref.WeakSet[SequenceGroup] = weakref.WeakSet()

    def iteration(self, num_tokens: int) -> None:
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)

    def scheduled(self, group: SequenceGroup, started: float) -> None:
        """``group`` ran prompt work in a step that began at ``started`` (its first such
        step sets its first-scheduled time; recomputation after preemption does not)."""
        if group not in self._first_scheduled and group not in self._counted:
            self._first_scheduled[group] = started

    def finished(self, group: SequenceGroup) -> None:
        """``group`` has finished (its finished_time is set): counted once, however many
        steps still carry it (a step already in flight when it finished)."""
        scheduled = self._first_scheduled.pop(group, None)
        if scheduled is not None:
            self._counted.add(group)
            self._finish(group, scheduled)

    def _finish(self, group: SequenceGroup, scheduled: float) -> None:
        end = group.finished_time
        first_token = group.first_token_time or end
        h, params = self.hists, group.sampling_params
        h["queue_time"].observe(max(scheduled - group.arrival_time, 0.0))
        h["prefill_time"].observe(max(first_token - scheduled, 0.0))
        h["decode_time"].observe(max(end - first_token, 0.0))
        h["inference_time"].observe(max(end - scheduled, 0.0))
        h["prompt_tokens"].observe(len(group.seqs[0].prompt_token_ids))
        h["generation_tokens"].observe(sum(len(seq.output_token_ids) for seq in group.seqs))
        h["params_n"].observe(params.n)
        if params.max_tokens is not None:
            h["params_max_tokens"].observe(params.max_tokens)

    def snapshot(self) -> dict[str, dict]:
        return {
            "iteration_tokens": self.iteration_tokens.snapshot(),
            **{name: b.snapshot() for name, b in self.hists.items()},
        }
