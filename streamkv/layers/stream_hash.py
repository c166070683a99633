"""Counter-based noise for seeded draws: a sample depends only on its own (seed, sample
index, output position, draw round) and the token id, never on its batch, so a sequence
resumed after preemption redraws the same tokens.

A stream's 64-bit *base* chains splitmix64's finalizer over seed, sample index and position;
a round's 32-bit *key* mixes the round in and folds the halves; a token's Exp(1) draw is
murmur3's 32-bit finalizer over ``token * golden + key``. kernels_cu/sampling.cu computes
the keys and draws of every round from the base on the device, bit for bit as here.
"""

from __future__ import annotations

import numpy as np
import torch

_M32 = 0xFFFF_FFFF
_M64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 arrays wrap on overflow, as the algorithm wants)."""
    z = z + 0x9E37_79B9_7F4A_7C15
    z = (z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9
    z = (z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB
    return z ^ (z >> 31)


def stream_bases(seeds: list[int], sample_indices: list[int], positions: list[int]) -> np.ndarray:
    """The 64-bit bases (uint64) of seeded streams, one per (seed, sample index, position)."""
    with np.errstate(over="ignore"):
        z = _mix64(np.array([s & _M64 for s in seeds], dtype=np.uint64))
        z = _mix64(z ^ np.array(sample_indices, dtype=np.uint64))
        return _mix64(z ^ np.array(positions, dtype=np.uint64))


def stream_keys(
    seeds: list[int], sample_indices: list[int], positions: list[int], round_: int = 0
) -> torch.Tensor:
    """The 32-bit keys (as int64) of seeded draws, one per (seed, sample index, output
    position), in draw round ``round_``: vectorized on the host, a few microseconds a batch."""
    with np.errstate(over="ignore"):
        z = _mix64(stream_bases(seeds, sample_indices, positions) ^ np.uint64(round_))
    return torch.from_numpy(((z ^ (z >> 32)) & _M32).astype(np.int64))


def hashed_exponentials(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws for ``keys[:, None]`` (int64, 32-bit values) x ``token_ids`` ([K] or
    [rows, K]): murmur3's 32-bit finalizer over ``token * golden + key``, in int64 so that
    every product's low 32 bits are exact and every shift is logical."""
    x = token_ids * 0x9E37_79B1 + keys[:, None]
    x.bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16).mul_(0x85EB_CA6B).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 13).mul_(0xC2B2_AE35).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    u = (x >> 8).to(torch.float32).add_(0.5).mul_(2.0**-24)  # uniform in (0, 1)
    return u.log_().neg_()
