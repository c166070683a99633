"""Structured outputs' token masks, applied to the logits of the rows that carry one.

A mask is a bitmask of little-endian int32 words (bit ``t % 32`` of word ``t // 32`` set:
token ``t`` allowed), as SeqStep.token_mask carries it (bytes), or as the engine's batched
fill makes it for a step whose masks follow it (a row of an int32 array, in-process). The
masked rows' words go to the device packed (vocab / 8 bytes a row) and are unpacked there;
a token outside the mask gets -inf, so neither greedy nor any sampling path can pick it.
Rows without a mask are not touched, and a step without one costs a single scan of the
requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from streamkv.layers.host_copy import on_device

TokenMask = bytes | np.ndarray  # little-endian int32 words, one bit per token


def apply_token_masks(logits: torch.Tensor, masks: Sequence[TokenMask | None]) -> None:
    """Ban, in place, every token outside row i's mask ``masks[i]`` (None: no mask)."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    vocab, dev = logits.shape[1], logits.device
    words = np.stack([np.frombuffer(masks[i], dtype="<i4") for i in rows])
    if dev.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        # numpy unpacks the inverted words in one pass (bits little-endian within each byte,
        # which with little-endian words is token order) and bans in place: on the CPU box
        # ~2x faster than torch's masked_fill over the same rows.
        banned = np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little").view(bool)[:, :vocab]
        if banned.shape[1] < vocab:  # a mask narrower than the logits: the rest is banned
            banned = np.pad(banned, ((0, 0), (0, vocab - banned.shape[1])), constant_values=True)
        flat = logits.numpy()
        for j, i in enumerate(rows):
            np.putmask(flat[i], banned[j], -np.inf)
        return
    # Through pinned memory, without blocking: a pageable copy would wait for the forward
    # pass still running (a step whose masks follow is sampled while the device works).
    packed = on_device(dev, torch.from_numpy(words))
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, -math.inf)
    else:
        index = on_device(dev, rows)
        logits[index] = logits[index].masked_fill_(~allowed, -math.inf)
