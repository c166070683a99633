"""benchmarks/bench_shared_burst.py: its --help and prompt builders, and, slow, a tiny burst
on the CPU where the cache-on run computes the shared system prompt once."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_shared_burst as bsb


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bsb.main(["--help"])
    assert exit_info.value.code == 0
    assert "SHARE_LATER" in capsys.readouterr().out


def test_questions_are_distinct_past_the_combinations():
    assert len(set(bsb.questions(100))) == 100


@pytest.mark.slow
def test_tiny_burst_computes_the_system_prompt_once(tmp_path):
    out = tmp_path / "burst.json"
    assert bsb.main(["--num-requests", "4", "--max-output-len", "2", "--json-out", str(out)]) == 0
    on, off = json.loads(out.read_text())["rows"]
    block = 16  # the default block size: only the system prompt's whole blocks are shared
    shared = on["system_tokens"] // block * block
    assert on["prefix_cache_hits"] == 3 * shared
    assert on["prompt_tokens_computed"] == on["prompt_tokens_sent"] - 3 * shared
    assert off["prompt_tokens_computed"] == off["prompt_tokens_sent"]
    assert off["prefix_cache_hits"] == 0
