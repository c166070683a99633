"""The records that cross the engine/worker boundary, one StepInput per iteration.

Plain data only (ints, floats, lists), so they can travel between processes without
pickling arbitrary objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SampleRequest:
    num_samples: int = 1
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    # Per output sample: (sample index, output position) keys its private random stream.
    sample_index: int = 0
    output_pos: int = 0
    logprobs: int | None = None  # top-k logprobs to return besides the sampled token's
    num_candidates: int = 0  # beam search: return this many best (token, logprob)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_token_ids: list[int] | None = None  # sent only when a penalty needs them
    output_token_ids: list[int] | None = None
    banned_token_ids: list[int] | None = None  # e.g. EOS before min_tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit


@dataclass(slots=True)
class SeqInput:
    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] (= tokens already cached)
    block_table: list[int]
    sample: SampleRequest | None = None  # None: a prompt chunk that samples nothing


@dataclass(slots=True)
class StepInput:
    seqs: list[SeqInput] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # one per sample
    logprobs: list[float]  # of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per sample
    candidates: list[tuple[int, float]] | None = None  # beam search


class StepFailed(Exception):
    """The model or the sampler raised during a step, after the step's swaps and copies were
    done, and the device is still usable: the engine fails that step's requests and goes on.
    (Raised by an in-process worker; a worker process reports any error and exits.)"""


@dataclass(slots=True)
class StepOutput:
    results: dict[int, SampleResult] = field(default_factory=dict)  # seq_id -> result
