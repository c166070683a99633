"""Kernels that move K/V bytes without looking at them (``kernels_cu/cache_ops.cu``):
reshape-and-cache writes each new token's K/V into its slot; copy-on-write copies move
whole blocks of every layer's pools in one launch (``move_blocks``, which swaps between
device and host pools use too: kernels/block_swap.py). Into an fp8 cache reshape-and-cache
quantizes (``reshape_and_cache_fp8_kernel``); block moves copy the bytes as they are.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from streamkv.kernels import cuda_driver, launch
from streamkv.kernels.fp8 import is_fp8
from streamkv.kernels.launch import DTYPE_NAMES, FLOAT, INT, LONG, PTR

CACHE_OPS_SOURCE = "cache_ops.cu"
COPY_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def cache_ops_names() -> tuple[str, ...]:
    return tuple(
        f"streamkv::{k}<{u}>"
        for u in COPY_UNITS.values()
        for k in ("reshape_and_cache_kernel", "move_blocks_kernel")
    ) + tuple(fp8_write_name(t) for t in DTYPE_NAMES.values())


def fp8_write_name(dtype: str) -> str:
    """The fp8 cache write for K/V of CUDA type ``dtype``."""
    return f"streamkv::reshape_and_cache_fp8_kernel<{dtype}>"


def copy_unit(nbytes: int, *addresses: int) -> int:
    """Widest access (16, 8, 4, 2 or 1 bytes) that divides every size and address given."""
    for unit in COPY_UNITS:
        if nbytes % unit == 0 and all(a % unit == 0 for a in addresses):
            return unit
    return 1


def _cache_ops_kernel(kind: str, unit: int, device: torch.device) -> cuda_driver.Kernel:
    module = launch.module(CACHE_OPS_SOURCE, cache_ops_names(), device)
    return module.kernel(f"streamkv::{kind}<{COPY_UNITS[unit]}>")


def _check_write(key, value, key_cache, value_cache) -> None:
    num_tokens, num_kv_heads, head = key.shape
    _, cache_heads, block_size, cache_head = key_cache.shape
    if (cache_heads, cache_head) != (num_kv_heads, head) or value.shape != key.shape:
        raise ValueError(f"K/V {tuple(key.shape)} do not fit caches {tuple(key_cache.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``k_scale`` / ``v_scale``: an fp8 cache stores K / k_scale and V / v_scale; other
    caches ignore them."""
    num_tokens, num_kv_heads, head = key.shape
    if num_tokens == 0:
        return
    _check_write(key, value, key_cache, value_cache)
    if is_fp8(key_cache.dtype):
        return _reshape_and_cache_fp8(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )
    _, _, block_size, _ = key_cache.shape
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if key.stride(-1) != 1 or key.stride(1) != head:
        key = key.contiguous()
    if value.stride(-1) != 1 or value.stride(1) != head:
        value = value.contiguous()
    es = key.element_size()
    row_bytes = head * es
    unit = copy_unit(
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


def _reshape_and_cache_fp8(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    num_tokens, num_kv_heads, head = key.shape
    if value_cache.dtype != key_cache.dtype or key.dtype not in DTYPE_NAMES:
        raise TypeError(
            f"no fp8 cache write from {key.dtype} into {key_cache.dtype} / {value_cache.dtype}"
        )
    if head % 2:
        raise ValueError(f"the fp8 cache write takes element pairs: head size {head} is odd")
    value = value.to(key.dtype)
    if key.stride(-1) != 1 or key.stride(1) != head:
        key = key.contiguous()
    if value.stride(-1) != 1 or value.stride(1) != head:
        value = value.contiguous()
    slots = slot_mapping.to(device=key.device, dtype=torch.int64).contiguous()
    threads = min(512, -(-num_kv_heads * head // 2 // 32) * 32)
    module = launch.module(CACHE_OPS_SOURCE, cache_ops_names(), key.device)
    module.kernel(fp8_write_name(DTYPE_NAMES[key.dtype])).launch(
        (num_tokens, 1, 1),
        (threads, 1, 1),
        [
            (PTR, key.data_ptr()),
            (PTR, value.data_ptr()),
            (PTR, key_cache.data_ptr()),
            (PTR, value_cache.data_ptr()),
            (PTR, slots.data_ptr()),
            (LONG, key.stride(0)),
            (LONG, value.stride(0)),
            (INT, num_kv_heads),
            (INT, key_cache.shape[2]),
            (INT, head),
            (FLOAT, 1.0 / k_scale),
            (FLOAT, 1.0 / v_scale),
        ],
        launch.stream(key.device),
        pdl=launch.use_pdl(key.device),
    )


@lru_cache(maxsize=64)
def pointer_table(device: torch.device, pointers: tuple[int, ...]) -> torch.Tensor:
    # Pools live as long as the engine, so their table is built (one H2D copy) only once.
    return torch.tensor(pointers, dtype=torch.int64).to(device)


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


def check_pools(pools: list[torch.Tensor]) -> int:
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
    block_bytes = check_pools(pools)
    device = pools[0].device
    pointers = tuple(p.data_ptr() for p in pools)
    table = pointer_table(device, pointers)
    mapping = block_mapping.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    move_blocks(table, table, mapping, block_bytes, copy_unit(block_bytes, *pointers))
