"""Paged decode attention on CUDA (``kernels_cu/paged_attention.cu``): one query token per
sequence over its paged context, split into partitions (flash-decoding) and merged.

One kernel per case (``decode_kernels.decode_name``): the tensor-core kernel for fp16 / bf16
with a head size that is a multiple of 64 and 2+ query heads per CTA, the CUDA-core kernel
(register loads) for the rest; the merge kernel when a context spans 2+ partitions. The
other configurations the templates take (cp.async rings, per-warp softmax, other unrolls,
the fused merge) are experiments of ``benchmarks/decode_variants.py``.

``paged_attention_decode`` picks the kernel and the partition size (``choose_partition_size``)
and launches on torch's current stream (``decode_launch.py``); it never synchronises the
host. ``max_context_len`` bounds the partitions: a CUDA graph is captured for one bound per
context bucket (worker/cuda_graphs.py), an eager call uses the batch's own maximum.

With an fp8 cache the kernels run in the query's dtype and widen K/V in registers; the K
scale folds into the softmax scale and the V scale multiplies the output (an extra
elementwise op only when it is not 1.0). ``dtype`` below is always the kernels' CUDA type.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from streamkv.kernels import cuda_driver, launch
from streamkv.kernels.decode_kernels import (
    ATTENTION_SOURCE,
    ATTENTION_THREADS,
    PARTITION_SIZES,
    attention_names,
    check_block_size,
    decode_name,
    decode_smem,
    group_pad,
    reduce_name,
    uses_tensor_cores,
)
from streamkv.kernels.decode_launch import DecodeGrid, DecodeKernels, launch_kernels
from streamkv.kernels.fp8 import FP8_CUDA_NAME, is_fp8
from streamkv.kernels.launch import DTYPE_NAMES

# choose_partition_size's long_waves: 1024-token partitions when the grid fits one wave or
# spans at least this many (per kernel; docs/kernels.md has the sweeps).
TC_LONG_WAVES = 2
CUDA_CORE_LONG_WAVES = 8


@lru_cache(maxsize=256)
def case_kernels(
    dtype: str, head: int, block: int, gpad: int, device: int, cache: str | None = None
) -> DecodeKernels:
    """The kernels of one case on one device: looked up once, not on every layer's call."""
    tc = uses_tensor_cores(dtype, head, gpad)
    names = attention_names(dtype, head, block, (gpad,), cache)
    module = launch.module(ATTENTION_SOURCE, names, torch.device("cuda", device))
    return DecodeKernels(
        module.kernel(decode_name(dtype, head, block, gpad, cache)),
        module.kernel(reduce_name(dtype, head)),
        lambda p: decode_smem(p, gpad, head, tc),
        TC_LONG_WAVES if tc else CUDA_CORE_LONG_WAVES,
    )


def choose_partition_size(
    kernel: cuda_driver.Kernel,
    ctas_per_partition: int,
    max_context_len: int,
    block_size: int,
    shared_mem: Callable[[int], int],
    device: torch.device,
    long_waves: int = 8,
) -> int:
    """Longest partition that still fills most of the GPU's CTA slots.

    Long partitions amortise each CTA's fixed cost (block ids, q, the cross-warp output sum)
    and keep the merge small; short ones keep multiprocessors busy when there are few
    sequences. The rule, from the sweeps of benchmarks/bench_kernels.py on an H200: the
    longest size whose grid is at least 3/4 of a wave; 1024 only when its grid fits one wave
    (one partition per sequence, no merge) or spans ``long_waves`` or more, since between
    those 512's finer grain balanced the multiprocessors better (8 for the CUDA-core kernel;
    2 for the tensor-core kernel, whose 1024-token CTAs were as fast or faster from 2 waves).
    """
    sizes = [p for p in PARTITION_SIZES if p % block_size == 0]
    sms = launch.sm_count(launch.device_index(device))
    for p in sizes:
        slots = sms * max(1, kernel.occupancy(ATTENTION_THREADS, shared_mem(p)))
        ctas = ctas_per_partition * -(-max_context_len // p)
        if 4 * ctas < 3 * slots:
            continue
        if p > 512 and slots < ctas < long_waves * slots:
            continue
        return p
    return sizes[-1]


def check_inputs(query, key_cache, value_cache) -> None:
    head, (_, num_kv_heads, _, cache_head) = query.shape[-1], key_cache.shape
    dtype = key_cache.dtype
    if is_fp8(dtype) and query.dtype not in DTYPE_NAMES:
        raise TypeError(f"no fp8-cache decode kernel for a {query.dtype} query")
    if (dtype not in DTYPE_NAMES and not is_fp8(dtype)) or value_cache.dtype != dtype:
        raise TypeError(f"unsupported KV cache dtype {dtype} / {value_cache.dtype}")
    if cache_head != head or value_cache.shape != key_cache.shape:
        raise ValueError(f"query head size {head} vs caches {tuple(key_cache.shape)}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"{query.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    check_block_size(key_cache.shape[2])
    if (
        not (launch.aligned16(key_cache) and launch.aligned16(value_cache))
        or (head * key_cache.element_size()) % 16
    ):
        raise ValueError("KV cache rows must be 16-byte aligned")


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The case's kernel at the partition size the rule picks. The kernels run in the
    cache's dtype, or in the query's over an fp8 cache, whose ``k_scale`` and ``v_scale``
    they apply (other caches ignore them)."""
    check_inputs(query, key_cache, value_cache)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    fp8 = is_fp8(key_cache.dtype)
    out = launch_decode(
        kernels_for(query, key_cache),
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale * k_scale if fp8 else scale,
        max_context_len,
    )
    return out.mul_(v_scale) if fp8 and v_scale != 1.0 else out


def kernels_for(query: torch.Tensor, key_cache: torch.Tensor) -> DecodeKernels:
    """The kernels of the case these tensors make (check_inputs first)."""
    fp8 = is_fp8(key_cache.dtype)
    return case_kernels(
        DTYPE_NAMES[query.dtype if fp8 else key_cache.dtype],
        query.shape[-1],
        key_cache.shape[2],
        group_pad(query.shape[1] // key_cache.shape[1]),
        launch.device_index(query.device),
        FP8_CUDA_NAME if fp8 else None,
    )


def launch_decode(
    kernels: DecodeKernels,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode launch and, past one partition, the merge. ``partition_size`` (None: the
    rule's) and ``out`` (the kernels' dtype, [seqs, heads, head]) are for tests and
    benchmarks. An fp8 cache's K scale is already in ``scale``."""
    num_seqs = query.shape[0]
    dtype = query.dtype if is_fp8(key_cache.dtype) else key_cache.dtype
    q, block_tables, context_lens = _kernel_inputs(query, dtype, block_tables, context_lens)
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    out = _checked_out(out, query, dtype)
    if num_seqs == 0:
        return out.to(query.dtype)
    grid = _decode_grid(kernels, query, key_cache, max_context_len, partition_size)
    launch_kernels(kernels, grid, out, q, key_cache, value_cache, block_tables, context_lens, scale)
    return out if query.dtype == dtype else out.to(query.dtype)


def _kernel_inputs(
    query: torch.Tensor, dtype: torch.dtype, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q in the kernels' dtype with contiguous, 16-byte aligned heads; int32 tables and
    lengths with contiguous rows (copies only where the tensors are not already so)."""
    head = query.shape[-1]
    q = query.to(dtype)
    if q.stride(-1) != 1 or q.stride(1) != head or not launch.aligned16(q):
        q = q.contiguous()
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    return q, block_tables, context_lens


def _checked_out(out: torch.Tensor | None, query: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The caller's ``out`` once checked, or a new one: [seqs, heads, head] of ``dtype``."""
    if out is None:
        return torch.empty(query.shape, dtype=dtype, device=query.device)
    if out.shape != query.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            "out must be a contiguous [seqs, heads, head] tensor of the kernels' dtype"
        )
    return out


def _decode_grid(
    kernels: DecodeKernels,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    max_context_len: int,
    partition_size: int | None = None,
) -> DecodeGrid:
    """The grid of a call with at least one sequence; ``partition_size`` None: the rule's."""
    num_seqs, num_heads, head = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    columns = num_kv_heads * -(-group // group_pad(group))
    if partition_size is None:
        partition_size = choose_partition_size(
            kernels.decode,
            num_seqs * columns,
            max_context_len,
            block_size,
            kernels.shared_mem,
            query.device,
            kernels.long_waves,
        )
    if partition_size % block_size or not 0 < partition_size <= PARTITION_SIZES[0]:
        raise ValueError(f"partition size {partition_size} vs block size {block_size}")
    max_parts = max(1, -(-max_context_len // partition_size))
    return DecodeGrid(
        num_seqs, num_heads, head, num_kv_heads, group, columns, partition_size, max_parts
    )
