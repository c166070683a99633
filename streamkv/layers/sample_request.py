"""What the sampler is asked for one sequence this step (layers/sampler.py draws it)."""

from __future__ import annotations

from dataclasses import dataclass

from streamkv.layers.penalties import TokenCounts
from streamkv.layers.token_mask import TokenMask


@dataclass(slots=True)
class SampleRequest:
    """How to sample one sequence's next token(s) this step."""

    num_samples: int = 1  # a prompt of a best_of > 1 request yields best_of tokens at once
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    # With the seed, these key a seeded sample's random stream.
    sample_index: int = 0  # sample j of the request (num_samples > 1: sample_index + j)
    output_pos: int = 0  # tokens the sample has generated so far
    logprobs: int | None = None  # top logprobs to return besides the sampled token's
    num_candidates: int = 0  # beam search: return this many best (token, logprob)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    banned_token_ids: list[int] | None = None  # e.g. EOS before min_tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    counts: TokenCounts | None = None  # where the sequence's token counts live (penalties)
    counts_row: int = -1
    token_mask: TokenMask | None = (
        None  # structured outputs: the allowed tokens (layers/token_mask.py)
    )
    allowed_mask: bytes | None = None  # allowed_token_ids, as a token mask made once per sequence

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this row's logits before drawing (then in float32)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.banned_token_ids
            or self.token_mask is not None
            or self.allowed_mask is not None
        )
