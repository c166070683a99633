"""Async scheduling on a GPU: the pending input token gathered on the device from the step
before reaches the decode graphs' static input buffer, the piecewise graphs and the eager
path, and the launch path does not wait for the device.

- greedy, seeded, top-p and penalised generation with async scheduling equals it without,
  token for token, with decode graphs and piecewise graphs replayed and with eager steps,
  under preemption by recompute and by swap;
- a step is handed to the device without waiting for the stream: while long kernels of
  ours hold it, an engine step (greedy and seeded top-k rows) returns before they end.
"""

from __future__ import annotations

import random

import pytest
import torch

from streamkv import SamplingParams
from streamkv.entrypoints.llm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.choice([3, 40, 90, 200]))] for _ in range(n)]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=4, max_tokens=24, ignore_eos=True),
    SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5
    ),
]


@pytest.mark.parametrize("case", ["graphs", "eager", "recompute", "swap"])
def test_async_equals_sync_on_cuda(tiny_dir, case):
    prompts = _prompts(12, 11)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    kw = dict(
        device="cuda",
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=128,
        num_kv_blocks=512,
        num_swap_blocks=0,
        enforce_eager=case == "eager",
    )
    if case in ("recompute", "swap"):
        kw.update(
            num_kv_blocks=48, preemption_mode=case, num_swap_blocks=128 if case == "swap" else 0
        )
    runs = {}
    for on in (True, False):
        llm = LLM(str(tiny_dir), async_scheduling=on, **kw)
        try:
            outs = llm.generate(None, params, prompt_token_ids=prompts)
            runs[on] = [list(o.outputs[0].token_ids) for o in outs]
            llm.engine.block_manager.check_no_leaks()
            assert (llm.engine.overlapped_steps > 0) == on
            runner = llm.engine.executor.worker.runner
            if case == "graphs":
                assert runner.graphs.replays > 0 and runner.mixed_graphs.replays > 0
            if case in ("recompute", "swap"):
                assert llm.stats()["num_preemptions"] > 0
        finally:
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()
    assert runs[True] == runs[False]


def test_a_step_does_not_wait_for_the_stream(tiny_dir):
    """While our own long matmuls hold the stream, one engine step hands over the next
    decode step (graph replay, pending tokens gathered on the device) and reads the step
    before, which ran ahead of the matmuls: it returns while the matmuls still run."""
    llm = LLM(
        str(tiny_dir),
        device="cuda",
        dtype="float32",
        num_kv_blocks=256,
        num_swap_blocks=0,
        max_num_seqs=8,
    )
    try:
        engine = llm.engine
        for i, p in enumerate(_prompts(4, 5)):
            engine.add_request(str(i), None, PARAMS[(0, 2)[i % 2]], prompt_token_ids=p)
        engine.step()
        engine.step()  # decoding now, one step in flight
        a = torch.randn(4096, 4096, device="cuda")
        (a @ a).sum().item()  # cuBLAS set up outside the timed part
        replays = engine.executor.worker.runner.graphs.replays
        for _ in range(60):
            a = a @ a
            a /= a.norm()
        held = torch.cuda.Event()
        held.record()
        engine.step()
        assert not held.query(), "the engine step waited for the whole stream"
        assert engine.executor.worker.runner.graphs.replays == replays + 1
        while engine.has_unfinished_requests():
            engine.step()
        engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()
