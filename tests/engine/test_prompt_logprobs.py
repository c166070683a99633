"""Prompt logprobs (SamplingParams.prompt_logprobs) come from the prefill pass and equal a
direct forward pass of the same model: whole prompts, prompts cut into 16-token chunks, and
prompts whose prefix is in the prefix cache; max_logprobs caps them."""

from __future__ import annotations

import pytest
import torch

from streamkv.sampling_params import InvalidParameter, SamplingParams

ATOL = 2e-3  # float32 on the CPU: two implementations summing in different orders
TEXTS = [
    "The capital of France is Paris, and the capital of Italy is",
    (
        "def fibonacci(n):\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    )
    * 2,
    "Hi",
]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(block_size=16, num_kv_blocks=1024, num_swap_blocks=0)


@pytest.fixture(scope="module")
def chunked(make_llm):
    return make_llm(
        block_size=16,
        num_kv_blocks=256,
        num_swap_blocks=0,
        max_num_batched_tokens=16,
        max_num_seqs=16,
    )


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    assert len(ids[1]) > 48 and len(ids[2]) <= 2
    return ids


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check(entries, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry, row, token = entries[i], ref[i - 1], ids[i]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=ATOL), f"token {i}"
        # Its rank counts the tokens more likely than it (ties within rounding either way).
        above = int((row > row[token] + ATOL).sum()) + 1
        assert above <= entry[token].rank <= int((row > row[token] - ATOL).sum()) + 1
        others = {t: lp for t, lp in entry.items() if t != token}
        assert len(entry) in (k, k + 1) and len(others) <= k
        top = row.topk(k).values if k else torch.empty(0)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:k]
        for lp, want in zip(ranked, top.tolist()):
            assert lp.logprob == pytest.approx(want, abs=ATOL)
        for t, lp in others.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_a_forward_pass(llm, hf_model, prompts, k):
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k),
    )
    for out, ids in zip(outs, prompts):
        _check(out.prompt_logprobs, ids, _reference(hf_model, ids), k)
    plain = llm.generate(
        prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=2)
    )
    assert plain[0].prompt_logprobs is None


@pytest.mark.slow
def test_chunked_prefill_and_a_prefix_cache_hit(chunked, hf_model, prompts):
    long = prompts[1]
    bm = chunked.engine.block_manager
    chunked.generate(
        prompt_token_ids=[long], sampling_params=SamplingParams(temperature=0, max_tokens=2)
    )
    hits = bm.prefix_cache_hits
    # The same prompt again, with prompt logprobs, beside a request that reuses its cache.
    params = [
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    outs = chunked.generate(prompt_token_ids=[long, long[:40] + prompts[0]], sampling_params=params)
    assert bm.prefix_cache_hits > hits  # the cache held the prompt's blocks
    _check(
        outs[0].prompt_logprobs, long, _reference(hf_model, long), 2
    )  # 16-token chunks, whole prompt
    assert outs[1].prompt_logprobs is None


@pytest.mark.slow
def test_max_logprobs_caps_both(llm, prompts):
    engine = llm.engine
    cap = engine.config.model.max_logprobs
    assert cap == 20
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidParameter) as e:
            engine.add_request(
                "too-many", None, SamplingParams(**{name: cap + 1}), prompt_token_ids=prompts[0]
            )
        assert e.value.param == name and str(cap) in str(e.value)
    assert not engine.has_unfinished_requests()
    out = llm.generate(
        prompt_token_ids=prompts[:1],
        sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=cap, logprobs=cap),
    )
    assert len(out[0].prompt_logprobs[1]) in (cap, cap + 1)
    with pytest.raises(InvalidParameter):
        SamplingParams(prompt_logprobs=-1)


def test_max_logprobs_is_an_engine_argument():
    import argparse

    from streamkv.entrypoints.args import add_engine_args, engine_config, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-logprobs", "5"])
    assert engine_config(None, **engine_kwargs(args)).model.max_logprobs == 5
    assert parser.parse_args([]).max_logprobs == 20
    with pytest.raises(ValueError, match="max_logprobs"):
        engine_config(None, max_logprobs=-2).verify()
