"""The decode-attention kernels of ``paged_attention.cu`` by name: which instantiation serves
a (dtype, head size, block size, query heads per CTA) case, the experimental variants the
tests and ``benchmarks/bench_kernels.py`` measure (one explicit record, ``DecodeVariant``),
and the dynamic shared memory of each. No GPU needed: CI compiles every name.

``dtype`` is always the query's (and output's) CUDA type. An fp8 cache adds its element
type as the kernels' last template argument (``cache=FP8_CUDA_NAME``); ``cache=None`` is a
cache of the query's type, and names the kernels exactly as before fp8 existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamkv.kernels.launch import next_pow2

ATTENTION_SOURCE = "paged_attention.cu"
HEAD_SIZES = (64, 80, 96, 128, 256)
# Tokens per KV block: every power of two from 1 to 256 (the paper's Fig 18b sweep). BLOCK
# is a template parameter that only addresses a token's row (t / BLOCK, t % BLOCK) and sizes
# the partition's block-id array (kMaxPartition / BLOCK ints), so each size is one more
# instantiation of the same kernels. The benchmarks and tuning of docs/kernels.md were
# measured at TUNED_BLOCK_SIZES; the others are tested for correctness only.
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TUNED_BLOCK_SIZES = (8, 16, 32)
GROUP_PADS = (1, 2, 4, 8)  # query heads per CTA; larger groups are split into chunks of 8
# Tokens per CTA. A partition holds whole blocks, so block 256 uses only 1024, 512 and 256.
PARTITION_SIZES = (1024, 512, 256, 128)
TENSOR_CORE_DTYPES = ("__half", "__nv_bfloat16")
# Tensor-core kernel: 16-token chunks a warp loads per step (UNROLL, 1-4) by head size;
# docs/kernels.md has the measurements.
TC_UNROLL = {64: 4, 128: 2, 256: 1}
TC_WARP_SOFTMAX = False  # tensor-core kernel: softmax per warp (True) or per CTA (False)
ATTENTION_THREADS = 128  # kThreads in paged_attention.cu
ATTENTION_WARPS = ATTENTION_THREADS // 32
KERNEL_KINDS = ("auto", "tensor_core", "cuda_core")


@dataclass(frozen=True, slots=True)
class DecodeVariant:
    """Which decode kernel, and how. The default is the production path; the other values
    are experiments kept for tests and benchmarks (docs/kernels.md has their figures).

    - ``kernel``: "tensor_core" (mma.sync; fp16 / bf16, head sizes that are multiples of
      64), "cuda_core" (fp32 multiply-adds, every dtype and head) or "auto" (resolve_kernel).
    - ``stages``: CUDA-core kernel, 0 = register loads, >= 2 = cp.async ring depth.
    - ``warp_softmax``: tensor-core kernel's softmax per warp (None: TC_WARP_SOFTMAX).
    - ``unroll``: tensor-core kernel's chunks per warp step (None: TC_UNROLL by head).
    - ``fused_merge``: the last CTA of a sequence merges its partitions instead of a second
      launch; faster with a few partitions, much slower with many (one CTA merges all).
    """

    kernel: str = "auto"
    stages: int = 0
    warp_softmax: bool | None = None
    unroll: int | None = None
    fused_merge: bool = False


def check_block_size(block: int) -> None:
    """The decode kernels serve BLOCK_SIZES only (kMaxPartition % BLOCK == 0 in the source)."""
    if block not in BLOCK_SIZES:
        raise ValueError(
            f"block size must be a power of two from 1 to {BLOCK_SIZES[-1]}, got {block}"
        )


def tensor_core_ok(dtype: str, head: int) -> bool:
    return dtype in TENSOR_CORE_DTYPES and head % 64 == 0


def resolve_kernel(kernel: str, dtype: str, head: int, gpad: int = 8) -> str:
    """``auto``: the tensor-core kernel where it applies and a KV head serves 2 or more
    query heads (padded). With one (multi-head attention) the CUDA-core kernel does few
    enough multiply-adds per byte to keep up, in fewer registers (docs/kernels.md)."""
    if kernel not in KERNEL_KINDS:
        raise ValueError(f"decode kernel must be auto, tensor_core or cuda_core, got {kernel!r}")
    if kernel == "auto":
        return "tensor_core" if tensor_core_ok(dtype, head) and gpad >= 2 else "cuda_core"
    if kernel == "tensor_core" and not tensor_core_ok(dtype, head):
        raise ValueError(
            f"the tensor-core decode kernel needs an fp16 / bf16 cache and a head size that is a "
            f"multiple of 64, got {dtype} and {head}"
        )
    return kernel


def decode_name(
    dtype: str,
    head: int,
    block: int,
    gpad: int,
    stages: int,
    kernel: str,
    warp_softmax: bool | None = None,
    unroll: int | None = None,
    cache: str | None = None,
) -> str:
    """``warp_softmax`` / ``unroll``: the tensor-core kernel's WARP_SOFTMAX and UNROLL
    (None: TC_WARP_SOFTMAX, TC_UNROLL for the head size). ``cache``: the cache's element
    type when it is not ``dtype`` (the fp8 cache)."""
    tail = "" if cache is None else f", {cache}"
    if resolve_kernel(kernel, dtype, head, gpad) == "tensor_core":
        ws = TC_WARP_SOFTMAX if warp_softmax is None else warp_softmax
        un = TC_UNROLL.get(head, 1) if unroll is None else unroll
        if not 1 <= un <= 4:
            raise ValueError(f"tensor-core unroll must be 1 to 4 chunks, got {un}")
        return (
            f"streamkv::paged_attention_decode_tc_kernel<{dtype}, {head}, {block}, {gpad}, "
            f"{'true' if ws else 'false'}, {un}{tail}>"
        )
    return (
        f"streamkv::paged_attention_decode_kernel<{dtype}, {head}, {block}, {gpad}, {stages}{tail}>"
    )


def reduce_name(dtype: str, head: int) -> str:
    return f"streamkv::paged_attention_reduce_kernel<{dtype}, {head}>"


def attention_names(
    dtype: str,
    head: int,
    block: int,
    gpads=GROUP_PADS,
    stages: int | None = None,
    warp_softmax: bool | None = None,
    unroll: int | None = None,
    cache: str | None = None,
) -> tuple[str, ...]:
    """Name expressions of one attention program: the CUDA-core decode kernel for each of
    ``gpads``, the tensor-core one for each of them where the dtype and head size allow, and
    the reduce. ``cache``: the fp8 cache's element type (decode_name)."""
    stages = DecodeVariant().stages if stages is None else stages
    names = [decode_name(dtype, head, block, g, stages, "cuda_core", cache=cache) for g in gpads]
    if tensor_core_ok(dtype, head):
        names += [
            decode_name(dtype, head, block, g, stages, "tensor_core", warp_softmax, unroll, cache)
            for g in gpads
        ]
    names.append(reduce_name(dtype, head))
    return tuple(names)


def attention_smem(
    partition_size: int,
    gpad: int,
    head: int,
    dtype: torch.dtype,
    stages: int,
    kernel: str = "cuda_core",
) -> int:
    """Dynamic shared memory of a decode kernel (mirrors paged_attention.cu); ``dtype`` is
    the cache's, whose element size sets the CUDA-core kernel's vectors per row."""
    if kernel == "tensor_core":  # logits [partition][8], reused for the cross-warp sums
        return max(partition_size * 8, ATTENTION_WARPS * gpad * head) * 4
    vec = 16 // dtype.itemsize
    nv = head // vec
    tg = min(32, next_pow2(nv))
    nvt = -(-nv // tg)
    unroll = (8 if stages == 0 else 4) // nvt
    ring = stages * unroll * nvt * ATTENTION_THREADS * 16
    return ring + max(partition_size, ATTENTION_WARPS * head) * gpad * 4
