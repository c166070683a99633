"""FP8 (e4m3) weights of a linear layer, ``--quantization fp8``: one fp32 scale per output
channel of the weight, computed at load time, and one per token of the activation, computed
on every call: on CUDA by one kernel (``fused_cuda.quant_fp8_rows``, kernels_cu/fused_ops.cu)
whose bytes and scales are the torch reference's, ``_quantize_rows``.

``fp8_linear`` on CUDA is one ``torch._scaled_mm`` with row-wise scales (fp32 accumulate, the
scales applied to the accumulator, the bias added, the output written in bf16). For at most
``SMALL_BATCH`` rows it is instead ``_scaled_mm`` with unit per-tensor scales into fp32 and one
kernel that applies the same scales and bias (``fused_cuda.scale_fp8_product``): the same
numerics, and on an H200 (benchmarks/bench_fp8_gemm.py) 1.2-1.7x faster at 8-128 rows,
because cuBLASLt's row-wise kernels use 128x128 tiles without split-K, so llama3-8b's 4096-
wide projections run on 32 CTAs for 132 multiprocessors. Anywhere else it is the reference
with the same numerics: both fp8 operands widened to fp32 with their scales, an fp32 product,
the output cast to the input's dtype. Every op works on device
tensors of fixed shapes, so a call can be captured in a CUDA graph (docs/kernels.md, "FP8
weights").
"""

from __future__ import annotations

import torch

# The number format and its rounding are the FP8 KV cache's (kernels/fp8.py); only the
# scales differ: per row here, per layer there.
from streamkv.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize

__all__ = ["FP8_DTYPE", "FP8_MAX"]  # re-exported for the layer's callers and tests
# The smallest scale: an all-zero row (a dead channel, padding) then quantizes to zeros,
# never to 0 / 0.
MIN_SCALE = 1e-12
# torch._scaled_mm's row-wise kernels need both inner and output sizes aligned to 16 bytes of
# fp8, and write bf16 only.
CUDA_ALIGN = 16
CUDA_OUT_DTYPE = torch.bfloat16
# The most rows that take the small-batch product (the per-tensor kernels, then the scales):
# below it the row-wise kernels starve the GPU; above it the fp32 product's extra bytes
# cost more than they save (benchmarks/bench_fp8_gemm.py).
SMALL_BATCH = 256
# The per-token kernel's element types (one NVRTC program each, kernels/fused_cuda.py).
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] -> (fp8 [R, K], fp32 scale [R, 1]): each row divided by amax(|row|) / 448 and
    rounded to the nearest e4m3 value, so a row's largest element lands on 448."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # Divided by a tensor, not the number 448: torch divides a CUDA tensor by a Python scalar
    # as a product with its fp32 reciprocal (1 ulp off the quotient for about half the rows),
    # a CPU one exactly; by a tensor both divide exactly, as the CUDA kernel does.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    # The saturation only guards rounding at the edge: |x / scale| <= 448 by construction.
    return quantize(x, scale), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (float8_e4m3fn [N, K], per-output-channel fp32 scale [N])."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight takes a [N, K] weight, got shape {tuple(w.shape)}")
    q, scale = _quantize_rows(w)
    return q, scale.view(-1)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activation -> (float8_e4m3fn [M, K], per-token fp32 scale [M, 1])."""
    if x.is_cuda and x.dim() == 2 and x.dtype in _KERNEL_DTYPES and x.stride(-1) == 1:
        from streamkv.kernels import fused_cuda

        return fused_cuda.quant_fp8_rows(x)
    return _quantize_rows(x)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of an fp8 tensor with a scale per row (``scale`` of shape [R] or [R, 1])."""
    return q.float() * scale.view(-1, 1)


def check_cuda_shape(out_features: int, in_features: int) -> None:
    """Raise if torch._scaled_mm cannot take a weight of this (local) shape."""
    if out_features % CUDA_ALIGN or in_features % CUDA_ALIGN:
        raise ValueError(
            f"quantization='fp8' on CUDA needs weight sizes that are multiples of {CUDA_ALIGN} "
            f"(torch._scaled_mm); this rank's shard is [{out_features}, {in_features}]"
        )


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    unit: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b`` with W stored as (``w_fp8`` [N, K], ``w_scale`` [N]) and x [..., K]
    quantized per token on the fly; the output is [..., N] in x's dtype. ``unit`` is a
    device scalar 1.0 for the small-batch path (made here if not given)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    x_fp8, x_scale = quantize_activation(x2)
    if x.is_cuda:
        if x.dtype != CUDA_OUT_DTYPE:
            raise ValueError(
                f"fp8_linear on CUDA writes bf16 (torch._scaled_mm with row-wise scales), "
                f"got a {x.dtype} input"
            )
        # mat2 must be column-major: the transpose of the row-major [N, K] weight is.
        if x2.shape[0] <= SMALL_BATCH:
            from streamkv.kernels import fused_cuda

            unit = torch.ones((), device=x.device) if unit is None else unit
            acc = torch._scaled_mm(
                x_fp8, w_fp8.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32
            )
            out = fused_cuda.scale_fp8_product(acc, x_scale, w_scale, bias, x.dtype)
            return out.view(*lead, w_fp8.shape[0])
        out = torch._scaled_mm(
            x_fp8,
            w_fp8.t(),
            scale_a=x_scale,
            scale_b=w_scale.view(1, -1),
            bias=bias,
            out_dtype=x.dtype,
        )
    else:
        out = dequantize(x_fp8, x_scale) @ dequantize(w_fp8, w_scale).t()
        if bias is not None:
            out = out + bias.float()
        out = out.to(x.dtype)
    return out.view(*lead, w_fp8.shape[0])
