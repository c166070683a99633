"""Async scheduling through the multiprocess executor (issue 12): step N+1 is written to the
ranks before step N's reply is read, and at TP 2 rank 0 broadcasts the tokens a step takes
as pending inputs (worker/token_broadcast.py). Outputs stay token-identical to the
synchronous engine; a step that fails with the next one in flight ends only its own
requests; a rank killed with a step in flight is restarted and its requests resume."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from streamkv import SamplingParams
from streamkv.engine.llm_engine import LLMEngine
from streamkv.entrypoints.llm import LLM, engine_config
from streamkv.executor.multiproc import MultiprocExecutor, WorkerError
from streamkv.messages import PENDING_TOKEN, NewSeq, SeqParams, SeqStep, StepInput
from tests.executor.conftest import GREEDY, tiny_prompts, tokens, with_faults
from tests.executor.faults.sitecustomize import POISON_SEED, POISON_TOKEN
from tests.executor.test_restart_tp import LONG, children, stream_and_kill

KW = {
    "device": "cpu",
    "dtype": "float32",
    "num_kv_blocks": 64,
    "num_swap_blocks": 0,
    "max_model_len": 128,
    "distributed_executor_backend": "mp",
}
PARAMS = [
    GREEDY,
    SamplingParams(temperature=1.0, seed=11, top_k=20, max_tokens=12, ignore_eos=True),
    SamplingParams(
        temperature=0.9, seed=12, top_p=0.8, repetition_penalty=1.2, max_tokens=12, ignore_eos=True
    ),
    # Forks after its first sample (that step runs synchronously), then overlaps.
    SamplingParams(n=2, temperature=0.8, seed=3, logprobs=2, max_tokens=10, ignore_eos=True),
]


def _outputs(llm: LLM) -> list:
    outs = [
        [(c.token_ids, c.logprobs) for c in o.outputs]
        for o in llm.generate(None, PARAMS, prompt_token_ids=tiny_prompts() + tiny_prompts()[:1])
    ]
    llm.engine.block_manager.check_no_leaks()
    assert not llm.engine.has_unfinished_requests()
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_async_outputs_equal_the_synchronous_ones(tiny4_dir, tp):
    got = {}
    for on in (True, False):
        llm = LLM(str(tiny4_dir), **KW, tensor_parallel_size=tp, async_scheduling=on)
        try:
            assert (
                isinstance(llm.engine.executor, MultiprocExecutor)
                and llm.engine.async_scheduling == on
            )
            got[on] = _outputs(llm)
            # Steps overlapped: with async scheduling every decode step after the first.
            assert (llm.engine.overlapped_steps > 5) == on
        finally:
            llm.shutdown()
    assert got[True] == got[False]
    assert got[True][0] != got[True][1]  # greedy and seeded rows differ: the sampling ran


def _failing_step_with_the_next_in_flight(
    tiny4_dir, tp: int, poisoned: tuple[list[int], SamplingParams]
):
    """Request "a" decodes; "b" joins and its first step fails; "c" joins in the step that was
    sent before that failure was read. "a" and "b" end with the error, "c" runs on."""
    config = engine_config(str(tiny4_dir), **KW, tensor_parallel_size=tp, async_scheduling=True)
    engine = LLMEngine(config)
    try:
        prompts = tiny_prompts()
        engine.add_request("a", None, GREEDY, prompt_token_ids=prompts[0])
        outs = {}
        for _ in range(3):
            outs.update({o.request_id: o for o in engine.step()})
        engine.add_request("b", None, poisoned[1], prompt_token_ids=poisoned[0])
        outs.update({o.request_id: o for o in engine.step()})  # sends b's first step, reads a's
        engine.add_request("c", None, GREEDY, prompt_token_ids=prompts[2])
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
        assert engine.overlapped_steps > 3
        engine.block_manager.check_no_leaks()
        return outs, engine.executor.pids
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fault", ["sampler", "forward"])
def test_a_failing_step_with_the_next_in_flight_ends_only_its_requests(
    tiny4_dir, tp, fault, monkeypatch
):
    with_faults(monkeypatch, fault)
    prompts = tiny_prompts()
    poisoned = (
        (prompts[1], SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=4))
        if fault == "sampler"
        else ([*prompts[1], POISON_TOKEN], GREEDY)
    )
    outs, pids = _failing_step_with_the_next_in_flight(tiny4_dir, tp, poisoned)
    error = (
        "IndexError: a bug in the sampler"
        if fault == "sampler"
        else "RuntimeError: a bug in the model"
    )
    for rid in "ab":
        assert outs[rid].finished and outs[rid].outputs[0].finish_reason == "abort", outs[rid]
        assert error in outs[rid].error
    c = outs["c"]
    assert c.finished and c.error is None and c.outputs[0].finish_reason == "length"
    # "c" ran in a step whose other rows took their pending tokens from the failed step: its
    # tokens are those of a run without any failure.
    ref = LLM(str(tiny4_dir), **{**KW, "distributed_executor_backend": "inprocess"})
    try:
        assert (
            list(c.outputs[0].token_ids)
            == tokens(ref.generate(None, GREEDY, prompt_token_ids=[prompts[2]]))[0]
        )
    finally:
        ref.shutdown()


@pytest.mark.slow
def test_a_rank_killed_with_a_step_in_flight_is_restarted_and_its_requests_resume(tiny4_dir):
    ref = LLM(str(tiny4_dir), **{**KW, "distributed_executor_backend": "inprocess"})
    want = tokens(ref.generate(None, LONG, prompt_token_ids=tiny_prompts()))
    ref.shutdown()
    config = engine_config(str(tiny4_dir), **KW, tensor_parallel_size=2, async_scheduling=True)

    def victim() -> int:
        ranks = children(os.getpid())
        assert len(ranks) == 2, ranks
        return max(ranks)

    got, (before, after) = asyncio.run(asyncio.wait_for(stream_and_kill(config, victim), 300))
    assert got == want
    assert len(after) == 2 and not set(before) & set(after)


@pytest.mark.slow
def test_replies_are_read_in_send_order_and_rank1_gets_the_pending_token(tiny4_dir):
    """At the executor: steps A and B sent, B read first (A's reply is read for it); B's input
    is A's pending token, which rank 1 gets from rank 0's broadcast. B's sample equals that of
    a twin sequence given A's token explicitly; a control call reads the replies before it."""
    executor = MultiprocExecutor(engine_config(str(tiny4_dir), **KW, tensor_parallel_size=2))
    try:
        assert executor.resolves_pending_tokens
        executor.init_cache(8, 0)
        prompt = [5, 6, 7]
        a = executor.submit(
            StepInput(
                [SeqStep(0, prompt, 0, new_blocks=[0]), SeqStep(1, prompt, 0, new_blocks=[1])],
                [NewSeq(0, SeqParams(), 3), NewSeq(1, SeqParams(), 3)],
            )
        )
        b = executor.submit(StepInput([SeqStep(0, [PENDING_TOKEN], 3)]))
        b_out = b.result()
        first = a.result().results
        token = first[0].token_ids[0]
        assert first[1].token_ids == [token]
        twin = executor.submit(StepInput([SeqStep(1, [token], 3)]))
        executor.num_available_blocks()  # reads twin's reply first
        assert twin.result().results[1].token_ids == b_out.results[0].token_ids
    finally:
        executor.shutdown()


@pytest.mark.slow
def test_a_rank_failing_a_step_alone_with_the_next_in_flight_is_a_divergence(
    tiny4_dir, monkeypatch
):
    """Rank 1 fails the step while rank 0 waits in one of its collectives, and the next step is
    already sent: rank 1 must not start it (its collectives would pair with rank 0's of the
    failed step); it waits for a Resume that never comes, and the engine ends the ranks."""
    with_faults(monkeypatch, "forward-rank1")
    llm = LLM(str(tiny4_dir), **KW, tensor_parallel_size=2, async_scheduling=True)
    llm.engine.executor.diverge_timeout = 2.0
    try:
        start = time.monotonic()
        with pytest.raises(
            WorkerError,
            match=r"rank\(s\) \[1\] failed a step .*a bug in the model.* rank\(s\) \[0\] "
            r"did not finish it within 2s: the ranks diverged",
        ):
            llm.generate(None, GREEDY, prompt_token_ids=[[5, 6, 7], [5, POISON_TOKEN, 7]])
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
