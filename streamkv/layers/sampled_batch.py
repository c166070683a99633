"""The sampler's traffic between host and device, neither direction syncing the stream (a
sync would make a step's launch wait for the step before it: async scheduling):

- ``on_device``: host lists (row indices, parameters, token ids) to the device;
- ``SampledBatch``: a step's samples as the engine reads them, a list of SampleResult (one
  per request) that stays on the device until it is first read, and whose ``tokens`` the
  next step takes its input ids from without the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from streamkv.messages import SampleResult

if TYPE_CHECKING:
    from streamkv.layers.sample_request import SamplingRows


def on_device(device: torch.device, data, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``data`` (a list of ints or a CPU tensor) on ``device``. On CUDA through pinned memory,
    without blocking: a copy from pageable memory waits for everything queued on the stream.
    The pinned buffer is freed through the caching host allocator, which waits for the copy."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SampledBatch(Sequence):
    """One batch's samples, a list of SampleResult (one per request) that stays on the device
    until it is first read. ``tokens`` (one per draw, in draw order) is the device tensor the
    next step can take its input ids from without the host (async scheduling). On CUDA the
    results are copied to pinned host memory without blocking as soon as they are launched;
    the first read waits for that copy alone."""

    def __init__(
        self,
        rows: SamplingRows,
        chosen: torch.Tensor,
        chosen_lp: torch.Tensor,
        asks: list[int],
        top,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self.rows, self.tokens, self._asks = rows, chosen, asks
        self._device = [chosen, chosen_lp] + ([top.indices, top.values] if top is not None else [])
        # ``finish``: the rest of the torch path's top-p rejection rounds, which read their
        # progress on the host (the CUDA kernel draws them at launch: no ``finish``). It runs
        # when the batch is first needed (the next step's launch or a read), so the step after
        # this one is scheduled and built before anything waits for the device.
        self._finish = finish
        self._results: list[SampleResult] | None = None
        self._copy()

    def _copy(self) -> None:
        tensors, self._ready = self._device, None
        if tensors[0].is_cuda:
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]  # pinned by torch
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._host = tensors

    def finalize(self) -> None:
        """Completes the draws in place (``tokens`` is then final), if any are unfinished."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            with torch.inference_mode():  # the tensors were made in the step's inference mode
                finish()
                self._copy()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.results()[i]

    def results(self) -> list[SampleResult]:
        if self._results is None:
            self.finalize()
            if self._ready is not None:
                self._ready.synchronize()
            self._results = _to_results(self.rows, self._asks, *(t.tolist() for t in self._host))
        return self._results


def _to_results(
    rows: SamplingRows,
    asks: list[int],
    chosen: list[int],
    lps: list[float],
    top_ids: list | None = None,
    top_vals: list | None = None,
) -> list[SampleResult]:
    ids = dict(zip(asks, top_ids or ()))
    vals = dict(zip(asks, top_vals or ()))
    results: list[SampleResult] = []
    if not asks and (rows.num_samples == 1).all():  # the common step: one token a row
        return [SampleResult([t], [lp]) for t, lp in zip(chosen, lps)]
    k = 0
    for i, (n, lp_k, cand_k) in enumerate(
        zip(rows.num_samples.tolist(), rows.logprobs.tolist(), rows.num_candidates.tolist())
    ):
        res = SampleResult(token_ids=chosen[k : k + n], logprobs=lps[k : k + n])
        if lp_k:
            res.top_logprobs = [list(zip(ids[i][:lp_k], vals[i][:lp_k]))] * n
        if cand_k:
            res.candidates = list(zip(ids[i][:cand_k], vals[i][:cand_k]))
        results.append(res)
        k += n
    return results
