"""The harness pieces behind docs/paper.md's Figs 14-19: the simulator charges swaps, and
--reserve-shared-prefix registers the workload's common prefix (computed once, pinned)."""

from __future__ import annotations

import pytest

from load_tests.sim import StepCost
from load_tests.workloads import BenchRequest
from streamkv.messages import StepInput


def test_a_swap_costs_its_blocks_each_way():
    cost = StepCost(
        base_ms=20.0,
        per_token_ms=0.0,
        per_kv_token_us=0.0,
        swap_block_us=10.0,
        swap_token_us=30.0,
        block_size=16,
    )
    idle = cost.seconds(StepInput())
    swapping = cost.seconds(StepInput(swap_out=[(0, 0), (1, 1)], swap_in=[(2, 5)]))
    assert swapping - idle == pytest.approx(3 * (10 + 16 * 30) / 1e6)


def test_reserve_common_prefix_on_the_simulated_engine():
    from load_tests.bench import reserve_common_prefix
    from load_tests.sim import SimulatedExecutor, VirtualClock
    from streamkv.engine.llm_engine import LLMEngine
    from streamkv.entrypoints.llm import engine_config

    clock = VirtualClock()
    config = engine_config(
        "opt-13b",
        block_size=16,
        num_kv_blocks=64,
        num_swap_blocks=0,
        max_model_len=2048,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config, SimulatedExecutor("opt-13b", 64, 0, StepCost(), clock))
    prefix = list(range(1000, 1040))  # 40 tokens: 2 whole blocks
    requests = [BenchRequest(prefix + [i, 5], 4) for i in range(3)]
    assert reserve_common_prefix(engine, requests) == {"tokens": 40, "blocks": 2}
    assert engine.stats()["num_pinned_kv_blocks"] == 2
    assert engine.stats()["num_prompt_tokens"] == 40
    engine.shutdown()


def test_a_calibrated_rerun_uses_the_fit_and_says_so(tmp_path, capsys):
    """paper_sharing --calibration runs on the fit's constants and records it; plot_sharing
    captions the figure with it and refuses a fit the runs did not use."""
    import json

    from load_tests import paper_sharing, plot_sharing

    fit = {
        "fit": {
            "base_ms": 8.0,
            "per_token_ms": 0.03,
            "per_kv_token_us": 0.2,
            "per_block_us": 1.5,
            "steps": 5000,
            "median_rel_err": 0.04,
            "rms_rel_err": 0.06,
        },
        "files": ["docs/paper/h200/sharegpt-paged-20.json"],
        "devices": ["NVIDIA H200"],
    }
    path, out = tmp_path / "fit.json", tmp_path / "runs"
    path.write_text(json.dumps(fit))
    argv = ["fig16", "--num-requests", "12", "--rates", "40,400", "--out", str(out)]
    assert paper_sharing.main([*argv, "--calibration", str(path)]) == 0
    run = json.loads((out / "fig16-5shot-paged.json").read_text())
    assert (run["args"]["sim_base_ms"], run["args"]["sim_block_us"]) == (8.0, 1.5)
    saved = json.loads((out / "calibration.json").read_text())
    assert "NVIDIA H200" in saved["caption"] and "sharegpt-paged-20" in saved["caption"]
    capsys.readouterr()
    assert plot_sharing.main(["fig16", "--dir", str(out), "--calibration", str(path)]) == 0
    assert "capacity" in capsys.readouterr().out and (out / "fig16.png").exists()
    fit["fit"]["base_ms"] = 20.0
    path.write_text(json.dumps(fit))
    with pytest.raises(SystemExit, match="did not run on the --calibration"):
        plot_sharing.main(["fig16", "--dir", str(out), "--calibration", str(path)])
