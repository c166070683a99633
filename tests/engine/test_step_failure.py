"""A step whose model or sampler raises ends the requests of that step with an error; the
engine, its blocks and the requests that come later are unharmed."""

from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.layers.sampler import Sampler

POISON_SEED = 666
PROMPT = [5, 17, 300, 2]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(
        str(tiny_llama_dir), device="cpu", num_kv_blocks=64, num_swap_blocks=0, max_model_len=128
    )
    yield engine
    engine.shutdown()


@pytest.fixture
def poisoned_sampler(monkeypatch):
    real = Sampler.__call__

    def call(self, logits, reqs):
        if (reqs.seeded & (reqs.seed == POISON_SEED)).any():  # SamplingRows' columns
            raise IndexError("a bug in the sampler")
        return real(self, logits, reqs)

    monkeypatch.setattr(Sampler, "__call__", call)


def test_a_failing_step_ends_its_requests_only(llm, poisoned_sampler):
    want = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)[0].outputs[0].token_ids
    poison = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=4)
    outs = llm.generate(prompt_token_ids=[PROMPT, PROMPT], sampling_params=[poison, GREEDY])
    # Both ran in the failing step: both end, with the error, and nothing raised.
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert "IndexError: a bug in the sampler" in out.error
    llm.engine.block_manager.check_no_leaks()
    assert not llm.engine.groups and not llm.engine.has_unfinished_requests()
    # The engine goes on.
    again = llm.generate(prompt_token_ids=[PROMPT, PROMPT], sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [want, want]
    llm.engine.block_manager.check_no_leaks()


def test_a_request_outside_the_failing_step_carries_on(llm, poisoned_sampler):
    engine = llm.engine
    engine.add_request(
        "early",
        None,
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        prompt_token_ids=PROMPT,
    )
    outs = engine.step()  # "early" runs its prompt alone
    assert [o.request_id for o in outs] == ["early"] and not outs[0].finished
    # "late" arrives with the poison and is scheduled with "early": that step fails both.
    engine.add_request(
        "late",
        None,
        SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=4),
        prompt_token_ids=PROMPT,
    )
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"early", "late"} and all(o.error for o in outs.values())
    engine.add_request("after", None, GREEDY, prompt_token_ids=PROMPT)
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    assert done[0].request_id == "after" and done[0].error is None
    assert len(done[0].outputs[0].token_ids) == 4
    engine.block_manager.check_no_leaks()
