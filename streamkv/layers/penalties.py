"""Presence, frequency and repetition penalties from token counts kept on the device.

``TokenCounts`` holds one row per sequence that has a penalty: how often each vocabulary
token occurs in its output so far (int32) and whether it occurs in its prompt (bool). A row
is filled once when its sequence reaches the worker and then grows by one batched in-place
add per step, so a step never ships or re-counts a sequence's token history.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from streamkv.layers.sampled_batch import on_device


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device | str, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=self.device)
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.output.shape[0]

    @property
    def num_rows(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """A zeroed row holding this history; grows the tables (doubling) when full."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.output[row].zero_()
        self.prompt[row].zero_()
        if prompt_ids:
            self.prompt[row, on_device(self.prompt.device, list(prompt_ids))] = True
        if output_ids:
            ids = on_device(self.output.device, list(output_ids))
            self.output[row].index_put_(
                (ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True
            )
        return row

    def free(self, row: int) -> None:
        self._free.append(row)

    def add(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count one more output token for each (row, token) pair, in one launch."""
        if not rows:
            return
        r, t = on_device(self.output.device, [rows, token_ids])  # one copy, no stream sync
        self.output.index_put_((r, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)

    def _grow(self) -> None:
        old = self.capacity
        new = max(2 * old, 1)
        output = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        output[:old] = self.output
        prompt[:old] = self.prompt
        self.output, self.prompt = output, prompt
        self._free.extend(range(new - 1, old - 1, -1))


def apply_penalties(
    logits: torch.Tensor,
    rows: np.ndarray,
    counts: TokenCounts,
    count_rows: np.ndarray,
    params: np.ndarray,
) -> None:
    """Penalise ``logits[rows]`` (ascending) in place from ``counts`` rows ``count_rows``;
    ``params`` is float [rows, 3]: (presence, frequency, repetition) per row. Repetition
    divides a positive logit (and multiplies a negative one) of every token seen in the prompt
    or the output; presence and frequency subtract from every token of the output, once and
    per occurrence."""
    dev = logits.device
    # One host-to-device copy: the count rows (exact in float32 below 2**24) and the factors.
    host = np.empty((len(rows), 4), dtype=np.float64)
    host[:, 0] = count_rows
    host[:, 1:] = params
    p = on_device(dev, torch.from_numpy(host).to(logits.dtype))
    crow = p[:, 0].long().to(counts.device)
    p = p[:, 1:]
    out = counts.output[crow].to(dev)
    whole = len(rows) == logits.shape[0]  # rows ascend: then they are every row, in order
    idx = None if whole else on_device(dev, torch.from_numpy(rows))
    x = logits if whole else logits[idx]
    in_output = out > 0
    if (params[:, 2] != 1.0).any():
        seen = counts.prompt[crow].to(dev) | in_output
        rep = p[:, 2:3]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if ((params[:, 0] != 0) | (params[:, 1] != 0)).any():
        x = x - p[:, 1:2] * out - p[:, 0:1] * in_output
    if whole:
        logits.copy_(x)
    else:
        logits[idx] = x
