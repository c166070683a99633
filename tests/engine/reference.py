"""Greedy references from Hugging Face transformers, and the near-tie rule.

Two fp32 implementations that sum in different orders can disagree on argmax when the top
two logits are within rounding distance. Like vLLM's logprob-closeness check, a divergence
is accepted only when our token was the reference's runner-up by a tiny margin; after it
the sequences are different continuations and comparison stops.
"""

from __future__ import annotations

import torch

NEAR_TIE_NATS = 0.02


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: set[int] | None = None):
    """(tokens, per-step log-softmax rows) of transformers' greedy generate."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return tokens, [s[0].float().log_softmax(-1) for s in out.scores]


def assert_greedy_match(ours: list[int], ref: list[int], ref_logprobs, label: str = "") -> bool:
    """True when identical; a near-tie divergence passes (returns False); else fails."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            lp = ref_logprobs[i]
            gap = float(lp[b] - lp[a])
            assert gap <= NEAR_TIE_NATS, (
                f"{label}: token {i} differs ({a} vs reference {b}) with a logprob gap of "
                f"{gap:.4f} nats, not a near-tie"
            )
            return False
    assert len(ours) == len(ref) or (len(ours) > len(ref) and ref and ref[-1] is not None), (
        f"{label}: lengths {len(ours)} vs {len(ref)}"
    )
    return True
