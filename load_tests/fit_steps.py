"""Fit the simulator's StepCost (load_tests/sim.py) to measured steps: the step records the
load harness keeps with ``--record-steps`` (load_tests/steps.py), from capacity points or
sweeps. Least squares of

    seconds = base_ms / 1e3 + per_token_ms * computed / 1e3
              + per_kv_token_us * context / 1e6 + per_block_us * blocks / 1e6

over every recorded step without swaps, weighted for least relative error, refitted once
without the steps whose relative residual is more than 5x the median (a compile, a stall
of the host). At one block size the blocks a
step touches are about context / block_size + seqs / 2, so their term cannot be told apart
from the context term: it is fixed (``--block-us``, from benchmarks/bench_block_size.py's
kernel sweep; default 0) unless ``--fit-blocks`` asks for it (records at several block
sizes).

    python -m load_tests.fit_steps docs/paper/h200/*.json [--block-us 0.4] [--json-out FIT.json]
    python -m load_tests.fit_steps docs/paper/h200/*.json \
        --block-us-from docs/paper/h200/kernel-block-size.json --json-out FIT.json

Files without step records (the kernel sweep's JSON, an earlier fit) are skipped. The JSON
holds the constants, the files and devices they came from, and the flags; it is what
``load_tests.paper_sharing --calibration`` and ``load_tests.plot_sharing --calibration`` read.

Prints the constants, the fit's error (RMS and median relative error per step, R^2) per
file and pooled, and the ``load_tests.bench --sim-*`` flags that use them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import numpy as np

from load_tests.steps import StepRecord, records_from_dict

OUTLIER_FACTOR = 5.0


@dataclass(slots=True)
class StepFit:
    base_ms: float
    per_token_ms: float
    per_kv_token_us: float
    per_block_us: float
    steps: int  # steps fitted
    dropped: int  # outliers left out of the refit
    rms_rel_err: float  # of the fitted steps' predicted times
    median_rel_err: float
    r2: float

    def predict(self, computed: np.ndarray, context: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        return (self.base_ms + self.per_token_ms * computed) / 1e3 + (
            self.per_kv_token_us * context + self.per_block_us * blocks
        ) / 1e6

    def flags(self) -> list[str]:
        return [
            "--sim-base-ms",
            f"{self.base_ms:.6g}",
            "--sim-token-ms",
            f"{self.per_token_ms:.6g}",
            "--sim-kv-us",
            f"{self.per_kv_token_us:.6g}",
            "--sim-block-us",
            f"{self.per_block_us:.6g}",
        ]


def _columns(records: list[StepRecord]) -> tuple[np.ndarray, ...]:
    a = np.array(
        [(r.seconds, r.computed, r.context, r.blocks) for r in records if not r.swapped and r.seqs],
        dtype=float,
    ).reshape(-1, 4)
    return a[:, 0], a[:, 1], a[:, 2], a[:, 3]


def fit_step_cost(
    records: list[StepRecord], block_us: float = 0.0, fit_blocks: bool = False
) -> StepFit:
    """``block_us``: the per-block cost to hold fixed (ignored with ``fit_blocks``)."""
    y, computed, context, blocks = _columns(records)
    n_terms = 4 if fit_blocks else 3
    if len(y) < 2 * n_terms:
        raise ValueError(f"{len(y)} steps without swaps: too few to fit {n_terms} constants")
    # Columns in the constants' units: ms, ms per token, us per context token, us per block.
    x = np.column_stack([np.full_like(y, 1e-3), computed * 1e-3, context * 1e-6, blocks * 1e-6])
    target = y if fit_blocks else y - block_us * blocks * 1e-6
    # Weighted by 1 / seconds: least relative error, so a 10 ms decode step counts as much
    # as a 100 ms prefill step (plain least squares would fit the long steps only).
    x, w = x[:, :n_terms], 1.0 / np.maximum(y, 1e-9)
    coef, *_ = np.linalg.lstsq(x * w[:, None], target * w, rcond=None)
    resid = np.abs(target - x @ coef) * w
    keep = resid <= OUTLIER_FACTOR * max(float(np.median(resid)), 1e-12)
    coef, *_ = np.linalg.lstsq(x[keep] * w[keep, None], target[keep] * w[keep], rcond=None)
    per_block = float(coef[3]) if fit_blocks else block_us
    fit = StepFit(
        float(coef[0]),
        float(coef[1]),
        float(coef[2]),
        per_block,
        int(keep.sum()),
        int((~keep).sum()),
        0.0,
        0.0,
        0.0,
    )
    fit.rms_rel_err, fit.median_rel_err, fit.r2 = errors(
        fit, y[keep], computed[keep], context[keep], blocks[keep]
    )
    return fit


def errors(fit: StepFit, y, computed, context, blocks) -> tuple[float, float, float]:
    """(RMS relative error, median relative error, R^2) of ``fit`` on these steps."""
    pred = fit.predict(computed, context, blocks)
    rel = (pred - y) / np.maximum(y, 1e-12)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((pred - y) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return float(np.sqrt((rel**2).mean())), float(np.median(np.abs(rel))), r2


COMPUTED_BINS = (1, 64, 256, 512, 1024, 1600, 4096)
SEQS_BINS = (1, 32, 64, 128, 192, 257)


def residuals(fit: StepFit, records: list[StepRecord]) -> dict:
    """Where the fit is off: measured against predicted mean step time by tokens computed and
    by sequences per step, and the total (capacity follows the total, not the median step)."""
    y, computed, context, blocks = _columns(records)
    seqs = np.array([r.seqs for r in records if not r.swapped and r.seqs], dtype=float)
    pred = fit.predict(computed, context, blocks)

    def by(col: np.ndarray, edges: tuple[int, ...]) -> list[dict]:
        out = []
        for lo, hi in zip(edges, edges[1:]):
            m = (col >= lo) & (col < hi)
            if m.any():
                ms = float(y[m].mean() * 1e3), float(pred[m].mean() * 1e3)
                out.append(
                    {"from": lo, "to": hi, "steps": int(m.sum()), "ms": ms[0], "fit_ms": ms[1]}
                )
        return out

    return {
        "fit_over_measured_total": float(pred.sum() / y.sum()) if len(y) else None,
        "by_computed": by(computed, COMPUTED_BINS),
        "by_seqs": by(seqs, SEQS_BINS),
    }


def load_records(path: str) -> list[StepRecord]:
    """Step records of a capacity point (``steps`` at the top) or of a sweep (per run)."""
    return _load(path)[0]


def _load(path: str) -> tuple[list[StepRecord], str]:
    """A file's step records and the device they were measured on."""
    with open(path) as f:
        d = json.load(f)
    device = d.get("device") or (d.get("hardware") or {}).get("gpu") or "unknown"
    blocks = (
        [d["steps"]] if "steps" in d else [r["steps"] for r in d.get("runs", []) if r.get("steps")]
    )
    return [rec for b in blocks for rec in records_from_dict(b)], device


def kernel_block_us(path: str) -> float:
    """The per-block cost per step (all layers) that the kernel sweep measured."""
    with open(path) as f:
        fit = json.load(f).get("block_cost_fit") or {}
    if fit.get("sim_block_us") is None:
        raise SystemExit(f"error: {path} holds no block_cost_fit.sim_block_us")
    return float(fit["sim_block_us"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.fit_steps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="+", help="capacity-point or sweep JSON with step records")
    p.add_argument(
        "--block-us",
        type=float,
        default=0.0,
        help="per-block cost held fixed (us per block touched)",
    )
    p.add_argument(
        "--block-us-from",
        default=None,
        metavar="KERNEL_JSON",
        help="take --block-us from benchmarks/bench_block_size.py's JSON (block_cost_fit."
        "sim_block_us); files in the list that hold no steps (such a JSON) are skipped",
    )
    p.add_argument(
        "--fit-blocks", action="store_true", help="fit the per-block term too (several block sizes)"
    )
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.block_us_from:
        args.block_us = kernel_block_us(args.block_us_from)
    loaded = {path: _load(path) for path in args.files}
    for path in [p for p, (recs, _) in loaded.items() if not recs]:
        print(f"skipped {path}: no step records")
        del loaded[path]
    args.files = list(loaded)
    per_file = {path: recs for path, (recs, _) in loaded.items()}
    pooled = [r for recs in per_file.values() for r in recs]
    try:
        fit = fit_step_cost(pooled, args.block_us, args.fit_blocks)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{'file':<48}{'steps':>7}{'mean ms':>9}{'rms err':>9}{'median err':>11}")
    for path, recs in per_file.items():
        y, c, x, b = _columns(recs)
        if len(y):
            rms, med, _ = errors(fit, y, c, x, b)
            print(f"{path[-48:]:<48}{len(y):>7}{y.mean() * 1e3:>9.2f}{rms:>9.1%}{med:>11.1%}")
    print(
        f"\npooled: {fit.steps} steps ({fit.dropped} outliers dropped), RMS relative error "
        f"{fit.rms_rel_err:.1%}, median {fit.median_rel_err:.1%}, R^2 {fit.r2:.3f}"
    )
    print(
        f"step = {fit.base_ms:.3f} ms + {fit.per_token_ms:.4f} "
        f"ms x computed + {fit.per_kv_token_us:.4f} us x context"
        f" + {fit.per_block_us:.4f} us x blocks{'' if args.fit_blocks else ' (fixed)'}"
    )
    if min(fit.base_ms, fit.per_token_ms, fit.per_kv_token_us, fit.per_block_us) < 0:
        print("warning: a negative constant: these steps do not separate that term (see the error)")
    print("load_tests.bench flags: " + " ".join(fit.flags()))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "fit": asdict(fit),
                    "files": args.files,
                    "devices": [loaded[p][1] for p in args.files],
                    "steps_per_file": {p: len(r) for p, r in per_file.items()},
                    "errors_per_file": {
                        p: dict(zip(("rms_rel_err", "median_rel_err"), errors(fit, *_columns(r))))
                        for p, r in per_file.items()
                        if r
                    },
                    "residuals": residuals(fit, pooled),
                    "residuals_per_file": {p: residuals(fit, r) for p, r in per_file.items()},
                    "block_us_fixed": not args.fit_blocks,
                    "flags": fit.flags(),
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
