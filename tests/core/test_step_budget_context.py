"""The prefill cap's context term (core/step_budget.py, ``StepCostModel.context_term``): the
decode rows' context tokens in the step-cost fit, g*context + [prompt] * h*context."""

import random

import pytest

from streamkv.core.step_budget import StepCostModel, decode_context
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.core.step_cost_helpers import WARMUP, cost

G, H = 20e-9, 60e-9  # s per context token: decode-only steps, and more beside prompts (session 7's kind)


def ctx_cost(d: int, p: int, k: int, g: float = G, h: float = H) -> float:
    return cost(d, p) + g * k + (h * k if p else 0.0)


def seeded(per_row=(256, 1024), g: float = G, h: float = H) -> StepCostModel:
    """Seeded by the warm-up's steps at each context per decode row in ``per_row``."""
    m = StepCostModel(ratio=2.0, context_term=True)
    assert m.seed([(d, p, ctx_cost(d, p, c * d, g, h), c * d) for d, p in WARMUP for c in per_row])
    return m


def test_the_fit_recovers_the_context_costs():
    m = seeded()
    *_, g, h = m.coefficients()
    # the ridge pulls a little toward 0 (CONTEXT_RIDGE), so not exactly
    assert g == pytest.approx(G, rel=0.02) and h == pytest.approx(H, rel=0.02)
    # ... and real steps at many contexts alone recover them as well
    m = StepCostModel(ratio=2.0, context_term=True)
    rng = random.Random(0)
    for _ in range(300):
        d, p, k = rng.randint(1, 256), rng.choice([0, rng.randint(1, 512)]), 0
        k = d * rng.randint(50, 2000)
        m.observe(d, p, ctx_cost(d, p, k), k)
    *_, g, h = m.coefficients()
    assert g == pytest.approx(G, rel=0.05) and h == pytest.approx(H, rel=0.05)
    assert m.predict(100, 200, 100 * 1500) == pytest.approx(ctx_cost(100, 200, 100 * 1500), rel=0.01)


def test_constant_contexts_leave_the_fit_usable_and_the_cap_as_without_the_term():
    """Every row at the same context: the context is collinear with the decode rows. The ridge
    keeps the fit solvable and its predictions right where the steps are."""
    m, plain = seeded(per_row=(300,)), StepCostModel(ratio=2.0)
    assert plain.seed([(d, p, ctx_cost(d, p, 300 * d)) for d, p in WARMUP])
    rng = random.Random(1)
    for _ in range(300):
        d, p = rng.randint(1, 256), rng.choice([0, rng.randint(1, 512)])
        t = ctx_cost(d, p, 300 * d) * (1 + rng.uniform(-0.01, 0.01))
        m.observe(d, p, t, 300 * d)
        plain.observe(d, p, t)
    assert m.coefficients() is not None
    for d in (8, 64, 200, 256):
        assert m.predict(d, 100, 300 * d) == pytest.approx(ctx_cost(d, 100, 300 * d), rel=0.02)
        assert abs(m.prompt_cap(d, 300 * d) - plain.prompt_cap(d)) <= max(4, 0.03 * plain.prompt_cap(d))


def test_longer_contexts_let_fewer_prompt_tokens_in_where_they_cost_more_beside_prompts():
    m = seeded()
    for d in (32, 128, 256):
        short, long = m.prompt_cap(d, 150 * d), m.prompt_cap(d, 1500 * d)
        assert long < short
        for k, cap in ((150 * d, short), (1500 * d, long)):
            assert ctx_cost(d, cap, k) <= 2.0 * ctx_cost(d, 0, k) * 1.005  # the ridge's pull
            assert ctx_cost(d, cap + 64, k) > 2.0 * ctx_cost(d, 0, k)  # not far below the bound
    # where context costs the decode-only step more than it adds beside prompts, the other way
    m = seeded(g=60e-9, h=10e-9)
    assert m.prompt_cap(128, 1500 * 128) > m.prompt_cap(128, 150 * 128)


def test_a_seed_without_contexts_seeds_the_term_at_zero():
    """A seed timed without contexts (3-tuples): usable, the context costs 0 until steps show them."""
    m = StepCostModel(ratio=2.0, context_term=True)
    assert m.seed([(d, p, cost(d, p)) for d, p in WARMUP])
    assert m.coefficients()[5:] == (0.0, 0.0)
    assert m.prompt_cap(100, 100 * 800) == m.prompt_cap(100, 0)


def test_without_the_term_contexts_change_nothing():
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, cost(d, p), 500 * d) for d, p in WARMUP])
    assert len(m.coefficients()) == 5
    assert m.prompt_cap(100, 100 * 2000) == m.prompt_cap(100, 0)


def _group(name: str, prompt: int, computed: int, status=SequenceStatus.RUNNING) -> SequenceGroup:
    seq = Sequence(len(name), list(range(prompt)))
    seq.status, seq.num_computed_tokens = status, computed
    return SequenceGroup(name, [seq], SamplingParams(max_tokens=8), arrival_time=0.0)


def test_decode_context_counts_the_rows_that_compute_a_token():
    rows = [_group("a", 40, 39), _group("bb", 100, 99),
            _group("ccc", 30, 30),  # nothing to compute: waits for the step in flight
            _group("dddd", 50, 49, SequenceStatus.SWAPPED)]
    assert decode_context(rows) == 140
