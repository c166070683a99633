"""The multiprocess executor on the CPU (gloo): tensor-parallel outputs equal the in-process
engine's token for token, swapping works on every rank's shard of the KV cache, a dead
worker is a clear error (never a hang), and no process outlives the executor."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from streamkv import SamplingParams
from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.llm_engine import LLMEngine
from streamkv.entrypoints.args import engine_kwargs
from streamkv.entrypoints.cli.main import build_parser
from streamkv.entrypoints.llm import LLM, engine_config
from streamkv.executor.multiproc import MultiprocExecutor, WorkerError, verify_tensor_parallel
from streamkv.models.loader import load_config, resolve_model_dir
from tests.tiny_models import KERNEL_HEADS

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):\n    ",
    "Write a short poem about the ocean and the moon.",
    "In 1492, Columbus sailed across the Atlantic. Summarize:",
]


def _gone(pids: list[int]) -> bool:
    """Exited and reaped: a zombie would still have its /proc entry."""
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama):
    """A 2-layer Llama with 4 query / 2 KV heads (TP=2 splits it) and an untied lm_head, so
    the sharded head's all-gather runs on every step."""
    return tiny_llama(**KERNEL_HEADS, max_position_embeddings=512, tie_word_embeddings=False)


def _tiny_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (1, 5, 17, 30)]


# -- validation (no process starts) ---------------------------------------------------------
def test_bad_tensor_parallel_sizes_are_refused_before_any_process_starts(tmp_path, monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr("streamkv.executor.multiproc.subprocess.Popen", no_process)
    with pytest.raises(
        ValueError, match=r"must divide the model's 9 attention heads and 3 KV heads"
    ):
        LLM(tensor_parallel_size=2, num_kv_blocks=8)
    with pytest.raises(ValueError, match="integer >= 1"):
        LLM(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend='mp'"):
        LLM(tensor_parallel_size=3, distributed_executor_backend="inprocess")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="use device='cuda'"):
        LLM(tensor_parallel_size=3, device="cuda:1")
    # Heads divide, the MLP width does not: caught from config.json's numbers (ModelInfo).
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 129,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"does not fit this model: its MLP width 129 does not divide by 2"
    ):
        LLM(str(tmp_path), load_format="dummy", tensor_parallel_size=2)


def test_more_ranks_than_gpus_is_refused():
    hf = load_config(resolve_model_dir(None))
    with pytest.raises(ValueError, match="GPUs, but"):
        verify_tensor_parallel(hf, 3 * (torch.cuda.device_count() + 1), torch.device("cuda"))


def test_cli_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["generate", "hi", "--tensor-parallel-size", "3", "--distributed-executor-backend", "mp"]
    )
    mc = engine_config(None, **engine_kwargs(args)).model
    assert (mc.tensor_parallel_size, mc.executor_backend) == (3, "mp")
    mc = engine_config(
        None, **engine_kwargs(build_parser().parse_args(["generate", "hi", "-tp", "2"]))
    ).model
    assert mc.executor_backend == "mp"  # the default above TP 1
    assert engine_config(None).model.executor_backend == "inprocess"


# -- a tiny model at TP=2: cheap enough for every run ---------------------------------------
TWO_GPUS = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_tiny_tp2_matches_tp1_with_swap_preemption(tiny_dir, device):
    """gloo on the CPU, NCCL on two GPUs; float32 so that the sharded sums stay within
    rounding of the unsharded ones."""
    prompts = _tiny_prompts()
    kwargs = {"device": device, "dtype": "float32", "num_kv_blocks": 64, "num_swap_blocks": 0}
    ref = LLM(str(tiny_dir), **kwargs)
    want = _tokens(ref.generate(None, GREEDY, prompt_token_ids=prompts))
    ref.shutdown()
    # The 4 sequences need 10 blocks at their longest; 6 fit: some must be swapped out.
    kwargs.update(num_kv_blocks=6, num_swap_blocks=6, preemption_mode="swap")
    tp2 = LLM(str(tiny_dir), **kwargs, tensor_parallel_size=2)
    assert _tokens(tp2.generate(None, GREEDY, prompt_token_ids=prompts)) == want
    stats = tp2.stats()
    assert stats["num_swapped_out_blocks"] > 0 and stats["num_swapped_in_blocks"] > 0
    tp2.engine.block_manager.check_no_leaks()
    pids = tp2.engine.executor.pids
    assert len(pids) == 2 and not _gone(pids)
    del tp2
    gc.collect()  # no shutdown(): the executor's finalizer stops and reaps the workers
    assert _gone(pids)


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_a_clear_error_not_a_hang(tiny_dir, monkeypatch):
    llm = LLM(str(tiny_dir), num_kv_blocks=64, num_swap_blocks=0, tensor_parallel_size=2)
    executor = llm.engine.executor
    pids = executor.pids
    submit = executor.submit
    calls: list[float] = []

    def submit_then_kill(step):
        calls.append(time.monotonic())
        if len(calls) == 5:  # the 4th decode step: rank 1 dies while the run goes on
            os.kill(pids[1], signal.SIGKILL)
        return submit(step)

    monkeypatch.setattr(executor, "submit", submit_then_kill)
    with pytest.raises(
        WorkerError, match=rf"worker rank 1 \(pid {pids[1]}\) was killed by SIGKILL"
    ):
        llm.generate(
            None, SamplingParams(max_tokens=100, ignore_eos=True), prompt_token_ids=[[5, 6, 7]] * 8
        )
    assert len(calls) == 5 and time.monotonic() - calls[-1] < 15
    # Rank 0 may have been left inside a collective with a dead peer: stopped and reaped too.
    assert _gone(pids)
    with pytest.raises(WorkerError, match="the workers are gone"):
        executor.num_available_blocks()
    llm.engine.block_manager.check_no_leaks()  # generate() aborted its requests
    llm.shutdown()  # idempotent


@pytest.mark.slow
def test_an_interrupted_call_retires_the_workers(tiny_dir, monkeypatch):
    """Ctrl-C while a reply is in flight: a later call must not read that stale reply."""
    llm = LLM(str(tiny_dir), num_kv_blocks=64, num_swap_blocks=0, distributed_executor_backend="mp")
    executor = llm.engine.executor
    pids = executor.pids

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(executor, "_gather", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(None, GREEDY, prompt_token_ids=[[5, 6, 7]])
    assert _gone(pids)
    with pytest.raises(WorkerError, match="interrupted while awaiting 'out'"):
        llm.generate(None, GREEDY, prompt_token_ids=[[5, 6, 7]])
    llm.engine.block_manager.check_no_leaks()


@pytest.mark.slow
def test_a_worker_that_fails_to_load_reports_its_error(tmp_path, tiny_dir):
    # A valid config.json (the engine's checks pass) without weights: the ranks fail.
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(
        WorkerError, match=r"worker rank \d failed: FileNotFoundError: no safetensors weights"
    ):
        LLM(str(tmp_path), num_kv_blocks=8, tensor_parallel_size=2)


@pytest.mark.slow
def test_async_engine_serves_through_worker_processes(tiny_dir):
    config = engine_config(str(tiny_dir), num_kv_blocks=64, distributed_executor_backend="mp")

    async def main():
        engine = AsyncEngine(lambda: LLMEngine(config))
        engine.start()
        await engine.wait_ready()
        pids = engine.engine.executor.pids
        stream = await engine.add_request(
            "r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)
        )
        outs = [o async for o in stream]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
        await engine.stop()
        return pids

    pids = asyncio.run(asyncio.wait_for(main(), 120))
    assert isinstance(pids, list) and _gone(pids)


# -- the real model (SmolLM2: 9 query / 3 KV heads, so TP=3) ---------------------------------
@pytest.mark.slow
def test_tp3_matches_tp1_with_swap_preemption(make_llm):
    ref = make_llm(block_size=16, num_kv_blocks=1024, num_swap_blocks=0)
    tok = ref.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    want = _tokens(ref.generate(None, GREEDY, prompt_token_ids=prompts))
    # 6 sequences of up to 3 blocks each in a 10-block pool: some must be swapped out.
    llm = LLM(
        block_size=16,
        num_kv_blocks=10,
        num_swap_blocks=10,
        preemption_mode="swap",
        tensor_parallel_size=3,
    )
    try:
        assert isinstance(llm.engine.executor, MultiprocExecutor)
        assert _tokens(llm.generate(None, GREEDY, prompt_token_ids=prompts[:2])) == want[:2]
        assert llm.stats()["num_preemptions"] == 0
        assert _tokens(llm.generate(None, GREEDY, prompt_token_ids=prompts)) == want
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_swapped_out_blocks"] > 0 and stats["num_swapped_in_blocks"] > 0
        llm.engine.block_manager.check_no_leaks()
    finally:
        pids = llm.engine.executor.pids
        llm.shutdown()
    assert _gone(pids)


@pytest.mark.slow
def test_mp_tp1_matches_inprocess_for_every_output_kind():
    # Both fresh: the unseeded request draws from the worker's generator, seeded at start.
    kwargs = {"block_size": 16, "num_kv_blocks": 256, "num_swap_blocks": 0}
    ref = LLM(**kwargs)
    llm = LLM(**kwargs, distributed_executor_backend="mp")
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=7, max_tokens=12, logprobs=3),
        SamplingParams(temperature=1.0, max_tokens=12),
        SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=8),
    ]
    prompts = PROMPTS[:4]
    try:
        for a, b in zip(ref.generate(prompts, params), llm.generate(prompts, params), strict=True):
            assert a.outputs == b.outputs  # tokens, text, logprobs: the same kernels ran
        ipc = llm.engine.executor.ipc_stats()
        assert ipc["steps"] > 0 and 0 < ipc["overhead_ms"] < ipc["roundtrip_ms"]
    finally:
        pids = llm.engine.executor.pids
        llm.shutdown()
    assert _gone(pids)
