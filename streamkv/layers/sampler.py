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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamkv.layers.host_copy import on_device as _on
from streamkv.layers.penalties import TokenCounts, apply_penalties
from streamkv.layers.token_mask import TokenMask, apply_token_masks
from streamkv.messages import SampleResult

_M32 = 0xFFFF_FFFF
_M64 = (1 << 64) - 1


@dataclass(slots=True)
class SampleRequest:
    """How to sample one sequence's next token(s) this step."""

    num_samples: int = 1  # a prompt of a best_of > 1 request yields best_of tokens at once
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    # With the seed, these key a seeded sample's random stream.
    sample_index: int = 0  # sample j of the request (num_samples > 1: sample_index + j)
    output_pos: int = 0  # tokens the sample has generated so far
    logprobs: int | None = None  # top logprobs to return besides the sampled token's
    num_candidates: int = 0  # beam search: return this many best (token, logprob)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    banned_token_ids: list[int] | None = None  # e.g. EOS before min_tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    counts: TokenCounts | None = None  # where the sequence's token counts live (penalties)
    counts_row: int = -1
    token_mask: TokenMask | None = None  # structured outputs: the allowed tokens (layers/token_mask.py)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 arrays wrap on overflow, as the algorithm wants)."""
    z = z + 0x9E37_79B9_7F4A_7C15
    z = (z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9
    z = (z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB
    return z ^ (z >> 31)


def stream_keys(seeds: list[int], sample_indices: list[int], positions: list[int], round_: int = 0) -> torch.Tensor:
    """The 32-bit keys (as int64) of seeded draws, one per (seed, sample index, output
    position), in draw round ``round_``: vectorized on the host, a few microseconds a batch."""
    z = _mix64(np.array([s & _M64 for s in seeds], dtype=np.uint64))
    z = _mix64(z ^ np.array(sample_indices, dtype=np.uint64))
    z = _mix64(z ^ np.array(positions, dtype=np.uint64))
    z = _mix64(z ^ np.uint64(round_))
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


class SampledBatch(Sequence):
    """One batch's samples, a list of SampleResult (one per request) that stays on the device
    until it is first read. ``tokens`` (one per draw, in draw order) is the device tensor the
    next step can take its input ids from without the host (async scheduling). On CUDA the
    results are copied to pinned host memory without blocking as soon as they are launched;
    the first read waits for that copy alone."""

    def __init__(self, reqs: list[SampleRequest], chosen: torch.Tensor, chosen_lp: torch.Tensor,
                 asks: list[int], top, finish: Callable[[], None] | None = None) -> None:
        self.reqs, self.tokens, self._asks = reqs, chosen, asks
        self._device = [chosen, chosen_lp] + ([top.indices, top.values] if top is not None else [])
        # ``finish``: the rest of top-p's rejection rounds, which read their progress on the
        # host. It runs when the batch is first needed (the next step's launch or a read), so
        # the step after this one is scheduled and built before anything waits for the device.
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
        return len(self.reqs)

    def __getitem__(self, i):
        return self.results()[i]

    def results(self) -> list[SampleResult]:
        if self._results is None:
            self.finalize()
            if self._ready is not None:
                self._ready.synchronize()
            self._results = _to_results(self.reqs, self._asks, *(t.tolist() for t in self._host))
        return self._results


def _to_results(reqs: list[SampleRequest], asks: list[int], chosen: list[int], lps: list[float],
                top_ids: list | None = None, top_vals: list | None = None) -> list[SampleResult]:
    ids = dict(zip(asks, top_ids or ()))
    vals = dict(zip(asks, top_vals or ()))
    results: list[SampleResult] = []
    k = 0
    for i, r in enumerate(reqs):
        n = r.num_samples
        res = SampleResult(token_ids=chosen[k : k + n], logprobs=lps[k : k + n])
        if r.logprobs:
            res.top_logprobs = [list(zip(ids[i][: r.logprobs], vals[i][: r.logprobs]))] * n
        if r.num_candidates:
            res.candidates = list(zip(ids[i][: r.num_candidates], vals[i][: r.num_candidates]))
        results.append(res)
        k += n
    return results


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> SampledBatch:
        logits = logits.float()
        vocab, dev = logits.shape[1], logits.device
        _adjust(logits, reqs)
        # One draw per output sample: (row, request, sample index).
        draws = [(i, r, r.sample_index + j) for i, r in enumerate(reqs) for j in range(r.num_samples)]
        expanded = len(draws) != len(reqs)
        src = _on(dev, [d[0] for d in draws]) if expanded else None
        if all(r.temperature > 0 for r in reqs):
            chosen = torch.empty(len(draws), dtype=torch.long, device=dev)
        else:
            chosen = logits.argmax(-1)
            chosen = chosen[src] if expanded else chosen
        top_k_draws, full_draws = [], []
        for k, d in enumerate(draws):
            r = d[1]
            if r.temperature > 0:
                (top_k_draws if 0 < r.top_k < vocab else full_draws).append((k, *d))
        finish = None
        if top_k_draws:
            picked = self._sample_top_k(logits, top_k_draws)
            if len(top_k_draws) == len(draws):
                chosen = picked
            else:
                chosen[_on(dev, [p[0] for p in top_k_draws])] = picked
        if full_draws:
            whole = len(full_draws) == len(draws)  # the rounds may then finish later, in place
            picked, finish = self._sample_full(logits, full_draws, defer=whole)
            if whole:
                chosen = picked
            else:
                chosen[_on(dev, [p[0] for p in full_draws])] = picked
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
        asks = [i for i, r in enumerate(reqs) if r.logprobs or r.num_candidates]
        top = None
        if asks:
            k = min(max(max(reqs[i].logprobs or 0, reqs[i].num_candidates) for i in asks), vocab)
            top = logprobs[_on(dev, asks)].topk(k, dim=-1)
        return SampledBatch(list(reqs), chosen, chosen_lp, asks, top, finish)

    # -- the two sampling paths; ``part`` holds (draw, row, request, sample index) ------------
    def _sample_top_k(self, logits: torch.Tensor, part: list[tuple]) -> torch.Tensor:
        vocab = logits.shape[1]
        params = _draw_params(part, logits.device, vocab)
        rows = logits if _every_row(part, logits) else logits[params[:, 0].long()]
        vals, ids = rows.topk(min(max(p[2].top_k for p in part), vocab), dim=-1)
        vals /= params[:, 1:2]
        cut = torch.arange(vals.shape[1], device=vals.device) >= params[:, 4:5]
        probs = vals.masked_fill_(cut, -math.inf).softmax(-1)
        if any(p[2].top_p < 1.0 for p in part):
            # Drop a token when the mass before it already reaches top_p (keeps at least one).
            probs = probs.masked_fill((probs.cumsum(-1) - probs) >= params[:, 2:3], 0.0)
        probs = _min_p(probs, part, params)
        q = self._exponentials(part, ids, 0)
        return ids.gather(1, (probs / q).argmax(-1, keepdim=True)).squeeze(1)

    def _sample_full(self, logits: torch.Tensor, part: list[tuple],
                     defer: bool = False) -> tuple[torch.Tensor, Callable[[], None] | None]:
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
        if all(p[2].top_p >= 1.0 for p in part):
            return (weights / self._exponentials(part, token_ids, 0)).argmax(-1), None
        top_p = params[:, 2]
        # Round 0 over every row, on the device: a draw is kept when the mass of the tokens
        # more likely than it is below top_p (it lies in the nucleus).
        pick = (weights / self._exponentials(part, token_ids, 0)).argmax(-1, keepdim=True)
        score = x.gather(1, pick)
        above = torch.where(x > score, probs, 0.0).sum(-1)
        ok = (above < top_p) | (top_p >= 1.0)
        chosen = pick.squeeze(1).clone()
        # The seeded streams' keys as of this step: by the time deferred rounds run, the
        # worker may have moved its requests on to the next step.
        frozen = [(p[0], p[1], _StreamKey(p[2].seed, p[2].output_pos), p[3]) for p in part]

        def rounds() -> None:
            w, xs, ps, score_, ok_, active, live, round_ = weights, x, probs, score, ok, None, frozen, 0
            while True:
                rejected = (~ok_).nonzero().squeeze(1)  # the round's one host sync
                if rejected.numel() == 0:
                    return
                # Redraw among the tokens more likely than the rejected one: the nucleus is inside.
                w = torch.where(xs[rejected] > score_[rejected], w[rejected], 0.0)
                xs, ps = xs[rejected], ps[rejected]
                live = [live[j] for j in rejected.tolist()]
                active = rejected if active is None else active[rejected]
                round_ += 1
                pick_ = (w / self._exponentials(live, token_ids, round_)).argmax(-1, keepdim=True)
                score_ = xs.gather(1, pick_)
                tp = top_p[active]
                ok_ = (torch.where(xs > score_, ps, 0.0).sum(-1) < tp) | (tp >= 1.0)
                chosen[active] = torch.where(ok_, pick_.squeeze(1), chosen[active])

        if defer:
            return chosen, rounds
        rounds()
        return chosen, None

    def _exponentials(self, part: list[tuple], token_ids: torch.Tensor, round_: int) -> torch.Tensor:
        """Exp(1) per (draw, token id): hashed for seeded draws, else from the generator."""
        dev = token_ids.device
        shape = (len(part), token_ids.shape[-1])
        seeded = [j for j, p in enumerate(part) if p[2].seed is not None]
        if not seeded:
            return torch.empty(shape, device=dev).exponential_(generator=self.generator)
        keys = _on(dev, stream_keys(
            [part[j][2].seed for j in seeded], [part[j][3] for j in seeded],
            [part[j][2].output_pos for j in seeded], round_,
        ))
        if len(seeded) == len(part):
            return hashed_exponentials(keys, token_ids)
        q = torch.empty(shape, device=dev).exponential_(generator=self.generator)
        sel = _on(dev, seeded)
        q[sel] = hashed_exponentials(keys, token_ids[sel] if token_ids.dim() == 2 else token_ids)
        return q


@dataclass(frozen=True, slots=True)
class _StreamKey:
    """What a draw's seeded noise is keyed by (``Sampler._exponentials`` reads these)."""

    seed: int | None
    output_pos: int


def _draw_params(part: list[tuple], device: torch.device, vocab: int) -> torch.Tensor:
    """Per draw (row, temperature, top_p, min_p, top_k clamped to the vocabulary), float32
    on the device in one copy (row ids and k stay exact below 2**24)."""
    rows = [(p[1], p[2].temperature, p[2].top_p, p[2].min_p, min(p[2].top_k, vocab)) for p in part]
    return _on(device, torch.tensor(rows, dtype=torch.float32))


def _every_row(part: list[tuple], logits: torch.Tensor) -> bool:
    return len(part) == logits.shape[0] and all(p[1] == i for i, p in enumerate(part))


def _min_p(probs: torch.Tensor, part: list[tuple], params: torch.Tensor) -> torch.Tensor:
    if all(p[2].min_p <= 0 for p in part):
        return probs
    return probs.masked_fill(probs < params[:, 3:4] * probs.amax(-1, keepdim=True), 0.0)


def _adjust(logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    """Penalties, then logit bias, then bans, then structured outputs' token masks, in
    place, each one batched over its rows."""
    penalised = [i for i, r in enumerate(reqs) if r.has_penalties]
    if penalised:
        stores = {id(reqs[i].counts): reqs[i].counts for i in penalised}
        if None in stores.values():
            raise ValueError("a request with a presence, frequency or repetition penalty needs its token counts")
        for store in stores.values():
            rows = [i for i in penalised if reqs[i].counts is store]
            apply_penalties(
                logits, rows, store, [reqs[i].counts_row for i in rows],
                [(reqs[i].presence_penalty, reqs[i].frequency_penalty, reqs[i].repetition_penalty) for i in rows],
            )
    biased = [(i, t, b) for i, r in enumerate(reqs) if r.logit_bias for t, b in r.logit_bias.items()]
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
