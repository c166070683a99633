"""FP8 weights on a GPU: the per-token quantization kernel (kernels_cu/fused_ops.cu) against
the torch reference byte for byte and inside a CUDA graph, ``torch._scaled_mm`` with row-wise
scales against the exact product of the same fp8 operands, inside a CUDA graph, and a tiny
Llama served with ``quantization="fp8"`` against its bf16 run. The CPU tests are
tests/models/test_fp8_weights.py."""

from __future__ import annotations

import pytest
import torch

from streamkv.kernels import fused_cuda, launch
from streamkv.layers import fp8
from streamkv.sampling_params import SamplingParams
from tests.tiny_models import KERNEL_HEADS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rand(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


@pytest.fixture(autouse=True)
def _fp8_tensor_cores():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 products need compute capability 8.9+")


def _assert_is_the_product(got: torch.Tensor, xq, xs, wq, ws, bias) -> None:
    """``got`` (bf16) is the exact product of the fp8 operands up to what _scaled_mm may do:
    sum in any order in Hopper's fp8 tensor-core accumulator, which keeps about 14 bits (2^-13
    of the sum of |terms|; the H200 measured 1.09x a 2^-24 * K bound at M = 200), and round to
    bf16 (half an ulp, 2^-8 of the value) once at the end, or once more before the bias is
    added (2^-8 of the product). The mean error is held near one rounding's, so a scale off by
    1% or applied to the wrong row or channel fails here, not only in the model's accuracy."""
    xd, wd = fp8.dequantize(xq, xs).double(), fp8.dequantize(wq, ws).double()
    prod = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    if bias is not None:
        want, mag = prod + bias.double(), mag + bias.double().abs()
    else:
        want = prod
    tol = 2.0**-8 * (want.abs() + prod.abs()) + 2.0**-13 * mag
    err = (got.double() - want).abs()
    worst = int((err / tol).argmax())
    assert bool((err <= tol).all()), (float(err.view(-1)[worst]), float(tol.view(-1)[worst]))
    # One bf16 rounding averages about 2^-9.5 of the value (measured 1.4e-3 on the CPU).
    assert float(err.mean()) <= 2.0**-8 * float(want.abs().mean())


# Up to fp8.SMALL_BATCH rows the product is per-tensor _scaled_mm plus the scale kernel;
# past it, row-wise _scaled_mm.
@pytest.mark.parametrize("m", [1, 3, 16, 200, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_matches_the_cpu_reference(m: int, bias: bool) -> None:
    n, k = 384, 512
    w = _rand(n, k, seed=1, std=0.02).to(torch.bfloat16)
    x = _rand(m, k, seed=2).to(torch.bfloat16)
    b = _rand(n, seed=3).to(torch.bfloat16) if bias else None
    q, scale = fp8.quantize_weight(w)
    got = fp8.fp8_linear(x.cuda(), q.cuda(), scale.cuda(), None if b is None else b.cuda()).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # The activation quantized on the GPU (the kernel) is the CPU's, byte for byte.
    xq_cpu, xs_cpu = fp8.quantize_activation(x)
    xq, xs = fp8.quantize_activation(x.cuda())
    assert torch.equal(xq.cpu().view(torch.uint8), xq_cpu.view(torch.uint8))
    assert torch.equal(xs.cpu(), xs_cpu)
    # The same fp8 operands: only the accumulation order and the bf16 rounding differ. (The
    # CPU path's bf16 output is a second rounding: compare both with the exact product.)
    _assert_is_the_product(got, xq_cpu, xs_cpu, q, scale, b)
    _assert_is_the_product(fp8.fp8_linear(x, q, scale, b), xq_cpu, xs_cpu, q, scale, b)


# --- the per-token quantization kernel --------------------------------------------------


def _activation_rows(k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows the kernel must get exactly right: Gaussian rows from 1e-3 to 1e3, a zero row, a
    row with one huge element (the rest fall to e4m3 subnormals and signed zeros), a row of
    tiny values (the 1e-12 floor on the scale), a row of one repeated value."""
    x = _rand(12, k, seed=20) * torch.logspace(-3, 3, 12)[:, None]
    x[1] = 0.0
    x[4, k // 3] = -2e3
    x[7] = _rand(k, seed=21) * 1e-14
    x[9] = 0.75
    return x.to(dtype)


def _assert_same_quantization(x: torch.Tensor) -> None:
    q, scale = fused_cuda.quant_fp8_rows(x)
    want_q, want_scale = fp8._quantize_rows(x.cpu())
    assert q.dtype == fp8.FP8_DTYPE and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    # The torch path on the GPU agrees too (its scale is an exact division there as well).
    ref_q, ref_scale = fp8._quantize_rows(x)
    assert torch.equal(ref_scale, scale) and torch.equal(
        ref_q.view(torch.uint8), q.view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [16, 4096, 14336, 1001])
def test_quant_kernel_equals_the_reference_byte_for_byte(dtype: torch.dtype, k: int) -> None:
    # 14336 bf16 is 1,792 vectors for 1,024 threads (a second round); 1001 is the scalar path.
    x = _activation_rows(k, dtype).cuda()
    want_width = 1 if k == 1001 else fused_cuda.vector_width(launch.DTYPE_NAMES[dtype])
    assert fused_cuda._width(dtype, k, x) == want_width
    _assert_same_quantization(x)


def test_quant_kernel_takes_strided_rows_and_many_tokens() -> None:
    wide = _rand(1024, 4096 + 64, seed=22).to(torch.bfloat16).cuda()
    x = wide[:, 32 : 32 + 4096]  # 16-byte aligned rows of stride 4160: the vector path
    assert fused_cuda._width(x.dtype, 4096, x) == 8 and x.stride(0) == 4160
    _assert_same_quantization(x)
    odd = wide[:, 1:4097]  # 2-byte offset: the scalar path
    assert fused_cuda._width(odd.dtype, 4096, odd) == 1
    _assert_same_quantization(odd)
    q, scale = fused_cuda.quant_fp8_rows(x[:0])
    assert q.shape == (0, 4096) and scale.shape == (0, 1)


def test_fp8_linear_uses_the_kernel_and_it_replays_in_a_graph(monkeypatch) -> None:
    calls = []
    real = fused_cuda.quant_fp8_rows
    monkeypatch.setattr(fused_cuda, "quant_fp8_rows", lambda x: calls.append(x.shape) or real(x))
    q, scale = fp8.quantize_weight(_rand(256, 512, seed=23, std=0.02).cuda())
    fp8.fp8_linear(torch.ones(2, 3, 512, dtype=torch.bfloat16, device="cuda"), q, scale)
    assert calls == [(6, 512)]

    src = torch.empty(64, 512, dtype=torch.bfloat16, device="cuda")
    seeds = (30, 31, 32)
    want = []
    for seed in seeds:
        src.copy_(_rand(64, 512, seed=seed).to(torch.bfloat16))
        want.append([t.clone() for t in fp8.quantize_activation(src)])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, out_scale = fp8.quantize_activation(src)
    for seed, (want_q, want_scale) in zip(seeds, want, strict=True):
        src.copy_(_rand(64, 512, seed=seed).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(out_scale, want_scale)


@pytest.mark.parametrize("m", [8, 300])
def test_fp8_linear_in_a_cuda_graph_equals_eager(m: int) -> None:
    n, k = 256, 512
    q, scale = fp8.quantize_weight(_rand(n, k, seed=4, std=0.02).cuda())
    bias = _rand(n, seed=5).to(torch.bfloat16).cuda()
    src = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
    unit = torch.ones((), device="cuda")  # as ParallelLinear.fp8_unit

    def step() -> torch.Tensor:
        return fp8.fp8_linear(src, q, scale, bias, unit)

    want = []
    for seed in (10, 11, 12):
        src.copy_(_rand(m, k, seed=seed).to(torch.bfloat16))
        want.append(step().clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture (cuBLASLt / CUTLASS workspace)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, expected in zip((10, 11, 12), want, strict=True):
        src.copy_(_rand(m, k, seed=seed).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


# --- the small-batch product's scales -----------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("aligned", [True, False])
def test_scale_kernel_is_the_torch_epilogue_bit_for_bit(bias: bool, aligned: bool) -> None:
    rows, cols = 5, 4096 + 16
    base = torch.empty(rows * cols + 1, device="cuda")
    acc = (base[:-1] if aligned else base[1:]).view(rows, cols)  # 4 bytes off: scalar path
    acc.copy_(_rand(rows, cols, seed=40).cuda() * 1e3)
    rs = _rand(rows, 1, seed=41).abs().cuda()
    cs = _rand(cols, seed=42).abs().cuda() * 1e-3
    b = _rand(cols, seed=43).to(torch.bfloat16).cuda() if bias else None
    got = fused_cuda.scale_fp8_product(acc, rs, cs, b, torch.bfloat16)
    want = acc * rs * cs  # fp32, in the kernel's order: (acc * row) * column (+ bias)
    if b is not None:
        want = want + b.float()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="fp32 product"):
        fused_cuda.scale_fp8_product(acc.half(), rs, cs, b, torch.bfloat16)


def test_small_batches_take_the_per_tensor_product(monkeypatch) -> None:
    calls = []
    real = fused_cuda.scale_fp8_product
    monkeypatch.setattr(
        fused_cuda, "scale_fp8_product", lambda acc, *a: calls.append(acc.shape) or real(acc, *a)
    )
    q, scale = fp8.quantize_weight(_rand(256, 512, seed=44, std=0.02).cuda())
    for m in (1, fp8.SMALL_BATCH, fp8.SMALL_BATCH + 1):
        fp8.fp8_linear(torch.ones(m, 512, dtype=torch.bfloat16, device="cuda"), q, scale)
    assert calls == [(1, 256), (fp8.SMALL_BATCH, 256)]


def test_a_non_bf16_input_is_refused_clearly() -> None:
    q, scale = fp8.quantize_weight(torch.randn(32, 32, device="cuda"))
    with pytest.raises(ValueError, match="bf16"):
        fp8.fp8_linear(torch.randn(4, 32, device="cuda"), q, scale)


def test_fp16_model_is_refused_clearly(tiny_llama) -> None:
    from streamkv.models.registry import build_model

    with pytest.raises(ValueError, match="bfloat16"):
        build_model(
            tiny_llama(**KERNEL_HEADS), torch.float16, torch.device("cuda"), quantization="fp8"
        )


PROMPTS = [[(7 * i + 13 * j) % 1000 for j in range(5 + i)] for i in range(8)]


def _greedy_texts(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    return [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs]


def _top1_agreement(llm, texts: list[list[int]]) -> float:
    """Teacher-forced: how often ``llm``'s most likely token at a generated position of
    ``texts`` is the text's (greedy) token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(prompt_token_ids=texts, sampling_params=params, use_tqdm=False)
    agree = total = 0
    for out, text, prompt in zip(outs, texts, PROMPTS):
        for i in range(len(prompt), len(text)):
            entry = out.prompt_logprobs[i]
            agree += min(entry.items(), key=lambda kv: kv[1].rank)[0] == text[i]
            total += 1
    return agree / total


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_tiny_llama_fp8_engine(tiny_llama, enforce_eager: bool) -> None:
    """The fp8 engine on the GPU (decode steps replayed from CUDA graphs, or eager) against
    the CPU reference engine of the same bf16 checkpoint and quantization, and against its
    own bf16 run.

    The tiny model's random weights (std 0.15) make it chaotic: free-running greedy runs
    part within a few tokens under any perturbation, so agreement is teacher-forced over the
    reference's greedy text. Floors from the CPU runs of these prompts (2026-12-03): fp8
    against bf16 63% (bf16 against fp32: 97%), so 45%; the GPU against the CPU, the same fp8
    weights, only bf16 accumulation order apart: 80%."""
    from streamkv.entrypoints.llm import LLM

    model = str(tiny_llama(**KERNEL_HEADS))
    kw = dict(dtype="bfloat16", num_kv_blocks=256, num_swap_blocks=0)
    gpu = dict(device="cuda", enforce_eager=enforce_eager, **kw)
    plain = LLM(model, **gpu)
    try:
        plain_texts = _greedy_texts(plain)
    finally:
        plain.shutdown()
    cpu = LLM(model, device="cpu", quantization="fp8", **kw)
    try:
        cpu_texts = _greedy_texts(cpu)
    finally:
        cpu.shutdown()
    quant = LLM(model, quantization="fp8", **gpu)
    try:
        layer = quant.engine.executor.worker.model.layers[0]
        assert layer.mlp.gate_up_proj.weight_fp8.dtype == fp8.FP8_DTYPE
        assert _top1_agreement(quant, cpu_texts) >= 0.8
        assert _top1_agreement(quant, plain_texts) >= 0.45
        quant.engine.block_manager.check_no_leaks()
    finally:
        quant.shutdown()
