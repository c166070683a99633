"""Async scheduling on a GPU: what only CUDA exercises — the pending token gathered on the
device into the CUDA graphs' static inputs, pinned non-blocking sample copies read after an
event, steps timed by CUDA events — leaves outputs token-identical to the synchronous engine."""

from __future__ import annotations

import pytest
import torch

from streamkv import SamplingParams
from tests.engine.test_async_scheduling import GREEDY, PROMPTS, _same

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = dict(device="cuda", dtype="float32")


def test_greedy_with_graphs(tiny_llama_dir):
    _same(tiny_llama_dir, GREEDY, num_kv_blocks=256, **CUDA)


def test_preemption_and_chunks(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, stats = _same(
        tiny_llama_dir,
        params,
        num_kv_blocks=40,
        preemption_mode="recompute",
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        **CUDA,
    )
    assert stats["num_preemptions"] > 0


def test_penalties_and_seeds(tiny_llama_dir):
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=14,
            ignore_eos=True,
            presence_penalty=0.8,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
        ),
        SamplingParams(temperature=1.0, seed=11, max_tokens=14, ignore_eos=True, top_k=20),
        SamplingParams(
            temperature=0.9, seed=12, max_tokens=14, ignore_eos=True, top_p=0.8, logprobs=2
        ),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, min_tokens=6),
    ]
    _same(tiny_llama_dir, params * 4, PROMPTS * 4, num_kv_blocks=256, **CUDA)
