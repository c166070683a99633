"""How many prompt tokens a step may carry beside its decodes without slowing them down.

Chunked prefill puts prompt chunks into the same step as the running decodes. A chunk of
2,048 tokens beside a decode batch of 16 makes that step several times longer than a
decode-only step, and every running request waits for it: its inter-token latency spikes.
With ``max_prefill_step_ratio`` set (e.g. 2.0), the scheduler caps the prompt tokens of a
step that carries decodes so that the step is predicted to take at most that many times a
decode-only step of the same decode batch. A step with no decodes keeps the whole budget
(nobody is waiting for a token), so the queue still drains at full prefill speed.

The prediction is a linear model of the step's time on the device, fitted online from the
steps with decodes that the engine has run (the only ones it caps):

    t = a + b*decodes + c*prompt_rows + [prompt_tokens > 0] * (e + f*decodes)

Weights are read once a step and each row costs its share of the matmuls; a step with prompt
tokens runs the piecewise-graph path with eager attention (a fixed cost, e), and its decode
rows cost more than in a decode-only step (f): a decode graph of 256 rows is bound by the
weight reads, where beside a few hundred prompt tokens the matmuls are bound by compute and
every row pays its FLOPs (session 6: mixed steps of ~250 decodes cost 2.7 ms + 0.029 ms per
token, decode or prompt, against ~0.012 ms per row in a decode-only step; without f the fit
under-predicted them by up to 28% and they ran 2.1-2.3x). Steps without decodes are left
out of the fit: a full 2,048-token prefill runs its matmuls more efficiently per token than
the few hundred tokens of a capped step, and would pull c below what capped steps cost. It
is a least-squares fit over exponentially weighted past steps, so it follows the device,
the model and the run's growing contexts without constants.

A mixed step's matmuls run in a piecewise graph of the smallest captured token count that
holds the step (worker/piecewise_graphs.py: 16, 32, 64, then multiples of 128), so the step
costs as many rows as that size: 25 decodes + 235 prompt tokens ran as 384 rows (session 7:
the fit's misses correlated 0.67 with those padding rows, and half of their spread was
them). Given those sizes (``token_sizes``, from the warm-up), a second fit counts a mixed
step's prompt rows as ``size - decodes``, and the cap takes prompt tokens up to the end of a
size: the padding rows do prompt work for free. The padded fit predicts unless real steps
show the unpadded one missing by far less: without graphs (a CPU, ``enforce_eager``) the
sizes explain nothing and the unpadded fit takes over within a few dozen mixed steps.

The model has no term for the context the decode rows read unless ``context_term`` is set:
then ``+ g*context + [prompt_tokens > 0] * h*context`` (the decode rows' lengths; the
scheduler passes the running decodes', the engine a step's; ridged toward 0 so it stays
solvable where contexts barely vary, and never negative). Off by default: session 7's two
H200 runs, replayed, say the exponentially weighted fit already follows the run's contexts
(sd of its log misses on prompt steps, one step ahead: 0.0550 -> 0.0557 and 0.0589 ->
0.0576 with the term), and the simulator found no fewer steps over the ratio with it, more
where the decode terms misfit (benchmarks/step_fit_replay.py, sim_prefill_cap.py).

Seeded at start (engine/step_warmup.py): the engine times a few deliberate steps that span
the terms (decode-only and mixed at several batches, two without decodes) and hands them to
``seed`` as a prior, so the cap holds from the first step, the ramp included (all requests
waiting: the history alone cannot separate the terms there). The prior weighs
``PRIOR_WEIGHT`` steps at first and decays with every real step, like one, to a floor of
``PRIOR_FLOOR``: real steps outweigh it within a few dozen, while a long stretch of one kind
of step (decode only, for thousands of steps) still cannot leave the fit unsolvable.

Aimed below the ratio by the fit's misses: where the cap binds, a step is predicted at exactly
``ratio`` times a decode-only step, so with predictions right on average half the capped steps
would land above it (session 5: p50 1.30, p90 2.04 with the cap on). For each band of decode
batch (``BANDS``) the model keeps an exponentially weighted mean and spread of
log(measured / predicted) over steps with both decodes and prompt tokens, and caps at
``ratio / margin``, margin = exp(mean + TAIL_Z * spread), the largest of the bands' (those
that have seen ``MIN_MISSES`` such steps): conservative where the fit has little evidence, as
where a ramp's batch enters a band (session 6's misses were all at 150-250 decodes).

When the margin leaves room for no chunk, the least chunk (``min_chunk`` tokens, or the
smallest graph size that holds that many) still goes where the fit itself puts it within the
ratio. When even the fit puts it over (a tiny decode batch beside the mixed path's fixed
cost), the step carries no prompt tokens, unless the last ``MAX_HELD_STEPS`` steps with
decodes carried none either: prompts then advance by ``min_chunk`` at least once every
``MAX_HELD_STEPS + 1`` steps (two in a row at most with async scheduling, whose next step is
planned before this one is observed), and a step with no decodes takes the whole budget, so
waiting prompts always start.

Torch-free: the scheduler imports it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field

from streamkv.core.step_cost_fit import BANDS, TERMS, Features, LinearFit
from streamkv.sequence import SequenceGroup, SequenceStatus

MIN_STEPS = 32  # observations before the cap applies, without a seed
MAX_HELD_STEPS = 8  # steps with decodes that may carry no prompt tokens in a row (see above)
# The plain fit predicts only where its mean square miss is below the padded fit's by this
# factor (``StepCostModel.padded``). H200 run b, replayed: the padded fit's was 2.2x smaller.
PLAIN_FIT_FACTOR = 0.5
# ... and only once it has seen this many (weighted) mixed steps: after 14, a modelled H200
# ramp whose seed read its decode rows' K/V for free swapped to the plain fit by chance.
PLAIN_FIT_EVIDENCE = 32.0


@dataclass(slots=True)
class StepCostModel:
    """Online fit of step time against (decodes, prompt tokens), and the prompt cap it implies."""

    ratio: float  # allowed (step with prompts) / (decode-only step); <= 1 disables the cap
    min_chunk: int = 16  # the least a prompt advances by in a step that carries any of it
    # The token counts a mixed step's matmuls are padded to (sorted; empty: unknown).
    token_sizes: tuple[int, ...] = ()
    # Whether the fit has the decode rows' context terms (g*context + [prompt] * h*context).
    context_term: bool = False
    steps: int = 0  # real steps with decodes observed
    _raw: LinearFit = field(init=False)
    _padded: LinearFit = field(init=False)
    _since_prompt: int = 0  # steps with decodes since one last carried prompt tokens

    def __post_init__(self) -> None:
        self._raw, self._padded = self._new_fit(), self._new_fit()

    def _new_fit(self) -> LinearFit:
        return LinearFit(MIN_STEPS, TERMS + 2 * self.context_term)

    @property
    def enabled(self) -> bool:
        return self.ratio > 1.0

    @property
    def seeded(self) -> bool:
        return self._raw.prior_weight > 0

    @property
    def padded(self) -> bool:
        """Whether the fit that predicts counts mixed steps' rows padded to ``token_sizes``:
        given the sizes, unless real steps show the plain fit missing by far less. The errors
        are not alike: the plain fit on a padding device lets steps over the ratio (it misses
        the padding rows: up to 127 of them), the padded fit on a device that pads nothing
        only caps tighter than it could; and the two fits' misses are close enough early on
        (noise, a seed that confounds its padding rows with its decode batches, which the plain
        fit's decode terms then absorb) to swap by chance. Hence the factor."""
        if not self.token_sizes:
            return False
        raw, padded = self._raw, self._padded
        return raw.error[0] < PLAIN_FIT_EVIDENCE or raw.mean_square_miss >= PLAIN_FIT_FACTOR * padded.mean_square_miss

    def _rows(self, decodes: int, prompt_tokens: int) -> int:
        """The prompt rows a mixed step's matmuls run: its tokens padded to a size, less its decodes."""
        sizes = self.token_sizes
        i = bisect_left(sizes, decodes + prompt_tokens)
        return sizes[i] - decodes if prompt_tokens and i < len(sizes) else prompt_tokens

    def _features(self, decodes: int, prompt_tokens: int, padded: bool, context: int) -> Features:
        mixed = 1.0 if prompt_tokens else 0.0
        rows = self._rows(decodes, prompt_tokens) if padded else prompt_tokens
        if self.context_term:
            return (1.0, float(decodes), float(rows), mixed, decodes * mixed, float(context), context * mixed)
        return (1.0, float(decodes), float(rows), mixed, decodes * mixed)

    def _fits(self) -> tuple[tuple[LinearFit, bool], ...]:
        return ((self._raw, False), (self._padded, True)) if self.token_sizes else ((self._raw, False),)

    def _fit(self) -> tuple[LinearFit, bool]:
        return (self._padded, True) if self.padded else (self._raw, False)

    def seed(self, samples: Iterable[tuple[int, int, float] | tuple[int, int, float, int]],
             token_sizes: Iterable[int] = ()) -> bool:
        """Timed warm-up steps, (decodes, prompt tokens, seconds[, the decode rows' context
        tokens]) each, as the fit's prior (see the module docstring), and the token counts
        mixed steps are padded to if known. Returns whether they make the fit usable on their
        own; if they do not (too few kinds of step, or the prompt tokens seem free), they are
        dropped and the cap waits for ``MIN_STEPS`` real steps as without a seed."""
        samples = [(s[0], s[1], s[2], s[3] if len(s) > 3 else 0) for s in samples if s[2] > 0]
        if not self.enabled or not samples:
            return False
        self.token_sizes = tuple(sorted(set(token_sizes)))
        usable = [fit.seed([(self._features(d, p, padded, k), t) for d, p, t, k in samples])
                  for fit, padded in self._fits()]
        if not usable[0]:
            self.token_sizes, self._raw, self._padded = (), self._new_fit(), self._new_fit()
            return False
        if not usable[-1]:
            self.token_sizes, self._padded = (), self._new_fit()
        return True

    def observe(self, decodes: int, prompt_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        """One finished step: how many decode rows and prompt tokens it carried, its time, and
        the context tokens its decode rows read (their lengths). Steps without decodes are
        not capped, so they do not enter the fit."""
        if not self.enabled or seconds <= 0 or not decodes:
            return
        self._since_prompt = 0 if prompt_tokens else self._since_prompt + 1
        for fit, padded in self._fits():
            fit.observe(self._features(decodes, prompt_tokens, padded, context_tokens), seconds, decodes)
        self.steps += 1

    def predict(self, decodes: int, prompt_tokens: int, context_tokens: int = 0) -> float | None:
        """The fit's time for a step, or None while it is not usable."""
        fit, padded = self._fit()
        return fit.predict(self._features(decodes, prompt_tokens, padded, context_tokens))

    def coefficients(self) -> tuple[float, ...] | None:
        """(a, b, c, e, f) of the model in the module docstring (and g, h with the context
        term), or None while not usable."""
        coef = self._fit()[0].coefficients()
        return None if coef is None else tuple(coef)

    @property
    def margin(self) -> float:
        """How far above its prediction a mixed step runs, at the tail of the fit's misses:
        the largest of the bands' (1.0 until a band has seen enough). The largest, not the
        step's own band's: a ramp enters each band with no misses seen there, or a first few
        that understate the spread, and the fit's misses there are the other bands' kind
        (a modelled H200 ramp: max 2.27x with each band's own margin, 1.85x with the largest)."""
        return max((m for m in self.margins().values() if m is not None), default=1.0)

    def margins(self) -> dict[str, float | None]:
        """Each band's margin (None: too few misses seen there), by its decode range."""
        edges = (1, *BANDS)
        names = [f"{lo}-{hi - 1}" for lo, hi in zip(edges, BANDS)] + [f"{BANDS[-1]}+"]
        fit = self._fit()[0]
        return {name: fit.band_margin(i) for i, name in enumerate(names)}

    def prompt_cap(self, decodes: int, context_tokens: int = 0) -> int | None:
        """The most prompt tokens a step with ``decodes`` decode rows (reading
        ``context_tokens`` of context) may carry, or None for no cap (no decodes, cap
        disabled, or the fit not usable yet)."""
        if decodes == 0 or not self.enabled:
            return None
        fit, padded = self._fit()
        coef = fit.coefficients()
        if coef is None:
            return None
        a, b, c, e, f, *gh = coef
        g, h = gh or (0.0, 0.0)
        decode_only = a + b * decodes + g * context_tokens
        if decode_only <= 0:
            return None
        # what any prompt token beside these decodes adds
        mixed_fixed = max(e + f * decodes + h * context_tokens, 0.0)

        def rows_within(ratio: float) -> int:
            rows = int(((ratio - 1.0) * decode_only - mixed_fixed) / c)
            if padded:  # up to the end of the largest size that fits: its padding rows come free
                fitting = [s - decodes for s in self.token_sizes if decodes < s <= decodes + rows]
                rows = fitting[-1] if fitting else -1  # none: one prompt token pads past the bound
            return rows

        rows = rows_within(self.ratio / self.margin)
        if rows >= self.min_chunk:
            return rows
        # The margin leaves no chunk: the least one still goes where the fit itself puts it
        # within the ratio. Held instead, such steps would stop giving the fit the misses that
        # move its margin (a large first miss held a simulated ramp at ~20 decodes for 450
        # steps: TTFT p50 8.1 s instead of 5.7).
        if rows_within(self.ratio) >= self.min_chunk:
            if not padded:
                return self.min_chunk
            return next(s - decodes for s in self.token_sizes if s - decodes >= self.min_chunk)
        return self.min_chunk if self._since_prompt >= MAX_HELD_STEPS else 0

    def budget(self, decodes: int, token_budget: int, context_tokens: int = 0) -> int:
        """The step's whole token budget given ``decodes`` decode rows (reading
        ``context_tokens`` of context) come first."""
        cap = self.prompt_cap(decodes, context_tokens)
        return token_budget if cap is None else min(token_budget, decodes + cap)


def decode_context(groups: Iterable[SequenceGroup]) -> int:
    """The context tokens the decode rows of ``groups`` read: their sequences' lengths
    (``StepCostModel.context_term``). The engine observes a step by the same measure."""
    return sum(len(s) for g in groups for s in g.seqs
               if s.status is SequenceStatus.RUNNING and s.num_uncomputed_tokens)
