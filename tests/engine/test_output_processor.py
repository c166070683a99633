"""OutputProcessor and beam search run on the collaborators they are given (a block manager,
the scheduler's free function, a sequence-id source, the context length), with no engine."""

from __future__ import annotations

import itertools

from streamkv.engine.beam_search import BeamState
from streamkv.engine.output_processor import OutputProcessor
from streamkv.messages import SampleResult, StepOutput
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.core.sched_helpers import make_bm, make_scheduler

EOS = 2


def _setup():
    bm = make_bm(num_blocks=16, block_size=4)
    sched = make_scheduler(bm, budget=64)
    ids = itertools.count(100)
    proc = OutputProcessor(
        bm, sched.free_finished_seqs, lambda: next(ids), 12, None, frozenset({EOS})
    )
    return bm, sched, proc


def test_parallel_samples_fork_share_and_free_through_the_given_parts():
    bm, sched, proc = _setup()
    group = SequenceGroup(
        "r", [Sequence(0, [5, 6, 7, 8, 9])], SamplingParams(n=2, temperature=1.0, max_tokens=None)
    )
    sched.add(group)
    out = sched.schedule()
    proc.apply(out, StepOutput({0: SampleResult([11, 12], [-0.5, -1.0])}))
    child = group.seqs[1]
    assert (
        child.seq_id == 100
        and child.output_token_ids == [12]
        and group.seqs[0].output_token_ids == [11]
    )
    assert bm.tables[0][0] == bm.tables[100][0] and bm.device.ref_counts[bm.tables[0][0]] == 2
    # The child samples EOS: it finishes and the scheduler's free function drops its blocks.
    out = sched.schedule()
    proc.apply(out, StepOutput({0: SampleResult([13], [-0.1]), 100: SampleResult([EOS], [-0.1])}))
    assert child.status is SequenceStatus.FINISHED_STOPPED and 100 not in bm.tables
    # The context length it was given ends the other at 12 tokens.
    while not group.finished:
        out = sched.schedule()
        proc.apply(out, StepOutput({0: SampleResult([13], [-0.1])}))
    assert len(group.seqs[0]) == 12 and group.seqs[0].status is SequenceStatus.FINISHED_LENGTH
    bm.check_no_leaks()


def test_beam_search_forks_with_the_given_block_manager_and_ids():
    bm, sched, proc = _setup()
    params = SamplingParams(
        n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=3, ignore_eos=True
    )
    group = SequenceGroup("b", [Sequence(0, [5, 6, 7])], params, beam_state=BeamState())
    sched.add(group)
    out = sched.schedule()
    # One beam, two continuations: it forks once (a new id from the given source).
    proc.apply(
        out,
        StepOutput(
            {
                0: SampleResult(
                    [20], [-0.1], candidates=[(20, -0.1), (21, -0.2), (22, -3.0), (23, -4.0)]
                )
            }
        ),
    )
    assert sorted(s.seq_id for s in group.seqs) == [0, 100]
    assert sorted(s.output_token_ids[0] for s in group.seqs) == [20, 21]
    assert bm.tables[0][0] == bm.tables[100][0]
    sched.abort("b")
    bm.check_no_leaks()
