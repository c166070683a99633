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

from streamkv.layers.host_copy import on_device as _on
from streamkv.layers.penalties import apply_penalties
from streamkv.layers.sample_request import SampleRequest
from streamkv.layers.sampled_batch import SampledBatch
from streamkv.layers.stream_hash import hashed_exponentials, stream_bases, stream_keys
from streamkv.layers.token_mask import apply_token_masks
from streamkv.layers.torch_draws import full_draws, top_k_draws

__all__ = ["SampleRequest", "SampledBatch", "Sampler", "hashed_exponentials", "stream_keys"]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        if torch.device(device).type == "cuda":
            from streamkv.kernels import sampling_cuda

            sampling_cuda.load(torch.device(device))  # at start-up, not in the first step

    def __call__(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> SampledBatch:
        if logits.is_cuda and logits.dtype in _KERNEL_DTYPES and logits.stride(-1) == 1:
            return self._on_kernel(logits, reqs)
        return self._in_torch(logits, reqs)

    def _in_torch(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> SampledBatch:
        logits = logits.float()
        vocab, dev = logits.shape[1], logits.device
        _adjust(logits, reqs)
        draws = _draws(reqs)
        expanded = len(draws) != len(reqs)
        src = _on(dev, [d[0] for d in draws]) if expanded else None
        if all(r.temperature > 0 for r in reqs):
            chosen = torch.empty(len(draws), dtype=torch.long, device=dev)
        else:
            chosen = logits.argmax(-1)
            chosen = chosen[src] if expanded else chosen
        top_k, full = [], []
        for k, d in enumerate(draws):
            r = d[1]
            if r.temperature > 0:
                (top_k if 0 < r.top_k < vocab else full).append((k, *d))
        finish = None
        if top_k:
            chosen = _place(chosen, top_k_draws(logits, top_k, self.generator), top_k, len(draws))
        if full:
            whole = len(full) == len(draws)  # the rounds may then finish later, in place
            picked, finish = full_draws(logits, full, self.generator, defer=whole)
            chosen = _place(chosen, picked, full, len(draws))
        # One fused log-softmax over every row: torch's logsumexp is several kernels and
        # passes (amax, sub, exp, sum), measured ~1.8x the time of log_softmax on the CPU.
        logprobs = torch.log_softmax(logits, -1)
        rows = src if expanded else torch.arange(len(reqs), device=dev)
        chosen_lp = logprobs[rows, chosen]
        if finish is not None:
            rounds = finish

            def finish() -> None:
                rounds()
                chosen_lp.copy_(logprobs[rows, chosen])

        asks, top = _top_logprobs(logprobs, reqs, None)
        return SampledBatch(list(reqs), chosen, chosen_lp, asks, top, finish)

    def _on_kernel(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> SampledBatch:
        """Greedy and full-vocabulary draws in kernels_cu/sampling.cu, top-k draws in torch;
        every draw is final on the device when this returns (no deferred rounds)."""
        from streamkv.kernels import sampling_cuda as kernel

        vocab, dev = logits.shape[1], logits.device
        draws, modes, table, adjust = _kernel_plan(reqs, vocab)
        if adjust:
            logits = logits.float()  # penalties, bias and masks in float32, as in the torch path
            _adjust(logits, reqs)
        chosen = torch.empty(len(draws), dtype=torch.long, device=dev)
        top_k = [(k, *d) for k, (d, m) in enumerate(zip(draws, modes)) if m == kernel.SCORE]
        if top_k:
            picked = top_k_draws(logits, top_k, self.generator)
            if len(top_k) == len(draws):
                chosen = picked
            else:
                chosen[_on(dev, [p[0] for p in top_k])] = picked
        random_bases = None
        if kernel.SAMPLE | kernel.UNSEEDED in modes:
            random_bases = torch.randint(
                0, 2**62, (len(draws),), dtype=torch.int64, device=dev, generator=self.generator
            )
        chosen_lp = kernel.sample(logits, _on(dev, table), chosen, random_bases)
        asks, top = _top_logprobs(logits, reqs, torch.float32)
        return SampledBatch(list(reqs), chosen, chosen_lp, asks, top)


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _draws(reqs: Sequence[SampleRequest]) -> list[tuple[int, SampleRequest, int]]:
    """One draw per output sample: (row, request, sample index)."""
    return [(i, r, r.sample_index + j) for i, r in enumerate(reqs) for j in range(r.num_samples)]


def _kernel_plan(
    reqs: Sequence[SampleRequest], vocab: int
) -> tuple[list[tuple], list[int], torch.Tensor, bool]:
    """One pass over the requests for the kernel path: the draws (row, request, sample
    index), each draw's kernel mode, the kernel's draw table (on the host) and whether any
    row adjusts its logits first."""
    from streamkv.kernels import sampling_cuda as kernel

    draws, modes, temperatures, top_ps, min_ps, seeded = [], [], [], [], [], []
    adjust = False
    for i, r in enumerate(reqs):
        adjust = adjust or r.adjusts_logits
        if r.temperature <= 0:
            mode = kernel.GREEDY
        elif 0 < r.top_k < vocab:
            mode = kernel.SCORE  # torch.topk draws it; the kernel scores its logprob
        else:
            mode = kernel.SAMPLE if r.seed is not None else kernel.SAMPLE | kernel.UNSEEDED
        for j in range(r.num_samples):
            if mode == kernel.SAMPLE:
                seeded.append(len(draws))
            draws.append((i, r, r.sample_index + j))
            modes.append(mode)
            temperatures.append(r.temperature)
            top_ps.append(r.top_p)
            min_ps.append(r.min_p)
    bases = np.zeros(len(draws), dtype=np.uint64)
    if seeded:
        bases[seeded] = stream_bases(
            [draws[k][1].seed for k in seeded],
            [draws[k][2] for k in seeded],
            [draws[k][1].output_pos for k in seeded],
        )
    table = kernel.draw_table([d[0] for d in draws], modes, temperatures, top_ps, min_ps, bases)
    return draws, modes, table, adjust


def _top_logprobs(x: torch.Tensor, reqs: Sequence[SampleRequest], dtype: torch.dtype | None):
    """The rows that ask for top logprobs or beam candidates, and their top-k: of ``x``
    itself (log-probabilities), or with ``dtype`` of ``log_softmax(x)`` over those rows only."""
    asks = [i for i, r in enumerate(reqs) if r.logprobs or r.num_candidates]
    if not asks:
        return asks, None
    k = min(max(max(reqs[i].logprobs or 0, reqs[i].num_candidates) for i in asks), x.shape[1])
    rows = x[_on(x.device, asks)]
    if dtype is not None:
        rows = torch.log_softmax(rows.to(dtype), -1)
    return asks, rows.topk(k, dim=-1)


def _place(
    chosen: torch.Tensor, picked: torch.Tensor, part: list[tuple], total: int
) -> torch.Tensor:
    """The draws of ``part`` (each led by its index among the ``total`` draws) set to
    ``picked`` in ``chosen``; when ``part`` is every draw, ``picked`` itself."""
    if len(part) == total:
        return picked
    chosen[_on(chosen.device, [p[0] for p in part])] = picked
    return chosen


def _adjust(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    """Penalties, then logit bias, then bans, then structured outputs' token masks, then
    allowed_token_ids' fixed masks, in place, each one batched over its rows. (A token the
    last two ban is -inf whatever came before: the order only matters to the others.)"""
    penalised = [i for i, r in enumerate(reqs) if r.has_penalties]
    if penalised:
        stores = {id(reqs[i].counts): reqs[i].counts for i in penalised}
        if None in stores.values():
            raise ValueError(
                "a request with a presence, frequency or repetition penalty needs its token counts"
            )
        for store in stores.values():
            rows = [i for i in penalised if reqs[i].counts is store]
            apply_penalties(
                logits,
                rows,
                store,
                [reqs[i].counts_row for i in rows],
                [
                    (
                        reqs[i].presence_penalty,
                        reqs[i].frequency_penalty,
                        reqs[i].repetition_penalty,
                    )
                    for i in rows
                ],
            )
    biased = [
        (i, t, b) for i, r in enumerate(reqs) if r.logit_bias for t, b in r.logit_bias.items()
    ]
    if biased:
        dev = logits.device
        rows, ids, vals = zip(*biased)
        index = (_on(dev, rows), _on(dev, ids))
        logits.index_put_(index, _on(dev, torch.tensor(vals, dtype=logits.dtype)), accumulate=True)
    banned = [(i, t) for i, r in enumerate(reqs) if r.banned_token_ids for t in r.banned_token_ids]
    if banned:
        rows, ids = zip(*banned)
        logits[_on(logits.device, rows), _on(logits.device, ids)] = -math.inf
    apply_token_masks(logits, [r.token_mask for r in reqs])
    apply_token_masks(logits, [r.allowed_mask for r in reqs])
