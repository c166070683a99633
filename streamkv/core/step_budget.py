"""How many prompt tokens a step may carry beside its decodes without slowing them down.

Chunked prefill puts prompt chunks into the same step as the running decodes. A chunk of
2,048 tokens beside a decode batch of 16 makes that step several times longer than a
decode-only step, and every running request waits for it: its inter-token latency spikes.
With ``max_prefill_step_ratio`` set (e.g. 2.0), the scheduler caps the prompt tokens of a
step that carries decodes so that the step is predicted to take at most that many times a
decode-only step of the same decode batch. A step with no decodes keeps the whole budget
(nobody is waiting for a token), so the queue still drains at full prefill speed.

The prediction is a linear model of the step's time on the device, fitted online from the
steps the engine has run: ``t = a + b * decodes + c * prompt_tokens + e * [prompt_tokens > 0]``
(weights are read once a step, each row costs its share of the matmuls, and a step with
prompt tokens runs the piecewise-graph path with eager attention, a fixed cost of its own).
It is a least-squares fit over exponentially weighted past steps, so it follows the device
and model without constants. Until the fit is usable (a few dozen varied steps: while every
request arrives at once, every step carries a full budget of prompt tokens and the terms
cannot be told apart yet) the cap is not applied.

Seeded at start (engine/step_warmup.py): the engine times a few deliberate steps that span
the terms (decode-only at several batches, mixed, prefill-only) and hands them to ``seed``
as a prior, so the cap holds from the first step, the ramp included (all requests waiting,
every step a full prefill chunk: the history alone cannot separate the terms there). The
prior weighs ``PRIOR_WEIGHT`` steps at first and decays with every real step, like one, to a
floor of ``PRIOR_FLOOR``: real steps outweigh it within a few dozen, while a long stretch of
one kind of step (decode only, for thousands of steps) still cannot leave the fit unsolvable.

Aimed below the ratio by the fit's misses: where the cap binds, a step is predicted at exactly
``ratio`` times a decode-only step, so with predictions right on average half the capped steps
would land above it (session 5: p50 1.30, p90 2.04 with the cap on). The model keeps an
exponentially weighted mean and spread of log(measured / predicted) over steps with both
decodes and prompt tokens, and caps at ``ratio / margin``, margin = exp(mean + TAIL_Z * spread),
so that about 98% of such steps (normal misses) stay within the ratio.

Torch-free: the scheduler imports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# Each new step weighs 1, older ones decay: ~200 steps of memory, so the fit follows a
# shift in context lengths over a run but is not thrown by a single slow step.
DECAY = 0.995
MIN_STEPS = 32  # observations before the cap applies, without a seed
# The seed's weight in steps: at start, and the least it decays to (see the module docstring).
PRIOR_WEIGHT = 32.0
PRIOR_FLOOR = 1.0
TAIL_Z = 2.0  # the margin covers misses up to this many spreads above their mean (~98%)
MIN_MISSES = 8.0  # weighted mixed steps seen before the margin applies
MARGIN_RANGE = (0.5, 2.0)  # a margin outside says the fit is wrong, not noisy: clipped


def _features(decodes: int, prompt_tokens: int) -> tuple[float, float, float, float]:
    return (1.0, float(decodes), float(prompt_tokens), 1.0 if prompt_tokens else 0.0)


def _accumulate(xx: list[list[float]], xt: list[float], x: tuple[float, ...], t: float, keep: float,
                weight: float = 1.0) -> None:
    """xx = keep * xx + weight * x x^T, xt = keep * xt + weight * x t."""
    for i, xi in enumerate(x):
        xt[i] = keep * xt[i] + weight * xi * t
        row = xx[i]
        for j, xj in enumerate(x):
            row[j] = keep * row[j] + weight * xi * xj


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solves m x = v (m symmetric, positive semi-definite) by Gaussian elimination with
    partial pivoting; None when m is near singular (the observations cannot tell the terms
    apart). The terms' scales differ by ~10^6 (a prompt-token count against the 0/1 mixed
    term), so m is first scaled to a unit diagonal: near singular then means a condition of
    about 10^9 whatever the units, not a pivot small against the largest entry."""
    n = len(v)
    d = [m[i][i] ** 0.5 if m[i][i] > 0 else 0.0 for i in range(n)]
    if not all(d):
        return None  # a term never seen
    a = [[m[i][j] / (d[i] * d[j]) for j in range(n)] + [v[i] / d[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-9:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return [x[i] / d[i] for i in range(n)]


@dataclass(slots=True)
class StepCostModel:
    """Online fit of step time against (decodes, prompt tokens), and the prompt cap it implies."""

    TERMS = 4  # intercept, decodes, prompt tokens, "has prompt tokens"

    ratio: float  # allowed (step with prompts) / (decode-only step); <= 1 disables the cap
    min_chunk: int = 16  # a prompt always advances by at least this much per step
    steps: int = 0  # real steps observed
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    _xt: list[float] = field(default_factory=lambda: [0.0] * 4)
    # The seed (``seed``): its sums with weights summing to 1, and its weight now, in steps.
    _prior_xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    _prior_xt: list[float] = field(default_factory=lambda: [0.0] * 4)
    _prior_weight: float = 0.0
    # log(measured / predicted) of steps with decodes and prompt tokens: weighted count, sum,
    # sum of squares.
    _misses: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _coef: list[float] | None = None

    @property
    def enabled(self) -> bool:
        return self.ratio > 1.0

    @property
    def seeded(self) -> bool:
        return self._prior_weight > 0

    def seed(self, samples: Iterable[tuple[int, int, float]]) -> bool:
        """Timed warm-up steps, (decodes, prompt tokens, seconds) each, as the fit's prior
        (see the module docstring). Returns whether they make the fit usable on their own;
        if they do not (too few kinds of step, or the prompt tokens seem free), they are
        dropped and the cap waits for ``MIN_STEPS`` real steps as without a seed."""
        rows = [(_features(d, p), t) for d, p, t in samples if t > 0]
        if not self.enabled or not rows:
            return False
        xx, xt = [[0.0] * self.TERMS for _ in range(self.TERMS)], [0.0] * self.TERMS
        for x, t in rows:
            _accumulate(xx, xt, x, t, 1.0, 1.0 / len(rows))
        coef = _solve(xx, xt)
        if coef is None or coef[2] <= 0:
            return False
        self._prior_xx, self._prior_xt, self._prior_weight = xx, xt, PRIOR_WEIGHT
        self._coef = None
        return True

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One finished step: how many decode rows and prompt tokens it carried, its time."""
        if not self.enabled or seconds <= 0:
            return
        if decodes and prompt_tokens:
            self._observe_miss(decodes, prompt_tokens, seconds)
        _accumulate(self._xx, self._xt, _features(decodes, prompt_tokens), seconds, DECAY)
        if self._prior_weight:
            self._prior_weight = max(PRIOR_FLOOR, self._prior_weight * DECAY)
        self.steps += 1
        self._coef = None

    def _observe_miss(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        coef = self.coefficients()
        if coef is None:
            return
        a, b, c, e = coef
        predicted = a + b * decodes + c * prompt_tokens + e
        if predicted <= 0:
            return
        x = math.log(seconds / predicted)
        m = self._misses
        m[0], m[1], m[2] = DECAY * m[0] + 1.0, DECAY * m[1] + x, DECAY * m[2] + x * x

    @property
    def margin(self) -> float:
        """How far above its prediction a mixed step runs, at the tail of the fit's misses
        (1.0 until enough of them are seen)."""
        n, total, squares = self._misses
        if n < MIN_MISSES:
            return 1.0
        mean = total / n
        spread = max(squares / n - mean * mean, 0.0) ** 0.5
        lo, hi = MARGIN_RANGE
        return min(hi, max(lo, math.exp(mean + TAIL_Z * spread)))

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, e) of t = a + b*decodes + c*prompt_tokens + e*[prompt_tokens > 0], or
        None while not usable."""
        if self.steps < MIN_STEPS and not self.seeded:
            return None
        if self._coef is None:
            w, n = self._prior_weight, self.TERMS
            m = [[self._xx[i][j] + w * self._prior_xx[i][j] for j in range(n)] for i in range(n)]
            v = [self._xt[i] + w * self._prior_xt[i] for i in range(n)]
            self._coef = _solve(m, v) or []
        if len(self._coef) != self.TERMS:
            return None
        a, b, c, e = self._coef
        return (a, b, c, e) if c > 0 else None

    def prompt_cap(self, decodes: int) -> int | None:
        """The most prompt tokens a step with ``decodes`` decode rows may carry, or None for
        no cap (no decodes, cap disabled, or the fit not usable yet)."""
        if decodes == 0 or not self.enabled:
            return None
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, e = coef
        decode_only = a + b * decodes
        if decode_only <= 0:
            return None
        slack = (self.ratio / self.margin - 1.0) * decode_only - max(e, 0.0)
        return max(self.min_chunk, int(slack / c))

    def budget(self, decodes: int, token_budget: int) -> int:
        """The step's whole token budget given ``decodes`` decode rows come first."""
        cap = self.prompt_cap(decodes)
        return token_budget if cap is None else min(token_budget, decodes + cap)
