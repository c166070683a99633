"""What the sampler is asked for one step's rows (layers/sampler.py draws them).

``SamplingRows`` holds the parameters of a step's sampled rows as columns, entry i for logits
row i: the worker gathers them from its persistent table (worker/sampling_table.py) by row
index, so a step builds no object per row. The rare per-row things (logit bias, banned
tokens, token masks) are sparse: a dict or list only when some row has one. ``SampleRequest``
is one row's parameters as a record, for hand-made batches (tests, benchmarks): the sampler
turns a list of them into columns (``SamplingRows.of``) and reads nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from streamkv.layers.penalties import TokenCounts
from streamkv.layers.token_mask import TokenMask

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_M64 = (1 << 64) - 1
_NO_PENALTY = np.array([0.0, 0.0, 1.0])  # presence, frequency, repetition


def clamp64(n: int) -> int:
    """An int into int64: ``top_k``, ``logprobs`` and the like are only compared with the
    vocabulary size or slice by it, which a clamped value does exactly as the original."""
    return min(max(n, _I64_MIN), _I64_MAX)


def seed_bits(seed: int) -> int:
    """A seed as an int64 column entry: its low 64 bits (all layers/stream_hash.py keys by)."""
    bits = seed & _M64
    return bits - (1 << 64) if bits > _I64_MAX else bits


@dataclass(slots=True)
class SampleRequest:
    """How to sample one sequence's next token(s) this step (a hand-made row)."""

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


@dataclass(slots=True)
class SamplingRows:
    """A step's sampled rows, as columns (numpy, one entry per row; the step's own copy, so
    work deferred past the step reads this step's values)."""

    num_samples: np.ndarray  # int64
    temperature: np.ndarray  # float64, as sent (0 = greedy)
    top_p: np.ndarray  # float64
    top_k: np.ndarray  # int64 (clamp64; < 1: none)
    min_p: np.ndarray  # float64
    seed: np.ndarray  # int64: the seed's low 64 bits (seed_bits)
    seeded: np.ndarray  # bool
    sample_index: np.ndarray  # int64
    output_pos: np.ndarray  # int64
    logprobs: np.ndarray  # int64 (0: none)
    num_candidates: np.ndarray  # int64
    penalties: np.ndarray  # float64 [rows, 3]: presence, frequency, repetition
    counts_row: np.ndarray  # int64: the row's token-count row (-1: none)
    counts: TokenCounts | None = None  # the token counts of every penalised row
    # Sparse, by row (ascending): only the rows that have one.
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    banned: dict[int, list[int]] = field(default_factory=dict)  # banned this step (min_tokens)
    allowed: dict[int, bytes] = field(default_factory=dict)  # allowed_token_ids' masks
    token_masks: list[TokenMask | None] | None = None  # structured outputs; None: no row has one

    def __len__(self) -> int:
        return len(self.num_samples)

    @classmethod
    def of(cls, reqs: Sequence[SampleRequest]) -> SamplingRows:
        """The columns of hand-made requests (all penalised ones on one TokenCounts)."""
        n = len(reqs)
        stores = {id(r.counts): r.counts for r in reqs if _penalised(r)}
        if len(stores) > 1:
            raise ValueError("a batch's penalised requests need their token counts in one store")

        def ints(values) -> np.ndarray:
            return np.fromiter(values, np.int64, n)

        rows = cls(
            num_samples=ints(r.num_samples for r in reqs),
            temperature=np.fromiter((r.temperature for r in reqs), np.float64, n),
            top_p=np.fromiter((r.top_p for r in reqs), np.float64, n),
            top_k=ints(clamp64(r.top_k) for r in reqs),
            min_p=np.fromiter((r.min_p for r in reqs), np.float64, n),
            seed=ints(seed_bits(r.seed or 0) for r in reqs),
            seeded=np.fromiter((r.seed is not None for r in reqs), bool, n),
            sample_index=ints(r.sample_index for r in reqs),
            output_pos=ints(r.output_pos for r in reqs),
            logprobs=ints(clamp64(r.logprobs or 0) for r in reqs),
            num_candidates=ints(clamp64(r.num_candidates) for r in reqs),
            penalties=np.array(
                [(r.presence_penalty, r.frequency_penalty, r.repetition_penalty) for r in reqs],
                dtype=np.float64,
            ).reshape(n, 3),
            counts_row=ints(r.counts_row for r in reqs),
            counts=next(iter(stores.values()), None),
            logit_bias={i: r.logit_bias for i, r in enumerate(reqs) if r.logit_bias},
            banned={i: r.banned_token_ids for i, r in enumerate(reqs) if r.banned_token_ids},
            allowed={i: r.allowed_mask for i, r in enumerate(reqs) if r.allowed_mask is not None},
        )
        if any(r.token_mask is not None for r in reqs):
            rows.token_masks = [r.token_mask for r in reqs]
        return rows

    def penalised(self) -> np.ndarray:
        """Per row: whether it has a presence, frequency or repetition penalty."""
        return (self.penalties != _NO_PENALTY).any(1)

    def adjusts_logits(self) -> bool:
        """Whether the sampler changes any row's logits before drawing (then in float32)."""
        return bool(
            self.logit_bias
            or self.banned
            or self.allowed
            or (self.token_masks is not None and any(m is not None for m in self.token_masks))
            or self.penalised().any()
        )

    def asks(self) -> np.ndarray:
        """The rows that ask for top logprobs or beam candidates."""
        return np.flatnonzero((self.logprobs != 0) | (self.num_candidates != 0))

    def draws(self) -> Draws:
        """One entry per output sample: row i's samples j = 0..num_samples-1 in row order."""
        n = len(self)
        if (self.num_samples == 1).all():
            at = np.arange(n)
            return Draws(at, at, self.temperature, self.top_p, self.top_k, self.min_p,
                         self.seed, self.seeded, self.sample_index, self.output_pos)  # fmt: skip
        row = np.repeat(np.arange(n), self.num_samples)
        first = np.cumsum(self.num_samples) - self.num_samples  # each row's first draw
        j = np.arange(len(row)) - first[row]
        return Draws(
            np.arange(len(row)),
            row,
            self.temperature[row],
            self.top_p[row],
            self.top_k[row],
            self.min_p[row],
            self.seed[row],
            self.seeded[row],
            self.sample_index[row] + j,
            self.output_pos[row],
        )


@dataclass(slots=True)
class Draws:
    """Draws as columns, one entry per draw (layers/torch_draws.py and the kernel's table)."""

    draw: np.ndarray  # int64: its index among the step's draws (where its token goes)
    row: np.ndarray  # int64: its logits row
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    seeded: np.ndarray
    stream: np.ndarray  # int64: the sample index that keys its seeded stream
    output_pos: np.ndarray

    def __len__(self) -> int:
        return len(self.draw)

    def take(self, index: np.ndarray) -> Draws:
        return Draws(*(getattr(self, f)[index] for f in Draws.__slots__))

    def stream_keys_args(self, index: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """(seeds, sample indices, output positions) of the draws ``index`` as
        layers/stream_hash.py takes them (seeds as their unsigned low 64 bits)."""
        return (
            self.seed[index].view(np.uint64).tolist(),
            self.stream[index].tolist(),
            self.output_pos[index].tolist(),
        )


def _penalised(r: SampleRequest) -> bool:
    return bool(r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1.0)
