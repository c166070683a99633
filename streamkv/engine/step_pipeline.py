"""Async scheduling: step N+1 is scheduled and submitted while step N runs, and N's outputs
are processed while N+1 runs. ``StepPipeline`` holds the step in flight between two calls
of LLMEngine.step; the plain step (schedule, execute, process) does not use it.

Step N+1 is planned as if the tokens that step N is sampling were known: each is counted
as pending (Sequence.num_pending) and sent as PENDING_TOKEN, and the worker takes the real
token on the device from step N's samples (worker/model_runner.py). That is only right
when nothing the host decides between the two steps changes N+1's inputs, which
``overlappable`` checks; any other step runs synchronously (N's outputs first, then N+1).

Structured outputs: the host decides one thing between the steps, a structured row's token
mask for N+1, which depends on the token N samples for it. But the mask is needed only at
N+1's sampling, not at its forward pass. So N+1 is submitted with ``MASK_FOLLOWS`` for such
rows (messages.py). Once N's outputs are processed (the matchers have accepted N's tokens),
``send_masks`` fills every such row's mask in one batched xgrammar call (one thread:
structured.FILL_THREADS; straight into the pinned buffer the sampler uploads,
layers/token_mask.py) and hands them to N+1's handle; the worker samples N+1 while the
host schedules N+2 (the default on a GPU, SchedulerConfig.overlap_structured):

    host:    submit N+1 (forward) | wait N | process N | N+1's masks | schedule N+2 ...
    device:  -- N --|-- N+1 forward -----------------------|-- N+1 sample --|-- N+2 ...

What was measured on the H200 (docs/benchmarks.md, "Structured outputs"): xgrammar's thread pool
(8 threads) made a step's fill ~1.6 ms slower than one thread, which is why this path once
ran 0.48x of unconstrained; filling on a Python thread of ours while the engine schedules
and builds N+2 (the native fill releases the GIL) was no faster than filling in place
(0.71x against 0.72x), the thread's wake-ups costing what the overlap saved.

That needs a handle that ``accepts_masks`` (StepHandle: the in-process executor's do); with
any other, a step that samples a structured row runs synchronously. A structured row that
ends in N (its grammar, EOS, a stop) gets no mask: its N+1 sample is discarded like any other.

Why a sequence that ends in step N may run in N+1 harmlessly: its N+1 output is discarded
(OutputProcessor.apply skips finished sequences), and its blocks are freed on the host
when N's outputs are processed, while N+1 may still write one slot of it. Every later use
of a freed block is a later step, which the device runs after N+1 (one stream, in order):
a new owner writes its slots before it reads them, and the one slot N+1 writes lies in a
block that the prefix cache never registered (only blocks of computed, known tokens are
registered), so no cache hit can read it.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Protocol

from streamkv.core.step_plan import SchedulerOutput
from streamkv.executor.base import StepHandle
from streamkv.messages import StepFailed
from streamkv.sequence import RequestOutput, Sequence, SequenceGroup


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
    follow = handle is not None and handle.accepts_masks
    return all(simple(s.group, s.seq, follow) for s in sched.scheduled if s.do_sample)


@dataclass(slots=True)
class InFlight:
    """A scheduled step, submitted unless it was empty, whose outputs are not processed yet."""

    sched: SchedulerOutput
    started: float  # time.monotonic() when it was scheduled (request metrics)
    handle: StepHandle | None = None  # None: nothing to run, or refused
    error: StepFailed | None = None  # the executor refused it (at submit, or its masks)

    @property
    def live(self) -> bool:
        """Whether its outputs still matter: a sequence it runs has not ended, or it ends a
        request with an error."""
        sched = self.sched
        return bool(sched.failed) or any(not s.seq.status.finished for s in sched.scheduled)


class MaskSource(Protocol):
    """What fills masks (engine/structured.py's StructuredOutputManager)."""

    def fill_masks(self, grammars: list) -> list: ...


Launch = Callable[[], InFlight]
Apply = Callable[[InFlight, bool], list[SequenceGroup]]
Build = Callable[[list[SequenceGroup], bool, Container[str]], list[RequestOutput]]
Advance = Callable[[SchedulerOutput, bool], None]
Emit = Callable[[list[RequestOutput]], None]


class StepPipeline:
    """The overlapped step: LLMEngine.step with async scheduling. Each call processes step N
    with step N+1 already submitted, and returns with N+1 in flight, as vLLM's batch queue
    and mini-sglang's overlap loop do. A step that is not ``overlappable``, and one whose
    successor has nothing to run, is processed in the same call, as the plain step does.

    An overlapped step's outputs are built in the next call, after N+2 is submitted: from
    N's samples to N+2's submission the host does only what planning N+2 needs (apply N's
    tokens and stop conditions, schedule, build N+2's input), so the device does not wait
    while every streaming request's output is built and handed to the server. The call
    hands them to ``emit`` as soon as they are built (the server's engine thread posts them
    to the event loop while the device runs N+1), or returns them.

    Its collaborators are the engine's: ``launch`` schedules a step and submits it,
    ``apply`` waits for a step's samples and applies them (advanced: its tokens were
    counted), returning the requests it touched, ``build`` makes their outputs,
    ``advance`` counts a step's tokens as computed (pending: and the tokens it samples as
    pending), and ``masks`` fills structured rows' token masks when ``masks_follow``
    (SchedulerConfig.overlap_structured)."""

    def __init__(
        self,
        launch: Launch,
        apply: Apply,
        build: Build,
        advance: Advance,
        masks: MaskSource,
        masks_follow: bool,
    ) -> None:
        self.launch, self.apply, self.build, self.advance = launch, apply, build, advance
        self.masks, self.masks_follow = masks, masks_follow
        self.inflight: InFlight | None = None
        self.applied: list[
            SequenceGroup
        ] = []  # touched by the step applied last; outputs not built
        self.overlapped_steps = 0  # steps whose successor was submitted before they were processed

    def step(
        self, finished_only: bool, unread: Container[str], emit: Emit | None = None
    ) -> list[RequestOutput]:
        current = self._take(finished_only, unread)
        if current is None:
            current = self.launch()
        if not self._overlaps(current):
            return self._built(finished_only, unread) + self._process(
                current, finished_only, unread, False
            )
        self.overlapped_steps += 1
        self.advance(current.sched, True)
        following = self.launch()
        if following.handle is None:  # refused, or nothing to run: no need to wait a step
            return (
                self._built(finished_only, unread)
                + self._process(current, finished_only, unread, True)
                + self._process(following, finished_only, unread, False)
            )
        due = self._masks_due(following)  # before ``apply`` makes the pending tokens known
        self.inflight = following
        # The step before's outputs, while the device runs this one.
        outputs = self._built(finished_only, unread)
        if emit is not None and outputs:
            emit(outputs)
            outputs = []
        self.applied = self.apply(current, True)
        if due:  # the matchers took this step's tokens
            send_masks(following, due, self.masks)
        return outputs

    def _process(
        self, step: InFlight, finished_only: bool, unread: Container[str], advanced: bool
    ) -> list[RequestOutput]:
        return self.build(self.apply(step, advanced), finished_only, unread)

    def _built(self, finished_only: bool, unread: Container[str]) -> list[RequestOutput]:
        """The outputs of the step applied in the call before (none if there is none)."""
        if not self.applied:
            return []
        touched, self.applied = self.applied, []
        return self.build(touched, finished_only, unread)

    def has_live_step(self) -> bool:
        """Whether a step is in flight whose outputs are still to be processed, or one was
        applied whose outputs are still to be built."""
        return bool(self.applied) or (self.inflight is not None and self.inflight.live)

    def drop(self) -> None:
        """Forget the step in flight (shutdown: its handle keeps device tensors alive)."""
        self.inflight = None
        self.applied = []

    def _take(self, finished_only: bool, unread: Container[str]) -> InFlight | None:
        """The step in flight, if its outputs still matter."""
        current, self.inflight = self.inflight, None
        if current is not None and not current.live:  # all it ran has ended: its outputs are void
            self.apply(current, False)
            return None
        return current

    def _overlaps(self, step: InFlight) -> bool:
        """Whether the step after ``step`` may be scheduled before ``step``'s outputs: only a
        step that computes something can change what the next one finds."""
        return (
            step.error is None
            and bool(step.sched.scheduled)
            and overlappable(step.sched, step.handle if self.masks_follow else None)
        )

    def _masks_due(self, step: InFlight) -> list[Sequence] | None:
        """The structured rows of a step just launched whose token masks follow it: those
        whose input token is pending (StepBuilder sends them ``MASK_FOLLOWS``)."""
        if not self.masks_follow:
            return None
        seqs = (s.seq for s in step.sched.scheduled)
        return [seq for seq in seqs if seq.grammar is not None and seq.num_pending] or None


def send_masks(step: InFlight, due: list[Sequence], source: MaskSource) -> None:
    """Hand ``step`` the token masks of its rows ``due``, now that the step before is
    processed (each row's matcher has taken its input token), so that its sampler runs
    before the next step is submitted. A row whose sequence has ended gets none: its sample
    is discarded. A failure ends the step's requests when it is processed."""
    due = [seq for seq in due if not seq.status.finished]
    words = source.fill_masks([seq.grammar for seq in due])
    try:
        step.handle.attach_masks({seq.seq_id: words[i] for i, seq in enumerate(due)})
    except StepFailed as e:
        step.error = e
