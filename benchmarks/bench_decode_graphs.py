"""Decode step time with CUDA graphs (and eagerly), and where the GPU time of a step goes.

    python benchmarks/bench_decode_graphs.py --batch-sizes 1 256 --context 512 --profile \\
        --out decode_graphs.json

Builds one Worker (default: the llama3-8b preset, dummy bf16 weights drawn on the GPU),
lets it capture its decode graphs, then times full decode steps through
``ModelRunner.execute`` (input preparation, forward, greedy sampling) for each batch size,
first replaying graphs, then eagerly (unless ``--no-eager``), on the same KV pool. Every
sequence starts with ``--context`` cached tokens and grows by one per step.

``--profile`` also records ``--profile-steps`` graph steps per batch size with
torch.profiler and splits their GPU kernel time into GEMM, decode attention, KV-cache
writes, the fused elementwise kernels and everything else (torch's elementwise kernels,
reductions, copies, sampling), per step. Prints tables and writes JSON. Imports only the
worker side of streamkv (torch, cuda-bindings), so an older checkout can run this file too.
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
from streamkv.worker.input_batch import SampleRequest, SeqInput  # noqa: E402
from streamkv.worker.worker import Worker  # noqa: E402

GEMM_MARKS = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "cublas")
FUSED_MARKS = (
    "rms_norm_kernel",
    "add_layer_norm_kernel",
    "rotary_embedding_kernel",
    "silu_and_mul_kernel",
)
CATEGORIES = ("gemm", "attention", "cache_write", "fused_elementwise", "other")


def category(kernel: str) -> str:
    name = kernel.lower()
    if "paged_attention" in name:
        return "attention"
    if "reshape_and_cache" in name:
        return "cache_write"
    if any(m in kernel for m in FUSED_MARKS):
        return "fused_elementwise"
    if any(m in name for m in GEMM_MARKS):
        return "gemm"
    return "other"


def build(args) -> Worker:
    blocks_per_seq = -(
        -(args.context + args.warmup + args.steps + args.profile_steps + 1) // args.block_size
    )
    num_blocks = max(args.batch_sizes) * blocks_per_seq
    config = EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            device="cuda",
            load_format="dummy",
            max_model_len=args.max_model_len,
            quantization=args.quantization,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=num_blocks,
            num_swap_blocks=0,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
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
        SeqInput(
            i,
            [tokens[i]],
            context,
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            SampleRequest(),
        )
        for i in range(batch)
    ]


def run_steps(
    worker: Worker, seqs: list[SeqInput], first_pos: int, steps: int, use_graphs: bool
) -> None:
    runner, kv = worker.runner, worker.cache.device_cache
    for k in range(steps):
        for s in seqs:
            s.start_pos = first_pos + k
        runner.execute(seqs, kv, use_graphs=use_graphs)  # sampling synchronises each step


def time_steps(
    worker: Worker, seqs: list[SeqInput], context: int, warmup: int, steps: int, use_graphs: bool
) -> float:
    """Seconds per decode step (wall clock: the CPU work is what graphs save)."""
    run_steps(worker, seqs, context, warmup, use_graphs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run_steps(worker, seqs, context + warmup, steps, use_graphs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _kernel_time_us(avg) -> float:
    for field in (
        "self_device_time_total",
        "self_cuda_time_total",
        "device_time_total",
        "cuda_time_total",
    ):
        value = getattr(avg, field, None)
        if value:
            return float(value)
    return 0.0


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), as bench_kernels.py."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * n * 10 / start.elapsed_time(end) / 1e6


def kv_bytes_per_step(worker: Worker, batch: int, mean_context: float) -> float:
    """Bytes of K and V the decode attention of one step reads, all layers."""
    c = worker.hf_config
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    es = worker.cache.device_cache[0][0].element_size()
    return 2 * c["num_hidden_layers"] * batch * mean_context * kv_heads * head * es


def profile_steps(worker: Worker, seqs: list[SeqInput], first_pos: int, steps: int) -> dict:
    """GPU kernel time per step by category, and the top kernels, over ``steps`` graph steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps(worker, seqs, first_pos, steps, True)
        torch.cuda.synchronize()
    split = {c: {"ms_per_step": 0.0, "kernels_per_step": 0.0} for c in CATEGORIES}
    top = []
    for avg in prof.key_averages():
        us = _kernel_time_us(avg)
        if us <= 0 or avg.key.startswith(("Memcpy", "Memset")):
            continue
        c = category(avg.key)
        split[c]["ms_per_step"] += us / 1e3 / steps
        split[c]["kernels_per_step"] += avg.count / steps
        top.append(
            {
                "kernel": avg.key[:120],
                "category": c,
                "ms_per_step": us / 1e3 / steps,
                "calls_per_step": avg.count / steps,
            }
        )
    top.sort(key=lambda r: -r["ms_per_step"])
    total = sum(v["ms_per_step"] for v in split.values())
    return {"total_ms_per_step": total, "split": split, "top": top[:15]}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama3-8b", help="a preset or HF directory (dummy weights)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 256])
    ap.add_argument(
        "--context", type=int, default=512, help="cached tokens per sequence at the start"
    )
    ap.add_argument(
        "--steps", type=int, default=50, help="timed decode steps per batch size and mode"
    )
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quantization", default=None, help="fp8: e4m3 weights (docs/kernels.md)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the graphs' largest context bucket (default: the model's context)",
    )
    ap.add_argument("--no-eager", action="store_true", help="time graph replays only")
    ap.add_argument(
        "--profile", action="store_true", help="split the GPU kernel time of graph steps"
    )
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument(
        "--label", default="", help="a name for this run in the JSON (e.g. before / after)"
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if not args.profile:
        args.profile_steps = 0

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    worker = build(args)
    graphs = worker.runner.graphs
    buckets = getattr(graphs, "buckets", [graphs.max_model_len])  # older checkouts: one bound
    graph_count = getattr(graphs, "count", len(graphs.sizes))
    vocab = worker.hf_config["vocab_size"]
    blocks_per_seq = -(
        -(args.context + args.warmup + args.steps + args.profile_steps + 1) // args.block_size
    )
    copy_gbs = copy_bandwidth_gbs() if args.profile else 0.0
    rows = []
    for batch in args.batch_sizes:
        seqs = decode_seqs(batch, args.context, blocks_per_seq, vocab)
        before = graphs.replays
        graph_s = time_steps(worker, seqs, args.context, args.warmup, args.steps, True)
        if graphs.replays - before != args.warmup + args.steps:  # every graph step, no eager one
            raise RuntimeError(
                f"batch {batch}: {graphs.replays - before} replays, "
                f"expected {args.warmup + args.steps}"
            )
        row = {
            "batch": batch,
            "graph_ms_per_step": 1e3 * graph_s,
            "graph_tokens_per_s": batch / graph_s,
        }
        if args.profile:
            first = args.context + args.warmup + args.steps
            p = profile_steps(worker, seqs, first, args.profile_steps)
            # Contexts first + 1 .. first + steps over the profiled steps.
            kv = kv_bytes_per_step(worker, batch, first + (args.profile_steps + 1) / 2)
            p["kv_bytes_per_step"] = kv
            p["attention_vs_copy"] = p["split"]["attention"]["ms_per_step"] / (kv / copy_gbs / 1e6)
            row["profile"] = p
        if not args.no_eager:
            eager_s = time_steps(worker, seqs, args.context, args.warmup, args.steps, False)
            row.update(eager_ms_per_step=1e3 * eager_s, speedup=eager_s / graph_s)
        rows.append(row)

    print(
        f"{args.label + ': ' if args.label else ''}{args.model} "
        f"{args.dtype} on {torch.cuda.get_device_name()}: "
        f"context {args.context}+, {args.steps} steps; "
        f"{graph_count} graphs (batch {graphs.sizes[0]}.."
        f"{graphs.max_batch}, context buckets {buckets}) "
        f"captured in {graphs.capture_seconds:.1f}s, "
        f"{graphs.memory_bytes / 2**20:.0f} MiB"
    )
    print(f"{'batch':>6} {'graph ms':>9} {'eager ms':>9} {'speedup':>8} {'tokens/s':>10}")
    for r in rows:
        eager = (
            f"{r['eager_ms_per_step']:>9.2f} {r['speedup']:>7.2f}x"
            if "speedup" in r
            else f"{'-':>9} {'-':>8}"
        )
        print(
            f"{r['batch']:>6} {r['graph_ms_per_step']:>9.2f} "
            f"{eager} {r['graph_tokens_per_s']:>10.0f}"
        )
    if args.profile:
        print(
            f"\nGPU kernel time per graph step (ms, kernels), {args.profile_steps} profiled steps; "
            f"copy bandwidth {copy_gbs:.0f} GB/s"
        )
        print(f"{'batch':>6} {'total':>7} " + " ".join(f"{c:>22}" for c in CATEGORIES))
        for r in rows:
            p = r["profile"]
            cells = " ".join(
                f"{p['split'][c]['ms_per_step']:>13.3f} ({p['split'][c]['kernels_per_step']:>5.0f})"
                for c in CATEGORIES
            )
            print(f"{r['batch']:>6} {p['total_ms_per_step']:>7.3f} {cells}")
        for r in rows:
            p = r["profile"]
            print(
                f"batch {r['batch']}: attention "
                f"{p['split']['attention']['ms_per_step']:.3f} ms for "
                f"{p['kv_bytes_per_step'] / 1e9:.2f} GB of K/V = "
                f"{p['attention_vs_copy']:.2f}x its time at copy bandwidth"
            )
        for r in rows:
            print(f"\nbatch {r['batch']}: top kernels (ms per step, calls per step)")
            for k in r["profile"]["top"]:
                print(
                    f"  {k['ms_per_step']:>7.3f} {k['calls_per_step']:>6.0f} "
                    f" {k['category']:<17} {k['kernel']}"
                )
    if args.out:
        result = {
            "label": args.label,
            "args": vars(args),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "capture_s": graphs.capture_seconds,
            "graph_memory_mib": graphs.memory_bytes / 2**20,
            "graph_count": graph_count,
            "copy_gbs": copy_gbs,
            "graph_sizes": graphs.sizes,
            "context_buckets": buckets,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
