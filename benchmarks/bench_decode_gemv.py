"""The decode GEMV against cuBLAS, per projection and in whole batch-1 decode steps.

    python benchmarks/bench_decode_gemv.py --out decode_gemv.json
    python benchmarks/bench_decode_gemv.py --no-shapes --variants cublas gemv+pdl   # steps only

Shapes: every llama3-8b projection at M = 1, 2, 4 rows, each variant captured in a CUDA
graph of back-to-back calls over enough weight copies that none is read from L2; µs per
call and the weight bytes it read per second, against a device-to-device copy.

Steps: for each variant (``VARIANTS``: cuBLAS, the GEMV without and with programmatic
dependent launch) one Worker (llama3-8b, dummy bf16 weights) captures its batch-1 graphs,
then ``ModelRunner.execute`` times graph steps (inputs, replay, greedy sampling) and
torch.profiler splits their GPU time (bench_decode_graphs.py's categories), sums the idle
time between kernels, and lists one step's kernels in order. Variants are switched by
replacing ``gemv.DEFAULT`` and ``launch.PDL`` before each Worker is built.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import bench_decode_graphs as bdg  # noqa: E402
from streamkv.kernels import fused, gemv, launch  # noqa: E402

# name: (GEMV config, fused kernels launched with PDL)
VARIANTS = {
    "cublas": (gemv.GemvConfig(max_rows=0, pdl=False), False),
    "cublas+pdl": (gemv.GemvConfig(max_rows=0, pdl=False), True),
    "gemv": (gemv.GemvConfig(pdl=False), False),
    "gemv+pdl": (gemv.GemvConfig(pdl=True), True),
    "gemv+pdl-gemv-only": (gemv.GemvConfig(pdl=True), False),
    "gemv-u8+pdl": (gemv.GemvConfig(unroll=8, pdl=True), True),
    "gemv-s8+pdl": (gemv.GemvConfig(split_k=8, pdl=True), True),
    "gemv-w4+pdl": (gemv.GemvConfig(warps=4, pdl=True), True),
    "gemv-s1+pdl": (gemv.GemvConfig(split_k=1, pdl=True), True),
}
# llama3-8b: (name, output columns, k, silu-paired)
SHAPES = [
    ("qkv", 6144, 4096, False),
    ("o", 4096, 4096, False),
    ("gate_up+silu", 14336, 4096, True),
    ("down", 4096, 14336, False),
    ("lm_head", 128256, 4096, False),
]
L2_BYTES = 60 << 20


def _call(variant: str, x, w, silu: bool):
    config, _ = VARIANTS[variant]
    if silu:
        return gemv.linear_silu_and_mul(x, w, None, config)
    return gemv.linear(x, w, None, config)


def time_shape(variant: str, m: int, n: int, k: int, silu: bool, weights, x) -> dict:
    calls = max(8, len(weights))
    _call(variant, x, weights[0], silu)  # compile, load
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            _call(variant, x, weights[i % len(weights)], silu)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    us = sorted(times)[len(times) // 2]
    ref = F.linear(x, weights[0])
    ref = fused.silu_and_mul(ref) if silu else ref
    out = _call(variant, x, weights[0], silu)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    return {
        "us": us,
        "gbs": weights[0].numel() * weights[0].element_size() / us / 1e3,
        "rel_err_vs_cublas": err,
    }


def bench_shapes(args) -> list[dict]:
    rows = []
    for name, n, k, silu in SHAPES:
        wn = 2 * n if silu else n
        nbytes = wn * k * 2
        copies = max(2, -(-4 * L2_BYTES // nbytes))
        weights = [
            torch.randn(wn, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for v in args.shape_variants:
                try:
                    r = time_shape(v, m, n, k, silu, weights, x)
                except Exception as e:  # a variant that fails must not hide the others
                    r = {"error": repr(e)[:200]}
                rows.append({"shape": name, "m": m, "variant": v, **r})
                print("shape", rows[-1], flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def kernel_sequence(prof, steps: int) -> tuple[list[dict], float, float]:
    """One middle step's kernels in order (name, µs, idle µs before it), and per step: the
    idle time between kernels inside steps, and the time kernels overlapped (PDL)."""
    events = [
        e
        for e in prof.events()
        if getattr(e, "device_type", None) is not None
        and str(e.device_type).endswith("CUDA")
        and not e.name.startswith(("Memcpy", "Memset"))
    ]
    events.sort(key=lambda e: e.time_range.start)
    per_step = len(events) // steps
    idle = overlap = 0.0
    for prev, cur in zip(events, events[1:]):
        gap = cur.time_range.start - prev.time_range.end
        if gap < 0:
            overlap -= gap
        elif gap < 100:  # longer: host work between steps
            idle += gap
    step = events[per_step : 2 * per_step] if steps > 1 else events
    seq = []
    for i, e in enumerate(step):
        gap = e.time_range.start - step[i - 1].time_range.end if i else 0.0
        seq.append(
            {"kernel": e.name[:90], "us": e.time_range.end - e.time_range.start, "gap_us": gap}
        )
    return seq, idle / steps / 1e3, overlap / steps / 1e3


def bench_steps(args) -> list[dict]:
    rows = []
    saved = (gemv.DEFAULT, launch.PDL)
    for name in args.variants:
        config, fused_pdl = VARIANTS[name]
        gemv.DEFAULT, launch.PDL = config, fused_pdl
        try:
            ns = SimpleNamespace(
                model=args.model,
                dtype="bfloat16",
                batch_sizes=args.batch_sizes,
                context=args.context,
                warmup=5,
                steps=args.steps,
                profile_steps=args.profile_steps,
                block_size=16,
                max_model_len=None,
            )
            t0 = time.perf_counter()
            worker = bdg.build(ns)
            build_s = time.perf_counter() - t0
            blocks = -(-(args.context + 5 + args.steps + args.profile_steps + 1) // 16)
            by_batch = {}
            for batch in args.batch_sizes:
                seqs = bdg.decode_seqs(batch, args.context, blocks, worker.hf_config["vocab_size"])
                by_batch[batch] = 1e3 * bdg.time_steps(
                    worker, seqs, args.context, 5, args.steps, True
                )
            seqs = bdg.decode_seqs(1, args.context, blocks, worker.hf_config["vocab_size"])
            ms = by_batch.get(1, float("nan"))
            first = args.context + 5 + args.steps
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                bdg.run_steps(worker, seqs, first, args.profile_steps, True)
                torch.cuda.synchronize()
            split = {c: {"ms_per_step": 0.0, "kernels_per_step": 0.0} for c in bdg.CATEGORIES}
            for avg in prof.key_averages():
                us = bdg._kernel_time_us(avg)
                if us <= 0 or avg.key.startswith(("Memcpy", "Memset")):
                    continue
                c = bdg.category(avg.key)
                split[c]["ms_per_step"] += us / 1e3 / args.profile_steps
                split[c]["kernels_per_step"] += avg.count / args.profile_steps
            seq, idle, overlap = kernel_sequence(prof, args.profile_steps)
            row = {
                "variant": name,
                "graph_ms_per_step": ms,
                "ms_by_batch": by_batch,
                "build_s": build_s,
                "split": split,
                "gpu_ms": sum(v["ms_per_step"] for v in split.values()),
                "idle_ms": idle,
                "overlap_ms": overlap,
                "sequence": seq,
            }
            del worker
        except Exception as e:
            row = {"variant": name, "error": repr(e)[:300]}
        finally:
            gemv.DEFAULT, launch.PDL = saved
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        brief = {k: v for k, v in row.items() if k not in ("sequence", "split")}
        print(
            "step",
            brief,
            {c: round(v["ms_per_step"], 3) for c, v in row.get("split", {}).items()},
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1],
        help="timed per variant; the profile is of batch 1",
    )
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["cublas", "cublas+pdl", "gemv", "gemv+pdl"],
        choices=list(VARIANTS),
    )
    ap.add_argument("--shape-variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--no-shapes", action="store_true")
    ap.add_argument("--no-steps", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(args),
    }
    result["copy_gbs"] = bdg.copy_bandwidth_gbs()
    print(f"copy bandwidth {result['copy_gbs']:.0f} GB/s (read + write)", flush=True)
    if not args.no_steps:
        result["steps"] = bench_steps(args)
    if not args.no_shapes:
        with torch.inference_mode():
            result["shapes"] = bench_shapes(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"\n{'variant':<22} {'b1 ms':>8} {'gpu ms':>7} {'idle':>6} "
        f"{'overlap':>7}  gemm / attention / fused / other"
        "   | ms per step by batch"
    )
    for r in result.get("steps", []):
        if "error" in r:
            print(f"{r['variant']:<22} error {r['error']}")
            continue
        s = r["split"]
        print(
            f"{r['variant']:<22} {r['graph_ms_per_step']:>8.3f} "
            f"{r['gpu_ms']:>7.3f} {r['idle_ms']:>6.3f} "
            f"{r['overlap_ms']:>7.3f}  {s['gemm']['ms_per_step']:.3f} "
            f"({s['gemm']['kernels_per_step']:.0f}) / "
            f"{s['attention']['ms_per_step']:.3f} / {s['fused_elementwise']['ms_per_step']:.3f} "
            f"({s['fused_elementwise']['kernels_per_step']:.0f}) / {s['other']['ms_per_step']:.3f} "
            f"({s['other']['kernels_per_step']:.0f})   | "
            + " ".join(f"b{b}: {ms:.3f}" for b, ms in r["ms_by_batch"].items())
        )
    if result.get("shapes"):
        print(
            f"\n{'shape':<14} {'m':>2} "
            + " ".join(f"{v[:14]:>14}" for v in args.shape_variants)
            + "   (µs / GB/s)"
        )
        keys = sorted(
            {(r["shape"], r["m"]) for r in result["shapes"]},
            key=lambda t: ([s[0] for s in SHAPES].index(t[0]), t[1]),
        )
        for shape, m in keys:
            cells = []
            for v in args.shape_variants:
                r = next(
                    x
                    for x in result["shapes"]
                    if x["shape"] == shape and x["m"] == m and x["variant"] == v
                )
                cells.append(f"{r['us']:>7.1f}/{r['gbs']:>6.0f}" if "us" in r else f"{'error':>14}")
            print(f"{shape:<14} {m:>2} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
