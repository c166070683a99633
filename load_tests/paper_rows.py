"""The rows of docs/paper.md's one table (load_tests/paper_table.py) for the modelled figures
(Figs 14-17: ``load_tests.paper_sharing``'s runs, on the fitted StepCost or not), and the row
record they share with the measured ones."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from load_tests import calibration
from load_tests.capacity import capacity_ratio, sweep_capacity


@dataclass(slots=True)
class Row:
    figure: str
    what: str
    paper: str
    ours: str = "not run"
    source: str = "not run"
    trace: str = "-"
    how: str = ""
    value: float | None = None


RERUNS = (  # (figure, what, paged file, baseline file, the paper's number) in --modelled
    *(
        (
            "14",
            f"alpaca n={w}: paged ÷ orca-oracle",
            f"fig14-n{w}-paged",
            f"fig14-n{w}-orca-oracle",
            "1.7-2.8x (n = 2-6)",
        )
        for w in (2, 4, 6)
    ),
    *(
        (
            "14",
            f"alpaca beam {w}: paged ÷ orca-oracle",
            f"fig14-beam{w}-paged",
            f"fig14-beam{w}-orca-oracle",
            "1.8-2.6x (width 2-6)",
        )
        for w in (2, 4, 6)
    ),
    (
        "16",
        "1-shot prefix: paged ÷ orca-oracle",
        "fig16-1shot-paged",
        "fig16-1shot-orca-oracle",
        "1.67x",
    ),
    (
        "16",
        "5-shot prefix: paged ÷ orca-oracle",
        "fig16-5shot-paged",
        "fig16-5shot-orca-oracle",
        "3.58x",
    ),
    *(
        ("17", f"chat: paged ÷ {s}", "fig17-paged", f"fig17-{s}", "2x")
        for s in ("orca-oracle", "orca-pow2", "orca-max")
    ),
)
FIG15_PAPER = {
    ("alpaca", "parallel n"): "6.1-9.8%",
    ("sharegpt", "parallel n"): "16.2-30.5%",
    ("alpaca", "beam width"): "37.6-55.2%",
    ("sharegpt", "beam width"): "44.3-66.3%",
}


def load_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def rerun_rows(directory: str | None) -> list[Row]:
    """The modelled figures (``load_tests.paper_sharing``), on the fitted StepCost or not."""
    d = directory or ""
    cal = load_json(os.path.join(d, "calibration.json")) if directory else None
    src = calibration.caption(cal)
    rows = []
    for figure, what, a, b, paper in RERUNS:
        row = Row(
            figure, what + ", capacity", paper, how="sweep: the most completed req/s past the knee"
        )
        pa, pb = (load_json(os.path.join(d, f"{n}.json")) if directory else None for n in (a, b))
        if pa and pb:
            (x, x_over), (y, y_over) = sweep_capacity(pa), sweep_capacity(pb)
            row.ours, row.source = capacity_ratio(x, x_over, y, y_over), src
            if not x or not y:
                row.ours = "not read: the runs predate completed_req_s"
            row.value = x / y if x and y else None
            row.trace = f"{pa['args']['num_requests']:,} req a point, {len(pa['runs'])} rates"
        rows.append(row)
    fig15 = load_json(os.path.join(d, "fig15.json")) if directory else None
    for (workload, mode), paper in FIG15_PAPER.items():
        row = Row(
            "15",
            f"{workload}: memory saved, {mode} 2/4/6",
            paper,
            how="1 - blocks used / unshared, time-averaged",
        )
        cells = [
            r
            for r in (fig15 or {}).get("sharing", [])
            if (r["workload"], r["mode"]) == (workload, mode)
        ]
        if cells:
            row.ours = " / ".join(f"{100 * r['sharing_savings']:.1f}" for r in cells) + "%"
            row.source, row.trace = src, f"{cells[0]['requests']:,} req"
        rows.append(row)
    return rows


def measured_rows(paper_dir: str | None, modelled: str | None) -> list[Row]:
    """Fig 19a (the swap micro-benchmark on the device), Fig 15's beam rows with real logits
    (the embedded model on the CPU) and Fig 19b (the modelled end-to-end sweep)."""
    rows = [
        Row(
            "19a",
            "swap out + in vs recompute, 2,000 tokens",
            "swap > 120 ms at block 1, ~10 ms at 256; recompute 4-5 ms",
            how="wall time, scattered block ids, 3 repeats",
        ),
        *(
            Row(
                "15",
                f"{w}: memory saved, beam width 2/4/6, real logits",
                paper,
                how="1 - blocks used / unshared, time-averaged; temperature 0",
            )
            for w, paper in (("alpaca", "37.6-55.2%"), ("sharegpt", "44.3-66.3%"))
        ),
        Row(
            "19b",
            "best preemption mode by block size (normalized latency)",
            "recompute below 16; comparable at 16-64",
            how="lowest normalized latency at one rate",
        ),
    ]
    swap = load_json(os.path.join(paper_dir, "swap-recompute-h200.json")) if paper_dir else None
    at = {(r["block_size"], r["context_len"]): r for r in (swap or {}).get("swap", [])}
    if (1, 2000) in at and (256, 2000) in at:
        r1, r256 = at[(1, 2000)], at[(256, 2000)]
        rows[0].ours = (
            f"swap {r1['swap_ms']:.1f} ms at block 1, {r256['swap_ms']:.1f} at 256; "
            f"recompute {r1['recompute_ms']:.1f} ms"
        )
        rows[0].source, rows[0].trace = (
            f"real ({swap['source'].split(' on ')[-1].split(',')[0]})",
            ("one request's blocks, contexts 256-2,000"),
        )
    beam = (
        load_json(os.path.join(paper_dir, "sharing", "fig15-beam-real.json")) if paper_dir else None
    )
    for row, w in zip(rows[1:3], ("alpaca", "sharegpt")):
        cells = [r for r in (beam or {}).get("rows", []) if r["workload"] == w]
        if cells:
            row.ours = " / ".join(f"{100 * r['real']['sharing_savings']:.1f}" for r in cells) + "%"
            row.source = "measured (SmolLM2-135M on the CPU)"
            row.trace = f"{cells[0]['requests']} req, outputs <= {beam['args']['max_output_len']}"
    rows[3] = _fig19b_row(rows[3], modelled)
    return rows


def _fig19b_row(row: Row, modelled: str | None) -> Row:
    best: dict[int, tuple[float, str]] = {}
    runs = 0
    for mode in ("swap", "recompute", "auto"):
        for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            d = load_json(os.path.join(modelled, f"fig19b-{mode}-b{bs}.json")) if modelled else None
            if not d:
                continue
            runs = d["args"]["num_requests"]
            latency = d["runs"][0]["summary"]["normalized_latency_s"]
            if mode != "auto" and (bs not in best or latency < best[bs][0]):
                best[bs] = (latency, mode)
    if best:
        runs_of: list[list] = []  # [mode, first block size, last block size]
        for bs, (_, mode) in sorted(best.items()):
            if runs_of and runs_of[-1][0] == mode:
                runs_of[-1][2] = bs
            else:
                runs_of.append([mode, bs, bs])
        row.ours = "; ".join(
            f"{m} at {lo}" + (f"-{hi}" if hi != lo else "") for m, lo, hi in runs_of
        )
        cal = load_json(os.path.join(modelled, "calibration.json"))
        row.source, row.trace = calibration.caption(cal), f"{runs:,} req a point, one rate"
    return row
