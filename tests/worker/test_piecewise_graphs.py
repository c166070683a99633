"""Piecewise CUDA graphs for steps with prompt tokens (worker/piecewise_graphs.py).

Everywhere: the token-count ladder, and that a CPU engine captures nothing. On a GPU: one
mixed step (decodes, a fresh prompt, a chunk after a cached prefix, padding) replayed
piecewise gives the hidden states of the same step run eagerly, and greedy generation with
the graphs equals ``enforce_eager=True`` token for token while prompts are cut into chunks
by a small budget and decodes run beside them, with preemption by recompute, the mixed
graphs actually replayed.
"""

from __future__ import annotations

import random

import pytest
import torch

from streamkv import SamplingParams
from streamkv.entrypoints.llm import LLM
from streamkv.worker.input_batch import SampleRequest, SeqInput
from streamkv.worker.piecewise_graphs import token_buckets

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _runner(llm: LLM):
    return llm.engine.executor.worker.runner


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1000) for _ in range(rng.choice([3, 40, 90, 200, 333]))] for _ in range(n)
    ]


def test_token_buckets():
    assert token_buckets(16) == [16]
    assert token_buckets(300) == [16, 32, 64, 128, 256, 300]
    b = token_buckets(2048)
    assert b[:4] == [16, 32, 64, 128] and b[-1] == 2048 and all(x % 128 == 0 for x in b[3:])
    big = token_buckets(8192)
    assert big[-1] == 8192 and big == sorted(set(big))
    # past 2048 each step grows by a quarter, so padding stays under 25% of a step
    assert all(y <= x + x // 4 for x, y in zip(big[15:], big[16:]))
    with pytest.raises(ValueError):
        token_buckets(0)


def test_cpu_never_captures(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", num_kv_blocks=64, num_swap_blocks=0)
    assert _runner(llm).mixed_graphs is None


@cuda
def test_replay_equals_eager_same_step(tiny_dir):
    """One mixed step: 3 decodes, a fresh 40-token prompt, a 25-token chunk after a cached
    prefix of 30 — 68 tokens, replayed in the 128-token bucket (60 rows of padding)."""
    llm = LLM(
        str(tiny_dir),
        device="cuda",
        dtype="float32",
        num_kv_blocks=256,
        num_swap_blocks=0,
        max_num_batched_tokens=256,
    )
    runner, kv = _runner(llm), llm.engine.executor.worker.cache.device_cache
    rng = random.Random(0)
    greedy = SampleRequest()
    # Fill the caches first: contexts of the decodes and the chunk's prefix (one eager step).
    warm = [
        SeqInput(i, [rng.randrange(1000) for _ in range(n)], 0, list(range(i * 8, i * 8 + 8)), None)
        for i, n in enumerate([9, 20, 33, 30])
    ]
    runner.forward(warm, kv, use_graphs=False)
    step = [
        SeqInput(0, [5], 9, list(range(0, 8)), greedy),
        SeqInput(1, [6], 20, list(range(8, 16)), greedy),
        SeqInput(2, [7], 33, list(range(16, 24)), greedy),
        SeqInput(9, [rng.randrange(1000) for _ in range(40)], 0, list(range(80, 88)), greedy),
        SeqInput(3, [rng.randrange(1000) for _ in range(25)], 30, list(range(24, 32)), greedy),
    ]
    # The same step twice on identical caches: eager, then replayed (writes are idempotent).
    eager, _ = runner.forward(step, kv, use_graphs=False)
    eager = eager.clone()
    before = runner.mixed_graphs.replays
    replayed, _ = runner.forward(step, kv, use_graphs=True)
    assert runner.mixed_graphs.replays == before + 1
    assert replayed.shape == eager.shape == (68, 256)
    err = float((replayed - eager).norm() / eager.norm())
    assert err <= 1e-5, err


@cuda
@pytest.mark.parametrize("mode", ["none", "recompute"])
def test_greedy_piecewise_equals_eager(tiny_dir, mode):
    prompts = _prompts(12, 7)
    kw = dict(
        device="cuda",
        dtype="float32",
        num_swap_blocks=0,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        num_kv_blocks=512 if mode == "none" else 32,
    )
    if mode == "recompute":
        kw["preemption_mode"] = "recompute"
    want = [
        list(o.outputs[0].token_ids)
        for o in LLM(str(tiny_dir), enforce_eager=True, **kw).generate(
            None, GREEDY, prompt_token_ids=prompts
        )
    ]
    llm = LLM(str(tiny_dir), **kw)
    warm_replays = _runner(llm).mixed_graphs.replays  # the prefill cap's warm-up steps at start
    got = [
        list(o.outputs[0].token_ids) for o in llm.generate(None, GREEDY, prompt_token_ids=prompts)
    ]
    assert got == want
    assert _runner(llm).mixed_graphs.replays - warm_replays >= 10
    if mode == "recompute":
        assert llm.stats()["num_preemptions"] > 0
