"""Every held sequence's sampling parameters as columns of one persistent table (vLLM's
``gpu_input_batch.py``): one row per sequence, written once when it arrives (its SeqParams),
and gathered by row index into the step's SamplingRows (layers/sample_request.py). Per step
the table takes one vectorized store: the output positions of the rows that read theirs
(seeded, or banning tokens until min_tokens; the others' go stale, unread), and the few rows
that draw several samples (a best_of prompt). A decode batch that keeps its rows reuses the
last gather of the set-once columns (``take``).

    floats  float64 [capacity, 6]: temperature top_p min_p presence frequency repetition
    ints    int64   [capacity, 12]: top_k seed seeded sample_index logprobs num_candidates
                                    counts_row prompt_len min_tokens output_pos
                                    has_banned has_extras (a logit bias or allowed ids)
    bias / banned / allowed: a Python list entry per row, None for (almost) every row

Rows never move: a freed row goes back to a free list and the table doubles when full. The
sampler's rows are the step's sampled rows in the model runner's order (decodes first), not
the table's, so a step gathers by index whatever the layout; compacting would buy nothing.
Row 0 is never handed out: it holds the defaults (greedy, unseeded, nothing else), the row
of a pending token the worker replaces after a failed step (worker.py _without_samples).

Logit bias, banned token ids and allowed_token_ids' masks stay Python objects (a dict, a
list, bytes) in a per-row list: few sequences have one, their sizes vary, and the sampler
scatters them as (row, token) pairs anyway. Structured outputs' token masks change every
step and travel on the SeqInput (the sampler's list of them is made only when one is set).
"""

from __future__ import annotations

import numpy as np

from streamkv.layers.penalties import TokenCounts
from streamkv.layers.sample_request import SamplingRows, clamp64, seed_bits
from streamkv.messages import SeqParams

PLAIN = 0  # the defaults' row

# Columns of ``floats``.
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
_FLOAT_DEFAULTS = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)
# Columns of ``ints``.
(
    TOP_K,
    SEED,
    SEEDED,
    SAMPLE_INDEX,
    LOGPROBS,
    NUM_CANDIDATES,
    COUNTS_ROW,
    PROMPT_LEN,
    MIN_TOKENS,
    OUTPUT_POS,
    HAS_BANNED,
    HAS_EXTRAS,
) = range(12)
_INT_DEFAULTS = (-1, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0)


class SamplingTable:
    def __init__(self, counts: TokenCounts | None = None, capacity: int = 64) -> None:
        self.counts = counts  # the token counts of every penalised row (None: not sampling)
        self.floats = np.empty((0, len(_FLOAT_DEFAULTS)), np.float64)
        self.ints = np.empty((0, len(_INT_DEFAULTS)), np.int64)
        self.bias: list[dict[int, float] | None] = []
        self.banned: list[list[int] | None] = []
        self.allowed: list[bytes | None] = []
        self._free: list[int] = []
        self._multi: dict[int, int] = {}  # this step's rows that sample more than one token
        self._version = 0  # bumped by every add and free: the gather cache's key
        self._gathered: _Gathered | None = None
        self._grow(max(capacity, 2))
        self._free.remove(PLAIN)

    @property
    def capacity(self) -> int:
        return self.floats.shape[0]

    @property
    def num_rows(self) -> int:
        return self.capacity - 1 - len(self._free)

    def add(
        self,
        p: SeqParams,
        sample_index: int,
        prompt_len: int,
        counts_row: int,
        allowed: bytes | None,
    ) -> int:
        """A row holding ``p`` (``prompt_len``: tokens before its first output)."""
        if not self._free:
            self._grow(2 * self.capacity)
        row = self._free.pop()
        self._version += 1
        self.floats[row] = (
            p.temperature,
            p.top_p,
            p.min_p,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        self.ints[row] = (
            clamp64(p.top_k),
            seed_bits(p.seed or 0),
            p.seed is not None,
            sample_index,
            clamp64(p.logprobs or 0),
            clamp64(p.num_candidates),
            counts_row,
            prompt_len,
            clamp64(p.min_tokens),
            0,
            bool(p.banned_token_ids),
            bool(p.logit_bias) or allowed is not None,
        )
        self.bias[row] = p.logit_bias or None
        self.banned[row] = p.banned_token_ids or None
        self.allowed[row] = allowed
        return row

    @staticmethod
    def reads_position(p: SeqParams) -> bool:
        """Whether the sampler reads a row's output position: a seed keys its stream by it,
        and a min_tokens ban ends at it. Only these rows have it written each step."""
        return p.seed is not None or bool(p.banned_token_ids)

    def free(self, row: int) -> None:
        self.bias[row] = self.banned[row] = self.allowed[row] = None
        self._free.append(row)
        self._version += 1

    def advance(self, rows: list[int], ends: list[int], multi: dict[int, int]) -> None:
        """This step's per-step entries: rows ``rows`` (those that read their output position)
        sample after the first ``ends`` tokens of their sequence; ``multi``: the rows that
        sample more than one token, and how many (every other row samples one)."""
        self._multi = multi
        if rows:
            n = len(rows)
            at = np.fromiter(rows, np.int64, n)
            prompt_len = self.ints[:, PROMPT_LEN].take(at)
            self.ints[at, OUTPUT_POS] = np.fromiter(ends, np.int64, n) - prompt_len

    def counts_rows(self, rows: list[int]) -> np.ndarray:
        """The token-count rows of table rows ``rows`` (-1: none)."""
        return self.ints[:, COUNTS_ROW].take(np.fromiter(rows, np.int64, len(rows)))

    def take(self, rows: list[int], token_masks: list | None = None) -> SamplingRows:
        """The step's SamplingRows: entry i is table row ``rows[i]`` (``token_masks``: the
        structured outputs' masks by entry, or None when no entry has one). The parameters
        set once per sequence are gathered again only when the rows or the table changed
        since the last step (a decode batch mostly keeps both); they are read-only, and the
        per-step columns are new arrays every step."""
        g = self._gathered
        if g is None or g.version != self._version or g.rows != rows:
            g = self._gathered = _Gathered(self, rows)
        i, f = g.ints, g.floats
        # Read only for the rows that read their position (else the gather's stale copy).
        output_pos = self.ints[:, OUTPUT_POS].take(g.at) if g.reads_position else i[:, OUTPUT_POS]
        num_samples = g.ones
        if self._multi:
            num_samples = np.ones(len(rows), np.int64)
            for k, r in enumerate(rows):
                if r in self._multi:
                    num_samples[k] = self._multi[r]
        out = SamplingRows(
            num_samples=num_samples,
            temperature=f[:, TEMPERATURE],
            top_p=f[:, TOP_P],
            top_k=i[:, TOP_K],
            min_p=f[:, MIN_P],
            seed=i[:, SEED],
            seeded=g.seeded,
            sample_index=i[:, SAMPLE_INDEX],
            output_pos=output_pos,
            logprobs=i[:, LOGPROBS],
            num_candidates=i[:, NUM_CANDIDATES],
            penalties=f[:, PRESENCE:],
            counts_row=i[:, COUNTS_ROW],
            counts=self.counts,
            logit_bias=g.bias,
            allowed=g.allowed,
            token_masks=token_masks,
        )
        if len(g.has_banned):
            k = g.has_banned
            for b in k[output_pos[k] < i[k, MIN_TOKENS]].tolist():
                out.banned[b] = self.banned[rows[b]]
        return out

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        floats = np.empty((capacity, len(_FLOAT_DEFAULTS)), np.float64)
        ints = np.empty((capacity, len(_INT_DEFAULTS)), np.int64)
        floats[:old], ints[:old] = self.floats, self.ints
        floats[old:], ints[old:] = _FLOAT_DEFAULTS, _INT_DEFAULTS
        self.floats, self.ints = floats, ints
        for extra in (self.bias, self.banned, self.allowed):
            extra.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))
        self._version += 1


class _Gathered:
    """The set-once parameters of one list of rows, gathered (SamplingTable.take's cache)."""

    __slots__ = ("rows", "version", "at", "floats", "ints", "seeded", "has_banned", "bias",
                 "allowed", "reads_position", "ones")  # fmt: skip

    def __init__(self, table: SamplingTable, rows: list[int]) -> None:
        self.rows, self.version = list(rows), table._version
        self.at = np.fromiter(rows, np.int64, len(rows))
        self.floats = table.floats.take(self.at, axis=0)
        self.ints = i = table.ints.take(self.at, axis=0)
        self.seeded = i[:, SEEDED] != 0
        self.has_banned = np.flatnonzero(i[:, HAS_BANNED])
        self.reads_position = bool(self.seeded.any() or len(self.has_banned))
        self.ones = np.ones(len(rows), np.int64)  # num_samples when every row draws one
        # The rare per-row things: a scan of a column, then only the rows that have one.
        self.bias: dict[int, dict[int, float]] = {}
        self.allowed: dict[int, bytes] = {}
        for k in np.flatnonzero(i[:, HAS_EXTRAS]).tolist():
            r = rows[k]
            if table.bias[r] is not None:
                self.bias[k] = table.bias[r]
            if table.allowed[r] is not None:
                self.allowed[k] = table.allowed[r]
