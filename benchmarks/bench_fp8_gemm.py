"""The fp8 weights' products at decode batch sizes, against bf16 and the weight-read floor.

    python benchmarks/bench_fp8_gemm.py --rows 8 32 64 128 256 512 --out fp8_gemm.json

For llama3-8b's four projections of one layer (qkv, o, gate_up, down), at each row count,
the GPU time (10 calls captured as one CUDA graph, bench_kernels.gpu_time_ms's median of
--repeats replays) of:

- ``bf16``: the unquantized product (``gemv.linear``, what a bf16 model runs);
- ``rowwise``: ``torch._scaled_mm`` with per-token and per-channel scales in the kernel;
- ``per_tensor``: ``_scaled_mm`` with unit per-tensor scales into fp32, then
  ``fused_cuda.scale_fp8_product`` (the same scales and result): the path ``fp8_linear``
  takes up to ``layers/fp8.SMALL_BATCH`` rows;
- ``fp8_linear``: the layer's whole product as the model runs it (the per-token
  quantization kernel, then whichever of the two the row count picks).

The floor is the fp8 weight bytes at the device-to-device copy bandwidth measured in the
same run. Prints a table (us per layer) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_graphs import copy_bandwidth_gbs  # noqa: E402
from benchmarks.bench_kernels import gpu_time_ms  # noqa: E402
from streamkv.kernels import fused_cuda, gemv  # noqa: E402
from streamkv.layers import fp8  # noqa: E402

# llama3-8b, one layer: (in, out) of each projection.
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def call_us(fn, repeats: int, calls: int = 10) -> float:
    """GPU microseconds of one call of ``fn``: ``calls`` of them replayed as one CUDA graph,
    timed by bench_kernels.gpu_time_ms (median of ``repeats``, device time only)."""
    return gpu_time_ms(lambda: [fn() for _ in range(calls)], repeats) * 1e3 / calls


def time_shape(m: int, k: int, n: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    wq, ws = fp8.quantize_weight(w)
    xq, xs = fp8.quantize_activation(x)
    unit = torch.ones((), device="cuda")
    ws_row = ws.view(1, -1)

    def rowwise():
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16)

    def per_tensor():
        acc = torch._scaled_mm(xq, wq.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)
        return fused_cuda.scale_fp8_product(acc, xs, ws, None, torch.bfloat16)

    return {
        "bf16": call_us(lambda: gemv.linear(x, w, None), repeats),
        "rowwise": call_us(rowwise, repeats),
        "per_tensor": call_us(per_tensor, repeats),
        "fp8_linear": call_us(lambda: fp8.fp8_linear(x, wq, ws, None, unit), repeats),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    # A copy captured in a graph runs on the copy engine (2.7 TB/s on the H200), so the floor
    # uses the eager copy kernel's bandwidth, as bench_decode_graphs does.
    gbs = copy_bandwidth_gbs()
    floor_us = sum(k * n for k, n in SHAPES.values()) / gbs / 1e3
    rows = []
    for m in args.rows:
        per = {name: time_shape(m, k, n, args.repeats) for name, (k, n) in SHAPES.items()}
        total = {path: sum(p[path] for p in per.values()) for path in next(iter(per.values()))}
        rows.append({"rows": m, "per_shape_us": per, "layer_us": total})
    print(
        f"{torch.cuda.get_device_name()}: llama3-8b layer (qkv, o, gate_up, down), us per "
        f"layer; fp8 weight-read floor {floor_us:.1f} us at {gbs:.0f} GB/s; "
        f"SMALL_BATCH = {fp8.SMALL_BATCH}"
    )
    paths = list(rows[0]["layer_us"])
    print(f"{'rows':>6}" + "".join(f"{p:>12}" for p in paths) + f"{'row/tensor':>12}")
    for r in rows:
        t = r["layer_us"]
        print(
            f"{r['rows']:>6}"
            + "".join(f"{t[p]:>12.1f}" for p in paths)
            + f"{t['rowwise'] / t['per_tensor']:>12.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "copy_gbs": gbs,
                    "floor_us": floor_us,
                    "small_batch": fp8.SMALL_BATCH,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
