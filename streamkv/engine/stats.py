"""Engine counters and time-averaged memory figures (the paper's utilization and sharing
metrics). Counters are exact; the memory figures walk every running sequence's block table,
O(blocks) Python work, so they are sampled every ``MEMORY_SAMPLE_EVERY`` steps (the first
step included) rather than on the step path every time."""

from __future__ import annotations

from streamkv.core.block_manager import BlockManager
from streamkv.core.scheduler import Scheduler, SchedulerOutput

# 256 sequences of 1k tokens are 16k table entries: a few ms of Python, against a decode step
# of ~10 ms on an H200 with CUDA graphs. Every 8th step keeps the average within reach.
MEMORY_SAMPLE_EVERY = 8


class EngineStats:
    def __init__(self, bm: BlockManager, scheduler: Scheduler) -> None:
        self.bm, self.scheduler = bm, scheduler
        self.peak_kv_blocks_used = 0
        self.steps = 0
        self._util_sum = 0.0
        self._util_steps = 0
        self._saving_sum = 0.0
        self._saving_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def record_step(self, sched: SchedulerOutput) -> None:
        self.steps += 1
        # A one-token step of a sequence that already has output is a decode (generation)
        # token; everything else (prompts, chunks, recomputation) is prompt work.
        generated = prompt = 0
        for s in sched.scheduled:
            n = s.num_new_tokens
            if n == 1 and s.seq.output_token_ids:
                generated += 1
            else:
                prompt += n
        self.num_generation_tokens += generated
        self.num_prompt_tokens += prompt
        used = self.bm.device.num_used
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, used)
        if not self.bm.tables or (self.steps - 1) % MEMORY_SAMPLE_EVERY:
            return
        block_size = self.bm.block_size
        tables = self.bm.tables
        fill: dict[int, int] = {}  # block -> tokens in it (the most any sharer has written)
        for group in self.scheduler.running:
            for seq in group.seqs:
                table = tables.get(seq.seq_id)
                if table is None:
                    continue
                seq_len = seq.num_computed_tokens
                full = min(seq_len // block_size, len(table))
                # Full blocks hold block_size tokens, the most there is: no comparison needed.
                fill.update(dict.fromkeys(table[:full], block_size))
                for i in range(full, len(table)):
                    block = table[i]
                    filled = min(max(seq_len - i * block_size, 0), block_size)
                    if filled >= fill.get(block, 0):
                        fill[block] = filled
        if fill:
            self._util_sum += sum(fill.values()) / (len(fill) * block_size)
            self._util_steps += 1
        logical = self.bm.num_logical_blocks()
        if logical:
            self._saving_sum += 1 - len(fill) / logical
            self._saving_steps += 1

    def as_dict(self) -> dict:
        bm = self.bm
        return {
            "num_kv_blocks": bm.device.num_blocks,
            "num_free_kv_blocks": bm.device.num_free,
            "num_swap_blocks": bm.cpu.num_blocks,
            "num_free_swap_blocks": bm.cpu.num_free,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped_out_blocks": self.scheduler.num_swapped_out_blocks,
            "num_swapped_in_blocks": self.scheduler.num_swapped_in_blocks,
            "peak_kv_blocks_used": self.peak_kv_blocks_used,
            "kv_utilization": self._util_sum / self._util_steps if self._util_steps else 0.0,
            "num_cow_copies": bm.num_cow_copies,
            "num_shared_blocks": bm.num_shared_blocks(),
            "sharing_savings": self._saving_sum / self._saving_steps if self._saving_steps else 0.0,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
        }
