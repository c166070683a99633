"""A modelled device and the warm-up's steps for the prefill cap's tests
(core/step_budget.py, core/step_cost_fit.py)."""

import random

from streamkv.core.step_budget import StepCostModel

A, B, C, E, F = 4e-3, 30e-6, 25e-6, 1.5e-3, 15e-6  # a modelled device (see ``cost``)


def cost(d: int, p: int, a=A, b=B, c=C, e=E, f=F) -> float:
    """t = a + b*d + c*p + [p > 0] * (e + f*d): core/step_budget.py's model."""
    return a + b * d + c * p + ((e + f * d) if p else 0.0)


def feed(model: StepCostModel, n: int = 200, noise: float = 0.0, seed: int = 0, **device) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        d, p = rng.randint(1, 256), rng.choice([0, 0, rng.randint(1, 2048)])
        model.observe(d, p, cost(d, p, **device) * (1 + rng.uniform(-noise, noise)))


WARMUP = [(1, 0), (32, 0), (128, 0), (256, 0), (1, 256), (32, 128), (32, 512), (128, 256), (256, 128),
          (256, 512), (0, 256), (0, 512)]


def seeded(**device) -> StepCostModel:
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, cost(d, p, **device)) for d, p in WARMUP])
    return m


SIZES = (16, 32, 64, *range(128, 2049, 128))  # worker/piecewise_graphs.token_buckets(2048)


def padded_cost(d: int, p: int) -> float:
    """The modelled device running a mixed step at the smallest size that holds it."""
    return cost(d, next(s for s in SIZES if s >= d + p) - d) if p else cost(d, 0)
