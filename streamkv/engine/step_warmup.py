"""Seeding the prefill cap's step-cost fit at engine start (core/step_budget.py).

The cap needs a fit of step time against decodes and prompt tokens, and a run's own history
cannot give one at first: while a burst of requests waits, every step is a full prefill chunk
and the terms cannot be told apart, so the worst steps of a run (a 2,048-token chunk beside a
handful of decodes, 8.6x a decode-only step on the H200) went uncapped. So before the first
request the engine runs a few deliberate steps through the real executor that span the terms
(decode-only and mixed at several batch sizes, two without decodes), times each as it times real
steps (the handle's ``device_seconds``), and seeds the fit with them.

The steps are synthetic and leave nothing behind:
- their sequences carry negative ids (real ones count up from 0), are sent to the workers as
  new and forgotten in the next step's ``finished_ids``; a last step with no work frees the
  last ones (and clears the worker's pending-token rows, which only the step after reads);
- their block ids are taken straight from the idle pool, not allocated: no request holds a
  block yet (checked), nothing is registered in the prefix cache, and the free list keeps its
  order. What they write there is finite K/V that any later owner overwrites before reading,
  as with every freed block (engine/step_pipeline.py);
- they bypass the scheduler, the output processor and the stats: no request, no counter.

The seed also hands the fit the token counts that the piecewise graphs pad a mixed step to
(worker/piecewise_graphs.py): the fit counts a step's matmul rows as those of its graph's
size where that explains the steps' times better (core/step_budget.py).

With the fit's context term (``StepCostModel.context_term``) two more steps, decode-only and
mixed at the largest batch, run with ``LONG_CONTEXT_FACTOR`` times the context behind each
decode row, so the term is seeded apart from the decode rows' own cost. Their rows share their
context's blocks as the others' do, so the device may serve those reads from its cache: the
seed can understate the term, which real steps then correct.

The timed steps follow two untimed ones (the plan's first decode-only and first mixed steps):
the first step down a path may pay one-off costs (allocator growth, lazy set-up) that real
steps do not. Every graph the steps replay was captured, and so run, at start already.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from streamkv.core.step_budget import StepCostModel
from streamkv.executor.base import Executor
from streamkv.messages import NewSeq, SeqParams, SeqStep, StepFailed, StepInput
from streamkv.worker.piecewise_graphs import token_buckets

logger = logging.getLogger(__name__)

DECODE_CONTEXT = 256  # tokens of context behind each decode row (ShareGPT-like; halved to fit)
PROMPT_SPAN = 512  # a step's prompt tokens come as spans of at most this many (several prompts)
LONG_CONTEXT_FACTOR = 4  # the context-term steps' context, in DECODE_CONTEXTs (see above)
_GREEDY = SeqParams()


@dataclass(frozen=True, slots=True)
class WarmupShape:
    """The limits a warm-up step must respect: those of real steps on this engine."""

    token_budget: int  # max_num_batched_tokens: tokens per step
    max_num_seqs: int  # decode rows per step (the decode graphs' largest batch)
    block_size: int
    num_blocks: int  # device pool, all free
    max_model_len: int  # positions stay below it
    vocab_size: int


@dataclass(frozen=True, slots=True)
class WarmupPoint:
    decodes: int
    prompt_tokens: int
    long_context: bool = False  # its decode rows read LONG_CONTEXT_FACTOR times the plan's context


@dataclass(slots=True)
class WarmupReport:
    # (decodes, prompt tokens, seconds, the decode rows' context tokens) of the timed pass
    samples: list[tuple[int, int, float, int]]
    seconds: float  # wall time of the whole warm-up
    usable: bool  # the fit can cap from the first step


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _spans(shape: WarmupShape, tokens: int) -> list[int]:
    span = min(PROMPT_SPAN, shape.max_model_len)
    return [min(span, tokens - k) for k in range(0, tokens, span)]


def row_context(shape: WarmupShape, point: WarmupPoint, context: int) -> int:
    """The context behind each of ``point``'s decode rows, given the plan's."""
    if not point.long_context:
        return context
    bs = shape.block_size
    return min(LONG_CONTEXT_FACTOR * context, shape.max_model_len - 1) // bs * bs


def blocks_needed(shape: WarmupShape, point: WarmupPoint, context: int) -> int:
    """Decode rows share their context's full blocks and each write its token into a block
    of its own; each prompt span has blocks of its own."""
    bs = shape.block_size
    shared = row_context(shape, point, context) // bs if point.decodes else 0
    return shared + point.decodes + sum(_cdiv(n, bs) for n in _spans(shape, point.prompt_tokens))


def plan(shape: WarmupShape, context_term: bool = False) -> tuple[int, list[WarmupPoint]]:
    """The decode rows' context and the steps: decode-only steps pin the intercept and the
    per-decode cost, mixed ones at several decode batches and prompt sizes the per-token,
    fixed and per-decode-row mixed costs, and two without decodes keep the terms apart when
    max_num_seqs is 1. Every prompt size is one a capped step carries (a few hundred tokens
    at most): the fit is linear, and a full budget's prefill runs its matmuls more cheaply per
    token than capped steps do. With ``context_term``, decode-only and mixed steps at the
    largest batch at a longer context too. Points that do not fit the pool are left out (the
    context is halved first)."""
    s, b = shape.max_num_seqs, shape.token_budget
    few, many = max(1, s // 8), max(1, s // 2)
    points = [WarmupPoint(d, 0) for d in (1, few, many, s)]
    # Mixed steps at the largest batch too: their decode rows cost what the fit's
    # decodes-beside-prompts term says (session 6 missed there by up to 28% without it).
    mixed = ((1, 8), (few, 16), (few, 4), (many, 8), (s, 16), (s, 4))
    points += [WarmupPoint(d, max(1, b // k)) for d, k in mixed]
    points += [WarmupPoint(0, max(1, b // 8)), WarmupPoint(0, max(1, b // 4))]
    if context_term:
        points += [WarmupPoint(s, 0, True), WarmupPoint(s, max(1, b // 8), True)]
    points = [p for p in dict.fromkeys(points) if p.decodes + p.prompt_tokens <= b]
    bs = shape.block_size
    context = min(DECODE_CONTEXT, shape.max_model_len - 1) // bs * bs
    while context and max(blocks_needed(shape, p, context) for p in points) > shape.num_blocks:
        context = context // 2 // bs * bs
    fitting = [p for p in points if blocks_needed(shape, p, context) <= shape.num_blocks]
    # a longer context only where there is one (a short max_model_len)
    return context, [p for p in fitting if not p.long_context or row_context(shape, p, context) > context]


def first_of_each_path(points: list[WarmupPoint]) -> list[WarmupPoint]:
    """The untimed steps that go first: the first decode-only step (decode graphs) and the
    first mixed one (the piecewise path)."""
    decode = next((p for p in points if not p.prompt_tokens), None)
    mixed = next((p for p in points if p.prompt_tokens and p.decodes), None)
    return [p for p in (decode, mixed) if p is not None]


def build_step(shape: WarmupShape, point: WarmupPoint, context: int, finished: list[int]) -> tuple[StepInput, list[int]]:
    """The step for ``point``, freeing ``finished`` first; and the ids it leaves on the workers."""
    bs, vocab = shape.block_size, shape.vocab_size
    context = row_context(shape, point, context)
    shared = list(range(context // bs))
    next_block, next_id = len(shared), -1
    step = StepInput(finished_ids=list(finished))
    for i in range(point.decodes):
        step.new_seqs.append(NewSeq(next_id, _GREEDY, context))
        step.seqs.append(SeqStep(next_id, [(3 + i) % vocab], context, True, new_blocks=shared + [next_block]))
        next_block, next_id = next_block + 1, next_id - 1
    for n in _spans(shape, point.prompt_tokens):
        k = _cdiv(n, bs)
        tokens = [(7 * j + 11) % vocab for j in range(n)]
        step.new_seqs.append(NewSeq(next_id, _GREEDY, n))
        step.seqs.append(SeqStep(next_id, tokens, 0, True, new_blocks=list(range(next_block, next_block + k))))
        next_block, next_id = next_block + k, next_id - 1
    return step, [s.seq_id for s in step.seqs]


def _run(executor: Executor, step: StepInput) -> float:
    """Runs one step to its end; its time as the engine's fit would see it."""
    submitted = time.perf_counter()
    handle = executor.submit(step)
    handle.result()
    timed = getattr(handle, "device_seconds", None)  # optional (executor/base.py)
    return timed() if timed is not None else time.perf_counter() - submitted


def seed_step_cost(executor: Executor, model: StepCostModel, shape: WarmupShape, blocks_in_use: int) -> WarmupReport:
    """Runs the warm-up steps on ``executor`` and seeds ``model`` with their times. Only on an
    engine that has run nothing yet (``blocks_in_use`` must be 0: the steps borrow free
    blocks without allocating them)."""
    if blocks_in_use:
        raise RuntimeError(f"the step warm-up needs an idle KV pool; {blocks_in_use} blocks are in use")
    start = time.perf_counter()
    context, points = plan(shape, model.context_term)
    samples: list[tuple[int, int, float, int]] = []
    held: list[int] = []
    primers = first_of_each_path(points)
    try:
        for i, point in enumerate(primers + points):
            step, held = build_step(shape, point, context, held)
            seconds = _run(executor, step)
            if i >= len(primers):
                rows = point.decodes * row_context(shape, point, context)
                samples.append((point.decodes, point.prompt_tokens, seconds, rows))
    except StepFailed as e:  # the sequences of the failed step are held all the same
        logger.warning("step warm-up failed (%s): the prefill cap waits for real steps", e)
        samples = []
    if held:  # the workers forget the last step's sequences and its pending-token rows
        _run(executor, StepInput(finished_ids=held))
    # The sizes the piecewise graphs pad a mixed step to, if the workers run them (on a GPU
    # without enforce_eager): the fit tells from the steps' times whether they do.
    usable = model.seed(samples, token_buckets(shape.token_budget))
    report = WarmupReport(samples, time.perf_counter() - start, usable)
    logger.info("prefill cap: %d warm-up steps in %.0f ms; the step-cost fit is %s", len(primers + points),
                1e3 * report.seconds, "usable from the first step" if usable else "not seeded")
    return report
