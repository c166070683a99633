"""The KV pools of one worker: per layer a K and a V tensor on the device, and a CPU twin
(pinned when the device is a GPU) for swapping. Their element type is the model's dtype, or
float8 e4m3 for ``kv_cache_dtype="fp8"`` (kernels/fp8.py): swaps and copies move the bytes as
they are."""

from __future__ import annotations

import torch

from streamkv.kernels import ops
from streamkv.kernels.fp8 import FP8_DTYPE, as_bytes


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' element type for CacheConfig.kv_cache_dtype ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {kv_cache_dtype!r}")


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    return (
        2
        * num_layers
        * num_kv_heads
        * head_dim
        * block_size
        * torch.tensor([], dtype=dtype).element_size()
    )


def _zeros(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    pin_memory: bool = False,
) -> torch.Tensor:
    """torch.zeros, one [K|V, layer] plane at a time under a progress bar (on a terminal):
    zeroing a pool of GiBs takes seconds on a CPU, and start-up should not look stuck."""
    from tqdm import tqdm

    pool = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    # Zeroed as bytes: the same for every dtype, and no float8 fill kernel needed.
    planes = as_bytes(pool).view(shape[0] * shape[1], *shape[2:])
    for plane in tqdm(
        planes,
        desc=f"allocating the {what}",
        unit="layer",
        disable=None if pool.numel() else True,
        leave=False,
    ):
        plane.zero_()
    return pool


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_kv_heads, block_size, head_dim)
        # One allocation per pool, [K|V, layer, block, ...], handed out as per-layer views:
        # the 2 * num_layers planes are evenly strided, so a swap of a run of block ids is a
        # single 2D copy over all layers (docs/kernels.md), not one memcpy per layer.
        self.device_pool = _zeros(
            (2, num_layers, num_device_blocks, *shape), dtype, device, "KV cache"
        )
        self.cpu_pool = _zeros(
            (2, num_layers, num_cpu_blocks, *shape),
            dtype,
            torch.device("cpu"),
            "CPU swap pool",
            pin_memory=device.type == "cuda",
        )
        self.device_cache = [
            (self.device_pool[0, i], self.device_pool[1, i]) for i in range(num_layers)
        ]
        self.cpu_cache = [(self.cpu_pool[0, i], self.cpu_pool[1, i]) for i in range(num_layers)]

    def _flat(self, caches):
        return [k for k, _ in caches] + [v for _, v in caches]

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            ops.swap_blocks(
                self._flat(self.device_cache), self._flat(self.cpu_cache), torch.tensor(mapping)
            )

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            ops.swap_blocks(
                self._flat(self.cpu_cache), self._flat(self.device_cache), torch.tensor(mapping)
            )

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            device = self.device_cache[0][0].device
            ops.copy_blocks(
                [k for k, _ in self.device_cache],
                [v for _, v in self.device_cache],
                torch.tensor(mapping, dtype=torch.int64, device=device),
            )
