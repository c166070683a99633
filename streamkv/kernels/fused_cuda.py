"""CUDA launches of the fused elementwise ops (``fused.py`` checks dtype, device and layout
before it calls these). One program per dtype holds every kernel in both access widths: a
16-byte vector per thread where the rows and pointers allow it, one element otherwise.
Launched with programmatic dependent launch where the device has it (``launch.use_pdl``):
each kernel waits for the one before it at its start (kernels_cu/pdl.cuh)."""

from __future__ import annotations

from functools import lru_cache

import torch

from streamkv.kernels import cuda_driver, launch
from streamkv.kernels.launch import FLOAT, INT, LONG, PTR

FUSED_SOURCE = "fused_ops.cu"
TEMPLATES = {
    "rms_norm": "rms_norm_kernel<{t}, {n}, false>",
    "add_rms_norm": "rms_norm_kernel<{t}, {n}, true>",
    "add_layer_norm": "add_layer_norm_kernel<{t}, {n}>",
    "rotary": "rotary_embedding_kernel<{t}, {n}>",
    "silu_and_mul": "silu_and_mul_kernel<{t}, {n}>",
    "quant_fp8_rows": "quant_fp8_rows_kernel<{t}, {n}>",
    "scale_fp8_product": "scale_fp8_product_kernel<{t}, {n}>",
}
SILU_THREADS = 256


def vector_width(dtype: str) -> int:
    return 16 // {"float": 4, "__half": 2, "__nv_bfloat16": 2}[dtype]


def kernel_name(kind: str, dtype: str, n: int) -> str:
    return "streamkv::" + TEMPLATES[kind].format(t=dtype, n=n)


def fused_names(dtype: str) -> tuple[str, ...]:
    """Name expressions of one dtype's program: every kernel, vectorised and scalar."""
    return tuple(
        kernel_name(kind, dtype, n) for n in (vector_width(dtype), 1) for kind in TEMPLATES
    )


@lru_cache(maxsize=64)
def _kernel(kind: str, dtype: str, n: int, device: int) -> cuda_driver.Kernel:
    module = launch.module(FUSED_SOURCE, fused_names(dtype), torch.device("cuda", device))
    return module.kernel(kernel_name(kind, dtype, n))


def _width(dtype: torch.dtype, length: int, *tensors: torch.Tensor, extra: int = 0) -> int:
    """Elements per access: a 16-byte vector when ``length`` (and ``extra``, an element
    offset some kernel adds to a row) divide into vectors and every tensor is 16-byte
    aligned, else 1."""
    n = vector_width(launch.DTYPE_NAMES[dtype])
    if length % n or extra % n or not all(launch.aligned16(t) for t in tensors):
        return 1
    return n


def _get(kind: str, t: torch.Tensor, n: int) -> cuda_driver.Kernel:
    return _kernel(kind, launch.DTYPE_NAMES[t.dtype], n, launch.device_index(t.device))


def _row_threads(packs: int, cap: int = 1024) -> int:
    return min(cap, max(32, -(-packs // 32) * 32))


def _check_hidden(hidden: int, *params: torch.Tensor) -> None:
    for p in params:
        if p.shape != (hidden,) or not p.is_contiguous():
            raise ValueError(f"norm parameter of shape {tuple(p.shape)} for rows of {hidden}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    tokens, hidden = x.shape
    _check_hidden(hidden, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if tokens == 0:
        return out
    n = _width(x.dtype, hidden, x, weight, out)
    _get("rms_norm", x, n).launch(
        (tokens, 1, 1),
        (_row_threads(hidden // n), 1, 1),
        [
            (PTR, out.data_ptr()),
            (PTR, 0),
            (PTR, x.data_ptr()),
            (PTR, weight.data_ptr()),
            (LONG, out.stride(0)),
            (LONG, 0),
            (LONG, x.stride(0)),
            (INT, hidden),
            (FLOAT, eps),
        ],
        launch.stream(x.device),
        pdl=launch.use_pdl(x.device),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    tokens, hidden = x.shape
    _check_hidden(hidden, weight)
    if tokens == 0:
        return
    n = _width(x.dtype, hidden, x, residual, weight)
    _get("add_rms_norm", x, n).launch(
        (tokens, 1, 1),
        (_row_threads(hidden // n), 1, 1),
        [
            (PTR, x.data_ptr()),
            (PTR, residual.data_ptr()),
            (PTR, x.data_ptr()),
            (PTR, weight.data_ptr()),
            (LONG, x.stride(0)),
            (LONG, residual.stride(0)),
            (LONG, x.stride(0)),
            (INT, hidden),
            (FLOAT, eps),
        ],
        launch.stream(x.device),
        pdl=launch.use_pdl(x.device),
    )


def fused_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> None:
    tokens, hidden = x.shape
    params = [p for p in (weight, bias) if p is not None]
    _check_hidden(hidden, *params)
    if tokens == 0:
        return
    n = _width(x.dtype, hidden, x, residual)
    _get("add_layer_norm", x, n).launch(
        (tokens, 1, 1),
        (_row_threads(hidden // n), 1, 1),
        [
            (PTR, x.data_ptr()),
            (PTR, residual.data_ptr()),
            (PTR, 0 if weight is None else weight.data_ptr()),
            (PTR, 0 if bias is None else bias.data_ptr()),
            (LONG, x.stride(0)),
            (LONG, residual.stride(0)),
            (INT, hidden),
            (FLOAT, eps),
        ],
        launch.stream(x.device),
        pdl=launch.use_pdl(x.device),
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    tokens, q_heads, head = q.shape
    if k.shape[0] != tokens or positions.numel() != tokens:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, {positions.numel()} positions")
    if tokens == 0:
        return
    half = head // 2
    pos = positions.to(device=q.device, dtype=torch.int64).contiguous()
    # Head rows start at multiples of head and the second half at +half: both must be
    # whole vectors, as must the token strides (aligned16 checks those).
    n = _width(q.dtype, half, q, k)
    threads = _row_threads((q_heads + k.shape[1]) * (half // n), 512)
    _get("rotary", q, n).launch(
        (tokens, 1, 1),
        (threads, 1, 1),
        [
            (PTR, q.data_ptr()),
            (PTR, k.data_ptr()),
            (PTR, pos.data_ptr()),
            (PTR, cos.data_ptr()),
            (PTR, sin.data_ptr()),
            (LONG, q.stride(0)),
            (LONG, k.stride(0)),
            (INT, q_heads),
            (INT, k.shape[1]),
            (INT, half),
        ],
        launch.stream(q.device),
        pdl=launch.use_pdl(q.device),
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    tokens, width = x.shape
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0 or inter == 0:
        return out
    n = _width(x.dtype, inter, x, out)
    packs = inter // n
    _get("silu_and_mul", x, n).launch(
        (tokens, -(-packs // SILU_THREADS), 1),
        (SILU_THREADS, 1, 1),
        [
            (PTR, out.data_ptr()),
            (PTR, x.data_ptr()),
            (LONG, out.stride(0)),
            (LONG, x.stride(0)),
            (INT, inter),
        ],
        launch.stream(x.device),
        pdl=launch.use_pdl(x.device),
    )
    return out


def quant_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, k] -> (float8_e4m3fn [tokens, k], fp32 scale [tokens, 1]): layers/fp8.py's
    per-token quantization in one launch instead of a chain of fp32 temporaries."""
    tokens, k = x.shape
    q = torch.empty((tokens, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((tokens, 1), dtype=torch.float32, device=x.device)
    if tokens == 0:
        return q, scale
    # q's rows are k bytes: with k % n == 0 each store of n bytes is n-byte aligned.
    n = _width(x.dtype, k, x)
    _get("quant_fp8_rows", x, n).launch(
        (tokens, 1, 1),
        (_row_threads(k // n), 1, 1),
        [
            (PTR, q.data_ptr()),
            (PTR, scale.data_ptr()),
            (PTR, x.data_ptr()),
            (LONG, q.stride(0)),
            (LONG, x.stride(0)),
            (INT, k),
        ],
        launch.stream(x.device),
        pdl=launch.use_pdl(x.device),
    )
    return q, scale


def scale_fp8_product(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[rows, cols] fp32 product of unscaled fp8 operands -> ``dtype`` [rows, cols] with
    each row's and column's scale (and the bias) applied: layers/fp8.py's small-batch path."""
    rows, cols = acc.shape
    floats = (acc, row_scale, col_scale)
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in floats) or (
        row_scale.numel(),
        col_scale.numel(),
    ) != (rows, cols):
        raise ValueError("scale_fp8_product takes a contiguous fp32 product and its scales")
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous {dtype} vector")
    out = torch.empty((rows, cols), dtype=dtype, device=acc.device)
    if rows == 0:
        return out
    # A pack is n outputs and n fp32 inputs: twice the out vector's bytes, so acc's rows and
    # the column scales must be 32-byte aligned for it as well.
    n = _width(dtype, cols, out, *([] if bias is None else [bias]))
    if any(t.data_ptr() % (4 * n) for t in (acc, col_scale)):
        n = 1
    packs = cols // n
    _get("scale_fp8_product", out, n).launch(
        (rows, -(-packs // SILU_THREADS), 1),
        (SILU_THREADS, 1, 1),
        [
            (PTR, out.data_ptr()),
            (PTR, acc.data_ptr()),
            (PTR, row_scale.data_ptr()),
            (PTR, col_scale.data_ptr()),
            (PTR, 0 if bias is None else bias.data_ptr()),
            (INT, cols),
        ],
        launch.stream(acc.device),
        pdl=launch.use_pdl(acc.device),
    )
    return out
