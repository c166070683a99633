"""Chunked prefill keeps greedy outputs identical to transformers: token budgets of 16 and 64
split every long prompt across steps, mixed with other requests' decodes, in a pool small
enough to preempt (recompute) with the prefix cache on."""

from __future__ import annotations

import pytest
import torch

from streamkv import LLM
from streamkv.core.step_plan import decode_rows
from tests.models.hf_tiny import greedy_compare, prompts

LENGTHS = (1, 5, 17, 30, 70, 120, 33)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill_matches_transformers_under_preemption(tiny_llama_dir, hf_tiny, budget):
    # 24 blocks of 8 tokens: the batch needs ~400 slots at its peak, so requests are preempted.
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        block_size=8,
        num_kv_blocks=24,
        num_swap_blocks=0,
        preemption_mode="recompute",
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        max_model_len=256,
    )
    try:
        ids = prompts(1000, lengths=LENGTHS)
        ids.append(
            ids[5][:64] + ids[0]
        )  # shares 8 full blocks with a longer prompt: a prefix-cache hit
        result = greedy_compare(hf_tiny, llm, ids, max_tokens=24)
        assert result.exact >= len(ids) - 1, result
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()


def test_one_token_budget_decodes_first_then_prompt_chunks_up_to_the_budget(tiny_llama_dir):
    """The scheduling rule (core/scheduler.py): every step runs every running decode, then
    prompt chunks oldest first, until the token budget or max_num_seqs. No other bound: while
    prompts wait, a step beside decodes fills the whole budget (the fitted prefill cap that
    held prompt tokens back beside decodes is gone)."""
    from streamkv import SamplingParams

    budget = 128
    ids = prompts(1000, lengths=(120, 90, 110, 100) * 8)
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 7 * (i % 5), ignore_eos=True)
        for i in range(len(ids))
    ]
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        block_size=8,
        num_kv_blocks=800,
        num_swap_blocks=0,
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    try:
        engine, seen = llm.engine, []
        schedule = engine.scheduler.schedule

        def spy():
            decoding = sum(1 for g in engine.scheduler.running if decode_rows(g))
            waiting = bool(engine.scheduler.waiting) or any(
                decode_rows(g) is None for g in engine.scheduler.running
            )
            out = schedule()
            seen.append((decoding, waiting, out))
            return out

        engine.scheduler.schedule = spy
        llm.generate(None, params, prompt_token_ids=ids)
        engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()
    full_mixed = 0
    for decoding, _, out in seen:
        assert out.num_batched_tokens <= budget and len(out.scheduled) <= 16
        assert out.num_decodes == decoding  # every running decode row ran
        prompt_tokens = out.num_batched_tokens - out.num_decodes
        if out.num_decodes and prompt_tokens and out.num_batched_tokens == budget:
            full_mixed += 1
    # Steps that carry decodes and prompt chunks use the whole budget while prompts wait.
    assert full_mixed >= 3, [(d, o.num_decodes, o.num_batched_tokens) for d, _, o in seen]
