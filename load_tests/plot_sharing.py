"""Figures and markdown tables of docs/paper.md's Figs 14, 15, 16, 17, 18b and 19b, from the
JSON files of ``load_tests.paper_sharing`` (or ``benchmarks/bench_sharing.py --simulate``).

    python -m load_tests.plot_sharing fig14|fig16|fig17 --dir docs/paper/sharing --threshold 0.2
    python -m load_tests.plot_sharing fig15 --dir docs/paper/sharing   # or --file FIG15.json
    python -m load_tests.plot_sharing fig18b|fig19b --dir docs/paper/sharing
    ... --calibration docs/paper/h200/stepcost-fit.json    # runs made on a fitted StepCost

Each writes ``<dir>/<figure>.png`` (or --out) and prints its table. Two ratios of paged over
a baseline: the capacity ratio (the most requests/s each completed at a point past its knee,
load_tests/capacity.py; '>=' / '<=' where a side never passed its knee) and the sustained rate
at the same normalized latency (``report.sustained_rate``: interpolated between sweep points;
'>=' where paged never reached the bound), which a short trace overstates. Every figure's
caption says which model made it: "calibrated model" and the fit's measurements with
--calibration (each run's flags are checked against the fit), "uncalibrated" without.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

from load_tests import calibration
from load_tests.capacity import capacity_ratio, sweep_capacity
from load_tests.report import _pyplot, sustained_rate

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _load(path: str, fit: dict | None = None) -> dict:
    with open(path) as f:
        res = json.load(f)
    if fit is not None and not calibration.matches(res.get("args", {}), fit):
        raise SystemExit(f"error: {path} did not run on the --calibration fit's constants")
    return res


def _norm(run: dict) -> float:
    return run["summary"]["normalized_latency_s"]


def _curve(ax, res: dict, **style) -> None:
    pts = sorted((r["request_rate"], _norm(r)) for r in res["runs"])
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=res["label"], **style)


def _ratio(paged: dict, oracle: dict, threshold: float) -> str:
    a, b = sustained_rate(paged, threshold), sustained_rate(oracle, threshold)
    if a is None or b is None:
        return "-"
    top = max(r["request_rate"] for r in paged["runs"])
    return f"{'>= ' if a >= top else ''}{a / b:.2f}x ({a:.1f} / {b:.1f} req/s)"


def _capacity(paged: dict, base: dict) -> str:
    (a, a_over), (b, b_over) = sweep_capacity(paged), sweep_capacity(base)
    cap = capacity_ratio(a, a_over, b, b_over)
    return cap if not a or not b else f"{cap} ({a:.2f} / {b:.2f} req/s)"


def rate_figure(args, tags: list[tuple[str, str]], title: str) -> None:
    """Figs 14 / 16: per tag, paged and orca-oracle curves side by side, and the ratio table."""
    plt = _pyplot()
    groups = sorted({g for g, _ in tags}, key=[g for g, _ in tags].index)
    fig, axes = plt.subplots(
        1, len(groups), figsize=(max(5.4, 4.2 * len(groups)), 3.6), dpi=100, squeeze=False
    )
    print(
        f"| {title} | paged ÷ orca-oracle, capacity | at {args.threshold} s/token |\n|---|---|---|"
    )
    for ax, group in zip(axes[0], groups):
        for i, (_, tag) in enumerate(t for t in tags if t[0] == group):
            paged = _load(f"{args.dir}/{args.figure}-{tag}-paged.json", args.fit)
            oracle = _load(f"{args.dir}/{args.figure}-{tag}-orca-oracle.json", args.fit)
            color = f"C{i}"
            _curve(ax, paged, color=color)
            _curve(ax, oracle, color=color, ls="--")
            print(
                f"| {tag} | {_capacity(paged, oracle)} | {_ratio(paged, oracle, args.threshold)} |"
            )
        ax.axhline(args.threshold, color="grey", lw=0.8, ls=":")
        ax.set_ylim(0, args.ylim)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_title(f"{group} (solid paged, dashed orca-oracle)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"{title}, 983-block KV pool\n{args.caption}", fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out or f"{args.dir}/{args.figure}.png")


def fig15(args) -> None:
    rows = _load(args.file, args.fit)["sharing"]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(7.6, 3.0), dpi=100)
    print("| trace | mode | width | memory saving |\n|---|---|---|---|")
    for ax, mode in zip(axes, ("parallel n", "beam width")):
        for k, workload in enumerate(("alpaca", "sharegpt")):
            pts = [
                (r["width"], 100 * r["sharing_savings"])
                for r in rows
                if r["mode"] == mode and r["workload"] == workload
            ]
            ax.bar(
                [i + 0.38 * k for i in range(len(pts))],
                [p[1] for p in pts],
                width=0.36,
                label=workload,
            )
            ax.set_xticks([i + 0.19 for i in range(len(pts))], [str(p[0]) for p in pts])
            for w, s in pts:
                print(f"| {workload} | {mode} | {w} | {s:.1f}% |")
        ax.set_xlabel(mode)
        ax.set_ylabel("memory saving (%)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Fig 15: KV memory saved by sharing\n{args.caption}", fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out or os.path.join(os.path.dirname(args.file), "fig15.png"))


FIG17_SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max")


def fig17(args) -> None:
    """The chatbot trace: every system's curve, and paged over each baseline."""
    plt = _pyplot()
    res = {s: _load(f"{args.dir}/fig17-{s}.json", args.fit) for s in FIG17_SYSTEMS}
    fig, ax = plt.subplots(figsize=(4.8, 3.4), dpi=100)
    for s in FIG17_SYSTEMS:
        _curve(ax, res[s])
    ax.axhline(args.threshold, color="grey", lw=0.8, ls=":")
    ax.set_ylim(0, args.ylim)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"Fig 17: chatbot (history cut to 1,024 tokens)\n{args.caption}", fontsize=6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out or f"{args.dir}/fig17.png")
    print(f"| baseline | paged ÷ this, capacity | at {args.threshold} s/token |\n|---|---|---|")
    for s in FIG17_SYSTEMS[1:]:
        paged, base = res["paged"], res[s]
        print(f"| {s} | {_capacity(paged, base)} | {_ratio(paged, base, args.threshold)} |")


def by_block_size(args, series: list[tuple[str, str]], title: str) -> None:
    """Figs 18b / 19b: normalized latency (one rate point per file) against block size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.2), dpi=100)
    table = {}
    for label, pattern in series:
        pts, rates = [], set()
        for bs in BLOCK_SIZES:
            path = f"{args.dir}/{pattern.format(bs=bs)}"
            if os.path.exists(path):
                run = _load(path, args.fit)["runs"][0]
                rates.add(run["request_rate"])
                pts.append((bs, _norm(run), run["kv"]["preemptions"] if run.get("kv") else None))
        table[label] = {bs: (y, p) for bs, y, p in pts}
        rate = f" @ {rates.pop():g} req/s" if len(rates) == 1 else ""
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label + rate)
    ax.set_xscale("log", base=2)
    ax.set_xticks(BLOCK_SIZES, [str(b) for b in BLOCK_SIZES])
    ax.set_yscale("log")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{title}\n{args.caption}", fontsize=6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out or f"{args.dir}/{args.figure}.png")
    print("| block size | " + " | ".join(table) + " |\n|---|" + "---|" * len(table))
    for bs in BLOCK_SIZES:
        cells = [f"{table[s][bs][0]:.4f}" if bs in table[s] else "-" for s in table]
        print(f"| {bs} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.plot_sharing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("figure", choices=["fig14", "fig15", "fig16", "fig17", "fig18b", "fig19b"])
    p.add_argument("--dir", default="docs/paper/sharing")
    p.add_argument("--file", default=None, help="fig15: its JSON (default <dir>/fig15.json)")
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FIT.json",
        help="the runs used this fitted StepCost (load_tests.fit_steps --json-out): say so",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=0.2,
        help="figs 14/16: normalized latency bound (s/token)",
    )
    p.add_argument("--ylim", type=float, default=1.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.file = args.file or os.path.join(args.dir, "fig15.json")
    args.fit = calibration.load_fit(args.calibration) if args.calibration else None
    # Wrapped: the one-axis figures (17, 18b, 19b) are too narrow for the caption's line.
    args.caption = textwrap.fill(calibration.caption(args.fit), 84)
    if args.figure == "fig14":
        rate_figure(
            args,
            [("parallel sampling", f"n{w}") for w in (2, 4, 6)]
            + [("beam search", f"beam{w}") for w in (2, 4, 6)],
            "Fig 14: Alpaca-shaped",
        )
    elif args.figure == "fig16":
        rate_figure(
            args,
            [("shared prefix", "1shot"), ("shared prefix", "5shot")],
            "Fig 16: translation-style",
        )
    elif args.figure == "fig15":
        fig15(args)
    elif args.figure == "fig17":
        fig17(args)
    elif args.figure == "fig18b":
        by_block_size(
            args,
            [
                ("ShareGPT", "fig18b-sharegpt-b{bs}.json"),
                ("Alpaca-shaped", "fig18b-alpaca-b{bs}.json"),
            ],
            "Fig 18b: paged, same KV memory (15,728 slots)",
        )
    else:
        by_block_size(
            args,
            [(m, f"fig19b-{m}-b{{bs}}.json") for m in ("swap", "recompute", "auto")],
            "Fig 19b: ShareGPT, 4 GiB swap pool (swaps modelled too)",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
