"""Open-loop arrival times: a Poisson process, or a gamma renewal process for bursts.

Inter-arrival gaps are Gamma(shape=burstiness, scale=1 / (rate * burstiness)): the mean gap
is always 1 / rate; burstiness 1 is the Poisson process (exponential gaps), below 1 the
gaps' coefficient of variation 1 / sqrt(burstiness) grows (bursts and lulls), above 1 the
arrivals get more regular. The same convention as ``vllm bench serve``.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of ``num`` requests is sent. ``rate`` is
    requests per second; ``math.inf`` sends every request at once."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 (inf for all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    # The first request goes at time 0: a run's clock starts with it.
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def parse_rates(text: str) -> list[float]:
    """``"1,2,4.5,inf"`` -> [1.0, 2.0, 4.5, inf] (a sweep), each > 0."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(
                f"not a request rate: {part!r} (numbers or 'inf', comma-separated)"
            ) from None
        if not rate > 0:
            raise ValueError(f"request rates must be > 0, got {part}")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates
