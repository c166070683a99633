"""A request resumed after a worker restart (engine/recovery.py) goes on with the tokens an
uninterrupted run gives, seeded sampling, penalties and min_tokens included (issue 26: a
seeded request resumed with different text, 23 of 55 tokens in common), and so does each
sample of a request of several (n > 1, best_of). The restart is simulated on the tiny
model: the request is cut off after k tokens and resumed, as RequestBook.resume_all does,
as new requests on the engine whose outputs ``Resumed.join`` puts back together."""

from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.engine.recovery import resume
from streamkv.sequence import RequestOutput

PROMPT = list(range(100, 131))
N = 40


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        block_size=8,
        num_kv_blocks=128,
        num_swap_blocks=0,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    yield llm.engine
    llm.shutdown()


def _finish(
    engine, rid: str, ids: list[int], params: SamplingParams, stop_after: int | None = None
):
    """Run one request; with ``stop_after``, abort it once a sample has that many tokens (the
    fault) and return its output then."""
    engine.add_request(rid, None, params, prompt_token_ids=ids)
    for _ in range(1000):
        for out in engine.step():
            if stop_after is not None and max(len(c.token_ids) for c in out.outputs) >= stop_after:
                engine.abort_request(rid)
                return out
            if out.finished:
                return out
    raise AssertionError("the request did not finish")


def _resume(
    engine, rid: str, params: SamplingParams, before: RequestOutput, cut: int | None = None
):
    """Resume ``rid`` from ``before`` as resume_all does and run its parts to the end (with
    ``cut``, until a sample has that many tokens: a second fault). Returns the joined output
    and the parts that were run."""
    parts, resumed = resume(rid, PROMPT, params, before, None)
    assert resumed is not None
    for part in parts:
        engine.add_request(
            part.request_id, None, part.params, prompt_token_ids=part.prompt_token_ids
        )
    for _ in range(1000):
        for out in engine.step():
            joined, ended = resumed.join(out)
            for part_id in ended:
                engine.abort_request(part_id)
            if joined is None:
                continue
            if cut is not None and max(len(c.token_ids) for c in joined.outputs) >= cut:
                for part_id in resumed.running:
                    engine.abort_request(part_id)
                return joined, parts
            if joined.finished:
                return joined, parts
    raise AssertionError("the resumed request did not finish")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1234, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=N, ignore_eos=True),
        # Presence / frequency penalties count outputs only: the earlier outputs stay outputs.
        SamplingParams(
            temperature=1.0,
            seed=5,
            max_tokens=N,
            ignore_eos=True,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
        ),
        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, frequency_penalty=1.0),
        # min_tokens spans the restart point: EOS stays banned until the 30th token overall.
        SamplingParams(temperature=1.0, seed=99, max_tokens=N, min_tokens=30, logit_bias={2: 8.0}),
    ],
    ids=["seeded", "seeded-top-k-p", "seeded-penalties", "greedy-penalty", "min-tokens"],
)
@pytest.mark.parametrize("cut", [1, 17])
def test_a_resumed_request_gives_the_uninterrupted_tokens(engine, params, cut):
    expected = _finish(engine, "whole", PROMPT, params).outputs[0]
    before = _finish(engine, "cut", PROMPT, params, stop_after=cut)
    assert len(before.outputs[0].token_ids) == cut
    after, (part,) = _resume(engine, "cut", params, before)
    assert part.request_id == "cut" and part.params.resumed_output_tokens == cut
    assert len(part.prompt_token_ids) == len(PROMPT) + cut
    assert after.outputs[0].token_ids == expected.token_ids
    assert after.outputs[0].finish_reason == expected.finish_reason
    engine.block_manager.check_no_leaks()


def test_a_request_resumed_twice_still_follows_its_stream(engine):
    params = SamplingParams(
        temperature=1.0, seed=31, max_tokens=N, ignore_eos=True, presence_penalty=1.0
    )
    expected = _finish(engine, "whole", PROMPT, params).outputs[0].token_ids
    first = _finish(engine, "cut", PROMPT, params, stop_after=9)
    second, _ = _resume(engine, "cut", params, first, cut=20)
    assert len(second.outputs[0].token_ids) == 20
    # From the original request and the joined output, as resume_all does.
    (part,) = resume("cut", PROMPT, params, second, None)[0]
    assert part.params.resumed_output_tokens == 20
    assert _resume(engine, "cut", params, second)[0].outputs[0].token_ids == expected


def test_resumed_output_tokens_must_leave_a_prompt(engine):
    from streamkv.sampling_params import InvalidParameter

    with pytest.raises(InvalidParameter) as e:
        engine.add_request(
            "bad", None, SamplingParams(resumed_output_tokens=3), prompt_token_ids=[5, 6, 7]
        )
    assert e.value.param == "resumed_output_tokens"


# -- requests of several samples ----------------------------------------------------------
def _same(after: RequestOutput, expected: RequestOutput) -> None:
    """The joined output is the uninterrupted one: choices, tokens, finish reasons, logprobs."""
    assert after.finished and after.prompt_token_ids == expected.prompt_token_ids
    assert [c.index for c in after.outputs] == [c.index for c in expected.outputs]
    assert [c.token_ids for c in after.outputs] == [c.token_ids for c in expected.outputs]
    assert [c.finish_reason for c in after.outputs] == [c.finish_reason for c in expected.outputs]
    assert [c.stop_reason for c in after.outputs] == [c.stop_reason for c in expected.outputs]
    for a, e in zip(after.outputs, expected.outputs, strict=True):
        assert a.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-3)
        if e.logprobs is not None:
            assert [list(x) for x in a.logprobs] == [list(x) for x in e.logprobs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=N, ignore_eos=True, logprobs=2),
        SamplingParams(
            n=3,
            temperature=0.9,
            top_p=0.8,
            seed=3,
            max_tokens=N,
            ignore_eos=True,
            presence_penalty=1.0,
            frequency_penalty=0.4,
        ),
        SamplingParams(n=3, temperature=0, max_tokens=N, ignore_eos=True),
    ],
    ids=["seeded", "seeded-top-p-penalties", "greedy"],
)
@pytest.mark.parametrize("cut", [1, 17])
def test_each_sample_resumes_with_its_uninterrupted_tokens(engine, params, cut):
    expected = _finish(engine, "whole", PROMPT, params)
    assert len({tuple(c.token_ids) for c in expected.outputs}) == (1 if params.greedy else 3)
    before = _finish(engine, "cut", PROMPT, params, stop_after=cut)
    after, parts = _resume(engine, "cut", params, before)
    # One request per sample, keeping its index (which keys its seeded stream).
    assert [p.request_id for p in parts] == ["cut#sample-0", "cut#sample-1", "cut#sample-2"]
    assert [(p.params.n, p.params.best_of, p.params.resumed_sample_index) for p in parts] == [
        (1, 1, 0),
        (1, 1, 1),
        (1, 1, 2),
    ]
    _same(after, expected)
    engine.block_manager.check_no_leaks()


def test_samples_that_had_ended_stay_as_they_were(engine):
    # Token 7 is likely enough that the samples end at different lengths.
    params = SamplingParams(
        n=3, temperature=1.0, seed=21, max_tokens=N, stop_token_ids=[7], logit_bias={7: 3.5}
    )
    expected = _finish(engine, "whole", PROMPT, params)
    lengths = sorted(len(c.token_ids) for c in expected.outputs)
    assert lengths[0] < lengths[-1], lengths
    before = _finish(engine, "cut", PROMPT, params, stop_after=lengths[0] + 1)
    assert any(c.finish_reason for c in before.outputs) and not before.finished
    after, parts = _resume(engine, "cut", params, before)
    assert len(parts) == sum(c.finish_reason is None for c in before.outputs) < 3
    _same(after, expected)


@pytest.mark.parametrize("n, best_of", [(1, 3), (2, 4)])
def test_best_of_chooses_among_the_resumed_samples_as_the_engine_does(engine, n, best_of):
    params = SamplingParams(
        n=n, best_of=best_of, temperature=1.0, seed=8, max_tokens=24, ignore_eos=True
    )
    expected = _finish(engine, "whole", PROMPT, params)
    assert len(expected.outputs) == n
    before = _finish(engine, "cut", PROMPT, params, stop_after=10)
    assert len(before.outputs) == best_of  # every candidate, while running
    after, parts = _resume(engine, "cut", params, before)
    assert len(parts) == best_of
    _same(after, expected)
    # The n best by cumulative logprob over every candidate, carried across the restart.
    candidates = _finish(
        engine,
        "all",
        PROMPT,
        SamplingParams(n=best_of, temperature=1.0, seed=8, max_tokens=24, ignore_eos=True),
    ).outputs
    best = sorted(candidates, key=lambda c: -c.cumulative_logprob)[:n]
    assert [c.token_ids for c in after.outputs] == [c.token_ids for c in best]
    engine.block_manager.check_no_leaks()


def test_samples_resumed_twice_still_follow_their_streams(engine):
    params = SamplingParams(n=2, temperature=1.0, seed=77, max_tokens=N, ignore_eos=True)
    expected = _finish(engine, "whole", PROMPT, params)
    first = _finish(engine, "cut", PROMPT, params, stop_after=5)
    second, _ = _resume(engine, "cut", params, first, cut=19)
    assert max(len(c.token_ids) for c in second.outputs) == 19 and not second.finished
    after, _ = _resume(engine, "cut", params, second)
    _same(after, expected)


def test_beam_search_and_token_less_requests_start_over(engine):
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=8)
    before = _finish(engine, "beam", PROMPT, beams, stop_after=3)
    assert any(c.token_ids for c in before.outputs)
    (part,), resumed = resume("beam", PROMPT, beams, before, None)
    assert resumed is None and (part.request_id, part.prompt_token_ids, part.params) == (
        "beam",
        PROMPT,
        beams,
    )
    parallel = SamplingParams(n=3, seed=1)
    (part,), resumed = resume("p", PROMPT, parallel, None, None)
    assert resumed is None and part.params is parallel


def test_the_samples_compute_their_common_prompt_once(engine, tiny_llama_dir):
    """After a restart the cache is empty; with prefix caching on, the samples' parts share
    the full blocks of the prompt they have in common: one computes them, the others hit."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    expected = _finish(engine, "whole", PROMPT, params)
    before = _finish(engine, "cut", PROMPT, params, stop_after=5)
    assert len({c.token_ids[0] for c in before.outputs}) == 3  # no block shared past the prompt
    fresh = LLM(
        str(tiny_llama_dir),
        device="cpu",
        block_size=8,
        num_kv_blocks=128,
        num_swap_blocks=0,
        max_model_len=256,
        enable_prefix_caching=True,
    )
    try:
        after, parts = _resume(fresh.engine, "cut", params, before)
        _same(after, expected)
        shared = (
            len(PROMPT) // 8 * 8
        )  # the prompt's full blocks (the 4th holds each sample's first token)
        assert fresh.engine.stats()["prefix_cache_hits"] == (len(parts) - 1) * shared
    finally:
        fresh.shutdown()
