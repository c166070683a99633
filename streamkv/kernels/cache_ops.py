"""Kernels that move K/V bytes without looking at them (``kernels_cu/cache_ops.cu``):
reshape-and-cache writes each new token's K/V into its slot; copy-on-write copies and swaps
move whole blocks of every layer's pools in one launch (swaps through a staging buffer and
as few host transfers as the runs of block ids allow). Swaps are the only op here that
reads the host side of a mapping, to plan their transfers.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from cuda.bindings import driver

from streamkv.kernels import launch, nvrtc
from streamkv.kernels.launch import INT, LONG, PTR

CACHE_OPS_SOURCE = "cache_ops.cu"
COPY_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def cache_ops_names() -> tuple[str, ...]:
    return tuple(
        f"streamkv::{k}<{u}>"
        for u in COPY_UNITS.values()
        for k in ("reshape_and_cache_kernel", "move_blocks_kernel")
    )


def _copy_unit(nbytes: int, *addresses: int) -> int:
    """Widest access (16, 8, 4, 2 or 1 bytes) that divides every size and address given."""
    for unit in COPY_UNITS:
        if nbytes % unit == 0 and all(a % unit == 0 for a in addresses):
            return unit
    return 1


def _cache_ops_kernel(kind: str, unit: int, device: torch.device) -> nvrtc.Kernel:
    module = launch.module(CACHE_OPS_SOURCE, cache_ops_names(), device)
    return module.kernel(f"streamkv::{kind}<{COPY_UNITS[unit]}>")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head = key.shape
    if num_tokens == 0:
        return
    _, cache_heads, block_size, cache_head = key_cache.shape
    if (cache_heads, cache_head) != (num_kv_heads, head) or value.shape != key.shape:
        raise ValueError(f"K/V {tuple(key.shape)} do not fit caches {tuple(key_cache.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if key.stride(-1) != 1 or key.stride(1) != head:
        key = key.contiguous()
    if value.stride(-1) != 1 or value.stride(1) != head:
        value = value.contiguous()
    es = key.element_size()
    row_bytes = head * es
    unit = _copy_unit(
        row_bytes,
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key.stride(0) * es,
        value.stride(0) * es,
    )
    slots = slot_mapping.to(device=key.device, dtype=torch.int64).contiguous()
    row_units = row_bytes // unit
    threads = min(512, -(-num_kv_heads * row_units // 32) * 32)
    _cache_ops_kernel("reshape_and_cache_kernel", unit, key.device).launch(
        (num_tokens, 1, 1),
        (threads, 1, 1),
        [
            (PTR, key.data_ptr()),
            (PTR, value.data_ptr()),
            (PTR, key_cache.data_ptr()),
            (PTR, value_cache.data_ptr()),
            (PTR, slots.data_ptr()),
            (LONG, key.stride(0) * es // unit),
            (LONG, value.stride(0) * es // unit),
            (INT, num_kv_heads),
            (INT, block_size),
            (INT, row_units),
        ],
        launch.stream(key.device),
        pdl=launch.use_pdl(key.device),
    )


@lru_cache(maxsize=64)
def _pointer_table(device: torch.device, pointers: tuple[int, ...]) -> torch.Tensor:
    # Pools live as long as the engine, so their table is built (one H2D copy) only once.
    return torch.tensor(pointers, dtype=torch.int64).to(device)


def _strided_table(device: torch.device, base: int, stride: int, count: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64, device=device) * stride + base


def _to_device(mapping: list[list[int]], device: torch.device) -> torch.Tensor:
    host = torch.tensor(mapping, dtype=torch.int64).reshape(-1, 2)
    if torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def move_blocks(
    src_table: torch.Tensor,
    dst_table: torch.Tensor,
    mapping: torch.Tensor,
    block_bytes: int,
    unit: int,
) -> None:
    """One launch: for every pool p and pair (s, d), block d of dst p = block s of src p."""
    device = mapping.device
    _cache_ops_kernel("move_blocks_kernel", unit, device).launch(
        (mapping.shape[0], src_table.shape[0], 1),
        (256, 1, 1),
        [
            (PTR, src_table.data_ptr()),
            (PTR, dst_table.data_ptr()),
            (PTR, mapping.data_ptr()),
            (LONG, block_bytes // unit),
        ],
        launch.stream(device),
    )


def _check_pools(pools: list[torch.Tensor]) -> int:
    """Validates a list of per-layer pools and returns the bytes of one block."""
    first = pools[0]
    for p in pools:
        if p.shape[1:] != first.shape[1:] or p.dtype != first.dtype or not p.is_contiguous():
            raise ValueError("pools must be contiguous and share block shape and dtype")
    return first[0].numel() * first.element_size()


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    pools = [*key_caches, *value_caches]
    block_bytes = _check_pools(pools)
    device = pools[0].device
    pointers = tuple(p.data_ptr() for p in pools)
    table = _pointer_table(device, pointers)
    mapping = block_mapping.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    move_blocks(table, table, mapping, block_bytes, _copy_unit(block_bytes, *pointers))


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index into ids, first id, length) of each run of consecutive ids in sorted ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _host_copy(
    to_host: bool,
    dev_base: int,
    dev_pitch: int,
    host_ptrs: tuple[int, ...],
    host_offset: int,
    nbytes: int,
    stream: int,
) -> None:
    """Copy nbytes per layer between staging rows (dev_base + l * dev_pitch) and host pools.

    Layer pools that are slices of one host tensor (a uniform stride) move in a single 2D
    copy whatever the number of layers; otherwise one copy per layer.
    """
    layers = len(host_ptrs)
    stride = host_ptrs[1] - host_ptrs[0] if layers > 1 else 0
    if stride >= nbytes and all(h == host_ptrs[0] + i * stride for i, h in enumerate(host_ptrs)):
        cp = driver.CUDA_MEMCPY2D()
        dev_type, host_type = (
            driver.CUmemorytype.CU_MEMORYTYPE_DEVICE,
            driver.CUmemorytype.CU_MEMORYTYPE_HOST,
        )
        if to_host:
            cp.srcMemoryType, cp.srcDevice, cp.srcPitch = dev_type, dev_base, dev_pitch
            cp.dstMemoryType, cp.dstHost, cp.dstPitch = (
                host_type,
                host_ptrs[0] + host_offset,
                stride,
            )
        else:
            cp.srcMemoryType, cp.srcHost, cp.srcPitch = (
                host_type,
                host_ptrs[0] + host_offset,
                stride,
            )
            cp.dstMemoryType, cp.dstDevice, cp.dstPitch = dev_type, dev_base, dev_pitch
        cp.WidthInBytes, cp.Height = nbytes, layers
        if driver.cuMemcpy2DAsync(cp, stream)[0] == driver.CUresult.CUDA_SUCCESS:
            return
        # A pitch past the driver's limit (huge pools): fall back to a copy per layer.
    for layer, host in enumerate(host_ptrs):
        dev = dev_base + layer * dev_pitch
        if to_host:
            nvrtc.check(driver.cuMemcpyDtoHAsync(host + host_offset, dev, nbytes, stream))
        else:
            nvrtc.check(driver.cuMemcpyHtoDAsync(dev, host + host_offset, nbytes, stream))


def swap_blocks(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Move blocks between device pools and (pinned) host pools, all layers at once.

    Device -> host: one kernel gathers every (layer, block) into a staging buffer, then each
    run of consecutive destination ids is one transfer for all layers. Host -> device: the
    mirror image, runs into staging then one scatter kernel. The transfers are asynchronous
    on the current stream: synchronise it before reading a host pool from the CPU.
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError("src and dst have different numbers of layers")
    block_bytes = _check_pools(src_caches)
    if _check_pools(dst_caches) != block_bytes or src_caches[0].dtype != dst_caches[0].dtype:
        raise ValueError("src and dst pools have different block shapes or dtypes")
    pairs = [(int(s), int(d)) for s, d in block_mapping.tolist()]
    src_dev, dst_dev = src_caches[0].is_cuda, dst_caches[0].is_cuda
    device = (src_caches if src_dev else dst_caches)[0].device
    src_ptrs = tuple(p.data_ptr() for p in src_caches)
    dst_ptrs = tuple(p.data_ptr() for p in dst_caches)
    if src_dev and dst_dev:
        unit = _copy_unit(block_bytes, *src_ptrs, *dst_ptrs)
        move_blocks(
            _pointer_table(device, src_ptrs),
            _pointer_table(device, dst_ptrs),
            _to_device(pairs, device),
            block_bytes,
            unit,
        )
        return
    n, layers = len(pairs), len(src_caches)
    staging = torch.empty((layers, n, block_bytes), dtype=torch.uint8, device=device)
    pitch = n * block_bytes
    staging_table = _strided_table(device, staging.data_ptr(), pitch, layers)
    stream = launch.stream(device)
    if src_dev:
        pairs.sort(key=lambda p: p[1])
        unit = _copy_unit(block_bytes, staging.data_ptr(), *src_ptrs)
        gather = _to_device([[s, i] for i, (s, _) in enumerate(pairs)], device)
        move_blocks(_pointer_table(device, src_ptrs), staging_table, gather, block_bytes, unit)
        for i, first, length in _runs([d for _, d in pairs]):
            _host_copy(
                True,
                staging.data_ptr() + i * block_bytes,
                pitch,
                dst_ptrs,
                first * block_bytes,
                length * block_bytes,
                stream,
            )
    else:
        pairs.sort()
        unit = _copy_unit(block_bytes, staging.data_ptr(), *dst_ptrs)
        for i, first, length in _runs([s for s, _ in pairs]):
            _host_copy(
                False,
                staging.data_ptr() + i * block_bytes,
                pitch,
                src_ptrs,
                first * block_bytes,
                length * block_bytes,
                stream,
            )
        scatter = _to_device([[i, d] for i, (_, d) in enumerate(pairs)], device)
        move_blocks(staging_table, _pointer_table(device, dst_ptrs), scatter, block_bytes, unit)
