"""Turns logits into tokens: penalties, temperature, top-k / top-p / min-p, and sampling.

Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)`` (equivalent to sampling from ``p``).
Seeded requests draw ``q`` from a generator keyed by (seed, sample index, output position),
so a sample's random stream does not depend on the batch it runs in, nor on preemption.
Returned logprobs are of the distribution after penalties and logit bias, before temperature
and filters.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from streamkv.worker.messages import SampleRequest, SampleResult


def _apply_penalties(logits: torch.Tensor, reqs: list[SampleRequest]) -> None:
    for i, r in enumerate(reqs):
        if r.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set((r.prompt_token_ids or []) + (r.output_token_ids or []))), dtype=torch.long, device=logits.device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / r.repetition_penalty, vals * r.repetition_penalty)
        if (r.presence_penalty or r.frequency_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids, device=logits.device), minlength=logits.shape[1])[: logits.shape[1]]
            logits[i] -= r.frequency_penalty * counts + r.presence_penalty * (counts > 0)
        if r.logit_bias:
            ids = torch.tensor(list(r.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(r.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if r.banned_token_ids:
            logits[i, r.banned_token_ids] = float("-inf")


def _filter(logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p, on rows that sample."""
    temps = torch.tensor([r.temperature for r in reqs], device=logits.device).unsqueeze(1)
    logits = logits / temps
    if any(r.top_k > 0 for r in reqs):
        vocab = logits.shape[1]  # a top_k past the vocabulary keeps every token
        k = torch.tensor([min(r.top_k, vocab) if r.top_k > 0 else vocab for r in reqs], device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(r.top_p < 1.0 for r in reqs):
        p = torch.tensor([r.top_p for r in reqs], device=logits.device).unsqueeze(1)
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = (probs.cumsum(-1) - probs) >= p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    if any(r.min_p > 0 for r in reqs):
        probs = logits.softmax(-1)
        m = torch.tensor([r.min_p for r in reqs], device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(probs < m * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def _exponentials(reqs: list[SampleRequest], vocab: int, device, generator: torch.Generator) -> torch.Tensor:
    q = torch.empty(len(reqs), vocab, device=device)
    for i, r in enumerate(reqs):
        if r.seed is None:
            q[i].exponential_(generator=generator)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(hash((r.seed, r.sample_index, r.output_pos)) & 0x7FFF_FFFF_FFFF_FFFF)
            q[i].exponential_(generator=g)
    return q


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> list[SampleResult]:
        logits = logits.float()
        _apply_penalties(logits, reqs)
        logprobs = torch.log_softmax(logits, dim=-1)
        # One row per output sample: a prompt of an n>1 request yields n tokens at once.
        rows, expanded = [], []
        for i, r in enumerate(reqs):
            for j in range(r.num_samples):
                rows.append(i)
                expanded.append(_with_sample_index(r, r.sample_index + j) if j else r)
        row_idx = torch.tensor(rows, device=logits.device)
        chosen = logprobs.argmax(-1)[row_idx]
        sampled = [k for k, r in enumerate(expanded) if r.temperature > 0]
        if sampled:
            sub = [expanded[k] for k in sampled]
            idx = torch.tensor(sampled, device=logits.device)
            filtered = _filter(logits[row_idx[idx]], sub)
            probs = filtered.softmax(-1)
            q = _exponentials(sub, logits.shape[1], logits.device, self.generator)
            chosen[idx] = (probs / q).argmax(-1)
        chosen_lp = logprobs[row_idx, chosen]
        max_top = max((r.logprobs or 0) for r in reqs)
        max_cand = max(r.num_candidates for r in reqs)
        k_top = min(max(max_top, max_cand), logprobs.shape[1])
        top = logprobs.topk(k_top, dim=-1) if k_top > 0 else None
        chosen_l, lp_l = chosen.tolist(), chosen_lp.tolist()
        top_vals = top.values.tolist() if top is not None else None
        top_ids = top.indices.tolist() if top is not None else None
        results: list[SampleResult] = []
        k = 0
        for i, r in enumerate(reqs):
            n = r.num_samples
            res = SampleResult(token_ids=chosen_l[k : k + n], logprobs=lp_l[k : k + n])
            if r.logprobs:
                pairs = list(zip(top_ids[i][: r.logprobs], top_vals[i][: r.logprobs]))
                res.top_logprobs = [pairs] * n
            if r.num_candidates:
                res.candidates = list(zip(top_ids[i][: r.num_candidates], top_vals[i][: r.num_candidates]))
            results.append(res)
            k += n
        return results


def _with_sample_index(r: SampleRequest, index: int) -> SampleRequest:
    return replace(r, sample_index=index)
