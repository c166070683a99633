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
