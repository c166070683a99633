"""Per-step and per-request histograms under vLLM's definitions, counted on the engine
thread (where the schedule and finish times are) and published with ``stats()``; the
server exports them as ``vllm:*`` metrics (entrypoints/server/metrics.py).

The intervals of a request (vLLM's docs/design/metrics.md, "Interval Calculations"):

    arrival ── queue ── first scheduled ── prefill ── first token ── decode ── finished
                        └──────────────────── inference ──────────────────────┘

"First scheduled" is the start of the first step that ran the request: a request
preempted later keeps it (its recomputation counts as inference time, not queueing).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field

from streamkv.sequence import SequenceGroup

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards built for vLLM read ours.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
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
