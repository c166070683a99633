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

Torch-free: the scheduler imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Each new step weighs 1, older ones decay: ~200 steps of memory, so the fit follows a
# shift in context lengths over a run but is not thrown by a single slow step.
DECAY = 0.995
MIN_STEPS = 32  # observations before the cap applies


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solves m x = v by Gaussian elimination with partial pivoting; None when m is near
    singular (the observations cannot tell the terms apart)."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(x) for row in m for x in row)
    if scale == 0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-9 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


@dataclass(slots=True)
class StepCostModel:
    """Online fit of step time against (decodes, prompt tokens), and the prompt cap it implies."""

    TERMS = 4  # intercept, decodes, prompt tokens, "has prompt tokens"


    ratio: float  # allowed (step with prompts) / (decode-only step); <= 1 disables the cap
    min_chunk: int = 16  # a prompt always advances by at least this much per step
    steps: int = 0
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    _xt: list[float] = field(default_factory=lambda: [0.0] * 4)
    _coef: list[float] | None = None

    @property
    def enabled(self) -> bool:
        return self.ratio > 1.0

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One finished step: how many decode rows and prompt tokens it carried, its wall time."""
        if not self.enabled or seconds <= 0:
            return
        x = (1.0, float(decodes), float(prompt_tokens), 1.0 if prompt_tokens else 0.0)
        for i in range(self.TERMS):
            self._xt[i] = DECAY * self._xt[i] + x[i] * seconds
            row = self._xx[i]
            for j in range(self.TERMS):
                row[j] = DECAY * row[j] + x[i] * x[j]
        self.steps += 1
        self._coef = None

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, e) of t = a + b*decodes + c*prompt_tokens + e*[prompt_tokens > 0], or
        None while not usable."""
        if self.steps < MIN_STEPS:
            return None
        if self._coef is None:
            self._coef = _solve(self._xx, self._xt) or []
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
        return max(self.min_chunk, int(((self.ratio - 1.0) * decode_only - max(e, 0.0)) / c))

    def budget(self, decodes: int, token_budget: int) -> int:
        """The step's whole token budget given ``decodes`` decode rows come first."""
        cap = self.prompt_cap(decodes)
        return token_budget if cap is None else min(token_budget, decodes + cap)
