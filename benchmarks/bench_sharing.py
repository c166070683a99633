"""Memory sharing: savings and throughput of parallel sampling (n = 2, 4, 6) and beam search
(width 2, 4, 6) on ShareGPT- and Alpaca-like prompts, and shared-prefix throughput with the
prefix cache on vs off, all in one run (the paper's Figures 14-16). Prints tables, writes JSON.

    python benchmarks/bench_sharing.py --num-requests 16 --max-output-len 64

Savings is the paper's metric: 1 - physical blocks in use / blocks that would be in use
without sharing, time-averaged over the steps of the run.

With --simulate (the paper's Fig 15, docs/paper.md) the engine runs on the step-time model
(load_tests/sim.py) with OPT-13B's shape and its A100 KV pool, on the load harness's full
ShareGPT and Alpaca-shaped traces (outputs not capped), requests arriving at --request-rate;
only the savings table is made (throughput is Fig 14's sweep):

    python benchmarks/bench_sharing.py --simulate --num-requests 200 --request-rate 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FEW_SHOT = [
    ("Translate to French: cheese", "fromage"),
    ("Translate to French: bread", "pain"),
    ("Translate to French: apple", "pomme"),
    ("Translate to French: water", "eau"),
    ("Translate to French: house", "maison"),
]
_QUESTIONS = [
    "dog",
    "cat",
    "car",
    "tree",
    "book",
    "sun",
    "moon",
    "river",
    "city",
    "friend",
    "school",
    "window",
    "garden",
    "music",
    "train",
    "flower",
]


def few_shot_prefix(tok, shots: int, target_tokens: int) -> list[int]:
    """A shared instruction + ``shots`` examples, padded with guidance to ~target tokens."""
    text = "You are a careful translator. Translate each English word into French. "
    while len(tok.encode(text)) < target_tokens - 12 * shots:
        text += "Keep answers short, use lowercase, and give only the French word. "
    for q, a in _FEW_SHOT[:shots]:
        text += f"\n{q}\nAnswer: {a}"
    return tok.encode(text)


def run(llm, prompts, params) -> tuple[float, dict, int]:
    from streamkv.engine.stats import EngineStats

    engine = llm.engine
    engine.stats_ = EngineStats(engine.block_manager, engine.scheduler)  # fresh time averages
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return elapsed, llm.stats(), tokens


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--num-requests", type=int, default=16, help="per workload (and per mode with --simulate)"
    )
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="default 4096; with --simulate 983 (OPT-13B's KV pool on an A100-40GB, docs/paper.md)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only-prefix", action="store_true", help="skip the n / beam sweep")
    ap.add_argument("--json-out", default="bench_results/sharing.json")
    sim = ap.add_argument_group("--simulate (Fig 15)")
    sim.add_argument(
        "--simulate", action="store_true", help="the step-time model instead of a model"
    )
    sim.add_argument(
        "--request-rate", type=float, default=2.0, help="Poisson arrivals, req/s (virtual clock)"
    )
    sim.add_argument(
        "--sim-model", default="opt-13b", help="the shape whose config the simulated engine reads"
    )
    sim.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    if args.simulate:
        args.num_kv_blocks = args.num_kv_blocks or 983
        return simulate(args)
    args.num_kv_blocks = args.num_kv_blocks or 4096

    from benchmarks.workloads import alpaca_requests, sharegpt_requests
    from streamkv import SamplingParams
    from streamkv.entrypoints.llm import LLM

    common = dict(
        device=args.device,
        load_format=args.load_format,
        num_kv_blocks=args.num_kv_blocks,
        num_swap_blocks=0,
    )
    llm = LLM(args.model, enable_prefix_caching=False, **common)
    tok = llm.get_tokenizer()
    workloads = {
        "sharegpt": sharegpt_requests(
            tok, args.num_requests, args.seed, max_prompt=512, max_output=args.max_output_len
        ),
        "alpaca": alpaca_requests(tok, args.num_requests, args.seed),
    }
    for reqs in workloads.values():
        for r in reqs:
            r.output_len = min(r.output_len, args.max_output_len)
    run(llm, [workloads["alpaca"][0].prompt_ids], SamplingParams(max_tokens=4))  # warm-up

    rows = []
    for name, reqs in [] if args.only_prefix else workloads.items():
        prompts = [r.prompt_ids for r in reqs]
        for kind, width in [("parallel n", w) for w in (1, 2, 4, 6)] + [
            ("beam width", w) for w in (2, 4, 6)
        ]:
            if kind == "parallel n":
                params = [
                    SamplingParams(
                        n=width, temperature=1.0, seed=i, ignore_eos=True, max_tokens=r.output_len
                    )
                    for i, r in enumerate(reqs)
                ]
            else:
                params = [
                    SamplingParams(
                        n=width,
                        best_of=width,
                        use_beam_search=True,
                        temperature=0,
                        ignore_eos=True,
                        max_tokens=r.output_len,
                    )
                    for r in reqs
                ]
            t, stats, tokens = run(llm, prompts, params)
            rows.append(
                {
                    "workload": name,
                    "mode": kind,
                    "width": width,
                    "seconds": t,
                    "output_tok_s": tokens / t,
                    "sharing_savings": stats["sharing_savings"],
                    "kv_utilization": stats["kv_utilization"],
                    "peak_blocks": stats["peak_kv_blocks_used"],
                }
            )
            print(
                f"{name:<9}{kind:<12}{width:>3}  {t:7.1f}s  {tokens / t:8.1f} "
                f"tok/s  savings {stats['sharing_savings']:.1%}",
                flush=True,
            )

    prefix_rows = []
    cached = LLM(args.model, enable_prefix_caching=True, **common)
    for shots, target in ((1, 80), (5, 340)):
        prefix = few_shot_prefix(tok, shots, target)
        prompts = [
            prefix + tok.encode(f"\nTranslate to French: {q}\nAnswer:", add_special_tokens=False)
            for q in (_QUESTIONS * 4)[: args.num_requests * 2]
        ]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        result = {"shots": shots, "prefix_tokens": len(prefix), "requests": len(prompts)}
        for label, engine_llm in (("off", llm), ("on", cached)):
            bm = engine_llm.engine.block_manager
            bm.device.reset_prefix_cache()
            # The shared prefix has been served once before (a system prompt in steady
            # state): requests arriving in the same step cannot hit blocks that are still
            # being computed.
            engine_llm.generate(
                prompt_token_ids=[prefix], sampling_params=SamplingParams(max_tokens=1)
            )
            queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
            t, stats, tokens = run(engine_llm, prompts, params)
            result[f"seconds_{label}"] = t
            result[f"req_s_{label}"] = len(prompts) / t
            if label == "on":
                result["hit_rate"] = (bm.prefix_cache_hits - hits) / max(
                    bm.prefix_cache_queries - queries, 1
                )
        result["speedup"] = result["seconds_off"] / result["seconds_on"]
        prefix_rows.append(result)

    print(
        f"\n{'workload':<10}{'mode':<12}{'w':>3}{'seconds':>9}"
        f"{'out tok/s':>11}{'savings':>9}{'kv util':>9}{'peak blk':>9}"
    )
    for r in rows:
        print(
            f"{r['workload']:<10}{r['mode']:<12}{r['width']:>3}{r['seconds']:>9.1f}{r['output_tok_s']:>11.1f}"
            f"{r['sharing_savings']:>9.1%}{r['kv_utilization']:>9.1%}{r['peak_blocks']:>9}"
        )
    print(
        f"\n{'prefix':<10}{'tokens':>7}{'reqs':>6}{'off s':>8}"
        f"{'on s':>8}{'speedup':>9}{'hit rate':>10}"
    )
    for r in prefix_rows:
        print(
            f"{r['shots']}-shot{'':<4}{r['prefix_tokens']:>7}{r['requests']:>6}{r['seconds_off']:>8.1f}"
            f"{r['seconds_on']:>8.1f}{r['speedup']:>8.2f}x{r['hit_rate']:>10.1%}"
        )
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"args": vars(args), "sharing": rows, "prefix": prefix_rows}, f, indent=2)
    return 0


def simulate(args) -> int:
    """Fig 15 on the simulated engine: savings per (trace, mode, width), a fresh engine each."""
    from load_tests.arrivals import arrival_times
    from load_tests.offline import run_offline
    from load_tests.sim import SimulatedExecutor, StepCost, VirtualClock
    from load_tests.workloads import build
    from streamkv.engine.llm_engine import LLMEngine
    from streamkv.entrypoints.llm import engine_config
    from streamkv.models.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    rows = []
    for workload in ("alpaca", "sharegpt"):
        for kind, width in [("parallel n", w) for w in (2, 4, 6)] + [
            ("beam width", w) for w in (2, 4, 6)
        ]:
            n, beam = (width, 0) if kind == "parallel n" else (width, width)
            reqs = build(workload, tok, args.num_requests, args.seed, n, beam)
            clock = VirtualClock()
            config = engine_config(
                args.sim_model,
                block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks,
                num_swap_blocks=0,
                max_model_len=2048,
                enable_prefix_caching=False,
            )
            executor = SimulatedExecutor(
                args.sim_model,
                args.num_kv_blocks,
                0,
                StepCost(block_size=args.block_size),
                clock,
                args.seed,
            )
            engine = LLMEngine(config, executor)
            arrivals = arrival_times(len(reqs), args.request_rate, 1.0, seed=args.seed)
            records, _ = run_offline(engine, reqs, arrivals, 3600.0, lambda rec: None, clock)
            stats = engine.stats()
            row = {
                "workload": workload,
                "mode": kind,
                "width": width,
                "requests": len(reqs),
                "completed": sum(1 for r in records if not r.incomplete and not r.error),
                "sharing_savings": stats["sharing_savings"],
                "avg_batched_requests": stats["avg_batched_requests"],
                "preemptions": stats["num_preemptions"],
            }
            rows.append(row)
            engine.shutdown()
            print(
                f"{workload:<9}{kind:<12}{width:>3}  savings "
                f"{row['sharing_savings']:6.1%}  batched "
                f"{row['avg_batched_requests']:6.1f}  completed {row['completed']}/{len(reqs)}",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"args": vars(args), "simulated": True, "sharing": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
