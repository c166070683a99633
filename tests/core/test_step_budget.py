"""The prompt cap that keeps a step with decodes within a ratio of a decode-only step."""

import math
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


# -- the seed: warm-up steps timed at engine start (engine/step_warmup.py) ------------------
WARMUP = [(1, 0), (32, 0), (128, 0), (256, 0), (1, 256), (32, 128), (32, 512), (128, 256), (0, 512), (0, 2048)]


def seeded(a: float, b: float, c: float, e: float) -> StepCostModel:
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, a + b * d + c * p + (e if p else 0.0)) for d, p in WARMUP])
    return m


def test_a_seed_makes_the_fit_usable_before_any_step():
    m = seeded(4e-3, 30e-6, 25e-6, 1.5e-3)
    assert m.steps == 0 and m.seeded
    a, b, c, e = m.coefficients()
    assert abs(a - 4e-3) < 1e-9 and abs(b - 30e-6) < 1e-11 and abs(c - 25e-6) < 1e-11 and abs(e - 1.5e-3) < 1e-9
    assert m.budget(8, 2048) < 2048 and m.budget(0, 2048) == 2048


def test_a_seed_that_cannot_separate_the_terms_is_dropped():
    m = StepCostModel(ratio=2.0)
    assert not m.seed([(64, 512, 0.02)] * 10)  # one kind of step only
    assert not m.seed([(d, 0, 4e-3 + 30e-6 * d) for d in (1, 8, 64)])  # no prompt-bearing step
    assert not m.seeded and m.coefficients() is None
    off = StepCostModel(ratio=0.0)
    assert not off.seed([(d, p, 0.01 + 1e-5 * (d + p)) for d, p in WARMUP]) and off.coefficients() is None


def test_real_steps_outweigh_the_seed():
    # The warm-up saw steps 30% slower than the run's (shorter contexts, another clock).
    m = seeded(5.2e-3, 39e-6, 32.5e-6, 2e-3)
    feed(m, 4e-3, 30e-6, 25e-6, e=1.5e-3, n=40)
    before = m.coefficients()
    feed(m, 4e-3, 30e-6, 25e-6, e=1.5e-3, n=600, seed=1)
    a, b, c, e = m.coefficients()
    assert abs(c - 25e-6) < 0.02 * 25e-6 and abs(b - 30e-6) < 0.02 * 30e-6 and abs(a - 4e-3) < 0.02 * 4e-3
    assert abs(before[2] - 25e-6) > abs(c - 25e-6)  # and more so, the more of them


def test_the_seed_caps_the_ramp_and_survives_long_decode_runs():
    """While every step is a full prefill chunk (all requests waiting) the history alone is
    singular, and after thousands of decode-only steps it has forgotten prompts: the seed
    keeps the fit usable in both, and the real steps still set the fit along what they show."""
    m = seeded(5e-3, 40e-6, 30e-6, 2e-3)
    for _ in range(40):
        m.observe(0, 2048, 0.06)  # the ramp: the same step again and again
    a, b, c, e = m.coefficients()
    assert abs(a + 2048 * c + e - 0.06) < 1e-3  # the full chunk's time is what the ramp measured
    assert m.prompt_cap(4) is not None and m.budget(4, 2048) < 2048
    rng = random.Random(2)
    for _ in range(5000):
        d = rng.randint(100, 256)
        m.observe(d, 0, 4e-3 + 30e-6 * d)
    a, b, c, e = m.coefficients()
    assert abs(a - 4e-3) < 1e-5 and abs(b - 30e-6) < 1e-7
    assert m.prompt_cap(200) is not None


def test_old_prompt_steps_still_inform_the_fit_after_long_decode_runs():
    """Decay shrinks every old step alike, so the solver (scaled to a unit diagonal) still
    reads the prompt terms from steps thousands of steps old, however small their weights."""
    m = StepCostModel(ratio=2.0)
    feed(m, 4e-3, 30e-6, 25e-6, e=1.5e-3)
    cap = m.prompt_cap(64)
    for i in range(8000):
        m.observe(100 + i % 150, 0, 4e-3 + 30e-6 * (100 + i % 150))
    assert cap is not None and abs(m.prompt_cap(64) - cap) <= 1


def _capped_run(noise: float, margin: bool, steps: int = 1500) -> float:
    """Steps whose prompt tokens the cap sets (prompts always waiting) on a device whose step
    times scatter by ``noise`` (log-normal): the share of them above the ratio, measured
    against the true decode-only time of their batch."""
    m = seeded(4e-3, 30e-6, 25e-6, 1e-3)
    rng = random.Random(3)
    over = counted = 0
    for i in range(steps):
        d = rng.randint(16, 256)
        if not margin:
            m._misses = [0.0, 0.0, 0.0]  # what the cap did before it kept its misses
        p = m.prompt_cap(d)
        t = (4e-3 + 30e-6 * d + 25e-6 * p + 1e-3) * math.exp(rng.gauss(0.0, noise))
        m.observe(d, p, t)
        m.observe(d, 0, (4e-3 + 30e-6 * d) * math.exp(rng.gauss(0.0, noise)))
        if i >= 300:
            counted += 1
            over += t > 2.0 * (4e-3 + 30e-6 * d) * (1 + 1e-9)  # not by rounding
    return over / counted


def test_the_cap_aims_below_the_ratio_by_the_spread_of_its_misses():
    assert _capped_run(0.05, margin=False) > 0.3  # aimed at the ratio itself: about half above
    assert _capped_run(0.05, margin=True) < 0.05
    assert _capped_run(0.0, margin=True) == 0.0
    m = seeded(4e-3, 30e-6, 25e-6, 1e-3)
    assert m.margin == 1.0  # no misses seen yet
    for _ in range(50):
        m.observe(64, 256, 1.2 * (4e-3 + 30e-6 * 64 + 25e-6 * 256 + 1e-3))  # 20% slower than predicted
    assert 1.1 < m.margin < 1.25 and m.prompt_cap(64) < seeded(4e-3, 30e-6, 25e-6, 1e-3).prompt_cap(64)
