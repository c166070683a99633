"""How many prompt tokens a step may carry beside its decodes without slowing them down.

Chunked prefill puts prompt chunks into the same step as the running decodes. A chunk of
2,048 tokens beside a decode batch of 16 makes that step several times longer than a
decode-only step, and every running request waits for it: its inter-token latency spikes.
With ``max_prefill_step_ratio`` set (e.g. 2.0), the scheduler caps the prompt tokens of a
step that carries decodes so that the step is predicted to take at most that many times a
decode-only step of the same decode batch. A step with no decodes keeps the whole budget
(nobody is waiting for a token), so the queue still drains at full prefill speed.

The prediction is a linear model of the step's wall time, fitted online from the steps the
engine has run: ``t = a + b * decodes + c * prompt_tokens`` (weights are read once a step,
each row costs its share of the matmuls). It is a least-squares fit over exponentially
weighted past steps, so it follows the device and model without constants, and it never
needs a decode-only step to have run (while requests wait, every step carries prompts).
Until the fit is usable (a few dozen varied steps) the cap is not applied.

Torch-free: the scheduler imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Each new step weighs 1, older ones decay: ~200 steps of memory, so the fit follows a
# shift in context lengths over a run but is not thrown by a single slow step.
DECAY = 0.995
MIN_STEPS = 32  # observations before the cap applies


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solves the 3x3 system m x = v (Cramer's rule); None when it is near singular."""
    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))

    d = det(m)
    scale = max(abs(x) for row in m for x in row) ** 3
    if scale == 0 or abs(d) < 1e-12 * scale:
        return None
    out = []
    for col in range(3):
        a = [row[:] for row in m]
        for r in range(3):
            a[r][col] = v[r]
        out.append(det(a) / d)
    return out


@dataclass(slots=True)
class StepCostModel:
    """Online fit of step time against (decodes, prompt tokens), and the prompt cap it implies."""

    ratio: float  # allowed (step with prompts) / (decode-only step); <= 1 disables the cap
    min_chunk: int = 16  # a prompt always advances by at least this much per step
    steps: int = 0
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xt: list[float] = field(default_factory=lambda: [0.0] * 3)
    _coef: list[float] | None = None

    @property
    def enabled(self) -> bool:
        return self.ratio > 1.0

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One finished step: how many decode rows and prompt tokens it carried, its wall time."""
        if not self.enabled or seconds <= 0:
            return
        x = (1.0, float(decodes), float(prompt_tokens))
        for i in range(3):
            self._xt[i] = DECAY * self._xt[i] + x[i] * seconds
            row = self._xx[i]
            for j in range(3):
                row[j] = DECAY * row[j] + x[i] * x[j]
        self.steps += 1
        self._coef = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) of t = a + b*decodes + c*prompt_tokens, or None while not usable."""
        if self.steps < MIN_STEPS:
            return None
        if self._coef is None:
            self._coef = _solve3(self._xx, self._xt) or []
        if len(self._coef) != 3:
            return None
        a, b, c = self._coef
        return (a, b, c) if c > 0 else None

    def prompt_cap(self, decodes: int) -> int | None:
        """The most prompt tokens a step with ``decodes`` decode rows may carry, or None for
        no cap (no decodes, cap disabled, or the fit not usable yet)."""
        if decodes == 0 or not self.enabled:
            return None
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c = coef
        decode_only = a + b * decodes
        if decode_only <= 0:
            return None
        return max(self.min_chunk, int((self.ratio - 1.0) * decode_only / c))

    def budget(self, decodes: int, token_budget: int) -> int:
        """The step's whole token budget given ``decodes`` decode rows come first."""
        cap = self.prompt_cap(decodes)
        return token_budget if cap is None else min(token_budget, decodes + cap)
