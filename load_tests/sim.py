"""The real engine (scheduler, block manager or baseline allocator, output processing,
detokenizer) with the model replaced by a step-time model on a virtual clock.

What the paper's Figures 2, 12 and 13 compare is memory management: how many requests fit
in the KV pool, and so how many are batched per step. That part runs here for real. Only
the model's time is modelled, as a GPU serving a 13B model spends it (memory-bound decode:
a step costs about the same whether it carries 1 or 100 sequences):

    step = base_ms + per_token_ms * (tokens computed) + per_kv_token_us * (context tokens read)
           + per_block_us * (KV blocks those contexts span)

Defaults, from first principles for OPT-13B in fp16 on an A100-40GB (the paper's setup):
reading 26 GB of weights at ~1.5 TB/s is ~17 ms (base 20 ms with the rest of a step);
a prompt token costs 2 x 13e9 FLOP, ~0.08 ms at ~300 TFLOP/s; attention reads 800 KB of
K/V per context token (40 layers x 5120 x 2 x 2 bytes), ~0.55 us at 1.5 TB/s; no per-block
term. None of them is calibrated: load_tests/fit_steps.py fits them to the step records of
measured runs (docs/paper.md, "The calibrated model").

A step advances the virtual clock by its modelled time and costs only the engine's own CPU
work, so a sweep of thousands of requests runs in seconds of CPU on a shared 2-core box.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from streamkv.executor.base import Executor
from streamkv.messages import SampleResult, StepInput, StepOutput


@dataclass(slots=True)
class StepCost:
    base_ms: float = 20.0
    per_token_ms: float = 0.08
    per_kv_token_us: float = 0.55
    # Swaps (preemption_mode swap / auto): each block moved costs a transfer's overhead plus
    # its K/V bytes over PCIe 4.0 (~25 GB/s: 800 KiB per token slot, ~32.8 us), each way.
    swap_block_us: float = 10.0
    swap_token_us: float = 32.8
    block_size: int = 16
    # The decode kernel's cost per KV block a step's contexts span (a block-id lookup and a
    # scattered read each): what makes small blocks slow in the paper's Fig 18a. 0 until
    # benchmarks/bench_block_size.py's sweep measures it (load_tests/fit_steps.py).
    per_block_us: float = 0.0

    def seconds(self, step: StepInput) -> float:
        computed = context = blocks = 0
        for s in step.seqs:
            n = s.start_pos + len(s.token_ids)
            computed += len(s.token_ids)
            context += n
            blocks += -(-n // self.block_size)
        moved = len(step.swap_in) + len(step.swap_out)
        swap_us = moved * (self.swap_block_us + self.block_size * self.swap_token_us)
        kv_us = self.per_kv_token_us * context + self.per_block_us * blocks
        return (self.base_ms + self.per_token_ms * computed) / 1e3 + (kv_us + swap_us) / 1e6


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


class SimulatedExecutor(Executor):
    """No model: each sample is a random token (every request runs with ignore_eos), and
    each step advances ``clock`` by ``cost``."""

    def __init__(
        self,
        model: str | None,
        num_blocks: int,
        num_cpu_blocks: int,
        cost: StepCost,
        clock: VirtualClock,
        seed: int = 0,
    ) -> None:
        from streamkv.models.loader import load_config, resolve_model_dir

        self.model_dir = resolve_model_dir(model)
        self.hf_config = load_config(self.model_dir)
        self.num_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        self.cost, self.clock = cost, clock
        self.rng = random.Random(seed)
        self.num_steps = 0
        # Virtual seconds of steps, and the same weighted by the sequences each step carried:
        # their ratio is the time-averaged batch (the engine's own figure averages per step).
        self.busy_seconds = 0.0
        self.seq_seconds = 0.0
        self._candidates: dict[int, int] = {}  # seq_id -> beam candidates to return (0: sampling)

    def num_available_blocks(self) -> tuple[int, int]:
        return self.num_blocks, self.num_cpu_blocks

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute(self, step: StepInput) -> StepOutput:
        seconds = self.cost.seconds(step)
        self.clock.advance(seconds)
        self.num_steps += 1
        self.busy_seconds += seconds
        self.seq_seconds += seconds * len(step.seqs)
        # Like a worker, remember what each sequence was sent once (beam width), forget the
        # finished ones.
        for new in step.new_seqs:
            self._candidates[new.seq_id] = new.params.num_candidates
        for seq_id in step.finished_ids:
            self._candidates.pop(seq_id, None)
        draw, hi = self.rng.randrange, min(self.hf_config["vocab_size"], 20000)
        results = {}
        for s in step.seqs:
            if not s.sample:
                continue
            k = self._candidates.get(s.seq_id, 0)
            if k:
                # Random, sorted logprobs: beams overtake one another, fork and drop as in a
                # real search (equal ones would make every beam descend from the first).
                lps = sorted((-self.rng.expovariate(1.0) for _ in range(k)), reverse=True)
                cands = [(draw(1000, hi), lp) for lp in lps]
                results[s.seq_id] = SampleResult([cands[0][0]], [cands[0][1]], candidates=cands)
            else:
                results[s.seq_id] = SampleResult(
                    [draw(1000, hi) for _ in range(s.num_samples)], [-1.0] * s.num_samples
                )
        return StepOutput(results)
