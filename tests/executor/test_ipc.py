"""The executor's wire format: plain data only, block tables as mirrored deltas."""

from __future__ import annotations

import pickle

import pytest

from streamkv.executor import ipc
from streamkv.worker.messages import SampleRequest, SampleResult, SeqInput, StepInput, StepOutput


def _roundtrip(enc: ipc.StepEncoder, dec: ipc.StepDecoder, step: StepInput) -> StepInput:
    return dec.decode(ipc.loads(ipc.dumps(enc.encode(step))))


def test_steps_roundtrip_through_table_deltas():
    enc, dec = ipc.StepEncoder(), ipc.StepDecoder()
    sample = SampleRequest(num_samples=2, temperature=0.7, seed=3, prompt_token_ids=[1, 2], banned_token_ids=[0],
                           logit_bias={7: -2.5, 9: 100.0})
    steps = [
        StepInput([SeqInput(1, [5, 6, 7], 0, [4, 9], sample), SeqInput(2, [8], 20, [3, 1])], copies=[(1, 2)]),
        # seq 1 grows by a block, seq 2's last block is replaced (copy-on-write)
        StepInput([SeqInput(1, [10], 3, [4, 9, 11], None), SeqInput(2, [12], 21, [3, 7])]),
        # seq 2 skips a step (swapped out) and is forgotten on both ends ...
        StepInput([SeqInput(1, [13], 4, [4, 9, 11])], swap_out=[(3, 0), (7, 1)]),
        # ... so it comes back whole, with new block ids
        StepInput([SeqInput(2, [14], 22, [5, 6])], swap_in=[(0, 5), (1, 6)]),
        StepInput([SeqInput(2, [15], 23, [5])]),  # a table may also shrink
    ]
    for step in steps:
        assert _roundtrip(enc, dec, step) == step


def test_deltas_are_small():
    enc = ipc.StepEncoder()
    table = list(range(100))
    enc.encode(StepInput([SeqInput(1, [1], 0, table)]))
    (_, _, _, keep, tail, _), = enc.encode(StepInput([SeqInput(1, [2], 1, table + [100])]))[1]
    assert (keep, tail) == (100, [100])


def test_the_encoder_keeps_its_own_copy_of_a_table():
    enc, dec = ipc.StepEncoder(), ipc.StepDecoder()
    table = [1, 2]
    _roundtrip(enc, dec, StepInput([SeqInput(1, [1], 0, table)]))
    table.append(3)  # a caller that grows its list in place must still send the new block
    assert _roundtrip(enc, dec, StepInput([SeqInput(1, [2], 1, table)])).seqs[0].block_table == [1, 2, 3]


def test_outputs_roundtrip():
    out = StepOutput({
        1: SampleResult([3, 4], [-0.1, -0.2], top_logprobs=[[(3, -0.1), (5, -2.0)]] * 2),
        2: SampleResult([7], [-1.0], candidates=[(7, -1.0), (8, -1.5)]),
    })
    assert ipc.decode_output(ipc.loads(ipc.dumps(ipc.encode_output(out)))) == out


def test_messages_never_become_objects():
    with pytest.raises(pickle.UnpicklingError, match="plain data only"):
        ipc.loads(pickle.dumps(("step", SampleRequest())))
    with pytest.raises(pickle.UnpicklingError):
        ipc.loads(pickle.dumps(print))
