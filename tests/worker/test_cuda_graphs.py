"""CUDA graphs for decode steps (worker/cuda_graphs.py).

Everywhere: the batch-size ladder and padding helpers, ``enforce_eager`` from LLM(...), the
CLI and the server's parser down to the worker processes' config, and that a CPU engine
captures nothing. On a GPU: a replayed step gives the same hidden states as the same padded
step run eagerly (bitwise) and as the unpadded eager step (to rounding), and greedy
generation with graphs equals generation with ``enforce_eager=True`` token for token over
batches that need padding, batches larger than the largest graph, prompt steps mixed in,
and swap / recompute preemption — with graphs actually replayed.
"""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch

from streamkv import SamplingParams
from streamkv.config import ModelConfig
from streamkv.entrypoints.args import engine_kwargs
from streamkv.entrypoints.cli.main import build_parser
from streamkv.entrypoints.llm import LLM, engine_config
from streamkv.executor.rank import config_from_dict
from streamkv.worker.cuda_graphs import (
    MAX_CAPTURE_BATCH,
    StaticInputs,
    capture_sizes,
    context_bucket,
    context_buckets,
    is_decode_only,
    padded_batch_size,
)
from streamkv.worker.input_batch import SampleRequest, SeqInput
from tests.tiny_models import KERNEL_HEADS

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama):
    """A 2-layer Llama, 4 query / 2 KV heads of 64 (a head size the CUDA kernels serve),
    untied lm_head, wide random weights (few near-ties)."""
    return tiny_llama(**KERNEL_HEADS, max_position_embeddings=2048, tie_word_embeddings=False)


def _runner(llm: LLM):
    return llm.engine.executor.worker.runner


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 100, 250]
    return [[rng.randrange(1000) for _ in range(lengths[i % len(lengths)] + i)] for i in range(n)]


# -- pure Python: runs everywhere ----------------------------------------------------------
def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 5]  # max_num_seqs itself is always captured
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(300) == [1, 2, 4, *range(8, 257, 8), 272, 288, 300]
    big = capture_sizes(1024)
    assert big[-18:] == [*range(496, 513, 16), *range(544, 1025, 32)]
    assert len(big) == 67 and big == sorted(set(big))
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_BATCH
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_context_buckets():
    assert context_buckets(8192) == [1024, 4096, 8192]
    assert context_buckets(2048) == [1024, 2048]
    assert context_buckets(4096) == [1024, 4096]  # max_model_len is always the last
    assert context_buckets(512) == [512]
    assert context_buckets(131072) == [1024, 4096, 16384, 65536, 131072]
    with pytest.raises(ValueError):
        context_buckets(0)
    buckets = context_buckets(8192)
    assert [context_bucket(n, buckets) for n in (1, 1024, 1025, 4096, 4097, 8192)] == [
        1024,
        1024,
        4096,
        4096,
        8192,
        8192,
    ]
    assert context_bucket(8193, buckets) is None


def test_padded_batch_size():
    sizes = capture_sizes(32)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        24,
        32,
    ]
    assert padded_batch_size(33, sizes) is None


def test_is_decode_only():
    one = SeqInput(0, [5], 3, [0])
    two = SeqInput(1, [5, 6], 0, [0])
    assert is_decode_only([one, one])
    assert not is_decode_only([one, two])
    assert not is_decode_only([])


def test_enforce_eager_wiring():
    pytest.importorskip(
        "starlette"
    )  # build_parser imports the server's CLI (absent on the GPU box)
    assert engine_config(None).model.enforce_eager is False
    assert engine_config(None, enforce_eager=True).model.enforce_eager is True
    for argv, want in (
        (["generate", "hi"], False),
        (["generate", "hi", "--enforce-eager"], True),
        (["serve", "--enforce-eager"], True),
    ):
        args = build_parser().parse_args(argv)
        assert engine_config(None, **engine_kwargs(args)).model.enforce_eager is want
    # Worker processes rebuild the config from a dict: the flag must survive the trip.
    config = engine_config(None, enforce_eager=True)
    assert config_from_dict(dataclasses.asdict(config)).model.enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager"):
        ModelConfig(enforce_eager="yes").verify()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cpu_never_captures(tiny_dir, enforce_eager):
    llm = LLM(
        str(tiny_dir),
        device="cpu",
        num_kv_blocks=64,
        num_swap_blocks=0,
        enforce_eager=enforce_eager,
    )
    outs = llm.generate(
        None,
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        prompt_token_ids=_prompts(3, 0),
    )
    assert all(len(t) == 4 for t in _tokens(outs))
    assert _runner(llm).graphs is None


def test_padded_static_inputs_match_eager_on_cpu(tiny_dir):
    """The graphs' input path without a graph: a step written into the static buffers,
    padded (slot -1, context 0) and with max_model_len as the context bound, computes the
    same hidden states for its real rows as the eager step (CPU reference kernels)."""
    llm = LLM(str(tiny_dir), device="cpu", num_kv_blocks=256, num_swap_blocks=0)
    worker = llm.engine.executor.worker
    runner, kv = worker.runner, worker.cache.device_cache
    pool = worker.cache.device_pool
    pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(0)))
    rng = random.Random(2)
    blocks = rng.sample(range(256), 256)
    inputs = StaticInputs(
        max_batch=8, max_blocks=2048 // 16, block_size=16, device=torch.device("cpu")
    )
    used = 0
    for contexts in ([40, 3, 17, 1, 300], [5, 900, 16]):  # padded to 8 rows, then 4
        seqs = []
        for i, ctx in enumerate(contexts):
            table = blocks[used : used + (ctx + 15) // 16]
            used += len(table)
            seqs.append(SeqInput(i, [rng.randrange(1000)], ctx - 1, table, SampleRequest()))
        batch = padded_batch_size(len(seqs), capture_sizes(8))
        inputs.fill(seqs, batch)
        assert inputs.slot_mapping[len(seqs) : batch].tolist() == [-1] * (batch - len(seqs))
        assert inputs.context_lens[:batch].tolist() == contexts + [0] * (batch - len(seqs))
        with torch.inference_mode():
            padded = worker.model(
                inputs.input_ids[:batch], inputs.positions[:batch], kv, inputs.metadata(batch, 2048)
            )
            eager, _ = runner.forward(seqs, kv)
        torch.testing.assert_close(padded[: len(seqs)], eager, atol=1e-4, rtol=1e-4)


# -- CUDA ----------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("model, dtype", [("tiny", "float32"), ("smollm2-135m", "bfloat16")])
def test_replay_equals_eager_same_step(tiny_dir, model, dtype):
    """One decode step of 5 sequences (padded to 8) with contexts across several decode
    partitions: the replay equals the same padded step run eagerly (the same kernels on the
    same shapes: bitwise expected, warned about otherwise), and the unpadded eager step to
    rounding. Padding rows come out finite."""
    name = str(tiny_dir) if model == "tiny" else model
    llm = LLM(
        name,
        device="cuda",
        dtype=dtype,
        load_format="dummy" if model != "tiny" else "auto",
        num_kv_blocks=1024,
        num_swap_blocks=0,
        max_num_seqs=16,
    )
    worker = llm.engine.executor.worker
    runner, kv = worker.runner, worker.cache.device_cache
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = worker.cache.device_pool
    pool.copy_(
        torch.randn(pool.shape, generator=gen, device="cuda", dtype=torch.float32).to(pool.dtype)
    )
    rng = random.Random(1)
    blocks = rng.sample(range(1024), 1024)
    seqs, used = [], 0
    for i, ctx in enumerate([1, 16, 17, 700, 1900]):  # up to 1900 tokens: several partitions
        table = blocks[used : used + (ctx + 15) // 16]
        used += len(table)
        seqs.append(SeqInput(i, [rng.randrange(100)], ctx - 1, table, SampleRequest()))
    # The engine's start may have replayed graphs already (the prefill cap's warm-up steps).
    before, bucket = graphs.replays, graphs.bucket_for(seqs)
    bucket_before = graphs.bucket_replays[bucket]
    with torch.inference_mode():
        replayed = runner.forward(seqs, kv)[0].clone()
        assert graphs.replays == before + 1
        assert (
            bucket == context_bucket(1900, graphs.buckets)
            and graphs.bucket_replays[bucket] == bucket_before + 1
        )
        padded = worker.model(*graphs.model_args(8, bucket))
        eager, _ = runner.forward(seqs, kv, use_graphs=False)
    assert graphs.replays == before + 1
    assert replayed.shape[0] == 8 and torch.isfinite(replayed).all()
    if not torch.equal(replayed, padded):
        warnings.warn(
            f"{model}/{dtype}: graph replay is close to, not bitwise equal to, eager", stacklevel=1
        )
    # Norm-relative errors: a bug (stale or misplaced inputs) is off by O(1), while bf16
    # rounding differences only grow slowly over 30 layers.
    assert _rel_err(replayed, padded) <= (1e-5 if dtype == "float32" else 2e-2)
    # The unpadded eager step splits the 1900-token context into other partitions than the
    # graph (captured for its 2048-token bucket), so its fp32 partial sums meet in another order; in
    # bf16 a one-ulp flip then grows over 30 layers of random weights (2.5e-2 seen on an H200).
    assert _rel_err(replayed[:5], eager) <= (1e-4 if dtype == "float32" else 5e-2)


@cuda
@pytest.mark.parametrize("batch", [3, 5, 17])
def test_greedy_graphs_equal_eager(tiny_dir, batch):
    """Batches that need padding (3 -> 4, 5 -> 8, 17 -> 24); prompts of very different
    lengths, so decode and prompt steps mix while sequences join and finish."""
    prompts = _prompts(batch, batch)
    # A small token budget admits the prompts over several steps: mixed steps run eagerly.
    kw = dict(
        device="cuda",
        num_kv_blocks=512,
        num_swap_blocks=0,
        max_num_seqs=32,
        max_num_batched_tokens=300,
    )
    eager = LLM(str(tiny_dir), enforce_eager=True, **kw)
    graphs = LLM(str(tiny_dir), **kw)
    assert _runner(eager).graphs is None
    assert _runner(graphs).graphs.sizes == [1, 2, 4, 8, 16, 24, 32]
    warm_replays = _runner(graphs).graphs.replays  # the prefill cap's warm-up steps at start
    want = _tokens(eager.generate(None, GREEDY, prompt_token_ids=prompts))
    got = _tokens(graphs.generate(None, GREEDY, prompt_token_ids=prompts))
    assert got == want
    assert _runner(graphs).graphs.replays - warm_replays >= GREEDY.max_tokens // 2


@cuda
def test_greedy_graphs_equal_eager_across_context_buckets(tiny_dir):
    """Contexts that grow across the first bucket's bound (1024 of [1024, 2048]) mid-run:
    both buckets' graphs replay and the tokens still equal an eager run."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1000) for _ in range(1000 + 3 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(device="cuda", num_kv_blocks=512, num_swap_blocks=0, max_num_seqs=8)
    want = _tokens(
        LLM(str(tiny_dir), enforce_eager=True, **kw).generate(
            None, params, prompt_token_ids=prompts
        )
    )
    llm = LLM(str(tiny_dir), **kw)
    graphs = _runner(llm).graphs
    assert graphs.buckets == [1024, 2048] and graphs.count == 2 * len(graphs.sizes)
    got = _tokens(llm.generate(None, params, prompt_token_ids=prompts))
    assert got == want
    assert graphs.bucket_replays[1024] > 0 and graphs.bucket_replays[2048] > 0


@cuda
def test_batches_beyond_the_largest_graph_run_eagerly(tiny_dir):
    prompts = _prompts(12, 7)
    eager = LLM(
        str(tiny_dir), device="cuda", num_kv_blocks=512, num_swap_blocks=0, enforce_eager=True
    )
    llm = LLM(str(tiny_dir), device="cuda", num_kv_blocks=512, num_swap_blocks=0, max_num_seqs=16)
    runner = _runner(llm)
    runner.graphs.max_batch = 8  # pretend only 8 were captured: 12 decodes must run eagerly
    before = runner.graphs.replays  # the prefill cap's warm-up steps at start replay some
    got = _tokens(llm.generate(None, GREEDY, prompt_token_ids=prompts))
    assert got == _tokens(eager.generate(None, GREEDY, prompt_token_ids=prompts))
    # All 12 start together and finish together: every decode step is too large to replay.
    assert runner.graphs.replays == before


@cuda
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_graphs(tiny_dir, mode):
    """A pool too small for the batch forces preemption; outputs still equal an eager run
    with room to spare. In fp32: a recomputed prompt's K/V come from other GEMM shapes than
    the ones computed a token at a time, and in bf16 that rounding flipped a token late in
    one sequence (H200, an early run), which says nothing about graphs or preemption."""
    prompts = _prompts(8, 3)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    eager = LLM(
        str(tiny_dir),
        device="cuda",
        dtype="float32",
        num_kv_blocks=512,
        num_swap_blocks=0,
        enforce_eager=True,
    )
    want = _tokens(eager.generate(None, params, prompt_token_ids=prompts))
    llm = LLM(
        str(tiny_dir),
        device="cuda",
        dtype="float32",
        num_kv_blocks=48,
        num_swap_blocks=48 if mode == "swap" else 0,
        preemption_mode=mode,
        max_num_seqs=8,
    )
    got = _tokens(llm.generate(None, params, prompt_token_ids=prompts))
    assert llm.stats()["num_preemptions"] > 0
    assert _runner(llm).graphs.replays > 0
    assert got == want
    llm.engine.block_manager.check_no_leaks()


@cuda
def test_worker_process_captures_too(tiny_dir):
    """The mp executor (TP 1) builds its Worker in a child process: same tokens as eager."""
    prompts = _prompts(5, 11)
    eager = LLM(
        str(tiny_dir), device="cuda", num_kv_blocks=256, num_swap_blocks=0, enforce_eager=True
    )
    llm = LLM(
        str(tiny_dir),
        device="cuda",
        num_kv_blocks=256,
        num_swap_blocks=0,
        max_num_seqs=8,
        distributed_executor_backend="mp",
    )
    try:
        got = _tokens(llm.generate(None, GREEDY, prompt_token_ids=prompts))
    finally:
        llm.shutdown()
    assert got == _tokens(eager.generate(None, GREEDY, prompt_token_ids=prompts))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_graphs(tiny_dir):
    """TP=2 over NCCL: the all-reduces and the lm_head all-gather are captured too."""
    prompts = _prompts(5, 13)
    eager = LLM(
        str(tiny_dir), device="cuda", num_kv_blocks=256, num_swap_blocks=0, enforce_eager=True
    )
    llm = LLM(
        str(tiny_dir),
        device="cuda",
        num_kv_blocks=256,
        num_swap_blocks=0,
        max_num_seqs=8,
        tensor_parallel_size=2,
    )
    try:
        got = _tokens(llm.generate(None, GREEDY, prompt_token_ids=prompts))
    finally:
        llm.shutdown()
    assert got == _tokens(eager.generate(None, GREEDY, prompt_token_ids=prompts))
