"""Chunked prefill keeps greedy outputs identical to transformers: token budgets of 16 and 64
split every long prompt across steps, mixed with other requests' decodes, in a pool small
enough to preempt (recompute) with the prefix cache on."""

from __future__ import annotations

import pytest
import torch

from streamkv import LLM
from tests.models.hf_tiny import greedy_compare, prompts

LENGTHS = (1, 5, 17, 30, 70, 120, 33)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill_matches_transformers_under_preemption(tiny_llama_dir, hf_tiny, budget):
    # 24 blocks of 8 tokens: the batch needs ~400 slots at its peak, so requests are preempted.
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=8, num_kv_blocks=24, num_swap_blocks=0,
              preemption_mode="recompute", max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=256)
    try:
        ids = prompts(1000, lengths=LENGTHS)
        ids.append(ids[5][:64] + ids[0])  # shares 8 full blocks with a longer prompt: a prefix-cache hit
        result = greedy_compare(hf_tiny, llm, ids, max_tokens=24)
        assert result.exact >= len(ids) - 1, result
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()
