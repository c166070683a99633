"""Prompt logprobs on the engine side: what a request that asks needs from the scheduler, and
the worker's scored chunks turned into its ``prompt_logprobs`` list.

- ``prepare`` (LLMEngine.add_request, for a request that asks): the list starts as ``[None]``
  (the first prompt token has nothing before it), and the sequence skips prefix-cache hits,
  since a cached block's positions would never be computed, so never scored (vLLM does too).
- ``record`` (OutputProcessor.apply): each step's PromptLogprobs for the chunk it
  computed. Entries are placed by prompt index, so a prompt computed twice (recompute after
  a preemption, or a group's shared prefix recomputed by its leader) never adds one twice.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamkv.messages import PromptLogprobs
from streamkv.sequence import Logprob, Sequence, SequenceGroup


def prepare(group: SequenceGroup, seq: Sequence) -> None:
    group.prompt_logprobs = [None]
    seq.skip_prefix_cache = True


def record(scheduled: Iterable, scored: dict[int, PromptLogprobs]) -> None:
    """Add every scored chunk of this step (``scheduled``: the SchedulerOutput's entries)."""
    for s in scheduled:
        chunk = scored.get(s.seq.seq_id)
        if chunk is not None and s.group.prompt_logprobs is not None:
            _add(s.group.prompt_logprobs, s.seq.prompt_token_ids, chunk)


def _add(
    entries: list[dict[int, Logprob] | None], prompt: list[int], chunk: PromptLogprobs
) -> None:
    skip = len(entries) - chunk.start
    if skip < 0:
        raise RuntimeError(
            f"prompt logprobs from index {chunk.start} arrived with only {len(entries)} known: "
            "prompt chunks are computed in order"
        )
    for j in range(skip, len(chunk.logprobs)):
        token = prompt[chunk.start + j]
        entry = {token: Logprob(chunk.logprobs[j], chunk.ranks[j])}
        if chunk.top is not None:
            for rank, (tid, lp) in enumerate(chunk.top[j], start=1):
                entry.setdefault(tid, Logprob(lp, rank))
        entries.append(entry)
