"""A rank's opt-in step profile (executor/rank.py builds one only when
``STREAMKV_PROFILE_DIR`` is set): apart from the rank's loop, which a plain run reads alone."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

DIR_ENV, STEPS_ENV = "STREAMKV_PROFILE_DIR", "STREAMKV_PROFILE_STEPS"
COLLECTIVE_MARKS = ("nccl", "gloo", "allreduce", "all_reduce", "allgather", "all_gather")


class StepProfiler:
    """Opt-in split of a rank's step time into collectives and the rest (issue 17's "compute /
    all-reduce / broadcast"): with ``STREAMKV_PROFILE_DIR`` set, every rank profiles steps
    ``[skip, skip + count)`` (``STREAMKV_PROFILE_STEPS=skip,count``, default 20,20) with
    torch.profiler and writes ``rank<r>.json`` there: wall time per step, time in collectives
    (NCCL kernels on a GPU; gloo / c10d ops on the CPU) per step, and the top collective ops.
    The broadcast's share is the engine's (MultiprocExecutor.ipc_stats: round trip minus rank
    0's time in the worker). Run eagerly (``--enforce-eager``) for the split: kernels replayed
    inside CUDA graphs are not all attributed.
    """

    def __init__(self, rank: int, out_dir: Path, skip: int, count: int) -> None:
        self.rank, self.out_dir, self.skip, self.count = rank, out_dir, skip, count
        self._seen, self._wall, self._prof = 0, 0.0, None

    @classmethod
    def from_env(cls, rank: int) -> StepProfiler | None:
        out = os.environ.get(DIR_ENV)
        if not out:
            return None
        skip, _, count = os.environ.get(STEPS_ENV, "20,20").partition(",")
        return cls(rank, Path(out), int(skip), int(count or 20))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        import torch

        if self._seen == self.skip:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._prof is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self._wall += time.perf_counter() - start
            self._seen += 1
            if self._prof is not None and self._seen == self.skip + self.count:
                self._prof.__exit__(None, None, None)
                self._write(self._prof)
                self._prof = None

    def _write(self, prof) -> None:
        on_device = any(e.device_type.name == "CUDA" for e in prof.key_averages())
        ops: dict[str, float] = {}
        total = 0.0
        for e in prof.key_averages():
            us = e.self_device_time_total if on_device else e.self_cpu_time_total
            total += us
            if any(m in e.key.lower() for m in COLLECTIVE_MARKS):
                ops[e.key] = ops.get(e.key, 0.0) + us
        n = self.count
        result = {
            "rank": self.rank,
            "steps": n,
            "clock": "device" if on_device else "cpu",
            "wall_ms_per_step": round(1e3 * self._wall / n, 3),
            "profiled_ms_per_step": round(total / 1e3 / n, 3),
            "collective_ms_per_step": round(sum(ops.values()) / 1e3 / n, 3),
            "collective_ops_ms_per_step": {
                k: round(v / 1e3 / n, 3) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:8]
            },
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{self.rank}.json").write_text(json.dumps(result, indent=2))
