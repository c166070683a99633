"""StepPipeline (engine/step_pipeline.py) on its own: which steps it launches, advances and
processes, in what order, and what it leaves in flight, with stand-ins for the engine's
launch / process / advance. Then, through a real engine with a model-free executor, that
pending tokens are a count that never reaches a sequence's outputs."""

from __future__ import annotations

import itertools

from streamkv.core.step_plan import ScheduledSeq, SchedulerOutput
from streamkv.engine.llm_engine import LLMEngine
from streamkv.engine.step_pipeline import InFlight, StepPipeline
from streamkv.entrypoints.llm import engine_config
from streamkv.executor.base import DoneStep, Executor
from streamkv.messages import PENDING_TOKEN, SampleResult, StepFailed, StepInput, StepOutput
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count()


def _step(name: str, *, rows: int = 1, runs: bool = True, structured: bool = False) -> InFlight:
    """A launched step of ``rows`` running sequences that each sample (a decode row)."""
    sched = SchedulerOutput()
    for _ in range(rows):
        params = SamplingParams(temperature=0, max_tokens=8)
        if structured:
            params = SamplingParams(
                temperature=0, max_tokens=8, structured_outputs={"regex": "[0-9]+"}
            )
        seq = Sequence(
            next(_ids),
            [1, 2, 3],
            output_token_ids=[7],
            num_computed_tokens=3,
            status=SequenceStatus.RUNNING,
        )
        sched.scheduled.append(ScheduledSeq(SequenceGroup(name, [seq], params), seq, 1))
    return InFlight(sched, 0.0, handle=DoneStep(StepOutput()) if runs else None)


class _Engine:
    """The engine's side of the pipeline: a queue of steps to launch, and a log of calls."""

    def __init__(self, *steps: InFlight) -> None:
        self.queue = list(steps)
        self.log: list[tuple] = []

    def name(self, step: InFlight) -> str:
        return step.sched.scheduled[0].group.request_id if step.sched.scheduled else "empty"

    def launch(self) -> InFlight:
        step = self.queue.pop(0)
        self.log.append(("launch", self.name(step)))
        return step

    def apply(self, step: InFlight, advanced: bool) -> list:
        self.log.append(("apply", self.name(step), advanced))
        return [self.name(step)]

    def build(self, touched: list, finished_only: bool, unread) -> list:
        self.log.append(("build", *touched))
        return list(touched)

    def advance(self, sched: SchedulerOutput, pending: bool) -> None:
        self.log.append(("advance", sched.scheduled[0].group.request_id, pending))

    def fill_masks(self, grammars: list) -> list:
        self.log.append(("fill", len(grammars)))
        return [b"mask"] * len(grammars)


def _pipeline(engine: _Engine, masks_follow: bool = False) -> StepPipeline:
    return StepPipeline(
        engine.launch, engine.apply, engine.build, engine.advance, engine, masks_follow
    )


def test_each_call_applies_one_step_with_the_next_in_flight_and_builds_its_outputs_in_the_next():
    engine = _Engine(_step("a"), _step("b"), _step("c"))
    pipe = _pipeline(engine)
    assert pipe.step(False, ()) == []
    assert engine.log == [
        ("launch", "a"),
        ("advance", "a", True),
        ("launch", "b"),
        ("apply", "a", True),
    ]
    assert pipe.inflight is not None and pipe.has_live_step()
    engine.log.clear()
    # b was launched by the call before: this one only advances it and launches c, then
    # builds a's outputs (while b runs) before it waits for b and applies it.
    assert pipe.step(False, ()) == ["a"]
    assert engine.log == [
        ("advance", "b", True),
        ("launch", "c"),
        ("build", "a"),
        ("apply", "b", True),
    ]
    assert pipe.overlapped_steps == 2


def test_outputs_go_to_emit_before_the_wait_for_the_step_in_flight():
    engine = _Engine(_step("a"), _step("b"), _step("c"))
    pipe = _pipeline(engine)
    emitted = []
    pipe.step(False, (), emit=emitted.append)
    engine.log.clear()
    assert pipe.step(False, (), emit=lambda outs: emitted.append((outs, list(engine.log)))) == []
    assert emitted == [(["a"], [("advance", "b", True), ("launch", "c"), ("build", "a")])]
    assert engine.log[-1] == ("apply", "b", True)


def test_a_step_that_does_not_overlap_is_processed_alone():
    engine = _Engine(_step("beam"))
    engine.queue[0].sched.scheduled[0].group.sampling_params = SamplingParams(
        use_beam_search=True, best_of=2, n=2, temperature=0, max_tokens=4
    )
    pipe = _pipeline(engine)
    assert pipe.step(False, ()) == ["beam"]
    assert engine.log == [("launch", "beam"), ("apply", "beam", False), ("build", "beam")]
    assert pipe.inflight is None and pipe.overlapped_steps == 0


def test_outputs_left_to_build_come_first_from_a_step_that_does_not_overlap():
    beam = _step("beam")
    beam.sched.scheduled[0].group.sampling_params = SamplingParams(
        use_beam_search=True, best_of=2, n=2, temperature=0, max_tokens=4
    )
    engine = _Engine(_step("a"), _step("b"), beam)
    pipe = _pipeline(engine)
    pipe.step(False, ())  # a applied, b in flight
    pipe.inflight.sched.scheduled[0].group.sampling_params = beam.sched.scheduled[
        0
    ].group.sampling_params
    assert pipe.has_live_step()
    engine.log.clear()
    assert pipe.step(False, ()) == ["a", "b"]
    assert engine.log == [("build", "a"), ("apply", "b", False), ("build", "b")]
    assert not pipe.has_live_step()


def test_a_successor_with_nothing_to_run_is_processed_at_once():
    engine = _Engine(_step("a"), InFlight(SchedulerOutput(), 0.0))
    pipe = _pipeline(engine)
    assert pipe.step(False, ()) == ["a", "empty"]
    assert engine.log[-4:] == [
        ("apply", "a", True),
        ("build", "a"),
        ("apply", "empty", False),
        ("build", "empty"),
    ]
    assert pipe.inflight is None


def test_a_successor_refused_at_submit_is_processed_at_once():
    refused = _step("b", runs=False)
    refused.error = StepFailed("refused")
    engine = _Engine(_step("a"), refused)
    pipe = _pipeline(engine)
    assert pipe.step(False, ()) == ["a", "b"]
    assert pipe.inflight is None


def test_a_step_in_flight_whose_sequences_ended_is_processed_and_replaced():
    engine = _Engine(_step("a"), _step("b"), _step("c"), _step("d"))
    pipe = _pipeline(engine)
    pipe.step(False, ())
    pipe.inflight.sched.scheduled[0].seq.status = SequenceStatus.FINISHED_ABORTED
    assert pipe.has_live_step()  # a's outputs are still to build
    engine.log.clear()
    assert pipe.step(False, ()) == ["a"]
    assert engine.log == [
        ("apply", "b", False),
        ("launch", "c"),
        ("advance", "c", True),
        ("launch", "d"),
        ("build", "a"),
        ("apply", "c", True),
    ]


def test_masks_follow_once_the_step_before_is_processed():
    follow = _step("s", structured=True)
    attached = []

    class Handle(DoneStep):
        accepts_masks = True

        def attach_masks(self, masks) -> None:
            attached.append(sorted(masks))

    follow.handle = Handle(StepOutput())
    seq = follow.sched.scheduled[0].seq
    # Planned while the step before samples its input token.
    seq.grammar, seq.num_pending, seq.num_computed_tokens = object(), 1, 4
    first = _step("s0", structured=True)
    first.handle = Handle(StepOutput())
    engine = _Engine(first, follow)
    pipe = _pipeline(engine, masks_follow=True)
    pipe.step(False, ())
    assert engine.log[-2:] == [("apply", "s0", True), ("fill", 1)]
    assert attached == [[seq.seq_id]] and pipe.inflight is follow


class _Executor(Executor):
    """No model: each sample is drawn from the sequence id and position."""

    resolves_pending_tokens = True

    def num_available_blocks(self) -> tuple[int, int]:
        return 256, 0

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute(self, step: StepInput) -> StepOutput:
        return StepOutput(
            {
                s.seq_id: SampleResult([1000 + (7 * s.seq_id + s.start_pos) % 500], [-1.0])
                for s in step.seqs
                if s.sample
            }
        )


def test_pending_tokens_are_a_count_that_never_reaches_the_outputs():
    executor = _Executor()
    sent: list[StepInput] = []
    submit = executor.submit
    executor.submit = lambda step: sent.append(step) or submit(step)
    engine = LLMEngine(
        engine_config(
            None, device="cpu", num_kv_blocks=256, num_swap_blocks=0, async_scheduling=True
        ),
        executor,
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), None, params, prompt_token_ids=[5 + i, 17, 300, 2])
    seqs = [g.seqs[0] for g in engine.groups.values()]
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert PENDING_TOKEN not in out.outputs[0].token_ids
        # Between calls nothing is pending: the step in flight is not advanced yet.
        assert all(s.num_pending == 0 and PENDING_TOKEN not in s.output_token_ids for s in seqs)
    assert engine.overlapped_steps > 0
    assert any(s.token_ids == [PENDING_TOKEN] for step in sent for s in step.seqs)
    assert all(len(s.output_token_ids) == 6 for s in seqs)
    engine.block_manager.check_no_leaks()
