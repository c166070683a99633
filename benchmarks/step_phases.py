"""Host time of an engine step's phases, for a benchmark to print beside its figure.

``PhaseClock`` wraps the methods that make up a step (schedule, build, submit, wait, output
processing, the grammar's accept and mask fills, the masks' attach, the sampler and its mask
step) with timers while it is installed, and counts their calls. Times are inclusive (a
sampler run inside an attach counts in both) and on the host: on a GPU, ``submit`` is the
launch and ``wait`` the time spent blocked on the device. The wrappers cost ~1 us a call,
which is why benchmarks install the clock only for a profiled run apart from the timed ones.
With ``sync_debug`` on CUDA it also counts the operations that synchronise the host with the
device (torch's sync debug mode), by the innermost streamkv line that made them.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections import Counter


def _targets():
    import streamkv.engine.llm_engine as le
    import streamkv.engine.step_pipeline as sp
    import streamkv.engine.structured as st
    import streamkv.layers.sampler as sm
    from streamkv.core.scheduler import Scheduler
    from streamkv.engine.output_processor import OutputProcessor
    from streamkv.engine.step_builder import StepBuilder
    from streamkv.executor.inprocess import InProcessExecutor
    from streamkv.worker.worker import LaunchedStep

    return [
        ("step", le.LLMEngine, "step"),
        ("schedule", Scheduler, "schedule"),
        ("build", StepBuilder, "build"),
        ("submit", InProcessExecutor, "submit"),
        ("wait", LaunchedStep, "result"),
        ("process", OutputProcessor, "apply"),
        ("accept", OutputProcessor, "_accept_structured"),
        ("mask bytes", st.SequenceGrammar, "mask_bytes"),
        ("batch fill", st.StructuredOutputManager, "fill_masks"),
        ("send masks", sp, "send_masks"),
        ("attach", LaunchedStep, "attach_masks"),
        ("sampler", sm.Sampler, "__call__"),
        ("mask apply", sm, "apply_token_masks"),
        ("new grammar", st.StructuredOutputManager, "new_grammar"),
    ]


# The grammar's own host work, disjoint phases: matcher advance of a step's structured rows
# (one native call, with the fill a completed grammar needs and those rows' stop checks), the
# builder's per-row fill for the wire, the batched fill of masks that
# follow a step, the sampler's mask step, and a request's new matcher.
GRAMMAR_PHASES = ("accept", "mask bytes", "batch fill", "mask apply", "new grammar")


class PhaseClock:
    def __init__(self, sync_debug: bool = False) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self._sync_debug = sync_debug
        self._saved: list[tuple[object, str, object]] = []
        self._warnings = None
        # One entry per engine step: (rows, tokens) of the schedule it made, its host
        # seconds and the seconds of it spent blocked on the device.
        self.timeline: list[tuple[int, int, float, float]] = []
        self._shape, self._wait = (0, 0), 0.0

    def __enter__(self) -> PhaseClock:
        for phase, owner, name in _targets():
            fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            self._saved.append((owner, name, fn))
            setattr(owner, name, self._timed(phase, fn))
        if self._sync_debug:
            import torch

            if torch.cuda.is_available():
                self._warnings = warnings.catch_warnings()
                self._warnings.__enter__()
                warnings.simplefilter("always")
                warnings.showwarning = self._record_sync
                torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
        if self._warnings is not None:
            import torch

            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            self._warnings = None

    def _timed(self, phase: str, fn):
        seconds, calls = self.seconds, self.calls

        def timed(*a, **kw):
            start = time.perf_counter()
            out = None
            try:
                out = fn(*a, **kw)
                return out
            finally:
                dt = time.perf_counter() - start
                seconds[phase] += dt
                calls[phase] += 1
                self._note(phase, out, dt)

        return timed

    def _note(self, phase: str, out, dt: float) -> None:
        if phase == "schedule" and out is not None:
            self._shape = (len(out.scheduled), out.num_batched_tokens)
        elif phase == "wait":
            self._wait += dt
        elif phase == "step":
            self.timeline.append((*self._shape, dt, self._wait))
            self._shape, self._wait = (0, 0), 0.0

    def timeline_report(self) -> list[dict]:
        """The steps binned by rows: how many, their host and blocked seconds, and how many
        never blocked (under 0.2 ms), the steps whose host work the device waited on."""
        edges = (1, 64, 128, 256, 512, 1024, 1 << 30)
        bins = []
        for lo, hi in zip(edges, edges[1:]):
            for prompt in (False, True):
                rows = [t for t in self.timeline if lo <= t[0] < hi and (t[1] > t[0]) == prompt]
                if rows:
                    bins.append(
                        {
                            "rows": f"{lo}-{hi - 1}" if hi < 1 << 30 else f">={lo}",
                            "prompt": prompt,
                            "steps": len(rows),
                            "step_s": round(sum(t[2] for t in rows), 4),
                            "wait_s": round(sum(t[3] for t in rows), 4),
                            "unblocked": sum(t[3] < 2e-4 for t in rows),
                        }
                    )
        return bins

    def _record_sync(self, message, category, filename, lineno, file=None, line=None) -> None:
        frames = [
            f
            for f in traceback.extract_stack()
            if "/streamkv/" in f.filename and "step_phases" not in f.filename
        ]
        where = (
            f"{frames[-1].filename.rsplit('/streamkv/', 1)[-1]}:{frames[-1].lineno}"
            if frames
            else filename
        )
        self.syncs[where] += 1

    def grammar_seconds(self) -> float:
        return sum(self.seconds[p] for p in GRAMMAR_PHASES)

    def report(self, steps: int) -> dict:
        """Per phase: total ms, calls, and ms per engine step."""
        return {
            phase: {
                "ms": round(1e3 * s, 3),
                "calls": self.calls[phase],
                "ms_per_step": round(1e3 * s / max(steps, 1), 4),
            }
            for phase, s in self.seconds.items()
        }


def print_report(
    title: str,
    report: dict,
    steps: int,
    syncs: Counter | None = None,
    timeline: list[dict] | None = None,
) -> None:
    print(f"\n{title}: host time by phase over {steps} engine steps (inclusive)")
    print(f"{'phase':<12}{'ms':>10}{'calls':>8}{'ms/step':>10}")
    for phase, r in report.items():
        print(f"{phase:<12}{r['ms']:>10.2f}{r['calls']:>8}{r['ms_per_step']:>10.3f}")
    if timeline:
        print(f"\n{'rows':<10}{'prompt':>7}{'steps':>7}{'host s':>9}{'wait s':>9}{'unblocked':>10}")
        for b in timeline:
            print(
                f"{b['rows']:<10}{'yes' if b['prompt'] else 'no':>7}{b['steps']:>7}"
                f"{b['step_s'] - b['wait_s']:>9.3f}{b['wait_s']:>9.3f}{b['unblocked']:>10}"
            )
    if syncs:
        print(
            "host-device syncs: " + ", ".join(f"{where} x{n}" for where, n in syncs.most_common(8))
        )
