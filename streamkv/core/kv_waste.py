"""KV waste (the paper's Fig 2): at a sample every slot that requests hold, plus the free
slots that fragmentation makes unusable, falls into one of four kinds:

    token      holds a computed token's K/V (a shared block counts once)
    reserved   held for a token the request will still write
    internal   held but never written: a block's tail past the request's final length, a
               contiguous reservation larger than the request, or (request-level batching)
               the runs of ended requests that their batch still holds
    external   free, but outside the largest free run: a contiguous run that the largest
               hole cannot take cannot use it either (always 0 for paged allocation)

A request's slots that will ever be written are its final length minus one (the last
sampled token's K/V is never computed); the final length is prompt + max_tokens (within
max_model_len), and the benchmarks send ignore_eos with max_tokens = the true output, so
there it is exact. Each block manager answers ``kv_usage`` (engine/stats.py samples it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from streamkv.sampling_params import SamplingParams
from streamkv.sequence import SequenceGroup

WASTE_KINDS = ("token", "reserved", "internal", "external")


@dataclass(slots=True)
class KVWaste:
    """KV slots by what they hold at one step (see the module docstring)."""

    token: int = 0
    reserved: int = 0
    internal: int = 0
    external: int = 0

    @property
    def total(self) -> int:
        return self.token + self.reserved + self.internal + self.external

    def shares(self) -> dict[str, float]:
        total = self.total
        return {k: getattr(self, k) / total if total else 0.0 for k in WASTE_KINDS}


@dataclass(slots=True)
class KVUsage:
    """One sample. ``tables``: the distinct blocks the sequences' block tables reach (the
    utilization and sharing figures); ``waste``: every slot the allocator holds for them (the
    same slots for paged allocation; whole runs, spares and holes for a contiguous one)."""

    tables: KVWaste
    waste: KVWaste


def final_len(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """Tokens a sequence holds when it ends by length (prompt + max_tokens, within the
    context). With ``ignore_eos`` this is the length it will reach."""
    if params.max_tokens is None:
        return max(max_model_len, prompt_len)
    return min(prompt_len + params.max_tokens, max(max_model_len, prompt_len))


def table_waste(
    tables: Mapping[int, list[int]],
    groups: list[SequenceGroup],
    block_size: int,
    max_model_len: int,
) -> KVWaste:
    """The groups' blocks by slot kind, every held block once (a shared block holds the most
    tokens any sharer has written), walked without a dict entry per full block: full blocks
    are gathered into one set, and only the partly filled ones (about one per sequence) go
    through Python (256 sequences of 1k tokens: ~2 ms a sample before). External is 0."""
    full_blocks: list[int] = []  # blocks some sharer has filled
    part: dict[int, int] = {}  # other blocks -> tokens in them (the most any sharer has written)
    will: dict[int, int] = {}  # partly filled block -> slots any sharer will ever write
    for group in groups:
        for seq in group.seqs:
            table = tables.get(seq.seq_id)
            if table is None:
                continue
            seq_len = seq.num_computed_tokens
            n = len(table)
            full = min(seq_len // block_size, n)
            full_blocks += table[:full]
            if full == n:
                continue
            final = final_len(len(seq.prompt_token_ids), group.sampling_params, max_model_len) - 1
            for i in range(full, n):
                block = table[i]
                filled = min(max(seq_len - i * block_size, 0), block_size)
                if filled >= part.get(block, 0):
                    part[block] = filled
                written = min(max(final - i * block_size, 0), block_size)
                if written > will.get(block, 0):
                    will[block] = written
    full_set = set(full_blocks)
    partial = [f for b, f in part.items() if b not in full_set]
    num_blocks = len(full_set) + len(partial)
    token = len(full_set) * block_size + sum(partial)
    internal = sum(
        block_size - max(w, block_size if b in full_set else part[b]) for b, w in will.items()
    )
    return KVWaste(token, num_blocks * block_size - token - internal, internal, 0)
