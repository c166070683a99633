"""A request resumed after a worker restart (engine/recovery.py) goes on with the tokens an
uninterrupted run gives, seeded sampling, penalties and min_tokens included (issue 26: a
seeded request resumed with different text, 23 of 55 tokens in common). The restart is
simulated on the tiny model: the request is cut off after k tokens and resumed, as
RequestBook.resume_all does, as a new request on the engine."""

from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.engine.recovery import resume_request, splice

PROMPT = list(range(100, 131))
N = 40


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=8, num_kv_blocks=128, num_swap_blocks=0,
              max_model_len=256, enable_prefix_caching=False)
    yield llm.engine
    llm.shutdown()


def _finish(engine, rid: str, ids: list[int], params: SamplingParams, stop_after: int | None = None):
    """Run one request; with ``stop_after``, abort it once it has that many tokens (the fault)
    and return its output then."""
    engine.add_request(rid, None, params, prompt_token_ids=ids)
    for _ in range(1000):
        for out in engine.step():
            if stop_after is not None and len(out.outputs[0].token_ids) >= stop_after:
                engine.abort_request(rid)
                return out
            if out.finished:
                return out
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1234, max_tokens=N, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=N, ignore_eos=True),
    # Presence / frequency penalties count outputs only: the earlier outputs stay outputs.
    SamplingParams(temperature=1.0, seed=5, max_tokens=N, ignore_eos=True, presence_penalty=1.5,
                   frequency_penalty=0.5, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, frequency_penalty=1.0),
    # min_tokens spans the restart point: EOS stays banned until the 30th token overall.
    SamplingParams(temperature=1.0, seed=99, max_tokens=N, min_tokens=30, logit_bias={2: 8.0}),
], ids=["seeded", "seeded-top-k-p", "seeded-penalties", "greedy-penalty", "min-tokens"])
@pytest.mark.parametrize("cut", [1, 17])
def test_a_resumed_request_gives_the_uninterrupted_tokens(engine, params, cut):
    expected = _finish(engine, "whole", PROMPT, params).outputs[0]
    before = _finish(engine, "cut", PROMPT, params, stop_after=cut)
    assert len(before.outputs[0].token_ids) == cut
    ids, resumed_params, base = resume_request(PROMPT, params, before, None)
    assert resumed_params.resumed_output_tokens == cut and len(ids) == len(PROMPT) + cut
    after = splice(base, _finish(engine, "resumed", ids, resumed_params)).outputs[0]
    assert after.token_ids == expected.token_ids
    assert after.finish_reason == expected.finish_reason
    engine.block_manager.check_no_leaks()


def test_a_request_resumed_twice_still_follows_its_stream(engine):
    params = SamplingParams(temperature=1.0, seed=31, max_tokens=N, ignore_eos=True, presence_penalty=1.0)
    expected = _finish(engine, "whole", PROMPT, params).outputs[0].token_ids
    first = _finish(engine, "cut1", PROMPT, params, stop_after=9)
    ids, p1, base1 = resume_request(PROMPT, params, first, None)
    second = splice(base1, _finish(engine, "cut2", ids, p1, stop_after=11))
    assert len(second.outputs[0].token_ids) == 9 + 11
    ids2, p2, base2 = resume_request(PROMPT, params, second, None)  # from the original request, as resume_all does
    assert p2.resumed_output_tokens == 20
    assert splice(base2, _finish(engine, "done", ids2, p2)).outputs[0].token_ids == expected


def test_resumed_output_tokens_must_leave_a_prompt(engine):
    from streamkv.sampling_params import InvalidParameter

    with pytest.raises(InvalidParameter) as e:
        engine.add_request("bad", None, SamplingParams(resumed_output_tokens=3), prompt_token_ids=[5, 6, 7])
    assert e.value.param == "resumed_output_tokens"
