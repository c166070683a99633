"""The fused elementwise ops around the matmuls, one signature each: residual add + RMSNorm,
RMSNorm, residual add + LayerNorm, rotary embedding in place, SiLU-and-mul.

CUDA tensors of one supported dtype (fp32 / fp16 / bf16) in a layout the kernels take go to
``kernels_cu/fused_ops.cu`` (launched by ``fused_cuda.py``); anything else runs the
pure-torch reference below. The references are exactly the unfused torch code the models
ran before these ops existed, so CPU outputs (and the greedy-equivalence tests against
transformers) are unchanged; the kernels round to the dtype at the same points and differ
only in the order of fp32 reductions (tests/kernels/test_fused_ops.py).

The "add" ops work in place like vLLM's ``fused_add_rms_norm``: ``residual += x`` and then
``x = norm(residual)``, so a decoder layer carries its residual stream without a separate
add kernel per sub-layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    """Every tensor on one CUDA device, in one supported dtype, rows of 2-D tensors with
    unit stride (the kernels index rows by a stride and elements contiguously)."""
    first = tensors[0]
    return (
        first.is_cuda
        and first.dtype in _DTYPES
        and all(t.device == first.device and t.dtype == first.dtype for t in tensors)
        and all(t.stride(-1) == 1 for t in tensors)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * T(x * rsqrt(mean(x^2) + eps))`` over the last axis of x [tokens, hidden]."""
    if x.dim() == 2 and _kernel_ok(x, weight):
        from streamkv.kernels import fused_cuda

        return fused_cuda.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like the reference implementations, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``."""
    if x.dim() == 2 and x.shape == residual.shape and _kernel_ok(x, residual, weight):
        from streamkv.kernels import fused_cuda

        return fused_cuda.fused_add_rms_norm(x, residual, weight, eps)
    fused_add_rms_norm_ref(x, residual, weight, eps)


def fused_add_rms_norm_ref(x, residual, weight, eps) -> None:
    residual.add_(x)
    x.copy_(rms_norm_ref(residual, weight, eps))


def fused_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> None:
    """In place: ``residual += x``, then ``x = layer_norm(residual)`` (OPT)."""
    params = [p for p in (weight, bias) if p is not None]
    if x.dim() == 2 and x.shape == residual.shape and _kernel_ok(x, residual, *params):
        from streamkv.kernels import fused_cuda

        return fused_cuda.fused_add_layer_norm(x, residual, weight, bias, eps)
    fused_add_layer_norm_ref(x, residual, weight, bias, eps)


def fused_add_layer_norm_ref(x, residual, weight, bias, eps) -> None:
    residual.add_(x)
    x.copy_(F.layer_norm(residual, residual.shape[-1:], weight, bias, eps))


def rotary_embedding(
    positions: torch.Tensor,  # [tokens] int64
    q: torch.Tensor,  # [tokens, q_heads, head]
    k: torch.Tensor,  # [tokens, k_heads, head]
    cos: torch.Tensor,  # [max_positions, head / 2] float32
    sin: torch.Tensor,
) -> None:
    """Rotates q and k in place (non-interleaved halves, as Hugging Face Llama)."""
    head = q.shape[-1]
    if (
        q.dim() == 3
        and k.dim() == 3
        and k.shape[-1] == head
        and _kernel_ok(q, k)
        and q.stride(1) == head
        and k.stride(1) == head
        and cos.is_cuda
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape == (cos.shape[0], head // 2)
    ):
        from streamkv.kernels import fused_cuda

        return fused_cuda.rotary_embedding(positions, q, k, cos, sin)
    rotary_embedding_ref(positions, q, k, cos, sin)


def rotary_embedding_ref(positions, q, k, cos, sin) -> None:
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    q.copy_(_rotate(q, c, s))
    k.copy_(_rotate(k, c, s))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * inter] (gate | up) -> [tokens, inter]: ``silu(gate) * up``."""
    if x.dim() == 2 and x.shape[-1] % 2 == 0 and _kernel_ok(x):
        from streamkv.kernels import fused_cuda

        return fused_cuda.silu_and_mul(x)
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
