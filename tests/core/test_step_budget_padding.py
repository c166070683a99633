"""The prefill cap on a device that runs mixed steps as piecewise graphs of a few token
counts (core/step_budget.py): the padded fit, the cap at a size, and the choice of fit."""

from streamkv.core.step_budget import MAX_HELD_STEPS, StepCostModel
from tests.core.step_cost_helpers import SIZES, WARMUP, cost, feed, padded_cost, seeded


def test_a_padded_device_is_fitted_by_its_padded_rows_and_capped_at_a_size():
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, padded_cost(d, p)) for d, p in WARMUP], token_sizes=SIZES)
    assert m.padded
    for d in (20, 100, 139, 250):
        cap = m.prompt_cap(d)
        assert d + cap in SIZES  # the padding rows carry prompt tokens
        assert padded_cost(d, cap) <= 2.0 * cost(d, 0) * (1 + 1e-9)
        assert padded_cost(d, cap + 1) > 2.0 * cost(d, 0)  # the next size is over
    # The unpadded fit of the same steps misses them by up to the padding rows' cost.
    raw = StepCostModel(ratio=2.0)
    assert raw.seed([(d, p, padded_cost(d, p)) for d, p in WARMUP]) and not raw.padded
    over = [padded_cost(d, raw.prompt_cap(d)) / (2.0 * cost(d, 0)) for d in range(16, 257, 8)]
    assert max(over) > 1.05


def test_without_padding_the_plain_fit_takes_over_from_real_steps():
    """Seeded with sizes on a device that pads nothing: the padded fit predicts first (a
    tighter cap, never a looser one), and the plain one once real steps show it misses less."""
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, cost(d, p)) for d, p in WARMUP], token_sizes=SIZES)
    plain = seeded()
    assert m.padded
    assert all(cost(d, m.prompt_cap(d)) <= 2.0 * cost(d, 0) * 1.01 for d in (16, 100, 250))
    feed(m, n=100)  # ~33 mixed steps: not yet enough to tell (PLAIN_FIT_EVIDENCE)
    assert m.padded
    feed(m, n=100, seed=1)
    assert not m.padded and abs(m.prompt_cap(100) - plain.prompt_cap(100)) <= 2


def test_the_seed_alone_does_not_choose_the_plain_fit():
    """The warm-up's few mixed steps confound the padding rows with their decode batches
    (the d = 1 and 32 steps are padded, the 128 and 256 ones not): the plain fit absorbs the
    padding into its decode terms and explains the seed as well, yet misses the ramp's
    steps of ~20 decodes and ~250 prompt tokens, which run as 384 rows."""
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, padded_cost(d, p)) for d, p in WARMUP], token_sizes=SIZES)
    assert m.padded
    cap = m.prompt_cap(22)
    assert padded_cost(22, cap) <= 2.0 * cost(22, 0) * (1 + 1e-9)


def test_real_steps_choose_between_the_fits():
    """Seeded on a padded device, then run on one that pads no more (graphs off): the misses
    of the padded fit grow and the plain fit takes over."""
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, padded_cost(d, p)) for d, p in WARMUP], token_sizes=SIZES)
    assert m.padded
    feed(m, n=300)
    assert not m.padded


def test_when_no_size_fits_the_prompt_waits():
    m = StepCostModel(ratio=1.3)
    assert m.seed([(d, p, padded_cost(d, p)) for d, p in WARMUP], token_sizes=SIZES)
    m.observe(250, 6, padded_cost(250, 6))
    # 250 decodes: 6 tokens would fill 256, but even that is over 1.3x.
    assert padded_cost(250, 6) > 1.3 * cost(250, 0) and m.prompt_cap(250) == 0
    for _ in range(MAX_HELD_STEPS):
        m.observe(250, 0, cost(250, 0))
    assert m.prompt_cap(250) == 16  # waited long enough


def test_the_plain_fit_predicts_only_when_it_misses_by_far_less():
    m = StepCostModel(ratio=2.0)
    assert m.seed([(d, p, padded_cost(d, p)) for d, p in WARMUP], token_sizes=SIZES)
    m._raw.error, m._padded.error = [40.0, 40 * 0.0057], [40.0, 40 * 0.0078]  # close: noise
    assert m.padded
    m._raw.error = [40.0, 40 * 0.003]  # under half the padded fit's
    assert not m.padded
    m._raw.error = [20.0, 20 * 0.0001]  # too few misses to tell
    assert m.padded
