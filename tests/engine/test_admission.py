"""Every admission rule (core/admission.py) at the engine: the request is refused at
add_request with InvalidParameter naming the parameter, nothing of it stays queued, and the
engine goes on serving."""

from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.core.admission import InvalidParameter

# 32 blocks of 8 tokens (256 slots, watermark 0 at this size), context 128, 4 sequences.
POOL = dict(
    device="cpu",
    block_size=8,
    num_kv_blocks=32,
    num_swap_blocks=0,
    max_model_len=128,
    max_num_seqs=4,
)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), **POOL)
    yield engine
    engine.shutdown()


CASES = [
    # (prompt, params, param, code)
    ([], SamplingParams(max_tokens=2), "prompt", None),
    ([5, 1000], SamplingParams(max_tokens=2), "prompt", None),
    ([5, -1], SamplingParams(max_tokens=2), "prompt", None),
    ([5] * 128, SamplingParams(max_tokens=1), "prompt", "context_length_exceeded"),
    ([5] * 100, SamplingParams(max_tokens=29), "max_tokens", "context_length_exceeded"),
    (
        [5] * 100,
        SamplingParams(max_tokens=None, min_tokens=29),
        "min_tokens",
        "context_length_exceeded",
    ),
    ([5] * 4, SamplingParams(best_of=5, max_tokens=2), "best_of", None),
    ([5] * 4, SamplingParams(n=5, max_tokens=2), "n", None),
    (
        [5] * 4,
        SamplingParams(use_beam_search=True, best_of=5, temperature=0, max_tokens=2),
        "best_of",
        None,
    ),
    # Peak blocks, shared prompt counted once: 8 + 4 * 8 = 40 > 32 (each sample 64 own tokens).
    ([5] * 64, SamplingParams(n=4, temperature=1.0, max_tokens=64), "n", "context_length_exceeded"),
    ([5] * 4, SamplingParams(max_tokens=2, stop_token_ids=[1000]), "stop_token_ids", None),
    ([5] * 4, SamplingParams(max_tokens=2, logit_bias={1000: 1.0}), "logit_bias", None),
]


@pytest.mark.parametrize("prompt, params, param, code", CASES)
def test_admission_refuses_with_the_parameter_named(llm, prompt, params, param, code):
    with pytest.raises(InvalidParameter) as info:
        llm.engine.add_request("bad", None, params, prompt_token_ids=prompt)
    assert info.value.param == param and info.value.code == code, str(info.value)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.groups


def test_a_group_that_fits_only_by_sharing_its_prompt_is_admitted(llm):
    # 12 prompt blocks shared + 4 samples x 3 own = 24 of 32 blocks (costed per sample, as
    # before issue 11, it would be 4 x 15 = 60): admitted, and it runs to its end.
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=20, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[5] * 100], sampling_params=params)[0]
    assert out.error is None and [len(c.token_ids) for c in out.outputs] == [20] * 4
    llm.engine.block_manager.check_no_leaks()


def test_one_refused_prompt_refuses_the_whole_generate_call(llm):
    with pytest.raises(InvalidParameter, match="context length"):
        llm.generate(
            prompt_token_ids=[[5, 6], [5] * 200, [7, 8]],
            sampling_params=SamplingParams(max_tokens=2),
        )
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(
        prompt_token_ids=[[5, 6], [7, 8]], sampling_params=SamplingParams(max_tokens=2)
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    llm.engine.block_manager.check_no_leaks()
