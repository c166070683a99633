"""Prompt logprobs (SamplingParams.prompt_logprobs), scored in the prefill pass itself.

The forward pass already computes the hidden state of every prompt token; the model runner
normally turns only each sampling sequence's last row into logits. For a sequence that asked
for prompt logprobs, every row at a prompt position ``p < prompt_len - 1`` is turned into
logits too and scores prompt token ``p + 1``: its logprob under the model (a plain
log-softmax, before any penalty or bias), its rank, and the top ``k``. A prompt computed in
several chunks (chunked prefill) is scored chunk by chunk; the worker knows each chunk's
next token because such a sequence arrives with its prompt (NewSeq.history).

Only those rows pay: other sequences still compute one row of logits, and a step without a
scoring sequence calls nothing here. Logits are made ``ROWS_PER_PASS`` rows at a time, so a
2,048-token prompt never holds a [2048, vocab] float32 block at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamkv.messages import PromptLogprobs

ROWS_PER_PASS = 256


@dataclass(slots=True)
class PromptScoring:
    """The prompt tokens one step scores for one sequence."""

    k: int  # top logprobs per token besides its own
    first: int  # prompt index of the first scored token (= the step's start position + 1)
    targets: list[int]  # the scored prompt tokens, prompt[first : first + len(targets)]


def plan_scoring(
    prompt: list[int], k: int, start_pos: int, num_tokens: int
) -> PromptScoring | None:
    """What a step computing positions [start_pos, start_pos + num_tokens) scores: the
    token after each of those positions that is still in the prompt."""
    end = min(start_pos + num_tokens, len(prompt) - 1)
    if end <= start_pos:
        return None
    return PromptScoring(k, start_pos + 1, prompt[start_pos + 1 : end + 1])


def score_prompts(
    model: torch.nn.Module, hidden: torch.Tensor, ordered: list, samples: bool = True
) -> dict[int, PromptLogprobs]:
    """Per scoring sequence of ``ordered`` (SeqInputs in the order of ``hidden``'s rows),
    its PromptLogprobs. A rank that does not sample only joins the logits' all-gather."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[object, int, int]] = []  # (seq, first row in the scored list, count)
    offset = 0
    for s in ordered:
        sc = s.scoring
        if sc is not None:
            spans.append((s, len(rows), len(sc.targets)))
            rows.extend(range(offset, offset + len(sc.targets)))
            targets.extend(sc.targets)
        offset += len(s.token_ids)
    if not rows:
        return {}
    if not samples:
        if model.lm_head is not None and model.tp_size > 1:
            for lo in range(0, len(rows), ROWS_PER_PASS):
                model.compute_logits(
                    hidden[torch.tensor(rows[lo : lo + ROWS_PER_PASS], device=hidden.device)]
                )
        return {}
    k = max(s.scoring.k for s, _, _ in spans)
    dev = hidden.device
    own, ranks, top_ids, top_vals = [], [], [], []
    for lo in range(0, len(rows), ROWS_PER_PASS):
        idx = torch.tensor(rows[lo : lo + ROWS_PER_PASS], device=dev)
        logprobs = torch.log_softmax(model.compute_logits(hidden[idx]).float(), -1)
        tgt = torch.tensor(targets[lo : lo + ROWS_PER_PASS], device=dev)
        lp = logprobs.gather(1, tgt[:, None])
        own.append(lp.squeeze(1))
        ranks.append((logprobs > lp).sum(-1) + 1)
        if k:
            top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
            top_ids.append(top.indices)
            top_vals.append(top.values)
    own_l = torch.cat(own).tolist()
    ranks_l = torch.cat(ranks).tolist()
    ids_l = torch.cat(top_ids).tolist() if k else None
    vals_l = torch.cat(top_vals).tolist() if k else None
    out = {}
    for s, lo, n in spans:
        sc = s.scoring
        top = None
        if sc.k:
            top = [list(zip(ids_l[j][: sc.k], vals_l[j][: sc.k])) for j in range(lo, lo + n)]
        out[s.seq_id] = PromptLogprobs(sc.first, own_l[lo : lo + n], ranks_l[lo : lo + n], top)
    return out
