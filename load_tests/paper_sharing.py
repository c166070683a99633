"""The CPU runs behind docs/paper.md's modelled figures (14, 15, 16, 17, 18b, 19b): sweeps of
the load harness (``load_tests.bench``, in this one process) on the simulated model
(load_tests/sim.py), with OPT-13B's shape and its A100-40GB KV pool (983 blocks of 16 tokens =
15,728 token slots); the figures are ``load_tests/plot_sharing.py``'s.

    python -m load_tests.paper_sharing fig14|fig15|fig16|fig17|fig18b|fig19b|calibrated
        [--out docs/paper/sharing] [--num-requests N] [--rates R,R,...] [--calibration FIT.json]

``--calibration`` runs on a StepCost fitted to measured steps (``load_tests.fit_steps
--json-out``; load_tests/calibration.py) instead of the first-principles constants, and
records the fit beside the runs (``calibration.json`` in --out). ``calibrated`` is the issue-30
rerun: Figs 14, 15, 16, 17 and 19b, one after another, then their plots, each captioned
"calibrated model" with the H200 measurements behind it:

    python -m load_tests.paper_sharing calibrated --calibration docs/paper/h200/stepcost-fit.json \
        --num-requests 2000 --out docs/paper/calibrated

- fig14: Alpaca-shaped, parallel sampling n = 2, 4, 6 and beam search width 2, 4, 6, paged
  against orca-oracle, a sweep of rates each (the paper's Fig 14).
- fig15: the memory sharing saves (1 - blocks in use / blocks without sharing, averaged over
  the steps), parallel sampling and beam search of width 2, 4, 6 on both traces, one engine
  each at 2 req/s (``--rates``); the same as ``benchmarks/bench_sharing.py --simulate``.
- fig16: the shared-prefix workload with a 1-shot (80-token) and a 5-shot (341-token)
  prefix; paged with the prefix registered as a reserved prefix against orca-oracle.
- fig17: the chatbot trace (multi-turn ShareGPT, history cut to 1,024 tokens), paged and the
  three Orca baselines, a sweep of rates each.
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
import json
import os
import sys

from load_tests import bench, calibration

POOL_SLOTS = 983 * 16  # OPT-13B on an A100-40GB: 12 GiB / 800 KiB per token
SWAP_SLOTS = 5242  # 4 GiB / 800 KiB per token
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def common(block_size: int = 16, fit: dict | None = None) -> list[str]:
    return [
        *calibration.sim_flags(fit),
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


def default_rates(args, rates: str) -> str:
    """--rates, else the figure's own sweep, scaled by how much faster the fitted model steps
    than the default one (so the sweep still crosses the knee; 1 without a fit)."""
    if args.rates:
        return args.rates
    scale = calibration.speedup(args.fit)
    return ",".join(f"{float(r) * scale:.3g}" for r in rates.split(","))


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
    rates = default_rates(args, "8,16,32,64,128")
    for flag, width in [("--n", w) for w in (2, 4, 6)] + [("--beam-width", w) for w in (2, 4, 6)]:
        tag = f"{'n' if flag == '--n' else 'beam'}{width}"
        for system in ("paged", "orca-oracle"):
            argv = [
                *common(fit=args.fit),
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
    rates = default_rates(args, "20,40,80,160,240,320")
    for shots, prefix_len in ((1, 80), (5, 341)):
        for system in ("paged", "orca-oracle"):
            extra = ["--reserve-shared-prefix"] if system == "paged" else []
            argv = [
                *common(fit=args.fit),
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
    for workload, rate in (
        ("sharegpt", default_rates(args, "5")),
        ("alpaca", default_rates(args, "100")),
    ):
        for bs in BLOCK_SIZES:
            argv = [
                *common(bs, args.fit),
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
    rate = default_rates(args, "6")
    for bs in BLOCK_SIZES:
        for mode in ("swap", "recompute", "auto"):
            argv = [
                *common(bs, args.fit),
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


def fig15(args) -> None:
    """Savings per (trace, mode, width): a fresh simulated engine each, all on one JSON."""
    from load_tests.arrivals import arrival_times
    from load_tests.offline import run_offline

    rate, rows = float(default_rates(args, "2").split(",")[0]), []
    for workload in ("alpaca", "sharegpt"):
        for mode, flag in (("parallel n", "--n"), ("beam width", "--beam-width")):
            for width in (2, 4, 6):
                argv = [*common(fit=args.fit), "--num-swap-blocks", "0", "--workload", workload]
                argv += [flag, str(width), "--num-requests", str(args.num_requests)]
                b = bench.build_parser().parse_args(argv)
                engine, clock, _ = bench.make_engine(b)
                reqs = bench._workload(b, bench.load_tokenizer(b.tokenizer))
                arrivals = arrival_times(len(reqs), rate, 1.0, seed=b.workload_seed)
                records, _ = run_offline(engine, reqs, arrivals, b.max_duration, virtual=clock)
                stats = engine.stats()
                engine.shutdown()
                rows.append(
                    {
                        "workload": workload,
                        "mode": mode,
                        "width": width,
                        "requests": len(reqs),
                        "completed": sum(1 for r in records if r.ok),
                        "sharing_savings": stats["sharing_savings"],
                        "avg_batched_requests": stats["avg_batched_requests"],
                        "preemptions": stats["num_preemptions"],
                    }
                )
                print(
                    f"{workload} {mode} {width}: saves {stats['sharing_savings']:.1%}", flush=True
                )
    with open(f"{args.out}/fig15.json", "w") as f:
        json.dump({"args": vars(b), "simulated": True, "request_rate": rate, "sharing": rows}, f)


def fig17(args) -> None:
    rates = default_rates(args, "0.25,0.5,1,1.5,2,3")
    for system in ("paged", "orca-oracle", "orca-pow2", "orca-max"):
        argv = [*common(fit=args.fit), "--num-swap-blocks", "0", "--kv-allocation", system]
        argv += ["--workload", "chat", "--num-requests", str(args.num_requests)]
        argv += ["--request-rate", rates]
        run(argv, f"{args.out}/fig17-{system}.json", f"{args.out}/fig17-{system}.log")


FIGURES = {
    "fig14": fig14,
    "fig15": fig15,
    "fig16": fig16,
    "fig17": fig17,
    "fig18b": fig18b,
    "fig19b": fig19b,
}
CALIBRATED = ("fig14", "fig15", "fig16", "fig17", "fig19b")  # issue 30's reruns


def calibrated(args) -> None:
    """Every rerun on the fitted model, then its plot (captioned with the fit)."""
    if args.fit is None:
        raise SystemExit("error: calibrated needs --calibration FIT.json (load_tests.fit_steps)")
    from load_tests import plot_sharing

    for name in CALIBRATED:
        FIGURES[name](args)
        plot_sharing.main([name, "--dir", args.out, "--calibration", args.calibration])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.paper_sharing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("figure", choices=sorted(FIGURES) + ["calibrated"])
    p.add_argument("--out", default="docs/paper/sharing")
    p.add_argument("--num-requests", type=int, default=200, help="per rate point")
    p.add_argument(
        "--rates", default=None, help="override the figure's rate sweep (comma-separated)"
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FIT.json",
        help="run on this fitted StepCost (load_tests.fit_steps --json-out), not the defaults",
    )
    args = p.parse_args(argv)
    args.fit = calibration.load_fit(args.calibration) if args.calibration else None
    os.makedirs(args.out, exist_ok=True)
    if args.fit is not None:
        with open(f"{args.out}/calibration.json", "w") as f:
            json.dump(
                {**args.fit, "caption": calibration.caption(args.fit, names=True)}, f, indent=1
            )
    (calibrated if args.figure == "calibrated" else FIGURES[args.figure])(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
