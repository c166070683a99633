"""The step warm-up that seeds the prefill cap's fit at engine start (engine/step_warmup.py):
it spans the fit's terms, fits the pool, leaves no trace in the engine or the worker, makes
the cap usable before any request, runs only with the cap on, and changes no greedy output."""

from __future__ import annotations

import pytest

import streamkv.engine.llm_engine as llm_engine
from streamkv import LLM, SamplingParams
from streamkv.core.step_budget import StepCostModel
from streamkv.engine import step_warmup
from streamkv.engine.step_warmup import (
    WarmupPoint,
    WarmupShape,
    blocks_needed,
    build_step,
    first_of_each_path,
    plan,
)
from streamkv.worker.piecewise_graphs import token_buckets
from tests.models.hf_tiny import prompts

# A modelled device: t = A + B*decodes + C*prompt + [prompt] * (E + F*decodes) (core/step_budget.py).
A, B, C, E, F = 4e-3, 30e-6, 25e-6, 1e-3, 12e-6
SHAPE = WarmupShape(token_budget=2048, max_num_seqs=256, block_size=16, num_blocks=20000, max_model_len=4096,
                    vocab_size=128256)


def modelled(decodes: int, prompt_tokens: int) -> float:
    return A + B * decodes + C * prompt_tokens + ((E + F * decodes) if prompt_tokens else 0.0)


def on_graphs(decodes: int, prompt_tokens: int, budget: int = 512) -> float:
    """The modelled device running a mixed step as its piecewise graph's size (the engine
    tests' budget: 512), as a GPU does."""
    if not prompt_tokens:
        return modelled(decodes, 0)
    size = next(s for s in token_buckets(budget) if s >= decodes + prompt_tokens)
    return modelled(decodes, size - decodes)


# -- the plan (no model) -------------------------------------------------------------------
@pytest.mark.parametrize("shape", [
    SHAPE,
    WarmupShape(512, 8, 8, 400, 256, 1000),  # the engine tests' sizes
    WarmupShape(16, 1, 16, 64, 128, 1000),  # one sequence, a tiny budget
    WarmupShape(2048, 256, 16, 260, 2048, 1000),  # a pool too small for the whole plan
])
def test_the_plan_seeds_a_usable_fit_within_the_engines_limits(shape):
    context, points = plan(shape)
    assert points and context % shape.block_size == 0 and context < shape.max_model_len
    for p in points:
        assert p.decodes <= shape.max_num_seqs and p.decodes + p.prompt_tokens <= shape.token_budget
        assert blocks_needed(shape, p, context) <= shape.num_blocks
    model = StepCostModel(ratio=2.0)
    assert model.seed([(p.decodes, p.prompt_tokens, modelled(p.decodes, p.prompt_tokens)) for p in points])
    if shape.max_num_seqs > 1:
        a, b, c, e, f = model.coefficients()
        assert a == pytest.approx(A, rel=1e-6) and c == pytest.approx(C, rel=1e-6) and e == pytest.approx(E, rel=1e-5)
        assert b == pytest.approx(B, rel=1e-6) and f == pytest.approx(F, rel=1e-5)
    else:  # one decode batch: the model without F, right where the steps will be
        assert model.coefficients()[4] == 0.0
        for p in (0, 1, shape.token_budget - 1):
            assert model.predict(1, p) == pytest.approx(modelled(1, p), rel=0.01)


def test_the_plan_times_mixed_steps_at_the_largest_batch_and_capped_prompt_sizes():
    """Session 6's misses were mixed steps at ~250 decodes, which the plan did not time; and a
    full budget's prefill would set the per-token cost below what capped steps pay."""
    _, points = plan(SHAPE)
    mixed = [p for p in points if p.decodes and p.prompt_tokens]
    assert {p.decodes for p in mixed} >= {1, SHAPE.max_num_seqs}
    assert len({p.decodes for p in mixed}) >= 3  # the per-decode-row mixed cost is told apart
    assert all(p.prompt_tokens <= SHAPE.token_budget // 4 for p in points)
    assert sum(1 for p in points if not p.decodes) == 2


def test_a_small_pool_shortens_the_decode_context_first():
    full, _ = plan(SHAPE)
    small, points = plan(WarmupShape(2048, 256, 16, 260, 2048, 1000))
    assert full == step_warmup.DECODE_CONTEXT and small < full
    assert WarmupPoint(256, 0) in points  # the largest decode batch still runs


def test_a_step_reads_valid_blocks_and_positions():
    context, _ = plan(SHAPE)
    step, ids = build_step(SHAPE, WarmupPoint(32, 1100), context, finished=[-1, -2])
    assert step.finished_ids == [-1, -2] and ids == [s.seq_id for s in step.new_seqs] and all(i < 0 for i in ids)
    decodes = [s for s in step.seqs if len(s.token_ids) == 1]
    spans = [s for s in step.seqs if len(s.token_ids) > 1]
    assert len(decodes) == 32 and sum(len(s.token_ids) for s in spans) == 1100
    assert all(s.start_pos == context for s in decodes) and all(s.start_pos == 0 for s in spans)
    shared = context // SHAPE.block_size
    # Decode rows share their context's blocks and write into blocks of their own; spans own theirs.
    own = [s.new_blocks[shared:] for s in decodes] + [s.new_blocks for s in spans]
    flat = [b for blocks in own for b in blocks]
    assert len(flat) == len(set(flat)) and all(shared <= b < SHAPE.num_blocks for b in flat)
    assert all(s.new_blocks[:shared] == list(range(shared)) for s in decodes)
    for s in spans:
        assert len(s.new_blocks) * SHAPE.block_size >= len(s.token_ids) and len(s.token_ids) <= SHAPE.max_model_len
    assert all(0 <= t < SHAPE.vocab_size for s in step.seqs for t in s.token_ids)


def test_the_warm_up_refuses_a_pool_in_use():
    with pytest.raises(RuntimeError, match="idle KV pool"):
        step_warmup.seed_step_cost(None, StepCostModel(ratio=2.0), SHAPE, blocks_in_use=3)


# -- on an engine (the tiny Llama, CPU) --------------------------------------------------------
class CountingExecutor:
    """The real executor, counting submits; with ``modelled`` its steps report the modelled
    device's time instead of this machine's noisy one."""

    def __init__(self, inner, modelled_time: bool) -> None:
        self.inner, self.modelled, self.submits = inner, modelled_time, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, step):
        self.submits += 1
        handle = self.inner.submit(step)
        if not self.modelled:
            return handle
        decodes = sum(1 for s in step.seqs if len(s.token_ids) == 1)
        prompt = sum(len(s.token_ids) for s in step.seqs) - decodes
        return ModelledHandle(handle, on_graphs(decodes, prompt))


class ModelledHandle:
    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def result(self):
        return self.inner.result()

    def device_seconds(self) -> float:
        return self.seconds


@pytest.fixture
def counting(monkeypatch):
    """Engines built in the test get a CountingExecutor (modelled time when asked)."""
    made: list[CountingExecutor] = []
    real = llm_engine.create_executor

    def wrap(modelled_time: bool = False):
        def create(config, info):
            made.append(CountingExecutor(real(config, info), modelled_time))
            return made[-1]
        monkeypatch.setattr(llm_engine, "create_executor", create)
        return made

    return wrap


def _llm(tiny_llama_dir, ratio: float | None, **kw) -> LLM:
    args = dict(device="cpu", block_size=8, num_kv_blocks=400, num_swap_blocks=0, max_num_batched_tokens=512,
                max_num_seqs=8, max_model_len=256, max_prefill_step_ratio=ratio, seed_prefill_cap=True)
    return LLM(str(tiny_llama_dir), **(args | kw))


def _trace(engine) -> dict:
    """Everything the warm-up could leave behind, engine side and worker side."""
    bm, worker = engine.block_manager, engine.executor.worker
    return {
        "stats": engine.stats(), "free": bm.device.num_free, "free_order": list(bm.device._free),
        "cached": dict(bm.device._cached), "tables": dict(bm.tables), "sent": dict(engine.step_builder.sent),
        "worker_seqs": dict(worker.input_batch.seqs), "pending_rows": dict(worker.runner._last_rows),
        "waiting": engine.num_waiting(), "unfinished": engine.has_unfinished_requests(),
    }


def test_the_warm_up_leaves_no_trace(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, 2.0, enable_prefix_caching=True)
    try:
        engine = llm.engine
        report = engine.step_warmup
        _, points = plan(WarmupShape(512, 8, 8, 400, 256, 1000))
        assert report is not None and len(report.samples) == len(points)
        assert all(seconds > 0 for _, _, seconds, _ in report.samples)
        before = _trace(engine)
        assert before["worker_seqs"] == {} and before["pending_rows"] == {} and before["cached"] == {}
        assert before["free"] == engine.block_manager.device.num_blocks
        again = step_warmup.seed_step_cost(engine.executor, engine.scheduler.step_cost, WarmupShape(
            512, 8, 8, 400, 256, 1000), engine.block_manager.device.num_used)
        assert len(again.samples) == len(points)
        assert _trace(engine) == before
        engine.block_manager.check_no_leaks()
        # The same counters as an engine that never warmed up.
        cold = _llm(tiny_llama_dir, 0.0, enable_prefix_caching=True)
        try:
            assert cold.engine.step_warmup is None and cold.engine.stats() == before["stats"]
        finally:
            cold.shutdown()
    finally:
        llm.shutdown()


def test_the_cap_holds_from_the_first_step(tiny_llama_dir, counting):
    made = counting(modelled_time=True)
    llm = _llm(tiny_llama_dir, 1.5)
    try:
        engine = llm.engine
        _, points = plan(WarmupShape(512, 8, 8, 400, 256, 1000))
        # Untimed steps first, then the plan, then one step that frees the last sequences.
        assert made[0].submits == len(first_of_each_path(points)) + len(points) + 1 == len(points) + 3
        cost = engine.scheduler.step_cost
        assert cost.steps == 0 and cost.seeded and engine.step_warmup.usable
        assert cost.padded and cost.token_sizes == tuple(token_buckets(512))  # the graphs' sizes
        a, b, c, e, f = cost.coefficients()
        assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-5) and c == pytest.approx(C, rel=1e-6)
        assert f == pytest.approx(F, rel=1e-4)
        assert cost.budget(1, 512) < 512 and cost.budget(8, 512) < 512

        seen = []
        schedule = engine.scheduler.schedule

        def spy():
            out = schedule()
            seen.append((sum(1 for s in out.scheduled if s.num_new_tokens == 1), out.num_batched_tokens))
            return out

        engine.scheduler.schedule = spy
        ids = prompts(1000, lengths=(200, 180, 220, 190) * 4)
        llm.generate(None, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), prompt_token_ids=ids)
        # The first step that carries decodes comes while prompts still wait, and it is cut.
        decodes, tokens = next((d, n) for d, n in seen if d)
        slack = 0.5 * (A + B * decodes) - E - F * decodes
        assert tokens < 512 and tokens - decodes <= max(16, int(slack / C)) + 1
    finally:
        llm.shutdown()


def test_no_warm_up_with_the_cap_off(tiny_llama_dir, counting):
    made = counting()
    for ratio in (0.0, None):  # None: a CPU's default, 0
        llm = _llm(tiny_llama_dir, ratio)
        try:
            assert made[-1].submits == 0 and llm.engine.step_warmup is None
            assert not llm.engine.scheduler.step_cost.enabled
        finally:
            llm.shutdown()


def test_no_warm_up_unless_asked(tiny_llama_dir, counting):
    """The cap on but seed_prefill_cap off: no synthetic steps, and the fit waits for real
    steps."""
    made = counting()
    llm = _llm(tiny_llama_dir, 2.0, seed_prefill_cap=False)
    try:
        assert made[-1].submits == 0 and llm.engine.step_warmup is None
        assert llm.engine.scheduler.step_cost.enabled and not llm.engine.scheduler.step_cost.seeded
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_outputs_unchanged(tiny_llama_dir, counting, async_scheduling):
    """Cap off against cap on after a warm-up (with modelled step times, so the cap cuts
    steps): the same greedy tokens, pending tokens included (async scheduling)."""
    ids = prompts(1000, lengths=(120, 90, 110, 100, 7, 30) * 3)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * (i % 4), ignore_eos=True) for i in range(len(ids))]
    runs = {}
    counting(modelled_time=True)
    for ratio in (0.0, 1.5):
        llm = _llm(tiny_llama_dir, ratio, async_scheduling=async_scheduling)
        try:
            assert (llm.engine.step_warmup is not None) == (ratio > 0)
            runs[ratio] = [list(o.outputs[0].token_ids) for o in llm.generate(None, params, prompt_token_ids=ids)]
            llm.engine.block_manager.check_no_leaks()
        finally:
            llm.shutdown()
    assert runs[1.5] == runs[0.0]


@pytest.mark.slow
def test_the_warm_up_runs_through_worker_processes(tiny_llama_dir):
    """Over the multiprocess executor's wire (msgspec, negative ids, a step that only frees):
    the plan runs, the worker process holds nothing after it, and outputs match in-process."""
    ids = prompts(1000, lengths=(60, 9, 33, 80))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = _llm(tiny_llama_dir, 0.0)
    want = reference.generate(None, params, prompt_token_ids=ids)
    reference.shutdown()
    llm = _llm(tiny_llama_dir, 2.0, distributed_executor_backend="mp")
    try:
        report = llm.engine.step_warmup
        _, points = plan(WarmupShape(512, 8, 8, 400, 256, 1000))
        assert report is not None and len(report.samples) == len(points)
        got = llm.generate(None, params, prompt_token_ids=ids)
        assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()
