"""The prompt cap that keeps a step with decodes within a ratio of a decode-only step."""

import math
import random

from streamkv.core import step_budget
from streamkv.core.step_budget import MAX_HELD_STEPS, MIN_STEPS, StepCostModel
from tests.core.sched_helpers import Sim, make_bm, make_scheduler
from tests.core.step_cost_helpers import (
    SIZES,
    WARMUP,
    A,
    B,
    C,
    E,
    F,
    cost,
    feed,
    padded_cost,
    seeded,
)


def test_fit_recovers_the_cost_of_decode_rows_beside_prompts():
    m = StepCostModel(ratio=2.0)
    feed(m)
    for got, want in zip(m.coefficients(), (A, B, C, E, F)):
        assert abs(got - want) < 1e-4 * want
    assert abs(m.predict(200, 300) - cost(200, 300)) < 1e-9


def test_steps_without_decodes_stay_out_of_the_fit():
    """A full prefill runs its matmuls cheaper per token than a capped step: it must not pull
    the per-token cost down (nobody waits on such a step, so it is never capped)."""
    m = StepCostModel(ratio=2.0)
    feed(m)
    before, steps = m.coefficients(), m.steps
    for _ in range(300):
        m.observe(0, 2048, 0.6 * cost(0, 2048))
    assert m.steps == steps and m.coefficients() == before


def test_cap_keeps_the_predicted_step_within_the_ratio():
    m = StepCostModel(ratio=2.0)
    feed(m, noise=0.05)
    for decodes in (1, 16, 128, 256):
        cap, margin = m.prompt_cap(decodes), m.margin
        assert 1.0 < margin < 1.15  # +-5% noise: aimed a little below the ratio
        bound = 2.0 / margin * cost(decodes, 0)
        # The mixed path's own costs count: its fixed one and its dearer decode rows.
        assert cost(decodes, cap) <= bound * 1.06  # the fit of noisy steps is off a little
        assert cost(decodes, int(cap * 1.2) + 1) > bound * 0.94  # not far below the bound
    assert m.budget(16, 2048) == 16 + m.prompt_cap(16)


def test_no_cap_without_decodes_before_the_fit_or_when_disabled():
    m = StepCostModel(ratio=2.0)
    feed(m, n=MIN_STEPS - 1)
    assert m.prompt_cap(64) is None and m.budget(64, 2048) == 2048  # not enough steps yet
    feed(m, n=50, seed=1)
    assert m.prompt_cap(0) is None and m.budget(0, 2048) == 2048  # nobody waits for a token
    assert m.prompt_cap(64) is not None
    off = StepCostModel(ratio=0.0)
    feed(off)
    assert off.coefficients() is None and off.budget(64, 2048) == 2048


def test_degenerate_history_gives_no_cap():
    m = StepCostModel(ratio=2.0)
    for _ in range(100):  # always the same step: the coefficients cannot be told apart
        m.observe(64, 512, 0.02)
    assert m.prompt_cap(64) is None


# -- when even the smallest chunk would exceed the ratio ------------------------------------
def test_prompts_wait_a_bounded_number_of_steps_when_no_chunk_fits():
    m = StepCostModel(ratio=1.2, min_chunk=16)
    feed(m)  # beside one decode the mixed path's fixed cost alone is over 1.2x
    m.observe(1, 64, cost(1, 64))
    for _ in range(MAX_HELD_STEPS):
        assert m.prompt_cap(1) == 0 and m.budget(1, 2048) == 1  # the decode goes alone
        m.observe(1, 0, cost(1, 0))
    assert m.prompt_cap(1) == 16  # waited long enough: the least chunk goes
    m.observe(1, 16, cost(1, 16))
    assert m.prompt_cap(1) == 0  # and the wait starts again
    assert m.prompt_cap(0) is None  # a step without decodes still takes the whole budget


def test_queued_prompts_start_and_finish_while_the_cap_holds_them():
    """On a scheduler: the prompt of a request arriving beside a running decode advances only
    every MAX_HELD_STEPS + 1 steps, by the least chunk, and every request finishes."""
    bm = make_bm(num_blocks=64, block_size=4)
    sched = make_scheduler(bm, budget=64, max_num_seqs=4)
    model = StepCostModel(ratio=1.2, min_chunk=8)
    feed(model)
    model.observe(1, 64, cost(1, 64))  # the last step with decodes carried prompt tokens
    sched.step_cost = model
    sim = Sim(sched)
    sim.add("a", prompt_len=8, max_tokens=40)
    sim.step()  # no decodes yet: the whole prompt
    sim.add("b", prompt_len=24, max_tokens=2)
    carried = []
    while sched.has_unfinished():
        out = sim.step()
        decodes = out.num_decodes
        carried.append(out.num_batched_tokens - decodes)
        model.observe(decodes, carried[-1], cost(decodes, carried[-1]))
        assert len(carried) < 200
    assert sorted(sim.finished) == ["a", "b"]
    first = next(i for i, p in enumerate(carried) if p)
    assert carried[first] == 8 and all(p == 0 for p in carried[:first]) and first == MAX_HELD_STEPS
    assert carried[first + 1: first + 1 + MAX_HELD_STEPS] == [0] * MAX_HELD_STEPS


# -- the seed: warm-up steps timed at engine start (engine/step_warmup.py) ------------------
def test_a_seed_makes_the_fit_usable_before_any_step():
    m = seeded()
    assert m.steps == 0 and m.seeded
    for got, want in zip(m.coefficients(), (A, B, C, E, F)):
        assert abs(got - want) < 1e-6 * want
    assert m.budget(8, 2048) < 2048 and m.budget(0, 2048) == 2048


def test_a_seed_that_cannot_separate_the_terms_is_dropped():
    m = StepCostModel(ratio=2.0)
    assert not m.seed([(64, 512, 0.02)] * 10)  # one kind of step only
    assert not m.seed([(d, 0, cost(d, 0)) for d in (1, 8, 64)])  # no prompt-bearing step
    assert not m.seeded and m.coefficients() is None
    off = StepCostModel(ratio=0.0)
    assert not off.seed([(d, p, 0.01 + 1e-5 * (d + p)) for d, p in WARMUP]) and off.coefficients() is None


def test_real_steps_outweigh_the_seed():
    # The warm-up saw steps 30% slower than the run's (shorter contexts, another clock).
    m = seeded(a=1.3 * A, b=1.3 * B, c=1.3 * C, e=1.3 * E, f=1.3 * F)
    feed(m, n=40)
    before = m.coefficients()
    feed(m, n=600, seed=1)
    for d in (1, 16, 64, 256):
        # The seed keeps the weight of one step (PRIOR_FLOOR), 30% off here: a little pull.
        for p in (0, 128, 512):
            assert abs(m.predict(d, p) - cost(d, p)) < 0.03 * cost(d, p)
        # The fed steps' prompts are 1-2048 tokens: few as small as 16, where the seed counts more.
        assert abs(m.predict(d, 16) - cost(d, 16)) < 0.05 * cost(d, 16)
    assert abs(before[2] - C) > abs(m.coefficients()[2] - C)  # and more so, the more of them


def test_the_seed_caps_the_ramp_and_survives_long_decode_runs():
    """While every step is a full prefill chunk beside a few decodes (all requests waiting)
    the history alone is singular, and after thousands of decode-only steps it has forgotten
    prompts: the seed keeps the fit usable in both, and the real steps still set the fit
    along what they show."""
    m = seeded(a=1.25 * A, b=1.3 * B, c=1.2 * C, e=1.3 * E)
    for _ in range(40):
        m.observe(20, 2028, 0.06)  # the ramp: the same step again and again
    assert abs(m.predict(20, 2028) - 0.06) < 1e-3  # the full chunk's time is what the ramp measured
    assert m.prompt_cap(4) is not None and m.budget(4, 2048) < 2048
    rng = random.Random(2)
    for _ in range(5000):
        d = rng.randint(100, 256)
        m.observe(d, 0, cost(d, 0))
    assert all(abs(m.predict(d, 0) - cost(d, 0)) < 2e-3 * cost(d, 0) for d in (100, 180, 256))
    assert m.prompt_cap(200) is not None


def test_old_prompt_steps_still_inform_the_fit_after_long_decode_runs():
    """Decay shrinks every old step alike, so the solver (scaled to a unit diagonal) still
    reads the prompt terms from steps thousands of steps old, however small their weights."""
    m = StepCostModel(ratio=2.0)
    feed(m)
    cap = m.prompt_cap(64)
    for i in range(8000):
        m.observe(100 + i % 150, 0, cost(100 + i % 150, 0))
    assert cap is not None and abs(m.prompt_cap(64) - cap) <= 1


# -- aiming below the ratio by the fit's misses ---------------------------------------------
def _capped_run(noise: float, margin: bool, steps: int = 1500, **device) -> float:
    """Steps whose prompt tokens the cap sets (prompts always waiting) on a device whose step
    times scatter by ``noise`` (log-normal): the share of them above the ratio, measured
    against the true decode-only time of their batch."""
    m = seeded(**device)
    rng = random.Random(3)
    over = counted = 0
    for i in range(steps):
        d = rng.randint(16, 256)
        if not margin:
            m._raw.misses = [[0.0, 0.0, 0.0] for _ in m._raw.misses]  # the cap before it kept its misses
        p = m.prompt_cap(d)
        t = cost(d, p, **device) * math.exp(rng.gauss(0.0, noise))
        m.observe(d, p, t)
        m.observe(d, 0, cost(d, 0, **device) * math.exp(rng.gauss(0.0, noise)))
        if i >= 300:
            counted += 1
            over += t > 2.0 * cost(d, 0, **device) * (1 + 1e-9)  # not by rounding
    return over / counted


def test_the_cap_aims_below_the_ratio_by_the_spread_of_its_misses():
    assert _capped_run(0.05, margin=False) > 0.3  # aimed at the ratio itself: about half above
    assert _capped_run(0.05, margin=True) < 0.01
    assert _capped_run(0.0, margin=True) == 0.0
    assert _capped_run(0.0, margin=True, f=0.0) == 0.0  # and on a device without the term
    m = seeded()
    assert m.margin == 1.0  # no misses seen yet
    for _ in range(50):
        m.observe(64, 256, 1.2 * cost(64, 256))  # 20% slower than predicted
    assert 1.1 < m.margin < 1.25 and m.prompt_cap(64) < seeded().prompt_cap(64)


def test_the_cap_aims_by_the_largest_band_margin():
    """Each band of decode batch keeps its own misses; the cap uses the largest margin, as a
    ramp enters every band with none (or too few) of its own."""
    m = seeded()
    for _ in range(60):
        m.observe(40, 200, cost(40, 200))  # right where the batch is small
        m.observe(240, 200, 1.25 * cost(240, 200))  # 25% over at the largest batches
    bands = m.margins()  # (the fit itself follows the slow steps too, so their misses shrink)
    assert bands["16-63"] < 1.01 and 1.1 < bands["192+"] < 1.3 and bands["1-15"] is None
    assert m.margin == bands["192+"] and len(bands) == len(step_budget.BANDS) + 1
    assert m.prompt_cap(240) < seeded().prompt_cap(240)


def test_the_least_chunk_goes_where_only_the_margin_rules_it_out():
    """A margin inflated by a few bad first misses must not hold prompts where the fit itself
    has room for a chunk: held, those steps would give the fit no misses to lower it by."""
    inflated = [20.0, 20 * 0.5, 20 * 0.25]  # 20 misses of +65% in one band: margin exp(0.5)
    m = StepCostModel(ratio=1.5, min_chunk=16)
    feed(m)
    m.observe(1, 64, cost(1, 64))
    assert m.prompt_cap(8) > 16
    m._raw.misses[1] = list(inflated)
    assert m.margin > 1.5  # ratio / margin < 1: no room at all
    assert m.prompt_cap(8) == 16  # but the fit at the ratio has room
    sized = StepCostModel(ratio=2.0, min_chunk=16)
    assert sized.seed([(d, p, padded_cost(d, p)) for d, p in WARMUP], token_sizes=SIZES)
    assert sized.prompt_cap(8) == 56  # 8 + 56 = 64
    sized._padded.misses[1] = list(inflated)
    assert sized.margin > 1.5 and sized.prompt_cap(8) == 24  # 8 + 24 = 32, the smallest size


def test_one_decode_batch_only_fits_the_model_without_the_mixed_row_term():
    """max_num_seqs 1: every step with decodes has one, so f cannot be told from e; the fit
    drops it (f = 0) rather than give up, and predicts the steps it will cap."""
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, cost(d, p)) for d, p in [(1, 0), (1, 2), (1, 8), (1, 4), (0, 2), (0, 4)]])
    assert m.coefficients()[4] == 0.0
    assert all(abs(m.predict(1, p) - cost(1, p)) < 0.01 * cost(1, p) for p in (0, 2, 8))
    assert m.prompt_cap(1) is not None
