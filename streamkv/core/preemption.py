"""How ``preemption_mode=auto`` gives a preempted group's blocks back: swap them to CPU RAM
or drop them and recompute later, whichever the measured cost model says is cheaper
(the paper's Fig 19a; benchmarks/bench_swap_recompute.py measures and fits it).

    swap      = 2 x (call_ms + blocks x (block_us + block_size x token_us) / 1000)
                (out now, in later: two transfers of the group's unique blocks)
    recompute = fixed_ms + tokens x token_ms + tokens^2 x quad_ns / 1e6
                (one prefill of what the group must compute again: the leader's tokens
                plus each other sequence's tail past the shared prefix, as allocate_group
                maps them)

The rule: swap when the CPU pool has room for the blocks and swapping costs less, else
recompute. Per block, a swap moves block_size tokens' K/V plus a per-transfer overhead, so
tiny blocks make swapping expensive (the paper: > 120 ms at block size 1) while recompute
does not depend on the block size; long contexts make recompute grow faster than linearly.

The constants live in ``preemption_costs.json`` next to this file, one profile per device
kind, fitted by ``bench_swap_recompute.py --write-costs``; its ``default`` profile is the one
used unless ``preemption_cost_profile`` names another. Pure Python, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

COSTS_FILE = Path(__file__).with_name("preemption_costs.json")


@dataclass(frozen=True, slots=True)
class PreemptionCosts:
    call_ms: float  # per swap transfer (all blocks of the group, all layers)
    block_us: float  # per block moved
    token_us: float  # per token slot moved (the K/V bytes)
    fixed_ms: float  # per recompute prefill
    token_ms: float  # per recomputed token
    quad_ns: float = 0.0  # per recomputed token squared (attention over the context)
    source: str = ""  # what was measured, where

    def swap_ms(self, num_blocks: int, block_size: int) -> float:
        return 2.0 * (
            self.call_ms + num_blocks * (self.block_us + block_size * self.token_us) / 1000.0
        )

    def recompute_ms(self, num_tokens: int) -> float:
        return (
            self.fixed_ms
            + num_tokens * self.token_ms
            + num_tokens * num_tokens * self.quad_ns / 1e6
        )


def device_profile(device_type: str, path: Path = COSTS_FILE) -> str | None:
    """The profile measured on this kind of device ("cuda", "cpu"), if the file has one;
    None leaves the file's default."""
    with open(path) as f:
        return device_type if device_type in json.load(f)["profiles"] else None


def load_costs(profile: str | None = None, path: Path = COSTS_FILE) -> PreemptionCosts:
    """The named profile of ``path`` (None: the file's default)."""
    with open(path) as f:
        data = json.load(f)
    name = profile or data["default"]
    profiles = data["profiles"]
    if name not in profiles:
        raise ValueError(
            f"no preemption cost profile {name!r} in {path.name}; known: {sorted(profiles)}"
        )
    fields = PreemptionCosts.__dataclass_fields__
    return PreemptionCosts(**{k: v for k, v in profiles[name].items() if k in fields})


def choose(
    costs: PreemptionCosts,
    num_blocks: int,
    block_size: int,
    recompute_tokens: int,
    cpu_free_blocks: int,
) -> str:
    """'swap' or 'recompute' for a group holding ``num_blocks`` unique device blocks that
    would recompute ``recompute_tokens`` tokens."""
    if num_blocks > cpu_free_blocks:
        return "recompute"
    if costs.swap_ms(num_blocks, block_size) < costs.recompute_ms(recompute_tokens):
        return "swap"
    return "recompute"


def auto_mode(costs: PreemptionCosts, bm, group, seqs: list) -> str:
    """The scheduler's ``auto`` choice for ``group`` whose running sequences are ``seqs``
    (``bm``: its block manager; one that cannot swap the group out, for want of CPU room or
    because it is a contiguous baseline, recomputes)."""
    if not bm.can_swap_out(group):
        return "recompute"
    group_blocks = {b for s in seqs for b in bm.block_table(s)}
    shared = bm.shared_prefix_blocks(seqs) * bm.block_size if len(seqs) > 1 else 0
    tokens = sum(len(s) for s in seqs) - shared * (len(seqs) - 1)
    # A reserved prefix's blocks come back mapped, not recomputed (they stay pinned).
    pinned = bm.reserved.pins()
    leader = bm.block_table(seqs[0])
    i = 0
    while i < len(leader) and leader[i] in pinned:
        i += 1
    tokens -= min(i * bm.block_size, tokens - 1)
    return choose(costs, len(group_blocks), bm.block_size, tokens, bm.cpu.num_free)
