"""Async scheduling: which steps the next one may overlap, and the record of a step handed
to the executor whose outputs are not processed yet.

While step N runs on the device, the engine schedules and submits step N+1, then processes
step N's outputs while N+1 runs (LLMEngine.step). Step N+1 is planned as if the tokens that
step N is sampling were known: each has a placeholder (Sequence.add_pending), and the worker
takes the real token on the device from step N's samples (worker/model_runner.py). That is
only right when nothing the host decides between the two steps changes N+1's inputs, which
``overlappable`` checks; any other step runs synchronously (N's outputs first, then N+1).

Why a sequence that ends in step N may run in N+1 harmlessly: its N+1 output is discarded
(OutputProcessor.process skips finished sequences), and its blocks are freed on the host
when N's outputs are processed, while N+1 may still write one slot of it. Every later use
of a freed block is a later step, which the device runs after N+1 (one stream, in order):
a new owner writes its slots before it reads them, and the one slot N+1 writes lies in a
block that the prefix cache never registered (only blocks of computed, known tokens are
registered), so no cache hit can read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamkv.core.scheduler import SchedulerOutput
from streamkv.executor.base import StepHandle
from streamkv.messages import StepFailed
from streamkv.sequence import Sequence, SequenceGroup


def simple(group: SequenceGroup, seq: Sequence) -> bool:
    """Whether ``seq``'s next input is exactly the token it samples now, with no decision of
    the host in between: not beam search (the engine picks each beam's token among the
    candidates and forks), not the first sample of an n > 1 / best_of > 1 request (it forks
    the sequence), not structured outputs (the next token mask is computed on the host from
    this token)."""
    p = group.sampling_params
    if p.use_beam_search or p.structured_outputs is not None:
        return False
    return not (p.best_of > 1 and not seq.output_token_ids)


def overlappable(sched: SchedulerOutput) -> bool:
    """Whether the step after ``sched`` may be scheduled before ``sched``'s samples are read:
    every sequence it samples is ``simple``. Call before the step's tokens are counted as
    computed (``do_sample`` reads the computed count)."""
    return all(simple(s.group, s.seq) for s in sched.scheduled if s.do_sample)


@dataclass(slots=True)
class InFlight:
    """A scheduled step, submitted unless it was empty, whose outputs are not processed yet."""

    sched: SchedulerOutput
    started: float  # time.monotonic() when it was scheduled (request metrics)
    overlaps: bool = False  # the next step may be scheduled before this one's outputs
    handle: StepHandle | None = None  # None: nothing to run
    error: StepFailed | None = None  # the executor refused it at submit
    submitted: float = 0.0  # time.perf_counter() at submit
    advanced: bool = False  # OutputProcessor.advance ran for it

    @property
    def live(self) -> bool:
        """Whether its outputs still matter: a sequence it runs has not ended, or it ends a
        request with an error."""
        return bool(self.sched.failed) or any(not s.seq.status.finished for s in self.sched.scheduled)
