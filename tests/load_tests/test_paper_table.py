"""docs/paper.md's one table (load_tests/paper_table.py) and the calibrated model's wiring
(load_tests/calibration.py): capacity ratios from a tiny synthetic directory, "not run" where
an input is missing, and a fit at several block sizes that recovers the simulator's own
constants, per-block term included, then drives the reruns' flags and captions."""

from __future__ import annotations

import json

import pytest

from load_tests import calibration, paper_rows, paper_sharing, paper_table
from load_tests.capacity import capacity_ratio, sweep_capacity

H200 = "NVIDIA H200"


def point(system, workload, rate, done, batched, token, overloaded=True, bs=16, device=H200):
    return {
        "figure": "12",
        "system": system if bs == 16 else f"{system}-b{bs}",
        "workload": workload,
        "num_requests": 1000,
        "request_rate": rate,
        "completed_req_s": done,
        "overloaded": overloaded,
        "normalized_latency_s_per_token": 1.5,
        "avg_batched_requests": batched - 1,
        "batched_while_arriving": batched,
        "kv_shares": {"token": token, "reserved": 1 - token, "internal": 0.0, "external": 0.0},
        "device": device,
        "block_size": bs,
    }


def write(directory, name, record):
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(record))


@pytest.fixture
def h200(tmp_path):
    d = tmp_path / "h200"
    write(d, "sharegpt-paged-20", point("paged", "sharegpt", 20, 6.0, 42.0, 0.97))
    write(d, "sharegpt-orca-oracle-12", point("orca-oracle", "sharegpt", 12, 4.0, 21.0, 0.5))
    write(d, "sharegpt-orca-max-5", point("orca-max", "sharegpt", 5, 1.5, 7.0, 0.17))
    # The knee point below capacity is a cross-check, not the capacity.
    write(d, "sharegpt-orca-oracle-5", point("orca-oracle", "sharegpt", 5, 4.9, 20.0, 0.5, False))
    write(d, "sharegpt-paged-b1-20", point("paged", "sharegpt", 20, 5.0, 40.0, 0.99, bs=1))
    write(d, "alpaca-paged-400", point("paged", "alpaca", 400, 100.0, 130.0, 0.9, False))
    write(d, "alpaca-orca-oracle-200", point("orca-oracle", "alpaca", 200, 80.0, 60.0, 0.3))
    rows = [
        {"block_size": b, "paged_over_contiguous": r, "batch": 8, "context": 64}
        for b, r in ((16, 1.1), (16, 1.3), (1, 3.0))
    ]
    write(d, "kernel-block-size", {"device": H200, "rows": rows, "block_cost_fit": None})
    return d


def by_claim(table: dict) -> dict[str, dict]:
    return {r["what"]: r for r in table["rows"]}


def test_capacity_batched_waste_and_kernel_ratios(h200):
    rows = by_claim(paper_table.build(str(h200), None))
    oracle = rows["sharegpt: paged ÷ orca-oracle, capacity"]
    assert oracle["value"] == pytest.approx(1.5) and oracle["ours"].startswith("1.50x")
    assert oracle["source"] == f"real ({H200})" and "1,000 req @ 12/s" in oracle["trace"]
    assert rows["sharegpt: paged ÷ orca-max, capacity"]["value"] == pytest.approx(4.0)
    # paged was not past its knee on Alpaca: its capacity, so the ratio, is a lower bound.
    assert rows["alpaca: paged ÷ orca-oracle, capacity"]["ours"].startswith(">= 1.25x")
    assert rows["sharegpt: batched, paged ÷ orca-oracle"]["value"] == pytest.approx(2.0)
    assert rows["sharegpt: batched, paged ÷ orca-max"]["value"] == pytest.approx(6.0)
    assert rows["sharegpt: orca-max's token states"]["ours"].startswith("17.0%")
    assert rows["paged kernel ÷ contiguous at block 16"]["value"] == pytest.approx(1.2)
    assert rows["sharegpt: best block size (capacity)"]["value"] == 16
    # The knee point sits beside its system's overloaded point; Alpaca's paged point has no
    # overloaded twin, so it makes no knee row.
    knee = [r for r in rows.values() if r["figure"] == "12 knee"]
    assert [r["what"] for r in knee] == [
        "sharegpt: orca-oracle's normalized latency below / past capacity"
    ]
    assert "at 5.0 req/s offered" in knee[0]["ours"] and "(capacity 4.00)" in knee[0]["ours"]


def test_model_check_sets_the_model_beside_the_device(h200, tmp_path):
    model = tmp_path / "check"
    sim = "simulated StepCost (fitted)"
    write(model, "sharegpt-paged-20", point("paged", "sharegpt", 20, 6.6, 40.0, 0.97, device=sim))
    write(model, "sharegpt-ft-max-3", point("ft-max", "sharegpt", 3, 1.0, 3.0, 0.1, device=sim))
    table = paper_table.build(str(h200), None, str(model))
    # Only points the device measured too; ft-max has no H200 point here.
    (check,) = table["model_check"]
    assert (check["system"], check["real_req_s"], check["model_req_s"]) == ("paged", 6.0, 6.6)
    assert check["model_over_real"] == pytest.approx(1.1)
    assert "| sharegpt | paged | 6.00 | 6.60 | 1.10x | 42.0 / 40.0 |" in paper_table.markdown(table)


def test_missing_inputs_say_not_run(h200, tmp_path):
    table = paper_table.build(str(h200), str(tmp_path / "no-reruns"))
    rows = by_claim(table)
    for claim in (
        "sharegpt: paged ÷ orca-pow2, capacity",
        "sharegpt: paged ÷ ft-max, capacity",
        "StepCost fitted to the measured steps",
        "chat: paged ÷ orca-max, capacity",
        "sharegpt: memory saved, beam width 2/4/6",
    ):
        assert (rows[claim]["ours"], rows[claim]["source"]) == ("not run", "not run"), claim
    md = paper_table.markdown(table)
    assert md.count("\n| ") >= len(table["rows"]) and "| 1 | 3.00x |" in md


def test_main_writes_markdown_and_json(h200, tmp_path, capsys):
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    assert paper_table.main(["--dir", str(h200), "--md-out", str(md), "--json-out", str(js)]) == 0
    assert "| 12a |" in capsys.readouterr().out and "| 12a |" in md.read_text()
    assert len(json.loads(js.read_text())["rows"]) > 10


def test_capacity_ratio_bounds_and_sweep_capacity():
    assert capacity_ratio(6, True, 4, True) == "1.50x"
    assert capacity_ratio(6, False, 4, True) == ">= 1.50x"
    assert capacity_ratio(6, True, 4, False) == "<= 1.50x"
    assert capacity_ratio(None, True, 4, True) == "not run"
    runs = [(1, 0.9, False), (4, 3.0, True), (8, 2.8, True)]
    sweep = {"runs": [{"capacity": {"completed_req_s": c, "overloaded": o}} for _, c, o in runs]}
    assert sweep_capacity(sweep) == (3.0, True)


def simulated_point(tmp_path, block_size: int) -> str:
    from load_tests import bench

    out = tmp_path / "h200"
    argv = ["--backend", "offline", "--simulate", "--model", "opt-13b", "--disable-tqdm"]
    argv += ["--num-kv-blocks", str(3200 // block_size), "--block-size", str(block_size)]
    argv += ["--num-swap-blocks", "0", "--no-enable-prefix-caching", "--workload", "alpaca"]
    argv += ["--num-requests", "40", "--request-rate", "200", "--record-steps", "300"]
    argv += ["--sim-base-ms", "9", "--sim-token-ms", "0.03", "--sim-kv-us", "0.25"]
    argv += ["--sim-block-us", "3", "--point-dir", str(out), "--label", f"paged-b{block_size}"]
    assert bench.main([*argv, "--json-out", str(tmp_path / f"sweep-{block_size}.json")]) == 0
    return str(out / f"alpaca-paged-b{block_size}-200.json")


def test_fit_at_several_block_sizes_recovers_the_simulator_and_drives_the_reruns(tmp_path):
    """Points at block sizes 1 and 64 separate the per-block term from the context term;
    the fit's JSON then gives the reruns their flags, rates and caption."""
    from load_tests import fit_steps

    files = [simulated_point(tmp_path, b) for b in (1, 64)]
    out = tmp_path / "fit.json"
    assert fit_steps.main([*files, "--fit-blocks", "--json-out", str(out)]) == 0
    fit = calibration.load_fit(str(out))
    got = [fit["fit"][k] for k in ("base_ms", "per_token_ms", "per_kv_token_us", "per_block_us")]
    assert got == pytest.approx([9, 0.03, 0.25, 3], rel=1e-3)
    assert fit["flags"] == calibration.sim_flags(fit)
    args = json.loads((tmp_path / "sweep-1.json").read_text())["args"]
    assert calibration.matches(args, fit)
    assert not calibration.matches({**args, "sim_kv_us": 0.55}, fit)
    text = calibration.caption(fit)
    assert text.startswith("calibrated model: StepCost fitted to") and "2 simulated" in text
    common = paper_sharing.common(16, fit)
    assert common[: len(fit["flags"])] == fit["flags"]
    ns = type("Args", (), {"rates": None, "fit": fit})
    scaled = paper_sharing.default_rates(ns, "5,10").split(",")
    assert float(scaled[0]) == pytest.approx(5 * calibration.speedup(fit), rel=1e-2)
    assert calibration.speedup(None) == 1.0 and calibration.caption(None).startswith("modelled")


def test_plot_capacity_draws_what_it_has(h200, tmp_path):
    from load_tests import plot_capacity

    out = tmp_path / "png"
    assert plot_capacity.main(["--dir", str(h200), "--out", str(out)]) == 0
    # No point carries the engine's KV window here, so no Fig 2 bars.
    assert sorted(p.name for p in out.iterdir()) == [
        "batched.png",
        "blocks.png",
        "capacity.png",
        "kernel.png",
    ]


def test_measured_rows_read_fig19a_fig15_real_and_fig19b(tmp_path):
    swap = [
        {"block_size": b, "context_len": 2000, "swap_ms": ms, "recompute_ms": 88.0}
        for b, ms in ((1, 98.0), (256, 63.0))
    ]
    write(tmp_path, "swap-recompute-h200", {"source": f"bench on {H200}, wall", "swap": swap})
    beam = [
        {"workload": "alpaca", "requests": 6, "real": {"sharing_savings": s}} for s in (0.4, 0.5)
    ]
    write(tmp_path / "sharing", "fig15-beam-real", {"args": {"max_output_len": 64}, "rows": beam})
    modelled = tmp_path / "cal"
    for mode, bs, latency in (("swap", 1, 0.2), ("recompute", 1, 0.1), ("swap", 16, 0.1)):
        run = {"summary": {"normalized_latency_s": latency}}
        write(modelled, f"fig19b-{mode}-b{bs}", {"args": {"num_requests": 2000}, "runs": [run]})
    rows = paper_rows.measured_rows(str(tmp_path), str(modelled))
    assert rows[0].ours == "swap 98.0 ms at block 1, 63.0 at 256; recompute 88.0 ms"
    assert rows[0].source == f"real ({H200})"
    assert rows[1].ours == "40.0 / 50.0%" and rows[2].ours == "not run"
    assert rows[3].ours == "recompute at 1; swap at 16" and rows[3].trace.startswith("2,000 req")
    assert rows[3].source.startswith("modelled (uncalibrated")  # no calibration.json there
