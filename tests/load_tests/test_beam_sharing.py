"""load_tests/beam_sharing.py (Fig 15's beam rows): the same requests through the simulated
executor's random scores and through the embedded model's real logits."""

from __future__ import annotations

from argparse import Namespace

import pytest

from load_tests.beam_sharing import measure, real_engine, simulated_engine
from load_tests.workloads import BenchRequest


def requests(width: int, output_len: int) -> list[BenchRequest]:
    return [BenchRequest(list(range(100 + i, 140 + i)), output_len, width, width) for i in range(2)]


def args() -> Namespace:
    return Namespace(model=None, device="cpu", block_size=16, num_kv_blocks=256, seed=0)


def test_simulated_beams_share_their_prompt_and_history():
    narrow = measure(simulated_engine, args(), requests(2, 48))
    wide = measure(simulated_engine, args(), requests(6, 48))
    assert narrow["completed"] == wide["completed"] == 2
    assert 0.2 < narrow["sharing_savings"] < wide["sharing_savings"] < 1.0


@pytest.mark.slow
def test_real_logits_beam_search_completes_and_shares():
    row = measure(real_engine, args(), requests(2, 16))
    assert row["completed"] == 2 and row["output_tokens"] == 2 * 2 * 16
    assert 0.0 < row["sharing_savings"] < 1.0
