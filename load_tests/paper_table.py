"""docs/paper.md's one table: each figure's claim, the paper's number beside ours, whether ours
is real or modelled, the trace it came from and how it was read.

    python -m load_tests.paper_table [--dir docs/paper/h200] [--modelled docs/paper/calibrated]
        [--check docs/paper/calibrated/h200-check/h200]
        [--md-out docs/paper/table.md] [--json-out docs/paper/table.json]

Reads from --dir the capacity points (one JSON per system, workload and rate:
load_tests/capacity.py, written by load_tests/capacity_point.sh), the kernel sweep
``kernel-block-size.json`` (benchmarks/bench_block_size.py) and the step fit
``stepcost-fit.json`` (load_tests.fit_steps); from --modelled the modelled figures' runs
(``load_tests.paper_sharing``: Figs 14-17 and 19b; calibrated when the directory holds the
``calibration.json`` that ``--calibration`` writes, uncalibrated otherwise); from the
directory above --dir the swap micro-benchmark (``swap-recompute-h200.json``, Fig 19a) and
the beam rows with real logits (``sharing/fig15-beam-real.json``).

Every ratio of systems is a capacity ratio: the requests/s each completed under overload
(``completed_req_s``), '>=' or '<=' where a side was not overloaded (its figure then only
bounds its capacity from below). A row whose inputs are missing says "not run".

``--check`` sets the capacity points rerun on the calibrated model (``SIM=1
load_tests/capacity_point.sh`` with the fit's ``--sim-*`` flags) beside the device's, so the
table says how far the model behind the modelled rows is off where it can be checked.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from dataclasses import asdict

from load_tests.capacity import capacity_ratio
from load_tests.paper_rows import Row, load_json, measured_rows, rerun_rows

CAPACITY = "completed req/s, 10th-90th pct completions, under overload"
BASELINES = (  # (system, the paper's number for paged over it on ShareGPT, Fig 12a)
    ("orca-oracle", "1.7-2.7x"),
    ("orca-pow2", "no number in the text"),
    ("orca-max", "2.7-8x"),
    ("ft-max", "up to 22x (FasterTransformer)"),
)
FIG2_PAPER = {"paged": "96.3%", "orca-oracle": "38.2%", "orca-pow2": "26.8%", "orca-max": "20.4%"}
FIG13_PAPER = {"orca-oracle": "2.2x", "orca-max": "4.3x (30.42 / 7.00)"}


def load_points(directory: str) -> dict[tuple[str, str, int], dict]:
    """Capacity points by (workload, system, block size); of several, the overloaded one with
    the most requests (a knee point below capacity is a cross-check, not the capacity)."""
    points: dict[tuple[str, str, int], dict] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            p = json.load(f)
        if not isinstance(p, dict) or "completed_req_s" not in p:
            continue
        p["path"] = path
        key = (p["workload"], re.sub(r"-b\d+$", "", p["system"]), int(p.get("block_size") or 16))
        rank = (bool(p.get("overloaded")), p["num_requests"], p["request_rate"])
        old = points.get(key)
        if old is None or rank > (
            bool(old.get("overloaded")),
            old["num_requests"],
            old["request_rate"],
        ):
            points[key] = p
    return points


def source(*points: dict) -> str:
    devices = sorted({p["device"] for p in points})
    if any(d.startswith("simulated") for d in devices):
        return "modelled (" + "; ".join(d.removeprefix("simulated ") for d in devices) + ")"
    return "real (" + ", ".join(devices) + ")"


def trace(*points: dict) -> str:
    return "; ".join(
        f"{p['system']} {p['num_requests']:,} req @ {p['request_rate']:g}/s" for p in points
    )


def capacity_rows(points: dict, workload: str, baselines, figure: str) -> list[Row]:
    rows = []
    paged = points.get((workload, "paged", 16))
    for system, paper in baselines:
        row = Row(figure, f"{workload}: paged ÷ {system}, capacity", paper, how=CAPACITY)
        base = points.get((workload, system, 16))
        if paged and base:
            a, b = paged["completed_req_s"], base["completed_req_s"]
            row.ours = capacity_ratio(a, paged["overloaded"], b, base["overloaded"])
            row.ours += f" ({a:.2f} / {b:.2f} req/s)" if a and b else ""
            row.value = a / b if a and b else None
            row.source, row.trace = source(paged, base), trace(paged, base)
        rows.append(row)
    return rows


def _batched(p: dict) -> float | None:
    return p.get("batched_while_arriving") or p.get("avg_batched_requests")


def batched_rows(points: dict) -> list[Row]:
    how = "requests batched per step while requests arrive (the steady load), overloaded points"
    rows = []
    paged = points.get(("sharegpt", "paged", 16))
    for system in ("orca-oracle", "orca-max"):
        row = Row("13a", f"sharegpt: batched, paged ÷ {system}", FIG13_PAPER[system], how=how)
        base = points.get(("sharegpt", system, 16))
        if paged and base and _batched(paged) and _batched(base):
            row.value = _batched(paged) / _batched(base)
            row.ours = f"{row.value:.2f}x ({_batched(paged):.1f} / {_batched(base):.1f})"
            row.source, row.trace = source(paged, base), trace(paged, base)
        rows.append(row)
    row = Row("13b", "alpaca: paged's batched requests", "about 132", how=how)
    if (p := points.get(("alpaca", "paged", 16))) and _batched(p):
        row.value, row.ours = _batched(p), f"{_batched(p):.1f}"
        row.source, row.trace = source(p), trace(p)
    return rows + [row]


def waste_rows(points: dict) -> list[Row]:
    how = "token states' share of held + unusable KV slots, every 8th step of the run"
    rows = []
    for system, paper in FIG2_PAPER.items():
        row = Row("2", f"sharegpt: {system}'s token states", paper, how=how)
        p = points.get(("sharegpt", system, 16))
        if p and (p.get("kv_shares") or {}).get("token") is not None:
            s = p["kv_shares"]
            row.value = s["token"]
            row.ours = (
                f"{100 * s['token']:.1f}%"
                + " (reserved {:.1f} / internal {:.1f} / external {:.1f})".format(
                    *(100 * (s.get(k) or 0) for k in ("reserved", "internal", "external"))
                )
            )
            row.source, row.trace = source(p), trace(p)
        rows.append(row)
    return rows


def kernel_by_block(kernel: dict | None) -> list[dict]:
    """Fig 18a: paged ÷ contiguous per block size, over the sweep's batches and contexts."""
    by: dict[int, list[float]] = {}
    for r in (kernel or {}).get("rows", []):
        by.setdefault(r["block_size"], []).append(r["paged_over_contiguous"])
    return [
        {
            "block_size": b,
            "median": statistics.median(v),
            "min": min(v),
            "max": max(v),
            "rows": len(v),
        }
        for b, v in sorted(by.items())
    ]


def kernel_rows(kernel: dict | None, table: list[dict]) -> list[Row]:
    how = "decode kernel ÷ SDPA on contiguous K/V, median over batch 8/32 x contexts 64-256"
    row = Row("18a", "paged kernel ÷ contiguous at block 16", "1.20-1.26x", how=how)
    by = {t["block_size"]: t for t in table}
    if 16 in by:
        t = by[16]
        row.value = t["median"]
        row.ours = f"{t['median']:.2f}x ({t['min']:.2f}-{t['max']:.2f}x)"
        row.source = (
            ("real (" if not kernel["device"].startswith("cpu") else "CPU torch reference (")
            + kernel["device"]
            + ")"
        )
        row.trace = f"{t['rows']} timings at block 16 ({len(kernel['rows'])} in the sweep)"
    return [row]


def block_size_table(points: dict) -> list[dict]:
    """Fig 18b end to end: paged on ShareGPT at each block size (the same 15,728 slots)."""
    return [
        {
            "block_size": bs,
            "completed_req_s": p["completed_req_s"],
            "overloaded": p["overloaded"],
            "normalized_latency_s_per_token": p["normalized_latency_s_per_token"],
            "batched": _batched(p),
            "point": p,
        }
        for (w, s, bs), p in sorted(points.items())
        if (w, s) == ("sharegpt", "paged")
    ]


def block_size_row(table: list[dict]) -> Row:
    row = Row("18b", "sharegpt: best block size (capacity)", "16-128", how=CAPACITY)
    if len(table) >= 2:
        best = max(table, key=lambda t: t["completed_req_s"] or 0)
        row.value = best["block_size"]
        each = ", ".join(f"{t['block_size']}: {t['completed_req_s']:.2f}" for t in table)
        row.ours = f"{best['block_size']} ({each} req/s)"
        row.source = source(*(t["point"] for t in table))
        sizes = sorted(t["point"]["num_requests"] for t in table)
        row.trace = f"{sizes[0]:,}-{sizes[-1]:,} req a point"
    return row


def _offered(p: dict) -> float:
    return p.get("offered_req_s") or p["request_rate"]


def knee_rows(directory: str, points: dict) -> list[Row]:
    """The cross-check of a capacity: a point below it (not overloaded) beside the overloaded
    one, each system's normalized latency flat below its capacity and rising past it."""
    rows = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        below = load_json(path)
        if not isinstance(below, dict) or below.get("overloaded", True):
            continue
        key = (below["workload"], below["system"], int(below.get("block_size") or 16))
        over = points.get(key)
        if over is None or not over.get("overloaded"):
            continue
        row = Row(
            "12 knee",
            f"{key[0]}: {key[1]}'s normalized latency below / past capacity",
            "flat, then vertical past capacity",
            how="normalized latency offered below the capacity and at the overloaded rate",
        )
        row.ours = (
            f"{below['normalized_latency_s_per_token']:.3f} s/token at "
            f"{_offered(below):.1f} req/s offered, "
            f"{over['normalized_latency_s_per_token']:.3f} at {_offered(over):.1f} "
            f"(capacity {over['completed_req_s']:.2f})"
        )
        row.value = below["normalized_latency_s_per_token"]
        row.source = source(below, over)
        row.trace = trace(below, over)
        rows.append(row)
    return rows


def calibration_row(fit: dict | None) -> Row:
    row = Row("model", "StepCost fitted to the measured steps", "-", how="load_tests.fit_steps")
    if fit:
        f = fit["fit"]
        row.value = f["median_rel_err"]
        row.ours = f"median error {f['median_rel_err']:.1%}, RMS {f['rms_rel_err']:.1%}"
        row.source = "fit of " + ", ".join(sorted(set(fit.get("devices") or ["?"])))
        row.trace = f"{f['steps']:,} steps of {len(fit['files'])} runs"
    return row


def model_check(points: dict, check: str | None) -> list[dict]:
    """The capacity points rerun on the calibrated model (``SIM=1 capacity_point.sh`` with the
    fit's flags), each beside the device's: how far the model is off where it can be checked."""
    model = load_points(check) if check else {}
    return [
        {
            "workload": w,
            "system": s,
            "real_req_s": points[key]["completed_req_s"],
            "model_req_s": m["completed_req_s"],
            "model_over_real": m["completed_req_s"] / points[key]["completed_req_s"],
            "real_batched": _batched(points[key]),
            "model_batched": _batched(m),
        }
        for key, m in sorted(model.items())
        if key in points and key[2] == 16
        for w, s, _ in [key]
    ]


def build(directory: str, modelled: str | None, check: str | None = None) -> dict:
    points = load_points(directory)
    kernel = load_json(os.path.join(directory, "kernel-block-size.json"))
    fit = load_json(os.path.join(directory, "stepcost-fit.json"))
    kernel_table, blocks = kernel_by_block(kernel), block_size_table(points)
    rows = [
        *capacity_rows(points, "sharegpt", BASELINES, "12a"),
        *capacity_rows(
            points, "alpaca", [("orca-oracle", "same trend, smaller gap (no number)")], "12d"
        ),
        *batched_rows(points),
        *waste_rows(points),
        *kernel_rows(kernel, kernel_table),
        *knee_rows(directory, points),
        block_size_row(blocks),
        calibration_row(fit),
        *rerun_rows(modelled),
        *measured_rows(os.path.dirname(os.path.normpath(directory)), modelled),
    ]
    for b in blocks:
        b["point"] = os.path.basename(b["point"]["path"])
    return {
        "dir": directory,
        "modelled": modelled,
        "rows": [asdict(r) for r in rows],
        "kernel_by_block_size": kernel_table,
        "end_to_end_by_block_size": blocks,
        "model_check": model_check(points, check),
    }


def markdown(table: dict) -> str:
    out = [
        "| figure | claim | paper | ours | real or modelled | trace | how it was read |",
        "|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['figure']} | {r['what']} | {r['paper']} | {r['ours']} | {r['source']} | "
        f"{r['trace']} | {r['how']} |"
        for r in table["rows"]
    ]
    if table["kernel_by_block_size"]:
        out += [
            "",
            "| block size | paged ÷ contiguous, median | range | timings |",
            "|---:|---:|---|---:|",
        ]
        out += [
            f"| {t['block_size']} | {t['median']:.2f}x | {t['min']:.2f}-{t['max']:.2f}x "
            f"| {t['rows']} |"
            for t in table["kernel_by_block_size"]
        ]
    if table["end_to_end_by_block_size"]:
        out += [
            "",
            "| block size | completed req/s | overloaded | norm. latency s/token | batched |",
            "|---:|---:|---|---:|---:|",
        ]
        out += [
            f"| {t['block_size']} | {t['completed_req_s']:.2f} | {t['overloaded']} | "
            f"{t['normalized_latency_s_per_token']:.3f} | {t['batched'] or 0:.1f} |"
            for t in table["end_to_end_by_block_size"]
        ]
    if table.get("model_check"):
        out += [
            "",
            "| workload | system | real req/s | calibrated model req/s | model ÷ real "
            "| batched, real / model |",
            "|---|---|---:|---:|---:|---|",
        ]
        out += [
            f"| {c['workload']} | {c['system']} | {c['real_req_s']:.2f} | {c['model_req_s']:.2f} "
            f"| {c['model_over_real']:.2f}x | {c['real_batched'] or 0:.1f} / "
            f"{c['model_batched'] or 0:.1f} |"
            for c in table["model_check"]
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.paper_table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dir", default="docs/paper/h200", help="capacity points, kernel sweep, fit")
    p.add_argument("--modelled", default=None, help="load_tests.paper_sharing's --out")
    p.add_argument(
        "--check",
        default=None,
        metavar="DIR",
        help="the same capacity points on the calibrated model, to set beside the real ones",
    )
    p.add_argument("--md-out", default=None, help="write the markdown table here")
    p.add_argument("--json-out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if not os.path.isdir(args.dir):
        raise SystemExit(f"error: {args.dir} is not a directory")
    table = build(args.dir, args.modelled, args.check)
    text = markdown(table)
    print(text, end="")
    for path, body in ((args.md_out, text), (args.json_out, json.dumps(table, indent=1))):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
