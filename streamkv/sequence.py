"""Sequences, sequence groups (one request), and the outputs handed to users."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from streamkv.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    # Value: (code, finish reason or None). ``finished`` and ``finish_reason`` are plain
    # attributes, not properties over a set: they are read several times per sequence per
    # step, and an Enum's hash is a Python-level call.
    WAITING = (1, None)
    RUNNING = (2, None)
    SWAPPED = (3, None)
    FINISHED_STOPPED = (4, "stop")
    FINISHED_LENGTH = (5, "length")
    FINISHED_ABORTED = (6, "abort")

    def __init__(self, code: int, reason: str | None) -> None:
        self.finish_reason: str | None = reason
        self.finished: bool = reason is not None


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    # Index within its group: seeds per-sample random streams so they do not depend on the
    # batch a sample runs in.
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V is in the cache. Prefill, chunked prefill, recompute after preemption
    # and prefix-cache hits all reduce to "compute tokens [num_computed_tokens, len)".
    num_computed_tokens: int = 0
    output_text: str = ""
    stop_reason: int | str | None = None
    beam_score: float = 0.0  # a finished beam hypothesis's length-penalised score
    # Detokenizer state (see engine/detokenizer.py).
    prefix_offset: int = -1
    read_offset: int = -1
    # Structured outputs: this sequence's grammar matcher (engine/structured.py), or None.
    grammar: Any = None
    # Prompt logprobs need every prompt position computed: no prefix-cache hits.
    skip_prefix_cache: bool = False
    # The parent key of its first block in the prefix cache (core/block_pool.root_key): its
    # request's cache_salt's, or None, the key every unsalted sequence shares.
    cache_root: bytes | None = None
    # Async scheduling: 1 while the step that samples its next token runs. That token counts
    # in its length, so the next step is planned with it (its slot and block; the worker
    # takes the token on the device), but is no output until it is known: the step's
    # outputs replace the count with the token (engine/output_processor.py).
    num_pending: int = 0

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_window(self, start: int) -> list[int]:
        """``all_token_ids[start:]`` without building the whole list."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def append_token(
        self, token_id: int, logprob: float, logprobs: dict[int, Logprob] | None
    ) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    @property
    def has_pending(self) -> bool:
        return self.num_pending > 0

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0

    def fork(self, new_seq_id: int, sample_index: int) -> Sequence:
        child = Sequence(
            seq_id=new_seq_id,
            prompt_token_ids=self.prompt_token_ids,
            sample_index=sample_index,
            output_token_ids=list(self.output_token_ids),
            output_logprobs=list(self.output_logprobs),
            cumulative_logprob=self.cumulative_logprob,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            output_text=self.output_text,
            prefix_offset=self.prefix_offset,
            read_offset=self.read_offset,
            grammar=self.grammar.fork() if self.grammar is not None else None,
            skip_prefix_cache=self.skip_prefix_cache,
            cache_root=self.cache_root,
        )
        return child


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sequences are gang-scheduled and preempted together."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None
    # Beam search: finished hypotheses kept for the final ranking.
    finished_beams: list[Sequence] = field(default_factory=list)
    beam_state: Any = None
    # Set by the scheduler on preemption (metrics, tests).
    num_preemptions: int = 0
    # After recompute of a group of several sequences: the tokens they share, which the
    # first sequence computes before the others start (BlockManager.allocate_group).
    num_shared_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token scored so far, the first None.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def live_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return [s for s in self.seqs if not s.status.finished]
        return [s for s in self.seqs if s.status == status]

    @property
    def finished(self) -> bool:
        seqs = self.seqs  # asked several times per group per step: keep the common case cheap
        if len(seqs) == 1:
            return seqs[0].status.finished
        return all(s.status.finished for s in seqs)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per prompt token its logprob (and the top ones), in
    # the Logprob records of the outputs; the first token has none (None).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


_S = TypeVar("_S", Sequence, CompletionOutput)


def best_of_n(samples: list[_S], n: int) -> list[_S]:
    """The ``n`` most likely of a best_of request's samples (Sequences or CompletionOutputs)
    by cumulative logprob, a tie kept in sample order: the engine's final choice, and a
    resumed request's (engine/recovery.py)."""
    return sorted(samples, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
