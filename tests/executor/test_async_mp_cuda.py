"""Async scheduling through worker processes on GPUs (run on the GPU host; skipped
elsewhere): outputs equal the synchronous engine's with the mp executor at TP 1 (one GPU)
and TP 2 (two GPUs: rank 0's pending tokens reach rank 1 by an NCCL broadcast queued
behind the sampler), CUDA graphs on, and steps overlap."""

from __future__ import annotations

import pytest
import torch

from streamkv.entrypoints.llm import LLM
from tests.executor.test_async_mp import _outputs
from tests.tiny_models import KERNEL_HEADS

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny64_dir(tiny_llama):
    """4 query / 2 KV heads of 64 (a head size the CUDA kernels serve), untied lm_head."""
    return tiny_llama(**KERNEL_HEADS, max_position_embeddings=512, tie_word_embeddings=False)


@pytest.mark.parametrize("tp", [1, 2])
def test_async_mp_on_gpus_equals_the_synchronous_engine(tiny64_dir, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s)")
    got = {}
    for on in (True, False):
        llm = LLM(
            str(tiny64_dir),
            device="cuda",
            dtype="float32",
            num_kv_blocks=64,
            num_swap_blocks=0,
            max_model_len=128,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp",
            async_scheduling=on,
        )
        try:
            got[on] = _outputs(llm)
            assert (llm.engine.overlapped_steps > 5) == on
        finally:
            llm.shutdown()
    assert got[True] == got[False]
