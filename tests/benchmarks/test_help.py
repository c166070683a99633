"""Every benchmark script answers --help on the CPU box: its flags parse, and whatever it
imports before parsing is importable without a GPU (most of them run only on the H200)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# The scripts, not the helpers they import: a script has a __main__ block.
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if "__main__" in p.read_text())


def test_the_list_is_not_empty() -> None:
    assert "bench_throughput.py" in SCRIPTS and "bench_kernels.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]
