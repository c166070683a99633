"""Offline throughput: streamkv vs transformers' generate with request-level static batching
(the paper's FasterTransformer-style baseline: a batch waits for its longest request), on the
same ShareGPT requests in the same run. Prints a table and writes JSON.

    python benchmarks/bench_throughput.py --num-requests 48 --json-out bench_results/throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_streamkv(llm, requests) -> float:
    from streamkv import SamplingParams

    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[r.prompt_ids for r in requests], sampling_params=params)
    elapsed = time.perf_counter() - start
    for r, o in zip(requests, outs):
        assert len(o.outputs[0].token_ids) == r.output_len
    return elapsed


def run_static_batching(model, requests, batch_size: int, pad_id: int) -> float:
    """transformers generate, FCFS batches of ``batch_size``, left-padded; each batch runs
    until its longest requested output (EOS suppressed, as with ignore_eos)."""
    import torch

    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[j, width - len(r.prompt_ids) :] = 1
        longest = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False,
                max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--max-output-len", type=int, default=256, help="cap on a request's output length")
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--baseline-batch-sizes", default="8,16", help="comma list; the best is the baseline")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--json-out", default="bench_results/throughput.json")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.workloads import sharegpt_requests
    from streamkv.entrypoints.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(max_num_seqs=args.max_num_seqs, num_kv_blocks=4096, num_swap_blocks=0)
    tok = llm.get_tokenizer()
    requests = sharegpt_requests(tok, args.num_requests, args.seed, max_prompt=args.max_prompt_len,
                                 max_output=args.max_output_len)
    out_tokens = sum(r.output_len for r in requests)
    in_tokens = sum(len(r.prompt_ids) for r in requests)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.executor.model_dir), dtype=torch.float32).eval()

    run_streamkv(llm, requests[:4])  # warm-up
    rows = []
    t = run_streamkv(llm, requests)
    rows.append({"system": "streamkv", "batch": f"continuous (<= {args.max_num_seqs})", "seconds": t, "output_tok_s": out_tokens / t})
    for bs in [int(x) for x in args.baseline_batch_sizes.split(",")]:
        t = run_static_batching(hf, requests, bs, tok.pad_token_id or 0)
        rows.append({"system": "transformers static", "batch": str(bs), "seconds": t, "output_tok_s": out_tokens / t})
    best_base = max(r["output_tok_s"] for r in rows[1:])
    ratio = rows[0]["output_tok_s"] / best_base

    print(f"\n{len(requests)} ShareGPT requests: {in_tokens} prompt tokens, {out_tokens} output tokens "
          f"(output cap {args.max_output_len}), torch threads {torch.get_num_threads()}")
    print(f"{'system':<22}{'batch':<22}{'seconds':>10}{'out tok/s':>12}")
    for r in rows:
        print(f"{r['system']:<22}{r['batch']:<22}{r['seconds']:>10.1f}{r['output_tok_s']:>12.1f}")
    print(f"streamkv / best static baseline = {ratio:.2f}x")
    result = {"args": vars(args), "num_requests": len(requests), "prompt_tokens": in_tokens,
              "output_tokens": out_tokens, "rows": rows, "ratio_vs_best_baseline": ratio,
              "stats": llm.stats()}
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
