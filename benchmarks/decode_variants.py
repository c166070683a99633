"""The decode-attention kernels' experimental variants, for ``bench_kernels.py``'s sweeps.

Production (``streamkv/kernels/decode_attention.py``) runs one kernel per case. The templates
of ``kernels_cu/paged_attention.cu`` take more, and docs/kernels.md has the figures that kept
each one out of production:

- ``kernel``: "tensor_core" or "cuda_core" forced, or "auto" (production's choice);
- ``stages``: the CUDA-core kernel's loads, 0 = registers, >= 2 = a cp.async ring that deep;
- ``warp_softmax``: the tensor-core kernel's softmax per warp instead of per CTA;
- ``unroll``: the tensor-core kernel's 16-token chunks per warp step (None: production's);
- ``fused_merge``: the last CTA of a (sequence, KV head chunk) merges the partitions instead
  of the merge kernel: a few percent faster with few partitions, up to 2x slower with many.

A variant's program holds the same kernels as production's (with the variant's template
arguments), since what else a program holds changes a kernel's code. ``launch_variant`` is
production's ``launch_decode`` with the variant's kernels. tests/benchmarks/
test_decode_variants.py compiles every variant without a GPU and checks them on one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

import torch

from streamkv.kernels import decode_attention as da
from streamkv.kernels import decode_kernels as dk
from streamkv.kernels import launch
from streamkv.kernels.fp8 import FP8_CUDA_NAME, is_fp8
from streamkv.kernels.launch import DTYPE_NAMES, PTR

KERNEL_KINDS = ("auto", "tensor_core", "cuda_core")
STAGES = (0, 2, 3, 4, 6)  # ring depths the tests and the sweep use
TC_UNROLLS = (1, 2, 3, 4)  # UNROLL's range in the template


@dataclass(frozen=True, slots=True)
class DecodeVariant:
    """Which decode kernel, and how; the default is what production launches."""

    kernel: str = "auto"
    stages: int = 0
    warp_softmax: bool = False
    unroll: int | None = None
    fused_merge: bool = False


PRODUCTION = DecodeVariant()


def resolve_kernel(kernel: str, dtype: str, head: int, gpad: int = 8) -> str:
    """``auto``: production's choice (decode_kernels.uses_tensor_cores)."""
    if kernel not in KERNEL_KINDS:
        raise ValueError(f"decode kernel must be auto, tensor_core or cuda_core, got {kernel!r}")
    if kernel == "auto":
        return "tensor_core" if dk.uses_tensor_cores(dtype, head, gpad) else "cuda_core"
    if kernel == "tensor_core" and not dk.tensor_core_ok(dtype, head):
        raise ValueError(
            f"the tensor-core decode kernel needs an fp16 / bf16 cache and a head size that is a "
            f"multiple of 64, got {dtype} and {head}"
        )
    return kernel


def decode_name(
    dtype: str, head: int, block: int, gpad: int, v: DecodeVariant, cache: str | None = None
) -> str:
    tail = "" if cache is None else f", {cache}"
    if resolve_kernel(v.kernel, dtype, head, gpad) == "tensor_core":
        unroll = dk.TC_UNROLL.get(head, 1) if v.unroll is None else v.unroll
        if not 1 <= unroll <= 4:
            raise ValueError(f"tensor-core unroll must be 1 to 4 chunks, got {unroll}")
        return (
            f"streamkv::paged_attention_decode_tc_kernel<{dtype}, {head}, {block}, {gpad}, "
            f"{'true' if v.warp_softmax else 'false'}, {unroll}{tail}>"
        )
    return (
        f"streamkv::paged_attention_decode_kernel<{dtype}, {head}, {block}, {gpad}, "
        f"{v.stages}{tail}>"
    )


def attention_names(
    dtype: str,
    head: int,
    block: int,
    gpads=dk.GROUP_PADS,
    v: DecodeVariant = PRODUCTION,
    cache: str | None = None,
) -> tuple[str, ...]:
    """A variant's program, laid out as production's (decode_kernels.attention_names)."""
    cc = DecodeVariant("cuda_core", v.stages)
    names = [decode_name(dtype, head, block, g, cc, cache) for g in gpads]
    if dk.tensor_core_ok(dtype, head):
        tc = DecodeVariant("tensor_core", v.stages, v.warp_softmax, v.unroll)
        names += [decode_name(dtype, head, block, g, tc, cache) for g in gpads]
    names.append(dk.reduce_name(dtype, head))
    return tuple(names)


def shared_mem(
    partition_size: int, gpad: int, head: int, cache: torch.dtype, stages: int, tc: bool
) -> int:
    """Production's decode_smem plus the CUDA-core kernel's cp.async ring (mirrors
    paged_attention.cu's RowShape: the ring's vectors per row depend on the cache's type)."""
    smem = dk.decode_smem(partition_size, gpad, head, tc)
    if tc or stages == 0:
        return smem
    nv = head // (16 // cache.itemsize)  # 16-byte vectors per row
    nvt = -(-nv // min(32, launch.next_pow2(nv)))  # of them per thread
    return smem + stages * (4 // nvt) * nvt * dk.ATTENTION_THREADS * 16


@lru_cache(maxsize=256)
def variant_kernels(
    v: DecodeVariant,
    dtype: str,
    head: int,
    block: int,
    gpad: int,
    cache: torch.dtype,
    device: int,
) -> da.DecodeKernels:
    """``cache``: the KV cache's torch dtype (fp8: the kernels' last template argument)."""
    tc = resolve_kernel(v.kernel, dtype, head, gpad) == "tensor_core"
    fp8 = FP8_CUDA_NAME if is_fp8(cache) else None
    names = attention_names(dtype, head, block, (gpad,), v, fp8)
    module = launch.module(dk.ATTENTION_SOURCE, names, torch.device("cuda", device))
    decode = module.kernel(decode_name(dtype, head, block, gpad, v, fp8))
    merge = module.kernel(dk.reduce_name(dtype, head))
    if v.fused_merge:
        decode, merge = _FusedMergeDecode(decode, device), _NoMerge()
    smem = partial(shared_mem, gpad=gpad, head=head, cache=cache, stages=v.stages, tc=tc)
    return da.DecodeKernels(
        decode, merge, smem, da.TC_LONG_WAVES if tc else da.CUDA_CORE_LONG_WAVES
    )


class _FusedMergeDecode:
    """The decode kernel launched with arrival counters: where a context spans 2+ partitions
    the last CTA of each column merges them. The counters are zeroed per launch (inside a
    graph the memset replays with it); the merging CTAs leave them at zero."""

    def __init__(self, kernel, device: int) -> None:
        self.kernel, self.device = kernel, device

    def occupancy(self, threads: int, smem: int) -> int:
        return self.kernel.occupancy(threads, smem)

    def launch(self, grid, block, args, stream, smem, pdl=False) -> None:
        if grid[0] > 1:
            if args[4] != (PTR, 0):
                raise RuntimeError("the decode kernel's 5th argument is no longer merge_counters")
            counters = torch.zeros(grid[1] * grid[2], dtype=torch.int32, device=self.device)
            args = [*args[:4], (PTR, counters.data_ptr()), *args[5:]]
            pdl = False  # the memset just before leaves nothing to overlap with
        self.kernel.launch(grid, block, args, stream, smem, pdl=pdl)


class _NoMerge:
    def launch(self, *args, **kwargs) -> None:
        pass  # the decode kernel's last CTAs merged


def launch_variant(
    v: DecodeVariant,
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
    """decode_attention.launch_decode with the variant's kernels (an fp8 cache's K scale
    folded into ``scale`` by the caller, its V scale not applied)."""
    da.check_inputs(query, key_cache, value_cache)
    dtype = query.dtype if is_fp8(key_cache.dtype) else key_cache.dtype
    kernels = variant_kernels(
        v,
        DTYPE_NAMES[dtype],
        query.shape[-1],
        key_cache.shape[2],
        dk.group_pad(query.shape[1] // key_cache.shape[1]),
        key_cache.dtype,
        launch.device_index(query.device),
    )
    return da.launch_decode(
        kernels,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        max_context_len,
        partition_size,
        out,
    )
