"""The worker's persistent per-sequence state and the engine's StepBuilder that mirrors it:
parameters sent once, block tables and token counts updated by deltas, state freed for every
sequence that finishes, is aborted or is preempted (no leaked rows), and outputs unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamkv import LLM, BeamSearchParams, SamplingParams
from streamkv.layers.sample_request import SamplingRows
from streamkv.messages import NewSeq, SeqParams, SeqStep, StepInput
from streamkv.sequence import SequenceStatus
from streamkv.worker.input_batch import InputBatch, ProtocolError

VOCAB = 300


def _batch() -> InputBatch:
    return InputBatch(VOCAB, torch.device("cpu"))


def _output_counts(batch: InputBatch, seq_id: int) -> torch.Tensor:
    return batch.counts.output[batch.seqs[seq_id].counts_row]


def _sampled(batch: InputBatch, s) -> SamplingRows:
    """The sampler's view of one SeqInput's row, as the model runner gathers it."""
    return batch.sampling.take([s.slot])


# -- InputBatch on hand-made steps -----------------------------------------------------------
def test_parameters_once_then_tokens_and_block_deltas() -> None:
    b = _batch()
    params = SeqParams(temperature=0.5, seed=3, min_tokens=2, banned_token_ids=[7])
    (s,) = b.apply(
        StepInput(
            [SeqStep(1, [5, 6, 8], 0, new_blocks=[4, 9])], [NewSeq(1, params, 3, sample_index=2)]
        )
    )
    assert (s.block_table, s.start_pos, s.token_ids) == ([4, 9], 0, [5, 6, 8])
    r = _sampled(b, s)
    assert s.sample and (r.seed.tolist(), r.seeded.tolist()) == ([3], [True])
    assert (r.sample_index.tolist(), r.output_pos.tolist(), r.banned) == ([2], [0], {0: [7]})
    assert r.temperature.tolist() == [0.5] and r.top_k.tolist() == [-1]
    (s,) = b.apply(StepInput([SeqStep(1, [10], 3)]))  # nothing changed but one token
    r = _sampled(b, s)
    assert s.block_table == [4, 9] and r.output_pos.tolist() == [1] and r.banned == {0: [7]}
    (s,) = b.apply(StepInput([SeqStep(1, [11], 4, new_blocks=[2])]))  # grows by a block
    assert s.block_table == [4, 9, 2] and _sampled(b, s).banned == {}  # min_tokens reached
    (s,) = b.apply(
        StepInput([SeqStep(1, [12], 5, new_blocks=[3], num_kept_blocks=2)])
    )  # copy-on-write
    assert s.block_table == [4, 9, 3]
    (s,) = b.apply(StepInput([SeqStep(1, [13], 6, sample=False, num_kept_blocks=1)]))  # shrinks
    assert s.block_table == [4] and not s.sample
    b.apply(StepInput(finished_ids=[1]))
    assert len(b) == 0 and b.sampling.num_rows == 0


def test_sampling_columns_gathered_by_row_and_rows_reused() -> None:
    b = _batch()
    new = [
        NewSeq(1, SeqParams(temperature=0.5, top_k=10**30, logprobs=2), 2),
        NewSeq(2, SeqParams(seed=2**64 + 5, logit_bias={3: 1.5}), 2),
        NewSeq(3, SeqParams(repetition_penalty=1.2), 2, history=[4, 5]),
    ]
    steps = [SeqStep(i, [4, 5], 0, new_blocks=[i], num_samples=i) for i in (3, 1, 2)]
    seqs = b.apply(StepInput(steps, new))
    r = b.sampling.take([s.slot for s in seqs])  # step order, not the table's
    assert r.num_samples.tolist() == [3, 1, 2] and r.seeded.tolist() == [False, False, True]
    assert r.top_k.tolist() == [-1, 2**63 - 1, -1] and r.logprobs.tolist() == [0, 2, 0]
    assert r.seed[2:].view("uint64").tolist() == [5] and r.logit_bias == {2: {3: 1.5}}
    assert r.penalised().tolist() == [True, False, False] and r.counts_row[0] >= 0
    seqs = b.apply(StepInput([SeqStep(i, [7], 2) for i in (3, 1, 2)]))
    again = b.sampling.take([s.slot for s in seqs])
    assert again.num_samples.tolist() == [1, 1, 1] and again.output_pos[2] == 1
    # The same rows: the last gather of the set-once columns, reused.
    assert np.shares_memory(again.temperature, r.temperature)
    # A freed row is handed to the next sequence, and the gather sees its parameters.
    slot = b.seqs[1].slot
    (s,) = b.apply(
        StepInput([SeqStep(4, [1], 0, new_blocks=[9])], [NewSeq(4, SeqParams(top_p=0.5), 1)], [1])
    )
    assert s.slot == slot and b.sampling.take([slot]).top_p.tolist() == [0.5]
    assert b.sampling.take([slot]).temperature.tolist() == [0.0]


def test_steps_that_do_not_fit_the_state_are_refused() -> None:
    b = _batch()
    with pytest.raises(ProtocolError, match="does not hold"):
        b.apply(StepInput([SeqStep(1, [5], 0)]))
    b.apply(StepInput([SeqStep(1, [5], 0, new_blocks=[0])], [NewSeq(1, SeqParams(), 1)]))
    with pytest.raises(ProtocolError, match="holds it"):
        b.apply(StepInput(new_seqs=[NewSeq(1, SeqParams(), 1)]))
    with pytest.raises(ProtocolError, match="keeps 3 of its 1"):
        b.apply(StepInput([SeqStep(1, [6], 1, num_kept_blocks=3)]))
    with pytest.raises(ProtocolError, match="without its history"):
        b.apply(StepInput(new_seqs=[NewSeq(2, SeqParams(presence_penalty=1.0), 1)]))
    with pytest.raises(ProtocolError, match="freed"):
        b.apply(StepInput(finished_ids=[9]))


def test_token_counts_follow_the_history_and_rows_are_reused() -> None:
    b = _batch()
    pen = SeqParams(temperature=1.0, frequency_penalty=0.5)
    b.apply(
        StepInput(
            [SeqStep(1, [3, 4, 4, 5], 0, new_blocks=[0])], [NewSeq(1, pen, 3, history=[3, 4, 4, 5])]
        )
    )
    b.apply(
        StepInput(
            [SeqStep(1, [5], 3), SeqStep(2, [9], 0, new_blocks=[1])], [NewSeq(2, SeqParams(), 1)]
        )
    )  # seq 1's token 5 was already counted
    b.apply(StepInput([SeqStep(1, [8], 4)]))
    assert _output_counts(b, 1).nonzero().squeeze(1).tolist() == [5, 8]
    assert _output_counts(b, 1)[[5, 8]].tolist() == [1, 1]
    row = b.seqs[1].counts_row
    assert b.counts.prompt[row].nonzero().squeeze(1).tolist() == [3, 4]
    assert b.seqs[2].counts_row == -1  # no penalty: no row
    b.apply(StepInput(finished_ids=[1]))
    assert b.counts.num_rows == 0
    b.apply(StepInput([SeqStep(3, [1, 2], 0, new_blocks=[2])], [NewSeq(3, pen, 2, history=[1, 2])]))
    assert b.seqs[3].counts_row == row and not _output_counts(b, 3).any()


def test_ranks_that_do_not_sample_keep_no_counts() -> None:
    b = InputBatch(VOCAB, torch.device("cpu"), samples=False)
    pen = SeqParams(temperature=1.0, repetition_penalty=1.5)
    (s,) = b.apply(
        StepInput([SeqStep(1, [3], 0, new_blocks=[0])], [NewSeq(1, pen, 1, history=[3])])
    )
    assert b.counts is None and b.seqs[1].counts_row == -1 and s.block_table == [0]
    assert _sampled(b, s).counts is None


# -- the engine's StepBuilder on hand-made scheduler outputs -----------------------------------
def test_the_builder_sends_a_sequence_once_then_deltas() -> None:
    from streamkv.core.step_plan import ScheduledSeq, SchedulerOutput
    from streamkv.engine.step_builder import StepBuilder
    from streamkv.sequence import Sequence, SequenceGroup

    tables = {0: [4, 9]}
    builder = StepBuilder(tables, eos_token_ids={2})
    seq = Sequence(0, [5, 6, 7], status=SequenceStatus.RUNNING)
    group = SequenceGroup(
        "r",
        [seq],
        SamplingParams(
            n=2, temperature=0.5, seed=1, min_tokens=1, stop_token_ids=[8], presence_penalty=0.5
        ),
    )

    def build(n: int):
        step = builder.build(SchedulerOutput([ScheduledSeq(group, seq, n)]))
        seq.num_computed_tokens += n
        return step

    first = build(3)
    (new,) = first.new_seqs
    assert (new.prompt_len, new.history, new.params.banned_token_ids) == (3, [5, 6, 7], [2, 8])
    assert first.seqs == [SeqStep(0, [5, 6, 7], 0, new_blocks=[4, 9], num_samples=2)]
    seq.output_token_ids.append(11)
    second = build(1)
    assert second.new_seqs == [] and second.seqs == [SeqStep(0, [11], 3)]
    seq.output_token_ids.append(12)
    tables[0].append(3)  # grown in place by the block manager
    assert build(1).seqs == [SeqStep(0, [12], 4, new_blocks=[3])]
    seq.output_token_ids.append(13)
    tables[0] = [4, 9, 1]  # its last block copied on write
    assert build(1).seqs == [SeqStep(0, [13], 5, new_blocks=[1], num_kept_blocks=2)]
    seq.num_computed_tokens = 0  # recomputed after a preemption no step was built for
    again = builder.build(SchedulerOutput([ScheduledSeq(group, seq, 6)]))
    assert again.finished_ids == [0] and again.new_seqs[0].history == [5, 6, 7, 11, 12, 13]
    seq.status = SequenceStatus.FINISHED_LENGTH
    assert builder.build(SchedulerOutput()).finished_ids == [0] and not builder.sent


# -- the engine's StepBuilder and the worker's InputBatch, through the real engine --------------
@pytest.fixture(scope="module")
def tiny_dir(tiny_llama):
    return tiny_llama(vocab_size=VOCAB, num_hidden_layers=1)


def _check_mirror(engine) -> None:
    """The worker holds exactly what the builder says, each row exactly right."""
    batch = engine.executor.worker.input_batch
    sent = engine.step_builder.sent
    assert set(batch.seqs) == set(sent)
    rows, slots = [], []
    for seq_id, known in sent.items():
        state, seq = batch.seqs[seq_id], known.seq
        assert state.block_table == known.table
        slots.append(state.slot)
        assert batch.sampling.counts_rows([state.slot]).tolist() == [state.counts_row]
        if state.counts_row >= 0:
            rows.append(state.counts_row)
            n_out = state.num_counted - len(seq.prompt_token_ids)
            want = torch.bincount(
                torch.tensor(seq.output_token_ids[:n_out], dtype=torch.long), minlength=VOCAB
            )
            assert torch.equal(batch.counts.output[state.counts_row].long(), want)
            prompt = batch.counts.prompt[state.counts_row].nonzero().squeeze(1).tolist()
            assert prompt == sorted(set(seq.prompt_token_ids))
    assert len(set(rows)) == len(rows) == batch.counts.num_rows
    assert len(set(slots)) == len(slots) == batch.sampling.num_rows  # no table row leaked


def _run_checked(llm, prompts, params) -> list:
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", None, sp, prompt_token_ids=p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        _check_mirror(engine)
        # Whatever the worker holds is still running, or ended in the last step.
        for known in engine.step_builder.sent.values():
            assert known.seq.status in (SequenceStatus.RUNNING,) or known.seq.status.finished
    return [done[f"r{i}"] for i in range(len(prompts))]


def _drain(llm) -> None:
    """One more step frees what the last step finished: then nothing but it is held."""
    out = llm.generate(
        prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(temperature=0, max_tokens=2)
    )
    assert out[0].finished
    batch = llm.engine.executor.worker.input_batch
    assert len(batch) <= 1 and batch.counts.num_rows == 0


PENALISED = [
    SamplingParams(
        temperature=0, max_tokens=12, presence_penalty=1.5, repetition_penalty=1.3, ignore_eos=True
    ),
    SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=10, frequency_penalty=1.0, ignore_eos=True
    ),
    SamplingParams(
        temperature=0.8, top_k=20, seed=2, max_tokens=14, min_tokens=4, repetition_penalty=0.7
    ),
    BeamSearchParams(3, 8).to_sampling_params(),
    SamplingParams(
        n=2,
        best_of=3,
        temperature=0.9,
        top_p=0.7,
        seed=9,
        max_tokens=9,
        presence_penalty=-1.0,
        ignore_eos=True,
    ),
]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 9, 30, 12)]


def _tokens(outs) -> list:
    return [[tuple(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_state_stays_exact_through_forks_beams_and_preemption(tiny_dir, mode):
    roomy = LLM(str(tiny_dir), device="cpu", block_size=8, num_kv_blocks=512, num_swap_blocks=0)
    want = _run_checked(roomy, _prompts(), PENALISED)
    alone = [
        roomy.generate(prompt_token_ids=[p], sampling_params=sp)[0]
        for p, sp in zip(_prompts(), PENALISED)
    ]
    assert _tokens(want) == _tokens(
        alone
    )  # penalised and seeded samples do not depend on the batch
    _drain(roomy)
    small = LLM(
        str(tiny_dir),
        device="cpu",
        block_size=8,
        num_kv_blocks=20,
        num_swap_blocks=64,
        preemption_mode=mode,
    )
    got = _run_checked(small, _prompts(), PENALISED)
    assert small.stats()["num_preemptions"] > 0
    assert _tokens(got) == _tokens(want)
    _drain(small)
    small.engine.block_manager.check_no_leaks()


def test_aborted_sequences_are_freed_on_the_worker(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", block_size=8, num_kv_blocks=256, num_swap_blocks=0)
    engine = llm.engine
    engine.add_request("a", None, PENALISED[1], prompt_token_ids=[4, 5, 6])
    engine.add_request("b", None, PENALISED[0], prompt_token_ids=[7, 8])
    for _ in range(3):
        engine.step()
    batch = engine.executor.worker.input_batch
    assert len(batch) == 4 and batch.counts.num_rows == 4
    engine.abort_request("a")
    engine.step()  # the next step tells the worker
    assert len(batch) == 1 and batch.counts.num_rows == 1
    _check_mirror(engine)
    engine.abort_request("b")
    _drain(llm)
