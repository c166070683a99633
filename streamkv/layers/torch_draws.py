"""The sampler's draws in torch: the reference path (CPU, and what the CPU tests exercise)
and, on CUDA too, the top-k rows. ``part`` holds the draws as columns (Draws, in
layers/sample_request.py: the step's own copy); layers/sampler.py's docstring gives the
semantics. kernels_cu/sampling.cu draws the greedy and full-vocabulary rows on CUDA with the
same keys and the same rounds."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from streamkv.layers.sample_request import Draws
from streamkv.layers.sampled_batch import on_device as _on
from streamkv.layers.stream_hash import hashed_exponentials, stream_keys


def top_k_draws(logits: torch.Tensor, part: Draws, generator: torch.Generator) -> torch.Tensor:
    """The draws of ``part`` among each row's ``torch.topk`` candidates (the top-p and
    min-p cuts exact on the sorted candidates); logits of any float dtype."""
    vocab = logits.shape[1]
    params = _draw_params(part, logits.device, vocab)
    rows = logits if _every_row(part, logits) else logits[params[:, 0].long()]
    vals, ids = rows.topk(min(int(part.top_k.max()), vocab), dim=-1)
    vals = vals.float()  # a no-op for float32 logits
    vals /= params[:, 1:2]
    cut = torch.arange(vals.shape[1], device=vals.device) >= params[:, 4:5]
    probs = vals.masked_fill_(cut, -math.inf).softmax(-1)
    if (part.top_p < 1.0).any():
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        probs = probs.masked_fill((probs.cumsum(-1) - probs) >= params[:, 2:3], 0.0)
    probs = _min_p(probs, part, params)
    q = exponentials(part, ids, 0, generator)
    return ids.gather(1, (probs / q).argmax(-1, keepdim=True)).squeeze(1)


def full_draws(
    logits: torch.Tensor, part: Draws, generator: torch.Generator, defer: bool = False
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """The draws of ``part`` over the whole vocabulary, and (top-p with ``defer``) a
    function that finishes them in place: its rounds read on the host which rows were
    rejected, so they wait for the device. Without ``defer`` they run here."""
    dev, vocab = logits.device, logits.shape[1]
    params = _draw_params(part, dev, vocab)
    if _every_row(part, logits):  # no gather: one pass less over the vocabulary
        x = logits / params[:, 1:2]
    else:
        x = logits[params[:, 0].long()]
        x /= params[:, 1:2]
    probs = x.softmax(-1)
    weights = _min_p(probs, part, params)
    token_ids = torch.arange(vocab, device=dev)
    if (part.top_p >= 1.0).all():
        return (weights / exponentials(part, token_ids, 0, generator)).argmax(-1), None
    top_p = params[:, 2]
    # Round 0 over every row, on the device: a draw is kept when the mass of the tokens
    # more likely than it is below top_p (it lies in the nucleus).
    pick = (weights / exponentials(part, token_ids, 0, generator)).argmax(-1, keepdim=True)
    score = x.gather(1, pick)
    above = torch.where(x > score, probs, 0.0).sum(-1)
    ok = _in_nucleus(above, top_p)
    chosen = pick.squeeze(1).clone()

    def rounds() -> None:
        # ``part`` is the step's own copy of its columns: rounds deferred past the step still
        # key the seeded streams as of this step.
        w, xs, ps, score_, ok_, active, live, round_ = weights, x, probs, score, ok, None, part, 0
        while True:
            rejected = (~ok_).nonzero().squeeze(1)  # the round's one host sync
            if rejected.numel() == 0:
                return
            if round_ >= MAX_ROUNDS:
                # A safety net, never reached with admitted values (each round accepts with
                # probability >= top_p): the most likely token is always in the nucleus.
                rows = rejected if active is None else active[rejected]
                chosen[rows] = xs[rejected].argmax(-1)
                return
            # Redraw among the tokens more likely than the rejected one: the nucleus is inside.
            w = torch.where(xs[rejected] > score_[rejected], w[rejected], 0.0)
            xs, ps = xs[rejected], ps[rejected]
            live = live.take(rejected.cpu().numpy())
            active = rejected if active is None else active[rejected]
            round_ += 1
            pick_ = (w / exponentials(live, token_ids, round_, generator)).argmax(-1, keepdim=True)
            score_ = xs.gather(1, pick_)
            tp = top_p[active]
            ok_ = _in_nucleus(torch.where(xs > score_, ps, 0.0).sum(-1), tp)
            chosen[active] = torch.where(ok_, pick_.squeeze(1), chosen[active])

    if defer:
        return chosen, rounds
    rounds()
    return chosen, None


def exponentials(
    part: Draws, token_ids: torch.Tensor, round_: int, generator: torch.Generator
) -> torch.Tensor:
    """Exp(1) per (draw, token id): hashed for seeded draws, else from the generator."""
    dev = token_ids.device
    shape = (len(part), token_ids.shape[-1])
    seeded = np.flatnonzero(part.seeded)
    if not len(seeded):
        return torch.empty(shape, device=dev).exponential_(generator=generator)
    keys = _on(dev, stream_keys(*part.stream_keys_args(seeded), round_))
    if len(seeded) == len(part):
        return hashed_exponentials(keys, token_ids)
    q = torch.empty(shape, device=dev).exponential_(generator=generator)
    sel = _on(dev, torch.from_numpy(seeded))
    q[sel] = hashed_exponentials(keys, token_ids[sel] if token_ids.dim() == 2 else token_ids)
    return q


# Redraw rounds of a top-p draw before it takes the most likely token (see ``rounds``).
MAX_ROUNDS = 64


def _in_nucleus(above: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Whether a drawn token with ``above`` probability mass strictly more likely than it
    lies in the top-p nucleus. A token with nothing above it is the most likely one, always
    in the nucleus: without that clause a top_p that rounds to 0 in float32 (1e-46) rejected
    every draw forever and hung the engine thread (issue 26)."""
    return (above < top_p) | (above <= 0.0) | (top_p >= 1.0)


def _draw_params(part: Draws, device: torch.device, vocab: int) -> torch.Tensor:
    """Per draw (row, temperature, top_p, min_p, top_k clamped to the vocabulary), float32
    on the device in one copy (row ids and k stay exact below 2**24)."""
    host = np.empty((len(part), 5), dtype=np.float32)
    with np.errstate(over="ignore"):  # rounded to float32 as torch.tensor would (inf past it)
        host[:, 0] = part.row
        host[:, 1] = part.temperature
        host[:, 2] = part.top_p
        host[:, 3] = part.min_p
        host[:, 4] = np.minimum(part.top_k, vocab)
    return _on(device, torch.from_numpy(host))


def _every_row(part: Draws, logits: torch.Tensor) -> bool:
    n = len(part)
    return n == logits.shape[0] and bool((part.row == np.arange(n)).all())


def _min_p(probs: torch.Tensor, part: Draws, params: torch.Tensor) -> torch.Tensor:
    if (part.min_p <= 0).all():
        return probs
    return probs.masked_fill(probs < params[:, 3:4] * probs.amax(-1, keepdim=True), 0.0)
