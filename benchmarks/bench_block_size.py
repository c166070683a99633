"""The paper's Fig 18a: paged decode attention at every block size against attention over
the same K/V laid out contiguously, on the paper's shapes (OPT-13B: 40 heads x 128 dims,
multi-head, fp16; batch 8 and 32; contexts 64-256), on one device.

- paged: ``streamkv.kernels.ops.paged_attention_decode``, i.e. the CUDA kernel of
  kernels_cu/paged_attention.cu on a GPU (block sizes 1, 2, 4, ..., 256:
  ``streamkv.config.BLOCK_SIZES``), the pure-torch reference (gather, then matmul; any block
  size) on a CPU;
  block tables are random permutations of a pool twice the size needed, as after churn.
- contiguous: torch SDPA over [batch, heads, context, dim] copies of exactly the same K/V
  (flash attention on a GPU).

GPU times are CUDA-graph replays (benchmarks/bench_kernels.py's ``gpu_time_ms``), inputs
rotated so one replay touches more than the L2; CPU times are the wall-time median. Then a
least-squares fit of the paged kernel's time over the rows, a + b x tokens + c x blocks,
gives the per-block cost; times ``--layers`` it is the simulator's ``--sim-block-us``
(load_tests/sim.py; load_tests/fit_steps.py takes it as ``--block-us``).

    python benchmarks/bench_block_size.py --json-out kernel_block_sizes.json
    python benchmarks/bench_block_size.py --tiny --device cpu        # the torch path, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamkv.config import BLOCK_SIZES  # noqa: E402  (the sizes the engine and its kernels serve)
from streamkv.kernels import ops, reference  # noqa: E402

L2_ROTATE_BYTES = 256 << 20
MAX_SETS = 16
TINY = {
    "heads": 4,
    "head_size": 32,
    "batch_sizes": "2",
    "contexts": "16,40",
    "block_sizes": "1,4,16,64",
}


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def make_set(batch: int, ctx: int, block: int, heads: int, head: int, dtype, device, gen) -> dict:
    """One random pool, block tables and query, and the contiguous copy of the same K/V."""
    per_seq = -(-ctx // block)
    num_blocks = 2 * batch * per_seq
    shape = (num_blocks, heads, block, head)
    # Drawn on the device: a row's pools are up to ~0.5 GB, too slow to draw on the host.
    k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)[: batch * per_seq].to(
        torch.int32
    )
    tables = perm.view(batch, per_seq)
    q = torch.randn((batch, heads, head), generator=gen, device=device, dtype=dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    kc = reference.gather_kv(k, tables, per_seq)[:, :, :ctx].contiguous()
    vc = reference.gather_kv(v, tables, per_seq)[:, :, :ctx].contiguous()
    return {"q": q, "k": k, "v": v, "tables": tables, "lens": lens, "kc": kc, "vc": vc}


def paged(s: dict, scale: float, ctx: int) -> torch.Tensor:
    return ops.paged_attention_decode(s["q"], s["k"], s["v"], s["tables"], s["lens"], scale, ctx)


def contiguous(s: dict, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(s["q"][:, :, None, :], s["kc"], s["vc"], scale=scale)[
        :, :, 0
    ]


def time_us(fn, iters: int, cuda: bool) -> float:
    if cuda:
        from benchmarks.bench_kernels import gpu_time_ms

        return gpu_time_ms(fn, iters) * 1e3
    for _ in range(3):  # thread pools, allocator
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def bench_row(batch: int, ctx: int, block: int, args, device, dtype, gen) -> dict:
    cuda = device.type == "cuda"
    one = make_set(batch, ctx, block, args.heads, args.head_size, dtype, device, gen)
    bytes_per_set = 2 * one["kc"].numel() * one["kc"].element_size()
    n_sets = min(MAX_SETS, max(1, math.ceil(L2_ROTATE_BYTES / bytes_per_set))) if cuda else 1
    sets = [one] + [
        make_set(batch, ctx, block, args.heads, args.head_size, dtype, device, gen)
        for _ in range(n_sets - 1)
    ]
    scale = args.head_size**-0.5
    out, ref = paged(one, scale, ctx).float(), contiguous(one, scale).float()
    err = ((out - ref).norm() / ref.norm()).item()
    paged_us = time_us(lambda: [paged(s, scale, ctx) for s in sets], args.iters, cuda) / n_sets
    contiguous_us = time_us(lambda: [contiguous(s, scale) for s in sets], args.iters, cuda) / n_sets
    return {
        "batch": batch,
        "context": ctx,
        "block_size": block,
        "blocks": batch * -(-ctx // block),
        "tokens": batch * ctx,
        "paged_us": paged_us,
        "contiguous_us": contiguous_us,
        "paged_over_contiguous": paged_us / contiguous_us,
        "rel_err": err,
        "sets": n_sets,
    }


def fit_block_cost(rows: list[dict]) -> dict | None:
    """paged_us = a + b x tokens + c x blocks over every row (needs rows at several block sizes)."""
    if len({r["block_size"] for r in rows}) < 2 or len(rows) < 4:
        return None
    x = np.array([(1.0, r["tokens"], r["blocks"]) for r in rows])
    y = np.array([r["paged_us"] for r in rows])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    rel = (x @ np.array([a, b, c]) - y) / y
    return {
        "fixed_us": a,
        "per_token_us": b,
        "per_block_us": c,
        "rms_rel_err": float(np.sqrt((rel**2).mean())),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default float16 on cuda, float32 on cpu")
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--contexts", default="64,128,192,256")
    p.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    p.add_argument(
        "--layers",
        type=int,
        default=40,
        help="the model's layers: per-step cost = per-layer x this",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed repeats (default 50 on cuda, 5 on cpu)"
    )
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU check: " + str(TINY))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="bench_results/block_size.json")
    args = p.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("float16" if cuda else "float32"))
    args.iters = args.iters or (50 if cuda else 5)
    blocks = parse_ints(args.block_sizes)
    if cuda and (bad := [b for b in blocks if b not in BLOCK_SIZES]):
        raise SystemExit(
            f"error: the CUDA decode kernel serves block sizes {BLOCK_SIZES}, not {bad}"
        )
    gen = torch.Generator(device=device).manual_seed(args.seed)
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({os.cpu_count()} cores)"
    paged_impl = (
        "CUDA kernel (kernels_cu/paged_attention.cu)" if cuda else "torch reference (ops.py)"
    )
    print(
        f"{name}: paged = {paged_impl}; contiguous = torch "
        f"SDPA; {args.heads} heads x {args.head_size}, {dtype}"
    )
    print(
        f"{'batch':>5}{'ctx':>5}{'block':>6}{'paged us':>10}"
        f"{'contig us':>11}{'ratio':>7}{'rel err':>9}"
    )
    rows = []
    for batch in parse_ints(args.batch_sizes):
        for ctx in parse_ints(args.contexts):
            for block in blocks:
                row = bench_row(batch, ctx, block, args, device, dtype, gen)
                rows.append(row)
                print(
                    f"{batch:>5}{ctx:>5}{block:>6}{row['paged_us']:>10.1f}{row['contiguous_us']:>11.1f}"
                    f"{row['paged_over_contiguous']:>7.2f}{row['rel_err']:>9.1e}",
                    flush=True,
                )
    fit = fit_block_cost(rows)
    if fit is not None:
        fit["sim_block_us"] = fit["per_block_us"] * args.layers
        print(
            f"\nper layer: {fit['fixed_us']:.2f} us + {fit['per_token_us'] * 1e3:.3f} ns x token + "
            f"{fit['per_block_us'] * 1e3:.2f} ns x block (RMS error {fit['rms_rel_err']:.1%}); "
            f"x {args.layers} layers: --sim-block-us {fit['sim_block_us']:.4g}"
        )
    result = {
        "device": name,
        "paged_impl": paged_impl,
        "contiguous_impl": "torch SDPA",
        "dtype": str(dtype),
        "kernel_block_sizes": list(BLOCK_SIZES),
        "args": vars(args),
        "rows": rows,
        "block_cost_fit": fit,
    }
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if all(r["rel_err"] < 2e-2 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
