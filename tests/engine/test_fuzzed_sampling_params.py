"""Random sampling parameters through the real engine (a tiny random Llama on the CPU): a
request either gets a clear ValueError before it runs, or runs; it never fails the step of
the other requests batched with it, and no block leaks. (Before this test, a top_k past the
vocabulary, or a stop token id past it with min_tokens, failed the whole step.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 1000
PROMPT = [5, 17, 300, 2]
CONTROL = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

_ids = st.sampled_from([0, 1, VOCAB - 1, VOCAB, VOCAB + 1, 10**6])
_params = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        "top_k": st.sampled_from([-1, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 10**6]),
        "top_p": st.sampled_from([0.05, 0.5, 1.0]),
        "min_p": st.sampled_from([0.0, 0.1, 1.0]),
        "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
        "n": st.integers(1, 3),
        "logprobs": st.sampled_from([None, 0, 5, VOCAB, VOCAB + 7]),
        "stop_token_ids": st.lists(_ids, max_size=3),
        "min_tokens": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "presence_penalty": st.sampled_from([-2.0, 0.0, 1.5]),
        "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
        "repetition_penalty": st.sampled_from([0.5, 1.0, 2.0]),
        "logit_bias": st.dictionaries(
            _ids, st.sampled_from([-100.0, -1.0, 0.5, 100.0]), max_size=3
        ),
        "max_tokens": st.integers(1, 4),
    },
)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(
        str(tiny_llama(vocab_size=VOCAB)),
        device="cpu",
        num_kv_blocks=128,
        num_swap_blocks=0,
        max_model_len=128,
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def control_tokens(llm):
    return llm.generate(prompt_token_ids=[PROMPT], sampling_params=CONTROL)[0].outputs[0].token_ids


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kwargs=_params, with_beams=st.booleans())
def test_a_request_never_fails_its_batch(llm, control_tokens, kwargs, with_beams):
    if with_beams:
        kwargs = {**kwargs, "use_beam_search": True, "best_of": 2, "temperature": 0.0}
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return  # refused when built: nothing reached the engine
    try:
        outs = llm.generate(prompt_token_ids=[PROMPT, PROMPT], sampling_params=[params, CONTROL])
    except ValueError as e:
        assert "vocabulary" in str(e) or "must" in str(e), e
        outs = llm.generate(prompt_token_ids=[PROMPT], sampling_params=[CONTROL]) * 2
    else:
        fuzzed = outs[0]
        assert fuzzed.error is None and fuzzed.finished
        assert 1 <= len(fuzzed.outputs) and all(
            len(c.token_ids) <= params.max_tokens for c in fuzzed.outputs
        )
        assert all(0 <= t < VOCAB for c in fuzzed.outputs for t in c.token_ids)
    assert outs[1].outputs[0].token_ids == control_tokens
    llm.engine.block_manager.check_no_leaks()
