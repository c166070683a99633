"""Host microseconds of the structured mask step's Python path, the earlier against the
staging buffer's (MaskStaging in layers/token_mask.py), on whatever device is given (default: CPU).

A step's masks are --rows rows of --vocab tokens, made by the batched fill; the sampler then
bans outside them (layers/token_mask.py). Clocked with time.perf_counter over --calls calls:

- fill: the earlier path allocated the fill's array a step; the staging buffer is filled in place
  (the native fill itself is replaced by a copy of fixed words: it is the same in both);
- mask step: the earlier path stacked the rows into a new array and uploaded it (on_device: pinned
  through the caching allocator, then copied); the staging path writes the row indices and
  copies [indices | words] once into its persistent device buffer.

The kernel launch is left out of both on a CPU (there is none); on CUDA both launch it, the
new path through its cached launch. On a CPU on_device is no copy at all (the earlier path
pins and copies only on CUDA), while the staging path's copy is a real memcpy there: the
CPU figures favour the old path.

    python benchmarks/bench_mask_step.py                       # CPU
    python benchmarks/bench_mask_step.py --device cuda         # the H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def clock(fn, calls: int) -> float:
    for _ in range(min(calls, 50)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=64, help="structured rows a step")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads: on a loaded 2-core box torch's 2-thread copy of 0.4 MB took ~8 ms",
    )
    ap.add_argument("--json-out", default="bench_results/mask_step.json")
    args = ap.parse_args()

    import numpy as np
    import torch

    import streamkv.kernels.token_mask_cuda as tmc
    from streamkv.layers import token_mask as tm
    from streamkv.layers.token_mask import MaskStaging

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    width = -(-args.vocab // 32)
    words = np.random.default_rng(0).integers(
        -(2**31), 2**31 - 1, (args.rows, width), dtype=np.int32
    )
    rows = list(range(1, 2 * args.rows, 2))  # every other logits row: the row indices are uploaded
    logits = torch.zeros(2 * args.rows, args.vocab, device=device)
    staging = MaskStaging(width, pin=device.type == "cuda")

    def old_fill():
        out = np.empty((args.rows, width), dtype=np.int32)
        np.copyto(out, words)
        return out

    def new_fill():
        return staging.fill(args.rows, lambda view: np.copyto(view, words))

    old_masks, new_masks = list(old_fill()), new_fill()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    on_cuda = device.type == "cuda"
    with (
        mock.patch.object(
            tmc, "ban_outside_masks", tmc.ban_outside_masks if on_cuda else lambda *a: None
        ),
        mock.patch.object(tmc, "BanLaunch", tmc.BanLaunch if on_cuda else _NoLaunch),
    ):
        old_step = clock(lambda: tm._ban_with_kernel(logits, old_masks, rows), args.calls)
        sync()
        new_step = clock(
            lambda: staged_step(staging, lambda: tm._ban_staged(logits, staging, new_masks, rows)),
            args.calls,
        )
        sync()
    result = {
        "device": str(device),
        "rows": args.rows,
        "vocab": args.vocab,
        "calls": args.calls,
        "us": {
            "fill_old": clock(old_fill, args.calls),
            "fill_new": clock(new_fill, args.calls),
            "mask_step_old": old_step,
            "mask_step_new": new_step,
        },
    }
    print(
        f"{args.rows} rows x {args.vocab} tokens on "
        f"{device}, host us a call (mean of {args.calls}):"
    )
    for name, us in result["us"].items():
        print(f"  {name:<15}{us:>9.1f}")
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def staged_step(staging, step) -> None:
    """One staged mask step, as the engine makes it: its fill follows the read of the step
    that used the last upload, so the upload's wait for that copy is instant. Here the same
    fill is uploaded again at once, so the wait (which would time the copy) is skipped: the
    buffer's contents do not change between calls."""
    staging._pending = False
    step()


class _NoLaunch:
    """The cached launch on a CPU: made and cached as BanLaunch is, with nothing to launch."""

    def __init__(self, device, words, rows, vocab: int, row_stride: int) -> None:
        self.key = (words.data_ptr(), rows.data_ptr(), words.shape[1], vocab, row_stride)

    def __call__(self, logits, n: int) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
