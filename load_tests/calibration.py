"""A StepCost fitted to measured steps (``load_tests.fit_steps --json-out FIT.json``), as the
modelled figures' reruns use it: the ``load_tests.bench --sim-*`` flags it implies, and the
caption every figure drawn with it carries, naming the measurements that calibrated it.

Without a fit the simulator runs on its first-principles constants (load_tests/sim.py), and
the caption says "uncalibrated", so a figure never claims a calibration it did not have.
"""

from __future__ import annotations

import json
import os

SIM_FLAGS = (
    ("base_ms", "--sim-base-ms"),
    ("per_token_ms", "--sim-token-ms"),
    ("per_kv_token_us", "--sim-kv-us"),
    ("per_block_us", "--sim-block-us"),
)
UNCALIBRATED = "modelled (uncalibrated StepCost: first-principles A100 constants)"


def load_fit(path: str) -> dict:
    """A fit_steps JSON, checked for the constants the flags need."""
    with open(path) as f:
        fit = json.load(f)
    missing = [k for k, _ in SIM_FLAGS if k not in fit.get("fit", {})]
    if missing:
        raise SystemExit(f"error: {path} is not a load_tests.fit_steps --json-out ({missing})")
    return fit


def sim_flags(fit: dict | None) -> list[str]:
    """The ``load_tests.bench`` flags of a fit (none without one: the simulator's defaults)."""
    if fit is None:
        return []
    return [x for key, flag in SIM_FLAGS for x in (flag, f"{fit['fit'][key]:.6g}")]


def speedup(fit: dict | None) -> float:
    """How many times faster a fitted model runs a typical ShareGPT decode step (32
    sequences of ~400 context tokens, 16-token blocks) than the default StepCost: the factor
    by which a figure's rate sweep moves so that it still crosses the knee."""
    from load_tests.sim import StepCost

    if fit is None:
        return 1.0
    seqs, context, blocks = 32, 32 * 400, 32 * 25

    def ms(base: float, token: float, kv_us: float, block_us: float) -> float:
        return base + token * seqs + (kv_us * context + block_us * blocks) / 1e3

    d, f = StepCost(), fit["fit"]
    default = ms(d.base_ms, d.per_token_ms, d.per_kv_token_us, d.per_block_us)
    fitted = ms(f["base_ms"], f["per_token_ms"], f["per_kv_token_us"], f["per_block_us"])
    if fitted <= 0:
        raise SystemExit("error: the fit predicts a step of no time: check its constants")
    return default / fitted


def caption(fit: dict | None, names: bool = False) -> str:
    """What a figure drawn on this model says about it (``names``: the runs' files too)."""
    if fit is None:
        return UNCALIBRATED
    f, files = fit["fit"], fit["files"]
    devices = ", ".join(sorted(set(fit.get("devices") or []))) or "measured"
    where = os.path.commonpath(files) if files else ""
    where = os.path.dirname(where) if where in files else where  # one file: its directory
    text = (
        f"calibrated model: StepCost fitted to {f['steps']:,} steps of {len(files)} "
        f"{devices[:48]} runs{f' in {where}' if where else ''} "
        f"(median error {f['median_rel_err']:.1%})"
    )
    if names:
        text += ": " + ", ".join(os.path.splitext(os.path.basename(p))[0] for p in files)
    return text


def matches(args: dict, fit: dict, tol: float = 1e-4) -> bool:
    """Whether a run's recorded ``args`` used this fit's constants (so its caption is true)."""
    for key, flag in SIM_FLAGS:
        ran, want = args.get(flag[2:].replace("-", "_")), float(f"{fit['fit'][key]:.6g}")
        if ran is None or abs(ran - want) > tol * max(abs(want), 1e-9):
            return False
    return True
