"""Turns logits into tokens: penalties, logit bias, temperature, top-k / top-p / min-p.

A sampled token is ``argmax(p / q)`` over the allowed tokens with ``q ~ Exp(1)`` per token
(the exponential race, equivalent to drawing from ``p``). Greedy rows take ``argmax`` of the
logits after penalties and bias. Everything is batched over rows; nothing loops over the
vocabulary in Python.

- Seeded rows draw ``q`` from a counter-based generator: a 32-bit hash of (a key from seed,
  sample index, output position and draw round) and the token id, computed with torch
  integer ops on the logits' device. A sample therefore depends only on its own row, never
  on its batch, and a sequence resumed after preemption redraws the same tokens. Unseeded
  rows draw ``q`` from the sampler's one torch generator.
- Top-k rows sample among ``torch.topk`` candidates (the top-p and min-p cuts are then exact
  on the sorted candidates), so they never sort the vocabulary.
- Top-p without top-k never sorts either: a token drawn from the whole distribution is in
  the nucleus iff the mass of the tokens more likely than it is below top_p. A row that
  drew outside redraws among the tokens more likely than the rejected one (a set that still
  holds the whole nucleus), so the accepted sample is exactly a nucleus sample; each round
  accepts with probability >= top_p.
- Logprobs are of the distribution after penalties and logit bias, before temperature and
  filters: one fused log-softmax gives every row its sampled token's logprob; top logprobs
  and beam candidates (a top-k) are computed only for the rows that ask.

On CUDA the greedy and full-vocabulary rows run kernels_cu/sampling.cu instead (one CTA per
draw, the logits in their own dtype, the top-p rounds inside the kernel, no host sync): the
same keys and rounds, so seeded rows draw the same tokens as the torch path. Unseeded rows
key the kernel's hash with a base drawn from the sampler's generator on the device. Top-k
rows keep ``torch.topk`` and the kernel scores their logprob. The torch path
(layers/torch_draws.py) is the reference, and what runs on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from streamkv.layers.penalties import apply_penalties
from streamkv.layers.sample_request import Draws, SampleRequest, SamplingRows
from streamkv.layers.sampled_batch import SampledBatch
from streamkv.layers.sampled_batch import on_device as _on
from streamkv.layers.stream_hash import stream_bases
from streamkv.layers.token_mask import apply_token_masks
from streamkv.layers.torch_draws import full_draws, top_k_draws


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        if torch.device(device).type == "cuda":
            from streamkv.kernels import sampling_cuda

            sampling_cuda.load(torch.device(device))  # at start-up, not in the first step

    def __call__(
        self, logits: torch.Tensor, rows: SamplingRows | Sequence[SampleRequest]
    ) -> SampledBatch:
        """``rows``: the worker's columns, or hand-made requests (tests, benchmarks)."""
        rows = rows if isinstance(rows, SamplingRows) else SamplingRows.of(rows)
        if logits.is_cuda and logits.dtype in _KERNEL_DTYPES and logits.stride(-1) == 1:
            return self._on_kernel(logits, rows)
        return self._in_torch(logits, rows)

    def _in_torch(
        self, logits: torch.Tensor, rows: SamplingRows | Sequence[SampleRequest]
    ) -> SampledBatch:
        rows = rows if isinstance(rows, SamplingRows) else SamplingRows.of(rows)
        logits = logits.float()
        vocab, dev = logits.shape[1], logits.device
        _adjust(logits, rows)
        draws = rows.draws()
        n = len(draws)
        expanded = n != len(rows)
        src = _on(dev, torch.from_numpy(draws.row)) if expanded else None
        sampled = draws.temperature > 0
        if (rows.temperature > 0).all():
            chosen = torch.empty(n, dtype=torch.long, device=dev)
        else:
            chosen = logits.argmax(-1)
            chosen = chosen[src] if expanded else chosen
        finish = None
        by_top_k = full = _NONE
        if sampled.any():
            by_top_k = sampled & (0 < draws.top_k) & (draws.top_k < vocab)
            full = sampled & ~by_top_k
        if by_top_k.any():
            part = draws.take(np.flatnonzero(by_top_k))
            chosen = _place(chosen, top_k_draws(logits, part, self.generator), part, n)
        if full.any():
            part = draws.take(np.flatnonzero(full))
            whole = len(part) == n  # the rounds may then finish later, in place
            picked, finish = full_draws(logits, part, self.generator, defer=whole)
            chosen = _place(chosen, picked, part, n)
        # One fused log-softmax over every row: torch's logsumexp is several kernels and
        # passes (amax, sub, exp, sum), measured ~1.8x the time of log_softmax on the CPU.
        logprobs = torch.log_softmax(logits, -1)
        at = src if expanded else torch.arange(len(rows), device=dev)
        chosen_lp = logprobs[at, chosen]
        if finish is not None:
            rounds = finish

            def finish() -> None:
                rounds()
                chosen_lp.copy_(logprobs[at, chosen])

        asks, top = _top_logprobs(logprobs, rows, None)
        return SampledBatch(rows, chosen, chosen_lp, asks, top, finish)

    def _on_kernel(self, logits: torch.Tensor, rows: SamplingRows) -> SampledBatch:
        """Greedy and full-vocabulary draws in kernels_cu/sampling.cu, top-k draws in torch;
        every draw is final on the device when this returns (no deferred rounds)."""
        from streamkv.kernels import sampling_cuda as kernel

        vocab, dev = logits.shape[1], logits.device
        draws, modes, table, adjust = _kernel_plan(rows, vocab)
        if adjust:
            logits = logits.float()  # penalties, bias and masks in float32, as in the torch path
            _adjust(logits, rows)
        n = len(draws)
        chosen = torch.empty(n, dtype=torch.long, device=dev)
        scored = np.flatnonzero(modes == kernel.SCORE)
        if len(scored):
            part = draws.take(scored)
            picked = top_k_draws(logits, part, self.generator)
            if len(part) == n:
                chosen = picked
            else:
                chosen[_on(dev, torch.from_numpy(part.draw))] = picked
        random_bases = None
        if (modes == kernel.SAMPLE | kernel.UNSEEDED).any():
            random_bases = torch.randint(
                0, 2**62, (n,), dtype=torch.int64, device=dev, generator=self.generator
            )
        chosen_lp = kernel.sample(logits, _on(dev, table), chosen, random_bases)
        asks, top = _top_logprobs(logits, rows, torch.float32)
        return SampledBatch(rows, chosen, chosen_lp, asks, top)


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NONE = np.zeros(0, dtype=bool)  # no draw of that kind


def _kernel_plan(
    rows: SamplingRows | Sequence[SampleRequest], vocab: int
) -> tuple[Draws, np.ndarray, torch.Tensor, bool]:
    """The kernel path's plan, from the columns: the draws, each draw's kernel mode, the
    kernel's draw table (on the host) and whether any row adjusts its logits first."""
    from streamkv.kernels import sampling_cuda as kernel

    rows = rows if isinstance(rows, SamplingRows) else SamplingRows.of(rows)
    draws = rows.draws()
    by_top_k = (0 < draws.top_k) & (draws.top_k < vocab)  # torch.topk draws, the kernel scores
    sample = np.where(draws.seeded, kernel.SAMPLE, kernel.SAMPLE | kernel.UNSEEDED)
    modes = np.where(
        draws.temperature <= 0, kernel.GREEDY, np.where(by_top_k, kernel.SCORE, sample)
    )
    bases = np.zeros(len(draws), dtype=np.uint64)
    seeded = np.flatnonzero(modes == kernel.SAMPLE)
    if len(seeded):
        bases[seeded] = stream_bases(*draws.stream_keys_args(seeded))
    table = kernel.draw_table(draws.row, modes, draws.temperature, draws.top_p, draws.min_p, bases)
    return draws, modes, table, rows.adjusts_logits()


def _top_logprobs(x: torch.Tensor, rows: SamplingRows, dtype: torch.dtype | None):
    """The rows that ask for top logprobs or beam candidates, and their top-k: of ``x``
    itself (log-probabilities), or with ``dtype`` of ``log_softmax(x)`` over those rows only."""
    asks = rows.asks()
    if not len(asks):
        return [], None
    k = min(int(np.maximum(rows.logprobs[asks], rows.num_candidates[asks]).max()), x.shape[1])
    picked = x[_on(x.device, torch.from_numpy(asks))]
    if dtype is not None:
        picked = torch.log_softmax(picked.to(dtype), -1)
    return asks.tolist(), picked.topk(k, dim=-1)


def _place(chosen: torch.Tensor, picked: torch.Tensor, part: Draws, total: int) -> torch.Tensor:
    """The draws of ``part`` set to ``picked`` in ``chosen`` (``total`` draws); when ``part``
    is every draw, ``picked`` itself."""
    if len(part) == total:
        return picked
    chosen[_on(chosen.device, torch.from_numpy(part.draw))] = picked
    return chosen


def _adjust(logits: torch.Tensor, rows: SamplingRows) -> None:
    """Penalties, then logit bias, then bans, then structured outputs' token masks, then
    allowed_token_ids' fixed masks, in place, each one batched over its rows. (A token the
    last two ban is -inf whatever came before: the order only matters to the others.)"""
    penalised = np.flatnonzero(rows.penalised())
    if len(penalised):
        if rows.counts is None or (rows.counts_row[penalised] < 0).any():
            raise ValueError(
                "a request with a presence, frequency or repetition penalty needs its token counts"
            )
        apply_penalties(
            logits, penalised, rows.counts, rows.counts_row[penalised], rows.penalties[penalised]
        )
    dev = logits.device
    if rows.logit_bias:
        biased = [(i, t, b) for i, bias in rows.logit_bias.items() for t, b in bias.items()]
        at, ids, vals = zip(*biased)
        index = (_on(dev, at), _on(dev, ids))
        logits.index_put_(index, _on(dev, torch.tensor(vals, dtype=logits.dtype)), accumulate=True)
    if rows.banned:
        banned = [(i, t) for i, ids in rows.banned.items() for t in ids]
        at, ids = zip(*banned)
        logits[_on(dev, at), _on(dev, ids)] = -math.inf
    if rows.token_masks is not None:
        apply_token_masks(logits, rows.token_masks)
    if rows.allowed:
        masks = [None] * len(rows)
        for i, m in rows.allowed.items():
            masks[i] = m
        apply_token_masks(logits, masks)
