"""Arrival processes: the rate and the burstiness (coefficient of variation of the gaps)
that a seeded run produces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from load_tests.arrivals import arrival_times, parse_rates


@pytest.mark.parametrize("rate", [0.5, 4.0, 200.0])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_rate_and_burstiness_match(rate, burstiness):
    times = arrival_times(20000, rate, burstiness, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert len(gaps) / times[-1] == pytest.approx(rate, rel=0.05)
    # Gamma(k) gaps have a coefficient of variation of 1/sqrt(k): 1 for Poisson.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_seeded_and_infinite_rate():
    assert arrival_times(50, 3.0, seed=7) == arrival_times(50, 3.0, seed=7)
    assert arrival_times(50, 3.0, seed=7) != arrival_times(50, 3.0, seed=8)
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0.0)
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError, match="not a request rate"):
        parse_rates("1,fast")
    with pytest.raises(ValueError, match="> 0"):
        parse_rates("-1")
