"""The prefill cap's context term at the engine (core/step_budget.py, ``context_term``): the
warm-up seeds it at a second context, and the scheduler's budget and the engine's observation
pass the decode rows' lengths."""

from __future__ import annotations

import pytest

from streamkv import SamplingParams
from streamkv.core.step_budget import StepCostModel
from streamkv.engine import step_warmup
from streamkv.engine.step_warmup import WarmupShape, plan
from tests.engine.test_step_warmup import SHAPE, _llm, modelled
from tests.models.hf_tiny import prompts


def test_the_engine_and_the_scheduler_feed_the_context_term(tiny_llama_dir):
    """With the fit's context term the scheduler's budget and the engine's observation get the
    decode rows' lengths (prompts of 180-220 tokens and 8 outputs: 180-228 a row)."""
    seen: list[tuple[str, int, int]] = []

    class Spy(StepCostModel):
        def observe(self, decodes, prompt_tokens, seconds, context_tokens=0):
            seen.append(("observe", decodes, context_tokens))
            super().observe(decodes, prompt_tokens, seconds, context_tokens)

        def budget(self, decodes, token_budget, context_tokens=0):
            seen.append(("budget", decodes, context_tokens))
            return super().budget(decodes, token_budget, context_tokens)

    llm = _llm(tiny_llama_dir, 1.5, seed_prefill_cap=False)
    try:
        llm.engine.scheduler.step_cost = Spy(1.5, context_term=True)
        ids = prompts(1000, lengths=(200, 180, 220, 190) * 2)
        llm.generate(None, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), prompt_token_ids=ids)
    finally:
        llm.shutdown()
    for kind in ("observe", "budget"):
        rows = [(d, k) for what, d, k in seen if what == kind and d]
        assert rows and all(180 * d <= k <= 229 * d for d, k in rows), (kind, rows)


def test_the_plan_seeds_the_context_term_at_a_second_context():
    """With the context term two steps at the largest batch read 4x the context; the seed then
    recovers a modelled context cost apart from the decode rows' own."""
    context, points = plan(SHAPE, context_term=True)
    long = [p for p in points if p.long_context]
    assert {(p.decodes, bool(p.prompt_tokens)) for p in long} == {(SHAPE.max_num_seqs, False), (SHAPE.max_num_seqs, True)}
    assert len(points) == len(plan(SHAPE)[1]) + 2
    assert all(step_warmup.row_context(SHAPE, p, context) == step_warmup.LONG_CONTEXT_FACTOR * context for p in long)
    g, h = 20e-9, 60e-9
    model = StepCostModel(ratio=2.0, context_term=True)
    samples = []
    for p in points:
        k = p.decodes * step_warmup.row_context(SHAPE, p, context)
        samples.append((p.decodes, p.prompt_tokens, modelled(p.decodes, p.prompt_tokens) + g * k + (h * k if p.prompt_tokens else 0), k))
    assert model.seed(samples)
    *_, fitted_g, fitted_h = model.coefficients()
    assert fitted_g == pytest.approx(g, rel=0.02) and fitted_h == pytest.approx(h, rel=0.02)
    # a short max_model_len leaves no longer context: no such steps
    assert not any(p.long_context for p in plan(WarmupShape(512, 8, 8, 400, 256, 1000), context_term=True)[1])
