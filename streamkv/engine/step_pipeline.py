"""Async scheduling: which steps the next one may overlap, and the record of a step handed
to the executor whose outputs are not processed yet.

While step N runs on the device, the engine schedules and submits step N+1, then processes
step N's outputs while N+1 runs (LLMEngine.step). Step N+1 is planned as if the tokens that
step N is sampling were known: each has a placeholder (Sequence.add_pending), and the worker
takes the real token on the device from step N's samples (worker/model_runner.py). That is
only right when nothing the host decides between the two steps changes N+1's inputs, which
``overlappable`` checks; any other step runs synchronously (N's outputs first, then N+1).

Structured outputs: the host decides one thing between the steps, a structured row's token
mask for N+1, which depends on the token N samples for it. But the mask is needed only at
N+1's sampling, not at its forward pass. So N+1 is submitted with ``MASK_FOLLOWS`` for such
rows (messages.py). Once N's outputs are processed (the matchers have accepted N's tokens),
``send_masks`` fills every such row's mask in one batched xgrammar call (one thread:
structured.FILL_THREADS; straight into the pinned buffer the sampler uploads,
layers/mask_staging.py) and hands them to N+1's handle; the worker samples N+1 while the
host schedules N+2 (the default on a GPU, SchedulerConfig.overlap_structured):

    host:    submit N+1 (forward) | wait N | process N | N+1's masks | schedule N+2 ...
    device:  -- N --|-- N+1 forward -----------------------|-- N+1 sample --|-- N+2 ...

What was measured on the H200 (docs/benchmarks.md, "Structured outputs"): xgrammar's thread pool
(8 threads) made a step's fill ~1.6 ms slower than one thread, which is why this path once
ran 0.48x of unconstrained; filling on a Python thread of ours while the engine schedules
and builds N+2 (the native fill releases the GIL) was no faster than filling in place
(0.71x against 0.72x), the thread's wake-ups costing what the overlap saved.

That needs a handle with ``attach_masks`` (the in-process executor's); with any other, a
step that samples a structured row runs synchronously. A structured row that ends in N
(its grammar, EOS, a stop) gets no mask: its N+1 sample is discarded like any other.

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
from typing import Protocol

from streamkv.core.scheduler import SchedulerOutput
from streamkv.executor.base import StepHandle
from streamkv.messages import MASK_FOLLOWS, StepFailed, StepInput
from streamkv.sequence import Sequence, SequenceGroup


def simple(group: SequenceGroup, seq: Sequence, masks_follow: bool = False) -> bool:
    """Whether ``seq``'s next input is exactly the token it samples now, with no decision of
    the host in between: not beam search (the engine picks each beam's token among the
    candidates and forks), not the first sample of an n > 1 / best_of > 1 request (it forks
    the sequence), and structured outputs only when the next step's token masks may follow
    it (``masks_follow``: the mask is computed on the host from this token)."""
    p = group.sampling_params
    if p.use_beam_search or (p.structured_outputs is not None and not masks_follow):
        return False
    return not (p.best_of > 1 and not seq.output_token_ids)


def overlappable(sched: SchedulerOutput, handle: StepHandle | None = None) -> bool:
    """Whether the step after ``sched`` may be scheduled before ``sched``'s samples are read:
    every sequence it samples is ``simple``, where structured rows are when the executor
    that ran ``sched`` (its ``handle``) takes a step's token masks after the step. Call
    before the step's tokens are counted as computed (``do_sample`` reads the computed count)."""
    follow = accepts_masks(handle)
    return all(simple(s.group, s.seq, follow) for s in sched.scheduled if s.do_sample)


def accepts_masks(handle: StepHandle | None) -> bool:
    """Whether ``handle``'s executor takes a step's token masks after the step: the handle
    has ``attach_masks(masks)`` (an optional method; see ``attach_masks`` below)."""
    return handle is not None and hasattr(handle, "attach_masks")


def masks_due(sched: SchedulerOutput, step: StepInput) -> list[Sequence] | None:
    """The sequences of a built step whose token masks follow it (StepBuilder sends one
    SeqStep per scheduled sequence, in order); None when there are none."""
    due = [s.seq for s, item in zip(sched.scheduled, step.seqs, strict=True) if item.token_mask == MASK_FOLLOWS]
    return due or None


@dataclass(slots=True)
class InFlight:
    """A scheduled step, submitted unless it was empty, whose outputs are not processed yet."""

    sched: SchedulerOutput
    started: float  # time.monotonic() when it was scheduled (request metrics)
    overlaps: bool = False  # the next step may be scheduled before this one's outputs
    handle: StepHandle | None = None  # None: nothing to run
    error: StepFailed | None = None  # the executor refused it at submit
    advanced: bool = False  # OutputProcessor.advance ran for it
    masks_due: list[Sequence] | None = None  # structured rows whose token masks follow (None: none, or sent)

    @property
    def live(self) -> bool:
        """Whether its outputs still matter: a sequence it runs has not ended, or it ends a
        request with an error."""
        return bool(self.sched.failed) or any(not s.seq.status.finished for s in self.sched.scheduled)


class MaskSource(Protocol):
    """What fills masks (engine/structured.py's StructuredOutputManager)."""

    def fill_masks(self, grammars: list) -> list: ...


def send_masks(step: InFlight, source: MaskSource) -> None:
    """Hand ``step`` the token masks of its rows that follow it, now that the step before is
    processed (each row's matcher has taken its input token), so that its sampler runs:
    before the next step is submitted and before this one's result is read. A row whose
    sequence has ended gets none: its sample is discarded. A failure ends the step's
    requests when it is completed."""
    if step.masks_due is None:
        return
    due = [seq for seq in step.masks_due if not seq.status.finished]
    step.masks_due = None
    words = source.fill_masks([seq.grammar for seq in due])
    try:
        step.handle.attach_masks({seq.seq_id: words[i] for i, seq in enumerate(due)})
    except StepFailed as e:
        step.error, step.overlaps = e, False
