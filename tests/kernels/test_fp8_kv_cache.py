"""The fp8 (e4m3) KV cache: the number format, the torch reference path against a full-precision
cache, block moves, the engine end to end on the embedded model, and (with a GPU) the CUDA
kernels against the reference path over the same fp8 cache."""

from __future__ import annotations

import pytest
import torch

from streamkv.kernels import ops
from streamkv.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize, quantize
from streamkv.sampling_params import SamplingParams
from streamkv.worker.cache_engine import kv_bytes_per_block, kv_cache_torch_dtype

# e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 relative for normal values
# (|x| >= 2^-6) and within half a subnormal step (2^-10) below that.
REL_STEP = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


# --- the number format ------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_round_trip_error_bounds(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (
        torch.randn(100_000, generator=gen)
        * torch.logspace(-3, 2, 100_000)[torch.randperm(100_000, generator=gen)]
    )
    x = x.clamp(-FP8_MAX * scale, FP8_MAX * scale)
    q = quantize(x, scale)
    assert q.dtype == FP8_DTYPE and q.element_size() == 1
    back = dequantize(q, scale, torch.float32)
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * REL_STEP, torch.full_like(x, SUBNORMAL_HALF_STEP * scale))
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())
    # Not a looser rounding in disguise: most normal values land strictly inside the bound.
    assert float((err / bound).mean()) < 0.5


def test_saturates_to_448_and_keeps_sign() -> None:
    x = torch.tensor([1e4, -1e4, 448.0, -500.0, 0.0, float("inf"), -float("inf")])
    back = dequantize(quantize(x, 1.0), 1.0, torch.float32)
    assert back.tolist() == [448.0, -448.0, 448.0, -448.0, 0.0, 448.0, -448.0]
    # With a scale the saturation point moves with it.
    assert dequantize(quantize(torch.tensor([1e4]), 2.0), 2.0, torch.float32).item() == 896.0


def test_dequantize_is_exact_in_16_bit_types() -> None:
    every = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    finite = every.float().isfinite()
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(dequantize(every, 1.0, dtype).float()[finite], every.float()[finite])


# --- the reference path -----------------------------------------------------------------


def _pools(num_blocks=64, kv_heads=2, block=8, head=32, gen=None):
    k = torch.randn(num_blocks, kv_heads, block, head, generator=gen)
    v = torch.randn(num_blocks, kv_heads, block, head, generator=gen)
    return k, v


def test_reshape_and_cache_quantizes_with_the_layer_scales() -> None:
    gen = torch.Generator().manual_seed(1)
    kc = torch.zeros(8, 2, 4, 16, dtype=FP8_DTYPE)
    vc = torch.zeros_like(kc)
    key = torch.randn(5, 2, 16, generator=gen) * 50
    value = torch.randn(5, 2, 16, generator=gen) * 50
    slots = torch.tensor([0, 5, -1, 17, 31])
    ops.reshape_and_cache(key, value, kc, vc, slots, k_scale=0.5, v_scale=2.0)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, 4)
        assert torch.equal(
            kc[blk, :, off].view(torch.uint8), quantize(key[t], 0.5).view(torch.uint8)
        )
        assert torch.equal(
            vc[blk, :, off].view(torch.uint8), quantize(value[t], 2.0).view(torch.uint8)
        )
    written = {divmod(s, 4) for s in (0, 5, 17, 31)}
    untouched = [(b, o) for b in range(8) for o in range(4) if (b, o) not in written]
    assert all(not kc[b, :, o].float().any() for b, o in untouched)  # the -1 slot wrote nothing


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def _decode_case(seed: int, num_seqs: int = 6, group: int = 3):
    gen = torch.Generator().manual_seed(seed)
    kvh, bs, hd, pool = 2, 8, 32, 128
    k, v = _pools(pool, kvh, bs, hd, gen)
    cl = torch.randint(1, 160, (num_seqs,), generator=gen, dtype=torch.int32)
    bt = torch.stack([torch.randperm(pool, generator=gen)[:20] for _ in range(num_seqs)]).int()
    q = torch.randn(num_seqs, kvh * group, hd, generator=gen)
    return q, k, v, bt, cl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_over_fp8_cache_is_close_to_full_precision(seed: int) -> None:
    q, k, v, bt, cl = _decode_case(seed)
    exact = ops.paged_attention_decode(q, k, v, bt, cl, 32**-0.5)
    k8, v8 = quantize(k, 1.0), quantize(v, 1.0)
    out = ops.paged_attention_decode(q, k8, v8, bt, cl, 32**-0.5)
    assert out.dtype == q.dtype
    # e4m3 rounds each element by up to 2^-4 relative, ~3.6% RMS: the outputs carry that, no more.
    assert _rel_l2(out, exact) < 0.06
    assert (out - exact).abs().max().item() < 0.25
    # It is only that rounding: a full-precision cache holding the dequantized values agrees.
    same = ops.paged_attention_decode(q, k8.float(), v8.float(), bt, cl, 32**-0.5)
    assert torch.allclose(out, same, atol=1e-5)


def test_decode_applies_k_and_v_scales() -> None:
    q, k, v, bt, cl = _decode_case(3)
    q = q / 40  # logits as in the unscaled case, over K and V 40x larger
    exact = ops.paged_attention_decode(q, k * 40, v * 40, bt, cl, 32**-0.5)
    k8, v8 = quantize(k * 40, 40.0), quantize(v * 40, 40.0)
    out = ops.paged_attention_decode(q, k8, v8, bt, cl, 32**-0.5, k_scale=40.0, v_scale=40.0)
    assert _rel_l2(out, exact) < 0.06
    unscaled = ops.paged_attention_decode(q, k8, v8, bt, cl, 32**-0.5)  # scales forgotten
    assert _rel_l2(unscaled, exact) > 0.5


def test_prefill_over_fp8_cache_is_close_to_full_precision() -> None:
    gen = torch.Generator().manual_seed(4)
    kvh, group, bs, hd, pool = 2, 2, 8, 32, 64
    k, v = _pools(pool, kvh, bs, hd, gen)
    # Two spans: a fresh 37-token prompt, and a 9-token chunk after 50 cached tokens.
    ctx = torch.tensor([37, 59], dtype=torch.int32)
    cu = torch.tensor([0, 37, 46], dtype=torch.int32)
    bt = torch.stack([torch.randperm(pool, generator=gen)[:8] for _ in range(2)]).int()
    q = torch.randn(46, kvh * group, hd, generator=gen)
    exact = ops.paged_attention_prefill_varlen(q, k, v, bt, cu, ctx, hd**-0.5)
    k8, v8 = quantize(k, 1.0), quantize(v, 1.0)
    out = ops.paged_attention_prefill_varlen(q, k8, v8, bt, cu, ctx, hd**-0.5)
    assert _rel_l2(out, exact) < 0.06
    assert (out - exact).abs().max().item() < 0.25
    same = ops.paged_attention_prefill_varlen(q, k8.float(), v8.float(), bt, cu, ctx, hd**-0.5)
    assert torch.allclose(out, same, atol=1e-5)


def test_copy_and_swap_move_fp8_bytes_as_they_are() -> None:
    gen = torch.Generator().manual_seed(5)
    layers = [tuple(quantize(t, 1.0) for t in _pools(16, 2, 4, 16, gen)) for _ in range(2)]
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    before = [c.view(torch.uint8).clone() for c in (*keys, *values)]
    ops.copy_blocks(keys, values, torch.tensor([[3, 9], [0, 1]]))
    for c, b in zip((*keys, *values), before):
        raw = c.view(torch.uint8)
        assert torch.equal(raw[9], b[3]) and torch.equal(raw[1], b[0])
        assert torch.equal(raw[2], b[2])
    host = [torch.zeros_like(c) for c in (*keys, *values)]
    ops.swap_blocks([*keys, *values], host, torch.tensor([[9, 0], [5, 7]]))
    for c, h in zip((*keys, *values), host):
        assert torch.equal(h.view(torch.uint8)[0], c.view(torch.uint8)[9])
        assert torch.equal(h.view(torch.uint8)[7], c.view(torch.uint8)[5])


# --- sizing and the engine ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_dtype", "ratio"), [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)]
)
def test_fp8_block_is_one_byte_per_element(model_dtype, ratio) -> None:
    for name in ("fp8", "fp8_e4m3"):
        assert kv_cache_torch_dtype(name, model_dtype) == FP8_DTYPE
    assert kv_cache_torch_dtype("auto", model_dtype) == model_dtype
    auto = kv_bytes_per_block(30, 3, 64, 16, kv_cache_torch_dtype("auto", model_dtype))
    fp8 = kv_bytes_per_block(30, 3, 64, 16, kv_cache_torch_dtype("fp8", model_dtype))
    assert fp8 == 2 * 30 * 3 * 64 * 16 and auto == ratio * fp8


def test_kv_cache_dtype_is_an_engine_flag_and_checked() -> None:
    import argparse

    from streamkv.config import CacheConfig
    from streamkv.entrypoints.args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).kv_cache_dtype == "auto"
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    assert engine_config(kv_cache_dtype="fp8_e4m3").cache.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int8").verify()


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
]


def _has_embedded_model() -> bool:
    from streamkv.models.gguf import embedded_gguf_path

    try:
        embedded_gguf_path()
    except FileNotFoundError:  # the GPU box of benchmarks/gpu_checks.sh has no weights
        return False
    return True


needs_model = pytest.mark.skipif(not _has_embedded_model(), reason="needs the embedded model")


@pytest.fixture(scope="module")
def engines(make_llm):
    # The same memory for both pools: the fp8 one must hold 4x the blocks (fp32 on the CPU).
    kw = {"device": "cpu", "cpu_kv_cache_space": 0.0625, "num_swap_blocks": 0}
    return make_llm(**kw), make_llm(kv_cache_dtype="fp8", **kw)


@pytest.mark.slow
@needs_model
def test_engine_pool_is_fp8_with_more_blocks(engines) -> None:
    auto, fp8 = engines
    pool = fp8.engine.executor.worker.cache.device_pool
    assert pool.dtype == FP8_DTYPE
    assert auto.engine.executor.worker.cache.device_pool.dtype == torch.float32
    n_auto, n_fp8 = (
        auto.engine.block_manager.device.num_blocks,
        fp8.engine.block_manager.device.num_blocks,
    )
    assert abs(n_fp8 - 4 * n_auto) < 4, (n_auto, n_fp8)  # 4 bytes -> 1, up to floor rounding


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check_agreement(auto, fp8, max_gap: float) -> None:
    ref = auto.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    ref_ids = [list(o.outputs[0].token_ids) for o in ref]
    # Free-running (the decode path): where the fp8 run leaves the default's text, the
    # default's token is a near tie under fp8 too, its runner-up within max_gap nats.
    free = fp8.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, logprobs=5), use_tqdm=False
    )
    for out, r in zip(free, ref_ids):
        got = out.outputs[0]
        d = _first_difference(got.token_ids, r)
        assert len(got.token_ids) == 16
        if d < 16:
            top = got.logprobs[d]
            assert r[d] in top, (d, r[d], top)
            assert top[got.token_ids[d]].logprob - top[r[d]].logprob < max_gap
    # Teacher-forced (the prefill path over the default's text): most tokens agree.
    texts = [o.prompt_token_ids + r for o, r in zip(ref, ref_ids)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = fp8.generate(prompt_token_ids=texts, sampling_params=params, use_tqdm=False)
    agree = total = 0
    for out, o, text in zip(scored, ref, texts):
        for i in range(len(o.prompt_token_ids), len(text)):
            entry = out.prompt_logprobs[i]
            agree += min(entry.items(), key=lambda kv: kv[1].rank)[0] == text[i]
            total += 1
    assert agree >= 0.85 * total, (agree, total)


@pytest.mark.slow
@needs_model
def test_engine_greedy_agrees_with_the_default_cache(engines) -> None:
    _check_agreement(*engines, max_gap=0.3)


# --- CUDA kernels against the reference path over the same fp8 cache ----------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (
        (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)
    ).item()


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_cache_write_matches_reference(dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    key = (torch.randn(40, 4, 128, generator=gen) * 100).to(dtype).cuda()
    value = (torch.randn(40, 4, 128, generator=gen) * 100).to(dtype).cuda()
    slots = torch.randperm(32 * 16, generator=gen)[:40].cuda()
    slots[7] = -1
    caches = [torch.zeros(32, 4, 16, 128, dtype=FP8_DTYPE, device="cuda") for _ in range(4)]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale=0.5, v_scale=1.0)
    ops.reshape_and_cache_ref(key, value, caches[2], caches[3], slots, 0.5, 1.0)
    torch.cuda.synchronize()
    # Both round to nearest even after saturating at 448: the same bytes.
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head", [64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_cuda_decode_matches_reference(dtype, head: int, group: int) -> None:
    # Production's kernel per case: CUDA cores at group 1, fp32 and head 80, else tensor cores.
    from streamkv.kernels import decode_attention

    gen = torch.Generator().manual_seed(head + group)
    kvh, bs, pool, seqs = 2, 16, 512, 9
    k = quantize(torch.randn(pool, kvh, bs, head, generator=gen), 0.5).cuda()
    v = quantize(torch.randn(pool, kvh, bs, head, generator=gen), 0.5).cuda()
    cl = torch.tensor([1, 15, 16, 17, 300, 1024, 1500, 2049, 0], dtype=torch.int32).cuda()
    bt = torch.stack([torch.randperm(pool, generator=gen)[:160] for _ in range(seqs)]).int().cuda()
    q = torch.randn(seqs, kvh * group, head, generator=gen).to(dtype).cuda()
    out = decode_attention.paged_attention_decode(
        q, k, v, bt, cl, head**-0.5, k_scale=0.5, v_scale=0.5
    )
    ref = ops.paged_attention_decode_ref(
        q.double(), k, v, bt, cl, head**-0.5, k_scale=0.5, v_scale=0.5
    )
    assert out.dtype == dtype
    assert not out[-1].float().any()  # the empty context
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert _rel(out[:-1], ref[:-1]) < tol


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block", [1, 16, 64])
def test_cuda_prefill_matches_reference(dtype, head: int, group: int, block: int) -> None:
    from streamkv.kernels import prefill

    gen = torch.Generator().manual_seed(head * group + block)
    kvh, tokens = 2, 4096
    pool = tokens // block + 8
    k = quantize(torch.randn(pool, kvh, block, head, generator=gen), 1.0).cuda()
    v = quantize(torch.randn(pool, kvh, block, head, generator=gen), 1.0).cuda()
    # Spans: a fresh prompt, a chunk after a cached prefix, a one-token span.
    ctx = torch.tensor([300, 700, 5], dtype=torch.int32)
    qlen = torch.tensor([300, 130, 1], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), qlen.cumsum(0).int()])
    nb = -(-int(ctx.max()) // block)
    bt = torch.stack([torch.randperm(pool, generator=gen)[:nb] for _ in range(3)]).int()
    q = torch.randn(int(cu[-1]), kvh * group, head, generator=gen).to(dtype)
    q, bt, cu, ctx = q.cuda(), bt.cuda(), cu.cuda(), ctx.cuda()
    out = prefill.paged_attention_prefill_varlen(q, k, v, bt, cu, ctx, head**-0.5, v_scale=2.0)
    ref = ops.paged_attention_prefill_varlen_ref(
        q.float(), k, v, bt, cu, ctx, head**-0.5, v_scale=2.0
    )
    tol = {torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    assert _rel(out, ref) < tol


@cuda
@needs_model
def test_cuda_engine_fp8_greedy_agrees(make_llm) -> None:
    auto = make_llm(num_kv_blocks=512, num_swap_blocks=0, device="cuda")
    fp8 = make_llm(num_kv_blocks=512, num_swap_blocks=0, device="cuda", kv_cache_dtype="fp8")
    assert fp8.engine.executor.worker.cache.device_pool.dtype == FP8_DTYPE
    _check_agreement(auto, fp8, max_gap=0.5)  # bf16 logits: coarser near ties than fp32's


@pytest.mark.slow
@needs_model
def test_engine_swap_preemption_keeps_fp8_outputs(engines, make_llm) -> None:
    # A pool too small for the batch: sequences are swapped out and back in, and since a swap
    # moves the fp8 bytes as they are, greedy outputs follow the unpreempted fp8 run's. Not
    # always token for token: preemption changes which rows share a step, and a CPU GEMM's
    # rounding depends on the batch, which an fp8 value can carry one step further. So where
    # the two part, the unpreempted run's token is a near tie in the swapped run.
    _, roomy = engines
    tight = make_llm(
        device="cpu",
        kv_cache_dtype="fp8",
        block_size=8,
        num_kv_blocks=20,
        num_swap_blocks=40,
        preemption_mode="swap",
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    want = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params, use_tqdm=False)]
    before = tight.stats()["num_preemptions"]
    got = [o.outputs[0] for o in tight.generate(PROMPTS, params, use_tqdm=False)]
    stats = tight.stats()
    assert stats["num_preemptions"] > before and stats["num_swapped_in_blocks"] > 0
    same = 0
    for out, w in zip(got, want, strict=True):
        d = _first_difference(out.token_ids, w)
        same += d == len(w)
        if d < len(w):
            top = out.logprobs[d]
            assert w[d] in top and top[out.token_ids[d]].logprob - top[w[d]].logprob < 0.3, d
    assert same >= len(want) // 2, same
