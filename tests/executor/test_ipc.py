"""The executor's wire format: typed msgspec structs, decoded only into the messages that
side may receive; never pickle."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from streamkv.executor import ipc
from streamkv.messages import NewSeq, SampleResult, SeqParams, SeqStep, StepInput, StepOutput


def _step() -> StepInput:
    params = SeqParams(
        temperature=0.7, seed=3, logit_bias={7: -2.5, 9: 100.0}, min_tokens=2, banned_token_ids=[0]
    )
    return StepInput(
        [
            SeqStep(1, [5, 6, 7], 0, new_blocks=[4, 9]),
            SeqStep(2, [8], 20, sample=False, new_blocks=[7], num_kept_blocks=1, num_samples=2),
        ],
        [NewSeq(1, params, 3, sample_index=1, history=[5, 6, 7])],
        finished_ids=[4, 5],
        swap_in=[(0, 5)],
        swap_out=[(3, 0)],
        copies=[(1, 2)],
    )


def test_steps_and_control_messages_roundtrip() -> None:
    dec = ipc.worker_decoder()
    for msg in (
        ipc.Step(_step()),
        ipc.Step(StepInput()),
        ipc.QueryBlocks(),
        ipc.InitCache(10, 2),
        ipc.Shutdown(),
        ipc.Setup(
            1,
            2,
            {"model": {"model": None, "seed": 0}},
            {"max_model_len": 8},
            "gloo",
            "file:///x",
            20,
        ),
    ):
        assert dec.decode(ipc.encode(msg)) == msg


def test_outputs_roundtrip() -> None:
    out = StepOutput(
        {
            1: SampleResult([3, 4], [-0.1, -0.2], top_logprobs=[[(3, -0.1), (5, -2.0)]] * 2),
            2: SampleResult([7], [-1.0], candidates=[(7, -1.0), (8, -1.5)]),
        }
    )
    dec = ipc.engine_decoder()
    for msg in (
        ipc.Out(out, 0.25),
        ipc.Ready(),
        ipc.Blocks(100, 7),
        ipc.Ok(),
        ipc.Error("boom", "trace"),
    ):
        assert dec.decode(ipc.encode(msg)) == msg


def test_a_decode_step_is_a_few_bytes_per_sequence() -> None:
    step = StepInput([SeqStep(i, [1000 + i], 500 + i) for i in range(256)])
    assert len(ipc.encode(ipc.Step(step))) < 256 * 16  # 13: a pickled tuple took ~30


def test_only_the_messages_of_that_side_decode() -> None:
    with pytest.raises(msgspec.ValidationError):
        ipc.engine_decoder().decode(
            ipc.encode(ipc.Step(StepInput()))
        )  # a worker never sends a step
    with pytest.raises(msgspec.ValidationError):
        ipc.worker_decoder().decode(ipc.encode(ipc.Ok()))
    with pytest.raises(msgspec.DecodeError):
        ipc.worker_decoder().decode(pickle.dumps(("step", print)))
    with pytest.raises(msgspec.ValidationError):  # a field of the wrong type
        ipc.worker_decoder().decode(msgspec.msgpack.encode(["init_cache", "10", 2]))


def test_kind_names_a_message_and_its_type() -> None:
    assert ipc.kind(ipc.Out) == ipc.kind(ipc.Out(StepOutput(), 0.0)) == "out"
