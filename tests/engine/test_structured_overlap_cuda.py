"""Structured rows overlapped on a GPU: the forward of step N+1 runs while the host advances
the grammars on step N's tokens, and the masks (pinned, copied without a sync) reach the
sampler after it. Outputs stay token-identical to the synchronous engine with CUDA graphs,
eager, and recompute preemption, and every finished structured output follows its grammar."""

from __future__ import annotations

import pytest
import torch

from streamkv import LLM
from tests.engine.test_structured_overlap import _check_valid, _mixed, _run
from tests.tiny_models import KERNEL_HEADS, TEXT

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def tiny_cuda_dir(tiny_llama):
    """The CPU tests' tokenizer model with a head size (64) and block size the kernels serve."""
    return tiny_llama(**TEXT, **KERNEL_HEADS)


@pytest.mark.parametrize("case", ["graphs", "eager", "recompute"])
def test_structured_overlap_equals_synchronous_on_cuda(tiny_cuda_dir, case):
    base = dict(
        device="cuda",
        dtype="float32",
        max_model_len=256,
        num_swap_blocks=0,
        block_size=16,
        num_kv_blocks=8 if case == "recompute" else 512,
        enforce_eager=case == "eager",
        preemption_mode="recompute",
    )
    prompts, params = _mixed()
    if case == "recompute":  # more rows than 8 blocks hold: sequences are preempted mid-grammar
        prompts, params = prompts + [p + " again" for p in prompts[:5]], params + params[:5]
    on = LLM(str(tiny_cuda_dir), async_scheduling=True, overlap_structured=True, **base)
    try:
        got = _run(on, prompts, params)
        overlapped, preemptions = on.engine.overlapped_steps, on.engine.stats()["num_preemptions"]
    finally:
        on.shutdown()
    off = LLM(str(tiny_cuda_dir), async_scheduling=False, **base)
    try:
        want = _run(off, prompts, params)
    finally:
        off.shutdown()
    assert got == want
    _check_valid(got, params)
    assert overlapped > 0
    if case == "recompute":
        assert preemptions > 0
