"""PNG plots from the JSON files of ``load_tests.bench`` runs, one line (or bar) per system.

python -m load_tests.plot latency paged.json orca-max.json orca-oracle.json --out fig12.png
python -m load_tests.plot waste paged.json orca-*.json --out fig2.png
python -m load_tests.plot batched paged.json orca-oracle.json --out fig13.png
python -m load_tests.plot table paged.json orca-*.json --threshold 0.5 --rate 2   (markdown)
"""

from __future__ import annotations

import argparse
import json
import sys

from load_tests.report import METRICS, markdown_table, plot_batched, plot_latency, plot_waste


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("kind", choices=["latency", "waste", "batched", "table"])
    p.add_argument("results", nargs="+", help="JSON files written by load_tests.bench")
    p.add_argument("--out", default=None, help="PNG path (all kinds but table)")
    p.add_argument(
        "--threshold", type=float, default=0.5, help="table: normalized latency bound (s/token)"
    )
    p.add_argument(
        "--metric",
        choices=sorted(METRICS),
        default="normalized_latency",
        help="latency plots: y axis",
    )
    p.add_argument("--title", default="")
    p.add_argument("--ylim", type=float, default=None, help="latency plots: clip the y axis here")
    p.add_argument("--logy", action="store_true", help="latency plots: a log y axis")
    p.add_argument(
        "--rate", type=float, default=None, help="waste plots: only the runs at this request rate"
    )
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    if args.kind == "table":
        print(markdown_table(results, args.threshold, args.rate))
        return 0
    if args.out is None:
        p.error("--out is required for a plot")
    if args.kind == "latency":
        plot_latency(results, args.out, args.metric, args.title, args.ylim, args.logy)
    elif args.kind == "waste":
        plot_waste(results, args.out, args.title, args.rate)
    else:
        plot_batched(results, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
