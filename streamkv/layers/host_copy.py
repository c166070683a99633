"""Host lists to device tensors without a stream sync."""

from __future__ import annotations

import torch


def on_device(device: torch.device, data, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``data`` (a list of ints or a CPU tensor) on ``device``. On CUDA through pinned memory,
    without blocking: a copy from pageable memory waits for everything queued on the stream,
    so it would make a step's launch wait for the step before it (async scheduling). The
    pinned buffer is freed through the caching host allocator, which waits for the copy."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
