"""CUDA launch of the decode GEMV (``gemv.py`` checks dtype, device and layout first)."""

from __future__ import annotations

from functools import lru_cache

import torch

from streamkv.kernels import cuda_driver, launch
from streamkv.kernels.gemv import DEFAULT, ROW_VARIANTS, GemvConfig
from streamkv.kernels.launch import INT, LONG, PTR

GEMV_SOURCE = "gemv.cu"


def kernel_name(dtype: str, rows: int, unroll: int, silu: bool) -> str:
    return f"streamkv::gemv_kernel<{dtype}, {rows}, {unroll}, {'true' if silu else 'false'}>"


def gemv_names(dtype: str, unroll: int) -> tuple[str, ...]:
    """One program per (dtype, unroll): every row count, plain and SiLU-paired."""
    return tuple(kernel_name(dtype, m, unroll, s) for m in ROW_VARIANTS for s in (False, True))


@lru_cache(maxsize=64)
def _kernel(dtype: str, rows: int, unroll: int, silu: bool, device: int) -> cuda_driver.Kernel:
    module = launch.module(GEMV_SOURCE, gemv_names(dtype, unroll), torch.device("cuda", device))
    return module.kernel(kernel_name(dtype, rows, unroll, silu))


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    silu: bool,
    config: GemvConfig = DEFAULT,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel launch (callers checked the layout). ``out``: a [m, n] tensor with unit
    column stride to write into (tests poison it first)."""
    m, k = x.shape
    n = w.shape[0] // 2 if silu else w.shape[0]
    if not 0 < m <= ROW_VARIANTS[-1]:
        raise ValueError(f"the GEMV kernel takes 1..{ROW_VARIANTS[-1]} rows, got {m}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} for a [{m}, {n}] {x.dtype} product")
    rows = next(r for r in ROW_VARIANTS if r >= m)
    slices = config.split_k_for(k)
    pairs_per_cta = config.warps // slices
    pairs = n if silu else -(-n // 2)
    index = launch.device_index(x.device)
    kernel = _kernel(launch.DTYPE_NAMES[x.dtype], rows, config.unroll, silu, index)
    kernel.launch(
        (-(-pairs // pairs_per_cta), 1, 1),
        (32 * config.warps, 1, 1),
        [
            (PTR, out.data_ptr()),
            (PTR, x.data_ptr()),
            (PTR, w.data_ptr()),
            (PTR, 0 if b is None else b.data_ptr()),
            (LONG, out.stride(0)),
            (LONG, x.stride(0)),
            (INT, m),
            (INT, n),
            (INT, k),
            (INT, slices),
        ],
        launch.stream(x.device),
        pdl=config.pdl and launch.arch(x.device) >= 90,
    )
    return out
