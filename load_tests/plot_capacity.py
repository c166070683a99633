"""The figures of docs/paper.md's capacity runs (issue 30), from the same directory the one
table reads (load_tests/paper_table.py): one PNG each, skipped where its inputs are missing.

    python -m load_tests.plot_capacity [--dir docs/paper/h200] [--out docs/paper/capacity]

- ``capacity.png`` (Fig 12, read as capacity): completed req/s under overload per system,
  ShareGPT and Alpaca-shaped, each bar labelled with paged ÷ it;
- ``batched.png`` (Fig 13): requests batched per step while requests arrive;
- ``sharegpt-waste.png`` / ``alpaca-waste.png`` (Fig 2): the held KV memory by kind;
- ``kernel.png`` (Fig 18a): paged decode ÷ contiguous per block size;
- ``blocks.png`` (Fig 18b end to end): paged's capacity per block size on ShareGPT.

Each title names where the points came from (the device, or the simulated StepCost).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from load_tests.paper_rows import load_json
from load_tests.paper_table import kernel_by_block, load_points, source
from load_tests.report import _pyplot, plot_waste

SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "ft-max")
WORKLOADS = ("sharegpt", "alpaca")


def _bars(points: dict, value, ylabel: str, title: str, out: str) -> bool:
    """Per workload, a bar per system at block size 16, labelled paged ÷ it."""
    have = {
        w: [(s, p) for s in SYSTEMS if (p := points.get((w, s, 16))) and value(p)]
        for w in WORKLOADS
    }
    have = {w: v for w, v in have.items() if v}
    if not have:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(have), figsize=(4.2 * len(have), 3.4), dpi=110, squeeze=False)
    for ax, (workload, bars) in zip(axes[0], have.items()):
        paged = next((value(p) for s, p in bars if s == "paged"), None)
        ax.bar([s for s, _ in bars], [value(p) for _, p in bars], color="C0")
        for i, (_, p) in enumerate(bars):
            label = f"{paged / value(p):.2f}x" if paged else f"{value(p):.3g}"
            ax.text(i, value(p), label, ha="center", va="bottom", fontsize=7)
        ax.set_title(workload, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    every = [p for bars in have.values() for _, p in bars]
    fig.suptitle(f"{title}\n{source(*every)}", fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def _waste(points: dict, out_dir: str) -> list[str]:
    written = []
    for workload in WORKLOADS:
        pts = [p for s in SYSTEMS if (p := points.get((workload, s, 16))) and p.get("kv")]
        if pts:
            results = [{"label": p["system"], "runs": [p]} for p in pts]
            path = os.path.join(out_dir, f"{workload}-waste.png")
            title = f"{workload}: KV memory held (Fig 2)\n" + textwrap.fill(source(*pts), 64)
            plot_waste(results, path, title)
            written.append(path)
    return written


def _kernel(kernel: dict | None, out: str) -> bool:
    table = kernel_by_block(kernel)
    if not table:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.2), dpi=110)
    xs, med = [t["block_size"] for t in table], [t["median"] for t in table]
    err = [[m - t["min"] for m, t in zip(med, table)], [t["max"] - m for m, t in zip(med, table)]]
    ax.errorbar(xs, med, yerr=err, marker="o", ms=3, capsize=2)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("paged ÷ contiguous decode time")
    ax.set_title(f"Fig 18a: decode attention, {kernel['device']}", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def _block_sizes(points: dict, out: str) -> bool:
    pts = sorted((bs, p) for (w, s, bs), p in points.items() if (w, s) == ("sharegpt", "paged"))
    if len(pts) < 2:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.2), dpi=110)
    ax.plot([b for b, _ in pts], [p["completed_req_s"] for _, p in pts], marker="o", ms=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks([b for b, _ in pts], [str(b) for b, _ in pts])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("completed req/s under overload")
    ax.set_ylim(bottom=0)  # from zero: a 2% difference between two points is not a trend
    ax.set_title(f"Fig 18b: paged on ShareGPT\n{source(*(p for _, p in pts))}", fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.plot_capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dir", default="docs/paper/h200", help="capacity points and kernel sweep")
    p.add_argument("--out", default="docs/paper/capacity", help="where the PNGs go")
    args = p.parse_args(argv)
    points = load_points(args.dir)
    os.makedirs(args.out, exist_ok=True)
    out = {
        n: os.path.join(args.out, f"{n}.png") for n in ("capacity", "batched", "kernel", "blocks")
    }
    done = {
        "capacity": _bars(
            points,
            lambda q: q["completed_req_s"] if q.get("overloaded") else None,
            "completed req/s under overload",
            "Capacity (Fig 12 read as capacity): bars labelled paged ÷ system",
            out["capacity"],
        ),
        "batched": _bars(
            points,
            lambda q: q.get("batched_while_arriving") or q.get("avg_batched_requests"),
            "requests batched while arriving",
            "Batched requests (Fig 13): bars labelled paged ÷ system",
            out["batched"],
        ),
        "kernel": _kernel(
            load_json(os.path.join(args.dir, "kernel-block-size.json")), out["kernel"]
        ),
        "blocks": _block_sizes(points, out["blocks"]),
    }
    written = [out[n] for n, ok in done.items() if ok] + _waste(points, args.out)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
