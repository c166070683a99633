"""``observe_many``: n observations of one value at the cost of one, identical to n calls
of ``observe`` in every bucket, the count and (up to rounding) the sum."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from streamkv.entrypoints.server.metrics import observe_many


def test_observe_many_equals_repeated_observe():
    one, many = CollectorRegistry(), CollectorRegistry()
    a = Histogram("h", "d", ["m"], registry=many, buckets=(0.01, 0.1, 1)).labels("x")
    b = Histogram("h", "d", ["m"], registry=one, buckets=(0.01, 0.1, 1)).labels("x")
    for amount, n in [(0.005, 3), (0.05, 2), (5.0, 4), (0.1, 1), (0.01, 7)]:
        observe_many(a, amount, n)
        for _ in range(n):
            b.observe(amount)
    for bound in ("0.01", "0.1", "1.0", "+Inf"):
        labels = {"m": "x", "le": bound}
        assert many.get_sample_value("h_bucket", labels) == one.get_sample_value("h_bucket", labels)
    assert (
        many.get_sample_value("h_count", {"m": "x"})
        == one.get_sample_value("h_count", {"m": "x"})
        == 17
    )
    assert many.get_sample_value("h_sum", {"m": "x"}) == pytest.approx(
        one.get_sample_value("h_sum", {"m": "x"})
    )
