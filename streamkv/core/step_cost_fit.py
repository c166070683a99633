"""The least-squares fit behind the prefill cap (core/step_budget.py): a step's time on the
device against a few features, over exponentially weighted past steps plus a seed (timed
warm-up steps) that decays to a floor, with the fit's one-step-ahead misses on steps that
carry decodes and prompt tokens kept per band of decode batch. Torch-free."""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field

# Each new step weighs 1, older ones decay: ~200 steps of memory, so the fit follows a
# shift in context lengths over a run but is not thrown by a single slow step.
DECAY = 0.995
# The seed's weight in steps: at start, and the least it decays to (core/step_budget.py).
PRIOR_WEIGHT = 32.0
PRIOR_FLOOR = 1.0
# The margin covers misses up to this many spreads above their mean (~99.9% of normal
# misses): issue 18 asks for every prompt step within the ratio, not 98% of them.
TAIL_Z = 3.0
MIN_MISSES = 8.0  # weighted mixed steps a band must have seen before its own margin applies
MARGIN_RANGE = (0.5, 2.0)  # a margin outside says the fit is wrong, not noisy: clipped
BANDS = (16, 64, 128, 192)  # decode batches whose misses are kept apart: [1, 16), [16, 64), ...
TERMS = 5  # intercept, decodes, prompt rows, "has prompt tokens", decodes * "has prompt tokens"
MIXED_ROW_TERM = 4  # decodes * "has prompt tokens": dropped when one decode batch cannot tell it apart
# The decode rows' context terms (core/step_budget.py) are pulled toward 0 by this share of
# their own diagonal: where contexts barely vary they are collinear with the decode rows, and
# the fit stays solvable with the decode terms taking their cost, as without them. Small:
# with a seed at two contexts the terms come out within ~1% (0.02 took 12% off them).
CONTEXT_RIDGE = 0.001

Features = tuple[float, ...]


def _accumulate(xx: list[list[float]], xt: list[float], x: Features, t: float, keep: float,
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


def _fit(m: list[list[float]], v: list[float]) -> list[float] | None:
    """The coefficients from the normal equations, the context terms (those past ``TERMS``)
    ridged (``CONTEXT_RIDGE``); where the steps cannot tell the decode rows' mixed-step cost
    apart (one decode batch only, as with max_num_seqs 1), those of the model without it (its
    coefficient 0, session 6's model); None when neither solves."""
    n = len(v)
    # A context term no step has seen yet (a seed timed without contexts) is 0, not unsolvable.
    seen = [i for i in range(n) if i < TERMS or m[i][i] > 0]
    for keep in (seen, [i for i in seen if i != MIXED_ROW_TERM]):
        while True:
            sub = _solve([[m[i][j] * (1.0 + CONTEXT_RIDGE) if i == j and i >= TERMS else m[i][j] for j in keep]
                          for i in keep], [v[i] for i in keep])
            # More context never makes a step faster: a negative context cost is the decode
            # terms' misfit leaking into it (a simulated run's four warm-up requests, whose
            # batch shrank as their contexts grew, set it at -2.5 us per token and let 1,900
            # prompt tokens in beside 38 decodes: 8x). The fit without that term instead.
            negative = [i for i, x in zip(keep, sub or ()) if i >= TERMS and x < 0]
            if not negative:
                break
            keep = [i for i in keep if i != negative[0]]
        if sub is not None:
            coef = [0.0] * n
            for i, x in zip(keep, sub):
                coef[i] = x
            return coef
    return None


def _zeros(n: int) -> list[list[float]]:
    return [[0.0] * n for _ in range(n)]


def band_of(decodes: int) -> int:
    return bisect_right(BANDS, decodes)


@dataclass(slots=True)
class LinearFit:
    """t = coefficients . features, fitted online; its misses per band of decode batch."""

    min_steps: int = 32  # real steps before the fit is usable without a seed
    terms: int = TERMS  # the features' length: TERMS, or more with context terms after them
    steps: int = 0  # real steps observed
    xx: list[list[float]] = field(default_factory=list)
    xt: list[float] = field(default_factory=list)
    # The seed: its sums with weights summing to 1, and its weight now, in steps.
    prior_xx: list[list[float]] = field(default_factory=list)
    prior_xt: list[float] = field(default_factory=list)
    prior_weight: float = 0.0
    # Per band: log(measured / predicted) of mixed steps, as [weighted count, sum, sum of squares].
    misses: list[list[float]] = field(default_factory=lambda: [[0.0, 0.0, 0.0] for _ in range(len(BANDS) + 1)])
    # All bands together: [weighted count, sum of squares].
    error: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _coef: list[float] | None = None

    def __post_init__(self) -> None:
        n = self.terms
        self.xx, self.xt = self.xx or _zeros(n), self.xt or [0.0] * n
        self.prior_xx, self.prior_xt = self.prior_xx or _zeros(n), self.prior_xt or [0.0] * n

    def seed(self, rows: list[tuple[Features, float]]) -> bool:
        """The seed's rows as the prior; whether they alone make the fit usable (if not,
        nothing is kept)."""
        xx, xt = _zeros(self.terms), [0.0] * self.terms
        for x, t in rows:
            _accumulate(xx, xt, x, t, 1.0, 1.0 / len(rows))
        coef = _fit(xx, xt)
        if coef is None or coef[2] <= 0:
            return False
        self.prior_xx, self.prior_xt, self.prior_weight = xx, xt, PRIOR_WEIGHT
        self._coef = None
        return True

    def observe(self, x: Features, seconds: float, decodes: int) -> None:
        if x[3]:  # carries prompt tokens: a miss of the fit before this step
            self._miss(x, seconds, decodes)
        _accumulate(self.xx, self.xt, x, seconds, DECAY)
        if self.prior_weight:
            self.prior_weight = max(PRIOR_FLOOR, self.prior_weight * DECAY)
        self.steps += 1
        self._coef = None

    def _miss(self, x: Features, seconds: float, decodes: int) -> None:
        predicted = self.predict(x)
        if predicted is None or predicted <= 0:
            return
        miss = math.log(seconds / predicted)
        hit_band = band_of(decodes)
        for band, m in enumerate(self.misses):  # every band ages with each miss, so stale ones fade
            hit = band == hit_band
            m[0], m[1], m[2] = DECAY * m[0] + hit, DECAY * m[1] + hit * miss, DECAY * m[2] + hit * miss * miss
        self.error[0] = DECAY * self.error[0] + 1.0
        self.error[1] = DECAY * self.error[1] + miss * miss

    @property
    def mean_square_miss(self) -> float:
        n, squares = self.error
        return squares / n if n else math.inf

    def coefficients(self) -> list[float] | None:
        """The coefficients, or None while not usable (fewer than ``min_steps`` real steps and
        no seed, the terms not told apart yet, or prompt tokens that seem free)."""
        if self.steps < self.min_steps and not self.prior_weight:
            return None
        if self._coef is None:
            w = self.prior_weight
            n = self.terms
            m = [[self.xx[i][j] + w * self.prior_xx[i][j] for j in range(n)] for i in range(n)]
            v = [self.xt[i] + w * self.prior_xt[i] for i in range(n)]
            self._coef = _fit(m, v) or []
        if len(self._coef) != self.terms or self._coef[2] <= 0:
            return None
        return self._coef

    def predict(self, x: Features) -> float | None:
        coef = self.coefficients()
        return None if coef is None else sum(k * xi for k, xi in zip(coef, x))

    def band_margin(self, band: int) -> float | None:
        n, total, squares = self.misses[band]
        if n < MIN_MISSES:
            return None
        mean = total / n
        spread = max(squares / n - mean * mean, 0.0) ** 0.5
        lo, hi = MARGIN_RANGE
        return min(hi, max(lo, math.exp(mean + TAIL_Z * spread)))
