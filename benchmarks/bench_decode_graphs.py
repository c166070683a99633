"""Decode steps per second with CUDA graphs vs eager, in one run on one GPU.

    python benchmarks/bench_decode_graphs.py --out decode_graphs.json

Builds one Worker (default: the llama3-8b preset, dummy bf16 weights drawn on the GPU),
lets it capture its decode graphs, then times full decode steps through
``ModelRunner.execute`` (input preparation, forward, greedy sampling) for each batch size,
first replaying graphs, then eagerly, on the same KV pool. Every sequence starts with
``--context`` cached tokens and grows by one per step. Prints a table and writes JSON.
Imports only the worker side of streamkv (torch, cuda-bindings): no server dependencies.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from streamkv.worker.messages import SampleRequest, SeqInput  # noqa: E402
from streamkv.worker.worker import Worker  # noqa: E402


def build(args) -> Worker:
    blocks_per_seq = -(-(args.context + args.warmup + args.steps + 1) // args.block_size)
    num_blocks = max(args.batch_sizes) * blocks_per_seq
    config = EngineConfig(
        model=ModelConfig(args.model, args.dtype, "cuda", "dummy", max_model_len=args.max_model_len),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=num_blocks, num_swap_blocks=0),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes)),
    )
    config.verify()
    worker = Worker(config)
    worker.init_cache(num_blocks, 0)  # captures the decode graphs
    return worker


def decode_seqs(batch: int, context: int, blocks_per_seq: int, vocab: int) -> list[SeqInput]:
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, vocab, (batch,), generator=gen).tolist()
    return [
        SeqInput(i, [tokens[i]], context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                 SampleRequest())
        for i in range(batch)
    ]


def time_steps(worker: Worker, seqs: list[SeqInput], context: int, warmup: int, steps: int,
               use_graphs: bool) -> float:
    """Seconds per decode step (wall clock: the CPU work is what graphs save)."""
    runner, kv = worker.runner, worker.cache.device_cache
    for k in range(warmup + steps):
        if k == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        for s in seqs:
            s.start_pos = context + k
        runner.execute(seqs, kv, use_graphs=use_graphs)  # sampling synchronises each step
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", help="a preset or HF directory (dummy weights)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence at the start")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size and mode")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the graphs' context bound (default: the model's); decode partitions cover it")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    worker = build(args)
    graphs = worker.runner.graphs
    vocab = worker.hf_config["vocab_size"]
    blocks_per_seq = -(-(args.context + args.warmup + args.steps + 1) // args.block_size)
    rows = []
    for batch in args.batch_sizes:
        seqs = decode_seqs(batch, args.context, blocks_per_seq, vocab)
        before = graphs.replays
        graph_s = time_steps(worker, seqs, args.context, args.warmup, args.steps, True)
        eager_s = time_steps(worker, seqs, args.context, args.warmup, args.steps, False)
        if graphs.replays - before != args.warmup + args.steps:  # every graph step, no eager one
            raise RuntimeError(f"batch {batch}: {graphs.replays - before} replays, "
                               f"expected {args.warmup + args.steps}")
        rows.append({
            "batch": batch,
            "graph_steps_per_s": 1 / graph_s,
            "eager_steps_per_s": 1 / eager_s,
            "graph_ms_per_step": 1e3 * graph_s,
            "eager_ms_per_step": 1e3 * eager_s,
            "graph_tokens_per_s": batch / graph_s,
            "eager_tokens_per_s": batch / eager_s,
            "speedup": eager_s / graph_s,
        })

    print(f"{args.model} {args.dtype} on {torch.cuda.get_device_name()}: context {args.context}+, "
          f"{args.steps} steps; {len(graphs.sizes)} graphs (batch {graphs.sizes[0]}..{graphs.max_batch}, "
          f"contexts up to {graphs.max_model_len}) captured in {graphs.capture_seconds:.1f}s, "
          f"{graphs.memory_bytes / 2**20:.0f} MiB")
    print(f"{'batch':>6} {'graph steps/s':>14} {'eager steps/s':>14} {'graph ms':>9} {'eager ms':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['graph_steps_per_s']:>14.1f} {r['eager_steps_per_s']:>14.1f} "
              f"{r['graph_ms_per_step']:>9.2f} {r['eager_ms_per_step']:>9.2f} {r['speedup']:>7.2f}x")
    if args.out:
        result = {
            "args": vars(args),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "capture_s": graphs.capture_seconds,
            "graph_memory_mib": graphs.memory_bytes / 2**20,
            "graph_sizes": graphs.sizes,
            "graph_max_context": graphs.max_model_len,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
