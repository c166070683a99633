"""The opt-in per-rank step profile (executor/step_profile.py): at TP 2 on gloo every rank
writes the split of its step time, with the layers' all-reduces among the collectives."""

from __future__ import annotations

import json

import pytest

from streamkv import SamplingParams
from streamkv.entrypoints.llm import LLM

KW = {
    "device": "cpu",
    "dtype": "float32",
    "num_kv_blocks": 64,
    "num_swap_blocks": 0,
    "max_model_len": 128,
}

# Starts two worker processes: seconds on a 2-core box.
pytestmark = pytest.mark.slow


def test_every_rank_writes_its_step_split(tiny4_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMKV_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("STREAMKV_PROFILE_STEPS", "2,4")
    llm = LLM(str(tiny4_dir), **KW, tensor_parallel_size=2)
    try:
        llm.generate(
            None, SamplingParams(max_tokens=10, ignore_eos=True), prompt_token_ids=[[5, 6, 7]]
        )
    finally:
        llm.shutdown()
    for rank in (0, 1):
        split = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert split["rank"] == rank and split["steps"] == 4 and split["clock"] == "cpu"
        assert 0 < split["collective_ms_per_step"] <= split["profiled_ms_per_step"]
        assert split["wall_ms_per_step"] > 0
        assert any(
            "allreduce" in k.lower() or "all_reduce" in k.lower()
            for k in split["collective_ops_ms_per_step"]
        )
