"""A burst sharing a system prompt: what the prefix cache saves when N requests with the
same ~100-token system prompt arrive together, on a cold cache, in one ``generate`` call.

    python benchmarks/bench_shared_burst.py --num-requests 32 --max-output-len 8

A waiting request whose next prompt block a running sequence is computing waits a step and
then maps it from the prefix cache (AllocStatus.SHARE_LATER, core/block_manager.py), so the
burst computes the system prompt's whole blocks once. The same prompts run with the prefix
cache on and off (greedy, ignore_eos); the script fails if their outputs differ.

Computed prompt tokens are the engine's ``num_prompt_tokens`` delta (engine/stats.py: every
token a step computes that is not a sampled one, so cache hits are not in it); hits are the
block manager's ``prefix_cache_hits`` delta, in tokens. Speedup is off seconds / seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SYSTEM = (
    "You are a patient assistant for a public library. Answer each question in one short, "
    "plain sentence. Do not invent facts; if you do not know, say so. Prefer simple words, "
    "avoid lists, and never mention these instructions. "
)
_TOPICS = ("rivers", "bread", "clocks", "bees", "maps", "glass", "tides", "paper", "salt", "wind")
_ASKS = ("What are {}?", "Why do people study {}?", "Where can I read about {}?", "Who uses {}?")
_WARM_UP_TOKENS = 2048  # one full step at the CPU's default max_num_batched_tokens (config.py)


def system_prompt(tok, target_tokens: int) -> list[int]:
    """The shared instruction, repeated clause by clause up to ~``target_tokens`` tokens."""
    clauses = _SYSTEM.split(". ")
    text, i = "", 0
    while len(tok.encode(text)) < target_tokens:
        text += clauses[i % len(clauses)].strip(". ") + ". "
        i += 1
    return tok.encode(text + "\n")


def questions(n: int) -> list[str]:
    """``n`` distinct questions (topic x phrasing, then numbered past the 40 combinations)."""
    pairs = [a.format(t) for a in _ASKS for t in _TOPICS]
    return [
        pairs[i % len(pairs)] + (f" (#{i // len(pairs)})" if i >= len(pairs) else "")
        for i in range(n)
    ]


def measure(llm, prompts: list[list[int]], params) -> tuple[dict, list[list[int]]]:
    """One cold-cache ``generate`` of every prompt: its figures and the greedy outputs."""
    bm = llm.engine.block_manager
    bm.device.reset_prefix_cache()
    before = llm.engine.stats()["num_prompt_tokens"]
    queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    sent = sum(len(p) for p in prompts)
    computed = llm.engine.stats()["num_prompt_tokens"] - before
    row = {
        "requests": len(prompts),
        "prompt_tokens_sent": sent,
        "prompt_tokens_computed": computed,
        "computed_share": computed / sent,
        "prefix_cache_hits": bm.prefix_cache_hits - hits,
        "prefix_cache_queries": bm.prefix_cache_queries - queries,
        "seconds": seconds,
    }
    return row, [list(o.outputs[0].token_ids) for o in outs]


def warm_up(llm, tok) -> None:
    """A full step of unrelated prompts, so start-up is not charged to the measured run.
    A tiny prompt is not enough on the CPU: the first 2,048-token step took 7.0 s and the
    next ones 2.5 s (SmolLM2, 2 cores), which made the cache-off run look 1.5x slower."""
    from streamkv import SamplingParams

    text = "the quick brown fox jumps over the lazy dog, again and again. " * 40
    # Distinct from the first token on: with the cache on, equal prompts would share a block.
    prompts = [tok.encode(f"Warm-up {i}: {text}")[: _WARM_UP_TOKENS // 4] for i in range(4)]
    llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=100, help="system prompt length, ~")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--json-out", default="bench_results/shared_burst.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from streamkv import LLM, SamplingParams

    common = dict(device=args.device, load_format=args.load_format, num_swap_blocks=0)
    common["num_kv_blocks"] = args.num_kv_blocks
    params = SamplingParams(temperature=0, max_tokens=args.max_output_len, ignore_eos=True)
    rows, outputs = [], {}
    for mode, caching in (("prefix cache on", True), ("prefix cache off", False)):
        llm = LLM(args.model, enable_prefix_caching=caching, **common)
        tok = llm.get_tokenizer()
        system = system_prompt(tok, args.system_tokens)
        prompts = [
            system + tok.encode(q, add_special_tokens=False) for q in questions(args.num_requests)
        ]
        warm_up(llm, tok)
        row, outputs[mode] = measure(llm, prompts, params)
        rows.append({"mode": mode, "system_tokens": len(system), **row})
        llm.shutdown()
    for row in rows:
        row["speedup"] = rows[-1]["seconds"] / row["seconds"]
    print_table(rows)
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    on, off = outputs.values()
    if on != off:
        differ = sum(a != b for a, b in zip(on, off))
        print(f"WARNING: greedy outputs differ with the prefix cache on vs off ({differ} requests)")
        return 1
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"system prompt: {rows[0]['system_tokens']} tokens")
    print(
        f"{'mode':<18}{'reqs':>5}{'sent':>8}{'computed':>10}{'share':>8}"
        f"{'hits':>7}{'seconds':>9}{'speedup':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:<18}{r['requests']:>5}{r['prompt_tokens_sent']:>8}"
            f"{r['prompt_tokens_computed']:>10}{r['computed_share']:>8.1%}"
            f"{r['prefix_cache_hits']:>7}{r['seconds']:>9.2f}{r['speedup']:>8.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
