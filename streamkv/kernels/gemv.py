"""Products with a Linear weight for steps of a few tokens: ``linear`` (``x W^T + b``) and
``linear_silu_and_mul`` (the Llama MLP's gate/up product with its SiLU-and-mul fused).

CUDA inputs of fp16 / bf16 with at most ``GemvConfig.max_rows`` rows, in a layout the
kernel takes, go to ``kernels_cu/gemv.cu``; anything else runs the torch reference
(``F.linear``, then ``fused.silu_and_mul``), which is what the layers ran before. At batch 1
a decode step is bound by reading the weights once; with this kernel a llama3-8b step runs
3 launches per layer fewer than with cuBLAS (split-K reduces, SiLU-and-mul) and its
projections 6% faster (docs/kernels.md, "Decode GEMV").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamkv.kernels import fused

ROW_VARIANTS = (1, 2, 4)  # the kernel's M: a call with m rows runs the smallest M >= m
_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """How the kernel runs; the default is the production path, the rest are experiments
    benchmarks/bench_decode_gemv.py passes explicitly.

    - ``max_rows``: the most rows (tokens) the kernel takes; 0 sends everything to cuBLAS.
    - ``unroll``: 16-byte loads per lane per row in flight before the multiplies.
    - ``warps``: per CTA (a power of two <= 8).
    - ``split_k``: warps that share one row pair, each over a slice of k; 0 = the fewest
      that leave a warp one round of ``unroll`` loads (split_k_for).
    - ``pdl``: programmatic dependent launch on sm_90+ (kernels_cu/pdl.cuh).
    """

    max_rows: int = 4
    unroll: int = 4
    warps: int = 8
    split_k: int = 0
    pdl: bool = True

    def split_k_for(self, k: int) -> int:
        if self.split_k:
            return min(self.split_k, self.warps)
        vectors = k // 8  # 16-byte vectors of a half-type row
        for s in (1, 2, 4, 8):
            if s >= self.warps or -(-vectors // s) <= 32 * self.unroll:
                return min(s, self.warps)
        return self.warps


DEFAULT = GemvConfig()


def _aligned16(t: torch.Tensor) -> bool:
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])


def _kernel_ok(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config: GemvConfig
) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= min(config.max_rows, ROW_VARIANTS[-1])
        and x.dtype in _DTYPES
        and w.dtype == x.dtype
        and w.device == x.device
        and w.dim() == 2
        and w.is_contiguous()
        and x.shape[1] == w.shape[1]
        and w.shape[1] % 8 == 0
        and x.stride(1) == 1
        and _aligned16(x)
        and _aligned16(w)
        and (b is None or (b.dtype == x.dtype and b.is_contiguous() and b.shape == (w.shape[0],)))
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``F.linear(x, w, b)`` for x [tokens, in], w [out, in]."""
    config = config or DEFAULT
    if _kernel_ok(x, w, b, config):
        from streamkv.kernels import gemv_cuda

        return gemv_cuda.gemv(x, w, b, silu=False, config=config)
    return F.linear(x, w, b)


def linear_silu_and_mul(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``fused.silu_and_mul(F.linear(x, w, b))``: w holds gate rows, then as many up rows."""
    config = config or DEFAULT
    if w.shape[0] % 2 == 0 and _kernel_ok(x, w, b, config):
        from streamkv.kernels import gemv_cuda

        return gemv_cuda.gemv(x, w, b, silu=True, config=config)
    return fused.silu_and_mul(F.linear(x, w, b))
