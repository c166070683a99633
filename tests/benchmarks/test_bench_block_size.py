"""benchmarks/bench_block_size.py (the paper's Fig 18a): its torch path on tiny shapes on the
CPU, and the CUDA kernel at every block size where a GPU is present."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_block_size as bbs


def test_tiny_cpu_sweep_agrees_with_contiguous_and_writes_json(tmp_path):
    out = tmp_path / "bs.json"
    assert bbs.main(["--tiny", "--device", "cpu", "--iters", "1", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["block_size"] for r in result["rows"]] == [1, 4, 16, 64] * 2
    assert all(
        r["rel_err"] < 1e-5 and r["paged_us"] > 0 and r["contiguous_us"] > 0 for r in result["rows"]
    )
    assert result["rows"][0]["blocks"] == 2 * 16 and result["rows"][-1]["blocks"] == 2 * 1
    assert result["kernel_block_sizes"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert result["block_cost_fit"] is not None


def test_fit_block_cost_recovers_a_known_per_block_cost():
    rows = [
        {
            "block_size": b,
            "tokens": n * c,
            "blocks": n * -(-c // b),
            "paged_us": 5.0 + 0.01 * n * c + 0.2 * n * -(-c // b),
        }
        for b in (1, 4, 16)
        for n in (8, 32)
        for c in (64, 256)
    ]
    fit = bbs.fit_block_cost(rows)
    assert fit["per_block_us"] == pytest.approx(0.2) and fit["per_token_us"] == pytest.approx(0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA decode kernel needs a GPU")
def test_cuda_kernel_at_every_block_size(tmp_path):
    out = tmp_path / "bs.json"
    argv = ["--batch-sizes", "8", "--contexts", "64", "--iters", "3", "--json-out", str(out)]
    assert bbs.main(argv) == 0
    assert [r["block_size"] for r in json.loads(out.read_text())["rows"]] == [
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        128,
        256,
    ]
