"""Memory sharing on copy-on-write blocks: parallel sampling, best_of, beam search, prefix
caching, all mixed in one batch, under preemption, with no leaked blocks."""

from __future__ import annotations

import pytest
import torch

from streamkv import BeamSearchParams, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def add(a, b):",
    "Three reasons to learn Python are",
]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(
        block_size=8, num_kv_blocks=1024, num_swap_blocks=256, enable_prefix_caching=False
    )


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


def _hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].float()
    lp = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0]


def test_forked_samples_never_see_each_others_tokens(llm, prompt_ids, hf_model):
    """Each sample's reported logprobs equal transformers' on that sample's own sequence:
    a sample reading a sibling's KV through a shared block would get different numbers."""
    before = llm.stats()["num_cow_copies"]
    prompt = next(p for p in prompt_ids if len(p) % 8)  # a partly filled last block
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(
            n=4, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True, logprobs=0
        ),
    )[0]
    assert len(out.outputs) == 4
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.stats()["num_cow_copies"] > before
    for comp in out.outputs:
        ours = torch.tensor([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)])
        ref = _hf_logprobs(hf_model, prompt, comp.token_ids)
        assert torch.allclose(ours, ref, atol=2e-3), (ours - ref).abs().max()


def test_prompt_blocks_are_shared_while_samples_run(llm, prompt_ids):
    engine = llm.engine
    prompt = prompt_ids[3] * 4  # several full blocks
    engine.add_request(
        "share",
        None,
        SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True),
        prompt,
    )
    engine.step()  # prompt computed once, 4 samples forked
    group = engine.groups["share"]
    assert len(group.seqs) == 4
    tables = [engine.block_manager.tables[s.seq_id] for s in group.seqs]
    full = len(prompt) // 8
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert engine.stats()["num_shared_blocks"] >= full
    while engine.has_unfinished_requests():
        engine.step()


def test_seeded_samples_are_reproducible_in_any_batch(llm, prompt_ids):
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[prompt_ids[0]], sampling_params=params)[0]
    mixed = llm.generate(
        prompt_token_ids=[prompt_ids[2], prompt_ids[0]],
        sampling_params=[SamplingParams(n=2, temperature=1.0, max_tokens=20), params],
    )[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]


def test_best_of_returns_the_n_most_likely(llm, prompt_ids):
    out = llm.generate(
        prompt_token_ids=[prompt_ids[0]],
        sampling_params=SamplingParams(
            n=2, best_of=5, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True
        ),
    )[0]
    assert len(out.outputs) == 2
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    "width, early_stopping, length_penalty", [(2, False, 1.0), (4, True, 0.6), (4, "never", 1.0)]
)
def test_beam_search_equals_transformers(
    llm, prompt_ids, hf_model, width, early_stopping, length_penalty
):
    outs = llm.beam_search(
        prompt_ids[:3],
        BeamSearchParams(width, 20, length_penalty=length_penalty, early_stopping=early_stopping),
    )
    for ids, out in zip(prompt_ids[:3], outs):
        with torch.inference_mode():
            g = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=20,
                num_beams=width,
                num_return_sequences=width,
                do_sample=False,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
                pad_token_id=0,
            )
        eos = hf_model.generation_config.eos_token_id
        ref = []
        for row in g[:, len(ids) :].tolist():
            # transformers pads finished hypotheses after their EOS.
            ref.append(row[: row.index(eos) + 1] if eos in row else row)
        assert [c.token_ids for c in out.outputs] == ref


def test_vllm_v0_beam_search_spelling(llm, prompt_ids):
    a = llm.beam_search(prompt_ids[:1], BeamSearchParams(3, 12))[0]
    b = llm.generate(
        prompt_token_ids=prompt_ids[:1],
        sampling_params=SamplingParams(
            n=3, best_of=3, use_beam_search=True, temperature=0, max_tokens=12
        ),
    )[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def _mixed_params():
    return [
        SamplingParams(temperature=0, max_tokens=16),
        SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
        SamplingParams(n=2, best_of=3, temperature=0.8, seed=9, max_tokens=16, ignore_eos=True),
        BeamSearchParams(3, 16).to_sampling_params(),
    ]


def _texts(outs):
    return [[tuple(c.token_ids) for c in o.outputs] for o in outs]


def test_mixed_decoding_in_one_batch_equals_each_alone(llm, prompt_ids):
    params = _mixed_params()
    together = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    alone = [
        llm.generate(prompt_token_ids=[p], sampling_params=sp)[0]
        for p, sp in zip(prompt_ids, params)
    ]
    assert _texts(together) == _texts(alone)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempting_multi_sequence_groups_keeps_results(make_llm, llm, prompt_ids, mode):
    params = _mixed_params()
    reference = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    small = make_llm(block_size=8, num_kv_blocks=24, num_swap_blocks=24, preemption_mode=mode)
    before = small.stats()["num_preemptions"]
    outs = small.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    assert small.stats()["num_preemptions"] > before
    assert _texts(outs) == _texts(reference)


def test_prefix_cache_gives_identical_greedy_outputs_and_hits(make_llm, llm, prompt_ids):
    cached = make_llm(
        block_size=8, num_kv_blocks=1024, num_swap_blocks=0, enable_prefix_caching=True
    )
    system = llm.get_tokenizer().encode("You are a concise assistant. Answer in one sentence. " * 4)
    prompts = [system + p for p in prompt_ids]
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    first = cached.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    hits_before = cached.stats()["prefix_cache_hits"]
    rest = cached.generate(prompt_token_ids=prompts, sampling_params=params)
    assert (
        cached.stats()["prefix_cache_hits"] - hits_before >= len(prompts) * (len(system) // 8) * 8
    )
    assert _texts(first) == _texts(ref[:1])
    assert _texts(rest) == _texts(ref)


def test_prefix_cache_eviction_under_pressure(make_llm, llm, prompt_ids):
    cached = make_llm(
        block_size=8, num_kv_blocks=24, num_swap_blocks=24, enable_prefix_caching=True
    )
    params = SamplingParams(temperature=0, max_tokens=12)
    long_prompts = [p * 6 for p in prompt_ids]  # ~8 blocks each: together more than 24
    ref = llm.generate(prompt_token_ids=long_prompts, sampling_params=params)
    for _ in range(2):
        outs = cached.generate(prompt_token_ids=long_prompts, sampling_params=params)
        assert _texts(outs) == _texts(ref)
    assert cached.engine.block_manager.device.num_evictions > 0
