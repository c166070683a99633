"""The records that cross the engine/worker boundary: one StepInput per iteration from the
engine to every worker, one StepOutput back from rank 0.

A worker keeps the state of every sequence it is running (worker/input_batch.py), so a step
carries only what changed (vLLM v1's new / cached request split):

- ``new_seqs``: sequences the worker does not hold yet — new, forked (parallel samples,
  beams), or resumed after preemption. Each carries its sampling parameters and, only when
  a penalty needs it, its whole token history. Sent once.
- ``seqs``: every sequence computed this step, in order: its tokens to compute, where they
  start, and its block-table change (how many entries of the table it had last step still
  hold, then the new block ids).
- ``finished_ids``: sequences the worker forgets: finished, aborted, preempted (a preempted
  sequence comes back later as new).

msgspec Structs: typed and compact on the wire (array-like: positional, no field names), and
decoded only into these types, never into arbitrary objects.
"""

from __future__ import annotations

import msgspec

# Async scheduling: a SeqStep's input token that the engine does not know yet because the
# step before, still running, is sampling it. The worker takes it on the device from that
# step's sampled tokens (worker/model_runner.py). Real token ids are never negative.
PENDING_TOKEN = -1
# Async scheduling with structured outputs: a SeqStep.token_mask that follows the step. The
# mask of a row whose input token is pending depends on that token, so the engine sends it
# once the step before is processed (the step handle's ``attach_masks``), and the worker
# samples the step only then. Never a real mask (which has ceil(vocab / 32) words).
MASK_FOLLOWS = b""


class SeqParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """How a sequence samples, for its whole life on the worker. A map on the wire, with the
    fields left at their defaults left out (most are)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # top logprobs to return besides the sampled token's
    num_candidates: int = 0  # beam search: return this many best (token, logprob)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # ``banned_token_ids`` are banned until this many outputs
    banned_token_ids: list[int] | None = None  # stop token ids and EOS (with min_tokens)
    prompt_logprobs: int | None = None  # score the prompt: top logprobs per prompt token
    allowed_token_ids: list[int] | None = None  # only these may be sampled (a fixed mask)

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


class NewSeq(msgspec.Struct, array_like=True):
    """A sequence the worker does not hold yet; its first SeqStep follows in the same step."""

    seq_id: int
    params: SeqParams
    prompt_len: int  # tokens past it are outputs (output position, min_tokens, penalties)
    sample_index: int = 0  # which sample of its request: keys its seeded random stream
    history: list[int] | None = None  # prompt + outputs so far, only when a penalty needs it
    # Of the prompt's last tokens, how many are outputs of the run this one resumes after a
    # worker restart (engine/recovery.py): output positions (the seeded stream), min_tokens
    # and penalties count from before them; prompt logprobs still score the whole prompt.
    resumed: int = 0


class SeqStep(msgspec.Struct, array_like=True):
    """One sequence's work this step."""

    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] (= tokens already cached)
    sample: bool = True  # False: a prompt chunk that samples nothing
    new_blocks: list[int] = msgspec.field(default_factory=list)  # appended to the kept table
    num_kept_blocks: int = -1  # entries of last step's table that still hold; -1: all
    num_samples: int = 1  # a prompt of a best_of > 1 request samples best_of tokens at once
    # Structured outputs: the tokens this step may sample, a bitmask of little-endian int32
    # words (bit t % 32 of word t // 32 set = token t allowed); None: unconstrained;
    # MASK_FOLLOWS: sent after the step.
    token_mask: bytes | None = None


class StepInput(msgspec.Struct, array_like=True):
    seqs: list[SeqStep] = msgspec.field(default_factory=list)
    new_seqs: list[NewSeq] = msgspec.field(default_factory=list)
    finished_ids: list[int] = msgspec.field(default_factory=list)
    swap_in: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (cpu, device)
    swap_out: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (device, cpu)
    copies: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (src, dst) copy-on-write


class SampleResult(msgspec.Struct, array_like=True):
    token_ids: list[int]  # one per sample
    logprobs: list[float]  # of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per sample
    candidates: list[tuple[int, float]] | None = None  # beam search


class PromptLogprobs(msgspec.Struct, array_like=True):
    """The prompt tokens a step scored for one sequence (SeqParams.prompt_logprobs)."""

    start: int  # prompt index of the first token scored (>= 1: token 0 has no logprob)
    logprobs: list[float]  # of each scored prompt token, given the tokens before it
    ranks: list[int]  # each one's rank in its distribution (1 = the most likely)
    top: list[list[tuple[int, float]]] | None = None  # per token, the top (id, logprob)


class StepOutput(msgspec.Struct, array_like=True):
    results: dict[int, SampleResult] = msgspec.field(default_factory=dict)  # seq_id -> result
    prompt_logprobs: dict[int, PromptLogprobs] = msgspec.field(default_factory=dict)  # seq_id ->


class StepFailed(Exception):
    """The model or the sampler raised during a step, after the step's swaps and copies were
    done, and the device is still usable: the engine fails that step's requests and goes on.
    (Raised by an in-process worker; a worker process reports any error and exits.)"""
