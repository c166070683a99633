"""A step's token masks in one persistent host buffer (pinned when CUDA is there), which the
grammar engine's batched fill writes in place, and its upload: the rows' words and their
logits row indices in one non-blocking copy into a persistent device buffer.

    host (pinned) int32:  [ logits row of staged row 0..capacity-1 | words of rows 0..capacity-1 ]
                           `---------------- one copy of [0, capacity + n * width) ----------------'

The earlier mask step (docs/benchmarks.md) stacked the rows into a new array, pinned it (a
caching-allocator block a step) and copied it; that was ~0.26 ms of host a step on the H200.
Here the fill's own output is the upload's source, and nothing is allocated per step.

Reuse: the host buffer is written again only once its last upload has been read (an event;
the engine fills step N+1's masks after reading step N's samples, which come after N's copy
on the stream, so the wait returns at once). The device buffer is written by the copy on the
stream that the kernel reading it runs on, so in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True, eq=False)
class StagedMask:
    """Row ``row`` of a staging buffer's last fill (a TokenMask; layers/token_mask.py)."""

    staging: MaskStaging
    row: int

    @property
    def words(self) -> np.ndarray:
        return self.staging.host_words[self.row]


class MaskStaging:
    def __init__(self, width: int, pin: bool | None = None) -> None:
        self.width = width  # int32 words a row: ceil(vocab / 32)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.capacity = 0
        self.filled = 0  # rows of the last fill
        self.host = torch.empty(0, dtype=torch.int32)
        self.host_rows = self.host.numpy()
        self.host_words = self.host_rows.reshape(0, width)
        self.masks: list[StagedMask] = []  # one per row, made once per capacity
        self._device: torch.Tensor | None = None
        self._uploaded: torch.cuda.Event | None = (
            None  # recorded after each upload (one event, re-recorded)
        )
        self._pending = False  # an upload was recorded since the last fill waited for it
        self.launch: object | None = (
            None  # the device's cached kernel launch (kernels/token_mask_cuda.py)
        )

    def fill(self, n: int, write: Callable[[np.ndarray], None]) -> list[StagedMask]:
        """Rows 0..n-1, written in place by ``write(int32 [n, width])``; valid until the
        next fill."""
        if n > self.capacity:
            self._grow(n)
        if self._pending:
            self._uploaded.synchronize()
            self._pending = False
        self.filled = n
        if n:
            write(self.host_words[:n])
        return self.masks[:n]

    def upload(
        self, device: torch.device, staged: list[int], rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Staged row staged[i] bans logits row rows[i] (``staged``: each of the last fill's
        rows once): copy the row indices and those rows' words to ``device`` without
        blocking; their device views: words int32 [n, width], rows int32 [n]."""
        if self._pending:  # uploaded before (the same fill twice): the last copy has read it
            self._uploaded.synchronize()
            self._pending = False
        n = len(staged)
        self.host_rows[staged] = rows
        cap, width = self.capacity, self.width
        dev = self._device
        if dev is None or dev.device != device:
            # A normal tensor even when made in the sampler's inference mode, so that a call
            # outside it may still copy into it.
            with torch.inference_mode(False):
                dev = self._device = torch.empty(
                    cap * (width + 1), dtype=torch.int32, device=device
                )
            # The last upload was waited for above; the event is made anew on this device.
            self.launch, self._uploaded = None, None
        end = cap + n * width
        dev[:end].copy_(self.host[:end], non_blocking=True)
        if device.type == "cuda":
            if self._uploaded is None:
                self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(device))
            self._pending = True
        return dev[cap:end].view(n, width), dev[:n]

    def _grow(self, n: int) -> None:
        cap = max(64, 1 << (n - 1).bit_length())
        if self._pending:  # the old buffer's last copy must not see it freed early
            self._uploaded.synchronize()
            self._pending = False
        self.host = torch.empty(cap * (self.width + 1), dtype=torch.int32, pin_memory=self.pin)
        flat = self.host.numpy()
        self.host_rows, self.host_words = flat[:cap], flat[cap:].reshape(cap, self.width)
        self.capacity = cap
        self.masks = [StagedMask(self, i) for i in range(cap)]
        self._device, self.launch = None, None
