"""The prompt cap that keeps a step with decodes within a ratio of a decode-only step."""

import random

from streamkv.core.step_budget import MIN_STEPS, StepCostModel


def feed(model: StepCostModel, a: float, b: float, c: float, e: float = 0.0, n: int = 200, noise: float = 0.0,
         seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        d, p = rng.randint(0, 256), rng.choice([0, 0, rng.randint(1, 2048)])
        model.observe(d, p, (a + b * d + c * p + (e if p else 0.0)) * (1 + rng.uniform(-noise, noise)))


def test_fit_recovers_a_linear_cost():
    m = StepCostModel(ratio=2.0)
    feed(m, 4e-3, 30e-6, 25e-6, e=1.5e-3)
    a, b, c, e = m.coefficients()
    assert abs(a - 4e-3) < 1e-6 and abs(b - 30e-6) < 1e-8 and abs(c - 25e-6) < 1e-8 and abs(e - 1.5e-3) < 1e-6


def test_cap_keeps_the_predicted_step_within_the_ratio():
    m = StepCostModel(ratio=2.0)
    feed(m, 4e-3, 30e-6, 25e-6, e=1e-3, noise=0.05)
    for decodes in (1, 16, 128, 256):
        cap = m.prompt_cap(decodes)
        decode_only = 4e-3 + 30e-6 * decodes
        mixed = decode_only + 1e-3 + 25e-6 * cap  # the mixed path's own fixed cost counts
        assert mixed <= 2.0 * decode_only * 1.06
        assert decode_only + 1e-3 + 25e-6 * (cap * 1.2) > 2.0 * decode_only * 0.94  # not far below the bound
    assert m.budget(16, 2048) == 16 + m.prompt_cap(16)


def test_no_cap_without_decodes_before_the_fit_or_when_disabled():
    m = StepCostModel(ratio=2.0)
    feed(m, 4e-3, 30e-6, 25e-6, n=MIN_STEPS - 1)
    assert m.prompt_cap(64) is None and m.budget(64, 2048) == 2048  # not enough steps yet
    feed(m, 4e-3, 30e-6, 25e-6, n=50, seed=1)
    assert m.prompt_cap(0) is None and m.budget(0, 2048) == 2048  # nobody waits for a token
    assert m.prompt_cap(64) is not None
    off = StepCostModel(ratio=0.0)
    feed(off, 4e-3, 30e-6, 25e-6)
    assert off.coefficients() is None and off.budget(64, 2048) == 2048


def test_degenerate_history_gives_no_cap():
    m = StepCostModel(ratio=2.0)
    for _ in range(100):  # always the same step: the three coefficients cannot be told apart
        m.observe(64, 512, 0.02)
    assert m.prompt_cap(64) is None


def test_min_chunk_lets_a_prompt_advance():
    m = StepCostModel(ratio=1.01, min_chunk=16)
    feed(m, 4e-3, 30e-6, 25e-6)
    assert m.prompt_cap(1) == 16
