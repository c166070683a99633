"""vLLM's allowed_token_ids and cache_salt through the engine on the tiny model (CPU): only
allowed tokens are ever sampled, greedy or not; equal prompts share prefix-cache blocks only
under equal salts."""

from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.sampling_params import InvalidParameter

ALLOWED = [3, 17, 256, 511, 998]
PROMPT = list(range(40, 80))  # 40 tokens: 5 whole blocks of 8


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        block_size=8,
        num_kv_blocks=128,
        num_swap_blocks=0,
        max_model_len=256,
        enable_prefix_caching=True,
    )
    yield llm
    llm.shutdown()


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, None, params, prompt_token_ids=ids)
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.block_manager.check_no_leaks()
    return done


def test_only_allowed_tokens_are_sampled(llm):
    runs = {
        "greedy": SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=ALLOWED
        ),
        "seeded": SamplingParams(
            temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, allowed_token_ids=ALLOWED
        ),
        "n3": SamplingParams(
            n=3,
            temperature=1.5,
            top_p=0.9,
            max_tokens=24,
            ignore_eos=True,
            allowed_token_ids=ALLOWED,
        ),
        "top_k": SamplingParams(
            temperature=1.0, top_k=2, max_tokens=24, ignore_eos=True, allowed_token_ids=ALLOWED
        ),
        # A bias that forces a token outside the set, and penalties, change nothing about the set.
        "biased": SamplingParams(
            temperature=1.0,
            max_tokens=24,
            ignore_eos=True,
            allowed_token_ids=ALLOWED,
            logit_bias={5: 100.0},
            presence_penalty=1.5,
            logprobs=3,
        ),
        "one": SamplingParams(
            temperature=1.0, max_tokens=8, ignore_eos=True, allowed_token_ids=[42]
        ),
    }
    done = _run(llm.engine, {rid: (PROMPT, p) for rid, p in runs.items()})
    assert set(done) == set(runs)
    seen = set()
    for rid, out in done.items():
        assert out.error is None
        for c in out.outputs:
            assert len(c.token_ids) == runs[rid].max_tokens
            seen |= set(c.token_ids)
            assert set(c.token_ids) <= (set(runs[rid].allowed_token_ids)), rid
    assert len(seen) > 2  # the sampled rows really spread over the set
    assert done["one"].outputs[0].token_ids == [42] * 8
    for top in done["biased"].outputs[0].logprobs:  # logprobs of the masked distribution
        assert all(t in ALLOWED or lp.logprob == float("-inf") for t, lp in top.items())


def test_the_mask_does_not_leak_into_other_rows(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _run(llm.engine, {"free": (PROMPT, free)})["free"].outputs[0].token_ids
    both = _run(
        llm.engine,
        {
            "free": (PROMPT, free),
            "masked": (
                PROMPT,
                SamplingParams(
                    temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=[3]
                ),
            ),
        },
    )
    assert both["free"].outputs[0].token_ids == alone
    assert both["masked"].outputs[0].token_ids == [3] * 12


@pytest.mark.parametrize(
    "params",
    [
        dict(allowed_token_ids=[1000]),  # the tiny model's vocabulary is 1000
        dict(allowed_token_ids=[5, -1]),
        dict(allowed_token_ids=[]),
        dict(allowed_token_ids=[5], structured_outputs={"regex": "a+"}),
    ],
)
def test_bad_allowed_token_ids_are_refused_by_name(llm, params):
    with pytest.raises(InvalidParameter) as e:
        llm.engine.add_request(
            "bad", None, SamplingParams(max_tokens=4, **params), prompt_token_ids=PROMPT
        )
    assert e.value.param == "allowed_token_ids"
    assert not llm.engine.has_unfinished_requests()


def test_allowed_tokens_that_min_tokens_bans_are_refused(llm):
    eos = sorted(llm.engine.eos_token_ids)
    with pytest.raises(InvalidParameter) as e:
        llm.engine.add_request(
            "bad",
            None,
            SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=eos),
            prompt_token_ids=PROMPT,
        )
    assert e.value.param == "allowed_token_ids"


def test_cache_salt_isolates_prefix_cache_hits(llm):
    engine = llm.engine
    llm.reset_prefix_cache()
    bm = engine.block_manager

    def hits(rid: str, salt: str | None) -> int:
        before = bm.prefix_cache_hits
        _run(engine, {rid: (PROMPT, SamplingParams(temperature=0, max_tokens=2, cache_salt=salt))})
        return bm.prefix_cache_hits - before

    assert hits("a1", "tenant-a") == 0
    assert hits("b1", "tenant-b") == 0  # the same prompt under another salt: no block shared
    assert hits("u1", None) == 0  # nor unsalted
    assert (
        hits("a2", "tenant-a") == 32
    )  # the same salt: its 4 whole prompt blocks (the 5th holds the last token)
    assert hits("u2", None) == 32
    llm.reset_prefix_cache()  # every cached block forgotten: the same prompt computes cold
    assert hits("u3", None) == 0
