"""Helpers for the model tests: tiny random transformers models saved as Hugging Face
directories, and a greedy comparison against transformers' own ``generate``.

Near-ties: tiny random models can put two tokens within float rounding of each other, and
then two correct implementations may pick different ones. Like vLLM's logprob-closeness
check, a divergence is accepted only if streamkv's token is in transformers' top-2 at that
step with a log-probability gap below ``TIE_GAP``; the rest of that sequence is then not
compared (the two continuations no longer share a prefix). The models are initialised with
a wide weight distribution (std 0.15), so near-ties are rare and a real bug shows up as a
divergence with a large gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamkv import SamplingParams

TIE_GAP = 1e-3
WEIGHT_STD = 0.15


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-degenerate random weights: N(0, WEIGHT_STD) for matrices and biases, 1 + noise for
    norm scales (transformers initialises those to exactly 1 and biases to 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "norm" in name:
                p.copy_(0.1 * noise)
            else:
                p.copy_(WEIGHT_STD * noise)
    return model.eval()


def save_tiny(hf_config, path, seed: int = 0, **save_kwargs) -> torch.nn.Module:
    """Build a transformers model from ``hf_config``, randomize it, save it (safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = randomize(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32), seed)
    model.save_pretrained(str(path), **save_kwargs)
    return model


@dataclass
class Comparison:
    exact: int = 0  # sequences identical over every generated token
    near_ties: int = 0  # sequences that diverged at an accepted near-tie


def greedy_compare(hf_model, llm, prompts: list[list[int]], max_tokens: int) -> Comparison:
    """Greedy streamkv (batched) vs transformers ``generate(do_sample=False)`` (one prompt
    at a time, so no padding enters the reference)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(None, params, prompt_token_ids=prompts)
    result = Comparison()
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        ref = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
        want = ref.sequences[0, len(prompt) :].tolist()
        assert len(got) == len(want) == max_tokens, (len(got), len(want))
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            if a == b:
                continue
            logprobs = ref.logits[step][0].float().log_softmax(-1)
            top2 = logprobs.topk(2).indices.tolist()
            gap = float(logprobs[b] - logprobs[a])
            assert a in top2 and gap < TIE_GAP, (
                f"prompt {prompt}: step {step} streamkv chose {a}, transformers {b} "
                f"(transformers top-2 {top2}, logprob gap {gap:.4g})\n got  {got}\n want {want}"
            )
            result.near_ties += 1
            break
        else:
            result.exact += 1
    return result


def prompts(vocab: int, lengths=(1, 5, 8, 17, 30), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
