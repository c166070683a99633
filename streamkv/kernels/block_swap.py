"""Swaps: blocks between device pools and (pinned) host pools, every layer at once.

Device -> host gathers every (layer, block) into a staging buffer with one ``move_blocks``
launch (kernels/cache_ops.py), then moves each run of consecutive destination ids in one
transfer for all layers; host -> device is the mirror image. The only op of the cache
kernels that reads the host side of a mapping, to plan its transfers.
"""

from __future__ import annotations

import torch
from cuda.bindings import driver

from streamkv.kernels import cuda_driver, launch
from streamkv.kernels.cache_ops import check_pools, copy_unit, move_blocks, pointer_table


def _strided_table(device: torch.device, base: int, stride: int, count: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64, device=device) * stride + base


def _to_device(mapping: list[list[int]], device: torch.device) -> torch.Tensor:
    host = torch.tensor(mapping, dtype=torch.int64).reshape(-1, 2)
    if torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


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
            cuda_driver.check(driver.cuMemcpyDtoHAsync(host + host_offset, dev, nbytes, stream))
        else:
            cuda_driver.check(driver.cuMemcpyHtoDAsync(dev, host + host_offset, nbytes, stream))


def swap_blocks(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Move blocks between device pools and (pinned) host pools, all layers at once.

    Device -> host: one kernel gathers every (layer, block) into a staging buffer, then each
    run of consecutive destination ids is one transfer for all layers. Host -> device: the
    mirror image, runs into staging then one scatter kernel. The transfers are asynchronous
    on the current stream: synchronise it before reading a host pool from the CPU.
    """
    block_bytes = _block_bytes(src_caches, dst_caches)
    pairs = [(int(s), int(d)) for s, d in block_mapping.tolist()]
    src_dev, dst_dev = src_caches[0].is_cuda, dst_caches[0].is_cuda
    device = (src_caches if src_dev else dst_caches)[0].device
    src_ptrs = tuple(p.data_ptr() for p in src_caches)
    dst_ptrs = tuple(p.data_ptr() for p in dst_caches)
    if src_dev and dst_dev:
        unit = copy_unit(block_bytes, *src_ptrs, *dst_ptrs)
        move_blocks(
            pointer_table(device, src_ptrs),
            pointer_table(device, dst_ptrs),
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
        _out_to_host(pairs, src_ptrs, dst_ptrs, staging, staging_table, block_bytes, stream)
    else:
        _in_from_host(pairs, src_ptrs, dst_ptrs, staging, staging_table, block_bytes, stream)


def _block_bytes(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor]) -> int:
    """The bytes of one layer's block, once src and dst pools are checked to match."""
    if len(src_caches) != len(dst_caches):
        raise ValueError("src and dst have different numbers of layers")
    block_bytes = check_pools(src_caches)
    if check_pools(dst_caches) != block_bytes or src_caches[0].dtype != dst_caches[0].dtype:
        raise ValueError("src and dst pools have different block shapes or dtypes")
    return block_bytes


def _out_to_host(
    pairs: list[tuple[int, int]],
    src_ptrs: tuple[int, ...],
    dst_ptrs: tuple[int, ...],
    staging: torch.Tensor,
    staging_table: torch.Tensor,
    block_bytes: int,
    stream: int,
) -> None:
    """Device -> host: gather into staging in destination order, then a copy per run."""
    device, pitch = staging.device, len(pairs) * block_bytes
    pairs.sort(key=lambda p: p[1])
    unit = copy_unit(block_bytes, staging.data_ptr(), *src_ptrs)
    gather = _to_device([[s, i] for i, (s, _) in enumerate(pairs)], device)
    move_blocks(pointer_table(device, src_ptrs), staging_table, gather, block_bytes, unit)
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


def _in_from_host(
    pairs: list[tuple[int, int]],
    src_ptrs: tuple[int, ...],
    dst_ptrs: tuple[int, ...],
    staging: torch.Tensor,
    staging_table: torch.Tensor,
    block_bytes: int,
    stream: int,
) -> None:
    """Host -> device: a copy per run of source ids into staging, then one scatter."""
    device, pitch = staging.device, len(pairs) * block_bytes
    pairs.sort()
    unit = copy_unit(block_bytes, staging.data_ptr(), *dst_ptrs)
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
    move_blocks(staging_table, pointer_table(device, dst_ptrs), scatter, block_bytes, unit)
