"""Issue 17: at TP 2 a step that raises in the model or the sampler fails that step's
requests on every rank together, and the engine, its blocks and later requests go on, as
with the in-process worker (tests/engine/test_step_failure.py). A rank that fails a step
alone while the other waits in a collective has diverged: a clear WorkerError, soon."""

from __future__ import annotations

import time

import pytest

from streamkv import SamplingParams
from streamkv.entrypoints.llm import LLM
from streamkv.executor.multiproc import WorkerError
from tests.executor.conftest import GREEDY, tiny_prompts, tokens, with_faults
from tests.executor.faults.sitecustomize import POISON_SEED, POISON_TOKEN

KW = {
    "device": "cpu",
    "dtype": "float32",
    "num_kv_blocks": 64,
    "num_swap_blocks": 0,
    "max_model_len": 128,
}


@pytest.fixture(scope="module")
def want(tiny4_dir):
    ref = LLM(str(tiny4_dir), **KW)
    out = tokens(ref.generate(None, GREEDY, prompt_token_ids=tiny_prompts()))
    ref.shutdown()
    return out


@pytest.mark.slow
def test_a_failing_step_fails_on_every_rank_and_the_engine_goes_on(tiny4_dir, want, monkeypatch):
    with_faults(monkeypatch, "sampler,forward")
    llm = LLM(str(tiny4_dir), **KW, tensor_parallel_size=2)
    try:
        pids = llm.engine.executor.pids
        prompts = tiny_prompts()
        poison_seed = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=4)
        # The sampler (rank 0 only, after every collective), then the model on both ranks.
        for faulty, params, error in (
            (prompts[0], poison_seed, "IndexError: a bug in the sampler"),
            ([*prompts[0], POISON_TOKEN], GREEDY, "RuntimeError: a bug in the model"),
        ):
            outs = llm.generate(None, [params, GREEDY], prompt_token_ids=[faulty, prompts[1]])
            for out in outs:  # both were in the failing step
                assert out.finished and out.outputs[0].finish_reason == "abort", out
                assert error in out.error
            llm.engine.block_manager.check_no_leaks()
            # The same processes serve on, with the outputs of a run that never failed.
            assert tokens(llm.generate(None, GREEDY, prompt_token_ids=prompts)) == want
            assert llm.engine.executor.pids == pids
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_rank_failing_a_step_alone_is_a_divergence_not_a_hang(tiny4_dir, monkeypatch):
    with_faults(monkeypatch, "forward-rank1")
    llm = LLM(str(tiny4_dir), **KW, tensor_parallel_size=2)
    llm.engine.executor.diverge_timeout = 2.0
    try:
        start = time.monotonic()
        with pytest.raises(
            WorkerError,
            match=r"rank\(s\) \[1\] failed a step .*a bug in the model.* rank\(s\) \[0\] "
            r"did not finish it within 2s: the ranks diverged",
        ):
            llm.generate(None, GREEDY, prompt_token_ids=[[5, POISON_TOKEN, 7]])
        assert time.monotonic() - start < 30
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()
