"""The CPU runs behind docs/paper.md's Figs 14, 16, 18b and 19b: sweeps of the load harness
(``load_tests.bench``, in this one process) on the simulated model (load_tests/sim.py), with
OPT-13B's shape and its A100-40GB KV pool (983 blocks of 16 tokens = 15,728 token slots),
then the figures (``load_tests/plot_sharing.py``). Fig 15 is benchmarks/bench_sharing.py.

    python -m load_tests.paper_sharing fig14|fig16|fig18b|fig19b [--out docs/paper/sharing]
        [--num-requests N] [--rates R,R,...]

- fig14: Alpaca-shaped, parallel sampling n = 2, 4, 6 and beam search width 2, 4, 6, paged
  against orca-oracle, a sweep of rates each (the paper's Fig 14).
- fig16: the shared-prefix workload with a 1-shot (80-token) and a 5-shot (341-token)
  prefix; paged with the prefix registered as a reserved prefix against orca-oracle.
- fig18b: paged at every block size 1-256 with the same KV memory (15,728 slots), ShareGPT
  and Alpaca-shaped, one rate each.
- fig19b: ShareGPT under memory pressure at every block size, preemption by swap, by
  recompute and ``auto`` (the ``sim-a100`` cost profile: the simulator's own swap and step
  constants), a swap pool of 4 GiB (5,242 token slots).

Every system sees the same requests and arrival times (--workload-seed 0). Each point is
bounded by --num-requests (kept small: the CPU is shared) and --max-duration.
"""

from __future__ import annotations

import argparse
import os
import sys

from load_tests import bench

POOL_SLOTS = 983 * 16  # OPT-13B on an A100-40GB: 12 GiB / 800 KiB per token
SWAP_SLOTS = 5242  # 4 GiB / 800 KiB per token
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def common(block_size: int = 16) -> list[str]:
    return [
        "--backend",
        "offline",
        "--simulate",
        "--model",
        "opt-13b",
        "--block-size",
        str(block_size),
        "--num-kv-blocks",
        str(POOL_SLOTS // block_size),
        "--max-model-len",
        "2048",
        "--no-enable-prefix-caching",
        "--max-duration",
        "3600",
        "--disable-tqdm",
    ]


def run(argv: list[str], out: str, log: str) -> None:
    print("python -m load_tests.bench " + " ".join(argv + ["--json-out", out]), flush=True)
    stdout = sys.stdout
    with open(log, "w") as f:
        sys.stdout = f
        try:
            bench.main(argv + ["--json-out", out])
        finally:
            sys.stdout = stdout


def fig14(args) -> None:
    rates = args.rates or "8,16,32,64,128"
    for flag, width in [("--n", w) for w in (2, 4, 6)] + [("--beam-width", w) for w in (2, 4, 6)]:
        tag = f"{'n' if flag == '--n' else 'beam'}{width}"
        for system in ("paged", "orca-oracle"):
            argv = [
                *common(),
                "--num-swap-blocks",
                "0",
                "--kv-allocation",
                system,
                "--workload",
                "alpaca",
                flag,
                str(width),
                "--num-requests",
                str(args.num_requests),
                "--request-rate",
                rates,
                "--label",
                f"{system} {tag}",
            ]
            run(
                argv,
                f"{args.out}/fig14-{tag}-{system}.json",
                f"{args.out}/fig14-{tag}-{system}.log",
            )


def fig16(args) -> None:
    rates = args.rates or "20,40,80,160,240,320"
    for shots, prefix_len in ((1, 80), (5, 341)):
        for system in ("paged", "orca-oracle"):
            extra = ["--reserve-shared-prefix"] if system == "paged" else []
            argv = [
                *common(),
                "--num-swap-blocks",
                "0",
                "--kv-allocation",
                system,
                "--workload",
                "shared-prefix",
                "--prefix-len",
                str(prefix_len),
                "--num-requests",
                str(args.num_requests),
                "--request-rate",
                rates,
                "--label",
                f"{system} {shots}-shot",
                *extra,
            ]
            run(
                argv,
                f"{args.out}/fig16-{shots}shot-{system}.json",
                f"{args.out}/fig16-{shots}shot-{system}.log",
            )


def fig18b(args) -> None:
    for workload, rate in (("sharegpt", args.rates or "5"), ("alpaca", args.rates or "100")):
        for bs in BLOCK_SIZES:
            argv = [
                *common(bs),
                "--num-swap-blocks",
                "0",
                "--workload",
                workload,
                "--num-requests",
                str(args.num_requests),
                "--request-rate",
                rate,
                "--label",
                f"block {bs}",
            ]
            run(
                argv,
                f"{args.out}/fig18b-{workload}-b{bs}.json",
                f"{args.out}/fig18b-{workload}-b{bs}.log",
            )


def fig19b(args) -> None:
    rate = args.rates or "6"
    for bs in BLOCK_SIZES:
        for mode in ("swap", "recompute", "auto"):
            argv = [
                *common(bs),
                "--num-swap-blocks",
                str(SWAP_SLOTS // bs),
                "--preemption-mode",
                mode,
                "--preemption-cost-profile",
                "sim-a100",
                "--workload",
                "sharegpt",
                "--num-requests",
                str(args.num_requests),
                "--request-rate",
                rate,
                "--label",
                f"{mode} block {bs}",
            ]
            run(argv, f"{args.out}/fig19b-{mode}-b{bs}.json", f"{args.out}/fig19b-{mode}-b{bs}.log")


FIGURES = {"fig14": fig14, "fig16": fig16, "fig18b": fig18b, "fig19b": fig19b}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.paper_sharing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("figure", choices=sorted(FIGURES))
    p.add_argument("--out", default="docs/paper/sharing")
    p.add_argument("--num-requests", type=int, default=200, help="per rate point")
    p.add_argument(
        "--rates", default=None, help="override the figure's rate sweep (comma-separated)"
    )
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    FIGURES[args.figure](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
