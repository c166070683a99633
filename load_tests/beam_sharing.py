"""Fig 15's beam-search rows with a real model's logits beside the simulator's random scores,
on the same requests: how much of the KV memory beam search shares depends on how the beams
fork and drop, which the simulator (load_tests/sim.py) draws from one fixed distribution.

Per trace (Alpaca-shaped, ShareGPT) and beam width, one fresh engine runs the first
``--num-requests`` requests of the load harness's trace, all arriving at once, with each
output capped at ``--max-output-len`` (a real model on the CPU): once through the embedded
SmolLM2 (``streamkv.LLM``'s engine, real logits, temperature 0) and once through the
simulated executor with the same model's config, block size and pool. The figure is the
paper's: 1 - blocks in use / blocks that would be in use without sharing, averaged over
the steps (``stats()["sharing_savings"]``).

    python -m load_tests.beam_sharing --num-requests 8 --max-output-len 128 \\
        --json-out docs/paper/sharing/fig15-beam-real.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from load_tests.offline import run_offline
from load_tests.workloads import build

WORKLOADS = ("alpaca", "sharegpt")


def real_engine(args):
    from streamkv.entrypoints.llm import LLM

    llm = LLM(
        args.model,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        num_swap_blocks=0,
        enable_prefix_caching=False,
    )
    return llm.engine, None


def simulated_engine(args):
    from load_tests.sim import SimulatedExecutor, StepCost, VirtualClock
    from streamkv.engine.llm_engine import LLMEngine
    from streamkv.entrypoints.llm import engine_config

    clock = VirtualClock()
    config = engine_config(
        args.model,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        num_swap_blocks=0,
        enable_prefix_caching=False,
    )
    executor = SimulatedExecutor(
        args.model, args.num_kv_blocks, 0, StepCost(block_size=args.block_size), clock, args.seed
    )
    return LLMEngine(config, executor), clock


def measure(make, args, requests) -> dict:
    engine, clock = make(args)
    start = time.perf_counter()
    records, _ = run_offline(engine, requests, [0.0] * len(requests), 3600.0, virtual=clock)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    engine.shutdown()
    return {
        "sharing_savings": stats["sharing_savings"],
        "completed": sum(r.ok for r in records),
        "output_tokens": sum(r.output_tokens for r in records),
        "preemptions": stats["num_preemptions"],
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.beam_sharing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-requests", type=int, default=8, help="per trace and width")
    p.add_argument("--max-output-len", type=int, default=128, help="each output capped at this")
    p.add_argument("--widths", default="2,4,6")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="bench_results/beam_sharing.json")
    args = p.parse_args(argv)
    from streamkv.models.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(args.model))
    rows = []
    print(f"{'trace':<10}{'width':>6}{'real logits':>13}{'random scores':>15}{'real s':>8}")
    for workload in args.workloads.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            requests = build(workload, tok, args.num_requests, args.seed, width, width)
            for r in requests:
                r.output_len = min(r.output_len, args.max_output_len)
            real = measure(real_engine, args, requests)
            sim = measure(simulated_engine, args, requests)
            rows.append(
                {
                    "workload": workload,
                    "beam_width": width,
                    "requests": len(requests),
                    "mean_prompt": sum(r.prompt_len for r in requests) / len(requests),
                    "mean_output": sum(r.output_len for r in requests) / len(requests),
                    "real": real,
                    "random": sim,
                }
            )
            print(
                f"{workload:<10}{width:>6}{real['sharing_savings']:>13.1%}{sim['sharing_savings']:>15.1%}"
                f"{real['seconds']:>8.1f}",
                flush=True,
            )
            _write(args.json_out, {"args": vars(args), "rows": rows})
    return 0


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
