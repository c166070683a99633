"""The FP8 KV cache's number format: float8 e4m3 (``torch.float8_e4m3fn``) with one fp32
scale per layer for K and one for V, as vLLM stores it.

A cached value is ``x / scale`` saturated to ±448 (e4m3's largest finite value) and rounded
to e4m3; reading it back is ``q * scale``. The scales are 1.0 (vLLM's default without
calibrated checkpoint scales): K and V activations of the models served here sit well inside
e4m3's range, and a scale that is a property of the layer, not of the data, lets a CUDA
graph or a swapped block never need re-scaling. docs/kernels.md ("FP8 KV cache") has the
choice and the measured error.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# The CUDA name of the cache element (kernels_cu/dtypes.cuh, <cuda_fp8.h>).
FP8_CUDA_NAME = "__nv_fp8_e4m3"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to ±448, as float8_e4m3fn (round to nearest even); ``scale`` a
    number or a tensor that broadcasts (fp8 weights' per-row scales, layers/fp8.py)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in ``dtype`` (e4m3 widens exactly to fp16, bf16 and fp32)."""
    x = q.to(dtype)
    return x if scale == 1.0 else x * scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 tensor, for the index ops torch lacks for float8 on the CPU
    (``index_copy_``); any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
