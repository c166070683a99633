"""How one paged decode call is laid out on the GPU and launched: its grid, the partition
buffers, and the decode and merge kernels' arguments in ``kernels_cu/paged_attention.cu``'s
parameter order.

Which kernels and which partition size are ``decode_attention.py``'s choice; this module
only launches them, so the argument lists can be read against the .cu signatures alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamkv.kernels import cuda_driver, launch
from streamkv.kernels.decode_kernels import ATTENTION_THREADS
from streamkv.kernels.launch import FLOAT, INT, LONG, PTR


@dataclass(frozen=True, slots=True)
class DecodeKernels:
    """A decode kernel and the merge of its partitions, with what the launch needs of them."""

    decode: cuda_driver.Kernel
    merge: cuda_driver.Kernel
    shared_mem: Callable[[int], int]  # dynamic shared memory at a partition size
    long_waves: int  # choose_partition_size's, for this kernel


@dataclass(frozen=True, slots=True)
class DecodeGrid:
    """One call's launch parameters: a CTA per (partition, column, sequence), a column being
    a KV head's chunk of query heads; the merge runs past one partition."""

    num_seqs: int
    num_heads: int
    head: int
    num_kv_heads: int
    group: int  # query heads per KV head
    columns: int  # grid.y: kv heads x head chunks
    partition_size: int
    max_parts: int


def partition_buffers(
    grid: DecodeGrid, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], tuple[int, int, int]]:
    """Past one partition, each partition's fp32 output and softmax stats, and the three
    pointers the kernels take (all null for one partition: the decode kernel writes out)."""
    if grid.max_parts == 1:
        return (), (0, 0, 0)
    part_out = torch.empty(
        (grid.num_seqs, grid.num_heads, grid.max_parts, grid.head),
        dtype=torch.float32,
        device=device,
    )
    part_stats = torch.empty(
        (2, grid.num_seqs, grid.num_heads, grid.max_parts), dtype=torch.float32, device=device
    )
    ptrs = (part_out.data_ptr(), part_stats[0].data_ptr(), part_stats[1].data_ptr())
    return (part_out, part_stats), ptrs


def launch_kernels(
    kernels: DecodeKernels,
    grid: DecodeGrid,
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    """The decode kernel on torch's current stream, then, past one partition, the merge.
    The inputs are the kernels' already (dtype, int32, strides: launch_decode)."""
    # The partition buffers stay referenced here until both launches are queued.
    buffers, part_ptrs = partition_buffers(grid, q.device)
    stream = launch.stream(q.device)
    pdl = launch.use_pdl(q.device)
    kernels.decode.launch(
        (grid.max_parts, grid.columns, grid.num_seqs),
        (ATTENTION_THREADS, 1, 1),
        [
            (PTR, out.data_ptr()),
            (PTR, part_ptrs[0]),
            (PTR, part_ptrs[1]),
            (PTR, part_ptrs[2]),
            (PTR, 0),  # merge_counters: none, the merge kernel merges
            (PTR, q.data_ptr()),
            (PTR, key_cache.data_ptr()),
            (PTR, value_cache.data_ptr()),
            (PTR, block_tables.data_ptr()),
            (PTR, context_lens.data_ptr()),
            (FLOAT, scale),
            (LONG, q.stride(0)),
            (INT, block_tables.stride(0)),
            (INT, grid.num_kv_heads),
            (INT, grid.group),
            (INT, grid.partition_size),
            (INT, grid.max_parts),
        ],
        stream,
        kernels.shared_mem(grid.partition_size),
        pdl=pdl,
    )
    if grid.max_parts > 1:
        _launch_merge(kernels.merge, grid, out, part_ptrs, context_lens, stream, pdl)


def _launch_merge(
    merge: cuda_driver.Kernel,
    grid: DecodeGrid,
    out: torch.Tensor,
    part_ptrs: tuple[int, int, int],
    context_lens: torch.Tensor,
    stream: int,
    pdl: bool,
) -> None:
    """A CTA per (query head, sequence) merges its partitions into ``out``."""
    merge.launch(
        (grid.num_heads, grid.num_seqs, 1),
        (ATTENTION_THREADS, 1, 1),
        [
            (PTR, out.data_ptr()),
            (PTR, part_ptrs[0]),
            (PTR, part_ptrs[1]),
            (PTR, part_ptrs[2]),
            (PTR, context_lens.data_ptr()),
            (INT, grid.num_heads),
            (INT, grid.partition_size),
            (INT, grid.max_parts),
        ],
        stream,
        grid.max_parts * 4,
        pdl=pdl,
    )
