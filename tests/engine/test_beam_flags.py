"""Beam search honours or refuses every flag it is given: stop_token_ids end a hypothesis
like EOS, logprobs come from the step each token was chosen in, and stop strings or a
temperature are refused with the field named."""

from __future__ import annotations

import math

import pytest

from streamkv import LLM, SamplingParams
from streamkv.sampling_params import BeamSearchParams, InvalidParameter

PROMPT = [5, 17, 300, 2, 41, 9]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(
        str(tiny_llama_dir), device="cpu", num_kv_blocks=64, num_swap_blocks=0, max_model_len=128
    )
    yield engine
    engine.shutdown()


def _beams(llm, **kwargs):
    params = SamplingParams(
        n=3, best_of=3, use_beam_search=True, temperature=0, ignore_eos=True, **kwargs
    )
    return llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs


def test_stop_strings_and_temperature_are_refused_with_the_field():
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(best_of=2, use_beam_search=True, temperature=0, stop=["\n"])
    assert info.value.param == "stop"
    with pytest.raises(InvalidParameter) as info:
        BeamSearchParams(2, 8, temperature=0.7)
    assert info.value.param == "temperature"


def test_stop_token_ids_end_hypotheses(llm):
    free = _beams(llm, max_tokens=3)
    stop = free[0].token_ids[2]  # the best beam's last token
    # The same best hypothesis, now ended by the stop id rather than by the length.
    best = _beams(llm, max_tokens=3, stop_token_ids=[stop])[0]
    assert best.token_ids == free[0].token_ids and free[0].finish_reason == "length"
    assert (best.finish_reason, best.stop_reason) == ("stop", stop)
    # Longer runs: the token ends a hypothesis wherever it is chosen, so no beam goes past it.
    for o in _beams(llm, max_tokens=8, stop_token_ids=[stop]):
        assert stop not in o.token_ids[:-1]
    llm.engine.block_manager.check_no_leaks()


def test_logprobs_are_those_of_the_chosen_tokens_with_the_top_ones(llm):
    outs = _beams(llm, max_tokens=6, logprobs=2)
    for o in outs:
        assert len(o.logprobs) == len(o.token_ids)
        for token, entry in zip(o.token_ids, o.logprobs, strict=True):
            assert token in entry and len(entry) >= 2
            ranked = sorted((lp.rank, lp.logprob) for t, lp in entry.items() if lp.rank is not None)
            assert [r for r, _ in ranked][:2] == [1, 2]
            assert ranked[0][1] >= ranked[1][1]
        assert math.isclose(
            sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)),
            o.cumulative_logprob,
            rel_tol=1e-5,
            abs_tol=1e-5,
        )
    # Asking for logprobs changes no beam.
    assert [o.token_ids for o in outs] == [o.token_ids for o in _beams(llm, max_tokens=6)]
