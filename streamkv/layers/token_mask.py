"""Structured outputs' token masks: where a step's masks are staged on the host, and how they
ban tokens in the logits of the rows that carry one.

A mask is a bitmask of little-endian int32 words (bit ``t % 32`` of word ``t // 32`` set:
token ``t`` allowed), as SeqStep.token_mask carries it (bytes, or an int32 row), or as the
engine's batched fill makes it for a step whose masks follow it (a ``StagedMask``: a row of a
``MaskStaging`` buffer, in-process). The masked rows' words go to the device packed
(vocab / 8 bytes a row), in one upload, and one kernel bans for all of them
(kernels/token_mask_cuda.py; torch ops elsewhere, numpy on the CPU); a token outside the mask
gets -inf, so neither greedy nor any sampling path can pick it. Rows without a mask are not
touched, and a step without one costs a single scan of the requests.

``MaskStaging`` is one persistent host buffer (pinned when CUDA is there) that the grammar
engine's batched fill writes in place. When a step's masks are exactly its last fill (the
overlapped path, the GPU's default), the rows' words and their logits row indices go to a
persistent device buffer in one non-blocking copy, and the kernel's launch is cached:

    host (pinned) int32:  [ logits row of staged row 0..capacity-1 | words of rows 0..capacity-1 ]
                           `---------------- one copy of [0, capacity + n * width) ----------------'

Stacking the rows into a new pinned array each step cost ~0.26 ms of host a step on the H200
(docs/benchmarks.md); here the fill's own output is the upload's source. Reuse: the host
buffer is written again only once its last upload has been read (an event; the engine fills
step N+1's masks after reading step N's samples, which come after N's copy on the stream, so
the wait returns at once). The device buffer is written by the copy on the stream that the
kernel reading it runs on, so in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamkv.layers.sampled_batch import on_device


@dataclass(slots=True, eq=False)
class StagedMask:
    """Row ``row`` of a staging buffer's last fill (a TokenMask)."""

    staging: MaskStaging
    row: int

    @property
    def words(self) -> np.ndarray:
        return self.staging.host_words[self.row]


TokenMask = bytes | np.ndarray | StagedMask  # little-endian int32 words, one bit per token


def mask_of(token_ids: list[int], vocab_size: int) -> bytes:
    """The token mask that allows exactly ``token_ids`` (each in [0, vocab_size))."""
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    bits[token_ids] = True
    return np.packbits(bits, bitorder="little").tobytes()


def apply_token_masks(logits: torch.Tensor, masks: Sequence[TokenMask | None]) -> None:
    """Ban, in place, every token outside row i's mask ``masks[i]`` (None: no mask)."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    vocab, dev = logits.shape[1], logits.device
    if dev.type == "cuda" and logits.dtype == torch.float32 and logits.stride(1) == 1:
        picked = [masks[i] for i in rows]
        staging = staged_fill(picked)
        if staging is not None:
            _ban_staged(logits, staging, picked, rows)
        else:
            _ban_with_kernel(logits, [_words(m) for m in picked], rows)
        return
    masks = [m.words if isinstance(m, StagedMask) else m for m in masks]
    if dev.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        _ban_with_torch(logits, [masks[i] for i in rows], rows)
        return
    # numpy unpacks the inverted words in one pass (bits little-endian within each byte,
    # which with little-endian words is token order) and bans in place: on the CPU box ~2x
    # faster than torch's masked_fill over the same rows.
    words = np.stack([np.frombuffer(masks[i], dtype="<i4") for i in rows])
    banned = np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little").view(bool)[:, :vocab]
    if banned.shape[1] < vocab:  # a mask narrower than the logits: the rest is banned
        banned = np.pad(banned, ((0, 0), (0, vocab - banned.shape[1])), constant_values=True)
    # One torch masked_fill over the masked rows (its intra-op threads split the rows'
    # n x vocab elements), not numpy's single-threaded putmask row by row: on the GPU host's
    # CPU that was ~17 ms of a ~115 ms float32 step at batch 64.
    banned_t = torch.from_numpy(banned)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned_t, -math.inf)
    else:
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill_(banned_t, -math.inf)


def _words(mask: TokenMask) -> TokenMask:
    return mask.words if isinstance(mask, StagedMask) else mask


def staged_fill(masks: list[TokenMask]) -> MaskStaging | None:
    """The staging buffer whose last fill ``masks`` are, each of its rows once, in any order
    (the overlapped path); None when they are anything else (bytes from the step builder,
    a fill of which some rows ended, a mix)."""
    first = masks[0]
    if not isinstance(first, StagedMask):
        return None
    staging = first.staging
    n = len(masks)
    if n != staging.filled:
        return None
    seen = set()
    for m in masks:
        if not isinstance(m, StagedMask) or m.staging is not staging or m.row >= n:
            return None
        seen.add(m.row)
    return staging if len(seen) == n else None


def upload_staged(
    staging: MaskStaging, masks: list[StagedMask], rows: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one copy (MaskStaging.upload), staged row masks[i].row banning logits row rows[i]:
    the device's words [n, width] and rows [n]."""
    return staging.upload(device, [m.row for m in masks], rows)


def _ban_staged(
    logits: torch.Tensor, staging: MaskStaging, masks: list[StagedMask], rows: list[int]
) -> None:
    """CUDA, float32: the staging buffer's one upload, then the kernel's cached launch."""
    from streamkv.kernels.token_mask_cuda import BanLaunch

    words, index = upload_staged(staging, masks, rows, logits.device)
    launch = staging.launch
    key = (words.data_ptr(), index.data_ptr(), staging.width, logits.shape[1], logits.stride(0))
    if launch is None or launch.key != key:
        launch = staging.launch = BanLaunch(
            logits.device, words, index, logits.shape[1], logits.stride(0)
        )
    launch(logits, len(masks))


def _ban_with_kernel(logits: torch.Tensor, masks: list[TokenMask], rows: list[int]) -> None:
    """CUDA, float32 (the sampler's logits): one kernel bans every masked row
    (kernels/token_mask_cuda.py), after one upload, through pinned memory and without
    blocking, of the words and, when not every row is masked, the row indices."""
    from streamkv.kernels.token_mask_cuda import ban_outside_masks

    n, width = len(rows), np.frombuffer(masks[0], dtype="<i4").size
    partial = n < logits.shape[0]
    host = np.empty(n * width + (n if partial else 0), dtype=np.int32)
    np.stack(
        [np.frombuffer(m, dtype="<i4") for m in masks], out=host[: n * width].reshape(n, width)
    )
    if partial:
        host[n * width :] = rows
    uploaded = on_device(logits.device, torch.from_numpy(host))
    ban_outside_masks(
        logits, uploaded[: n * width].view(n, width), uploaded[n * width :] if partial else None
    )


def _ban_with_torch(logits: torch.Tensor, masks: list[TokenMask], rows: list[int]) -> None:
    """The device path. One upload, through pinned memory and without blocking (a pageable
    copy would wait for the forward pass still running: a step whose masks follow is sampled
    while the device works): the rows' words, the 32 bit values that unpack them, and the
    row indices. Then three kernels ban (and, compare, fill): for a small model a step's
    host time is what counts, and each launch costs it several microseconds."""
    vocab, n = logits.shape[1], len(rows)
    width = np.frombuffer(masks[0], dtype="<i4").size
    partial = n < logits.shape[0]
    at_bits = n * width
    host = np.empty(at_bits + 32 + (n if partial else 0), dtype=np.int32)
    np.stack([np.frombuffer(m, dtype="<i4") for m in masks], out=host[:at_bits].reshape(n, width))
    host[at_bits : at_bits + 32] = _BIT_VALUES
    if partial:
        host[at_bits + 32 :] = rows
    uploaded = on_device(logits.device, torch.from_numpy(host))
    packed, bit_values = uploaded[:at_bits].view(n, width, 1), uploaded[at_bits : at_bits + 32]
    banned = (packed & bit_values).eq(0).view(n, -1)[:, :vocab]
    if banned.shape[1] < vocab:  # a mask narrower than the logits: the rest is banned
        banned = torch.nn.functional.pad(banned, (0, vocab - banned.shape[1]), value=True)
    if not partial:
        logits.masked_fill_(banned, -math.inf)
    else:
        index = uploaded[at_bits + 32 :]
        logits[index] = logits[index].masked_fill_(banned, -math.inf)


# Bit t of a word, as an int32 (bit 31 is the sign bit).
_BIT_VALUES = (np.uint32(1) << np.arange(32, dtype=np.uint32)).view(np.int32)
_BIT_VALUES.setflags(write=False)


# -- the staging buffer --------------------------------------------------------------------------
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
