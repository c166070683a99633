"""A contiguous slot space: runs of consecutive block ids handed out first-fit (lowest
address), freed runs coalesced with their neighbours, so holes between live runs (external
fragmentation) form as in any contiguous allocator. Pure Python; baselines/contiguous.py uses
it for the paper's Orca baselines."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from streamkv.core.block_pool import NoFreeBlocksError


@dataclass(slots=True)
class Run:
    """A reservation: consecutive block ids ``[start, start + num_blocks)``."""

    start: int
    num_blocks: int

    def blocks(self, n: int | None = None) -> list[int]:
        return list(range(self.start, self.start + (self.num_blocks if n is None else n)))


class FirstFitAllocator:
    """Free space as sorted, coalesced ``[start, length]`` holes; a request takes the first
    hole large enough (lowest address)."""

    num_evictions = 0  # no prefix cache: nothing is ever evicted (read like BlockPool's)

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._holes: list[list[int]] = [[0, num_blocks]] if num_blocks else []
        self.num_free = num_blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def largest_free(self) -> int:
        return max((h[1] for h in self._holes), default=0)

    @property
    def ref_counts(self) -> bytearray:
        """A BlockPool-shaped view for readers (the KV view's snapshot): 1 for every reserved
        block, 0 for a free one. Built on demand, O(blocks)."""
        counts = bytearray(b"\x01") * self.num_blocks
        for start, length in self._holes:
            counts[start : start + length] = bytes(length)
        return counts

    @property
    def num_holes(self) -> int:
        return len(self._holes)

    def can_fit(self, sizes: Iterable[int]) -> bool:
        """Whether first-fit could place all of ``sizes`` (in order) right now."""
        holes = [h[1] for h in self._holes]
        for size in sizes:
            i = next((i for i, free in enumerate(holes) if free >= size), None)
            if i is None:
                return False
            holes[i] -= size
        return True

    def allocate(self, size: int) -> Run:
        if size < 1:
            raise ValueError(f"a run needs at least one block, got {size}")
        for i, hole in enumerate(self._holes):
            if hole[1] >= size:
                run = Run(hole[0], size)
                hole[0] += size
                hole[1] -= size
                if hole[1] == 0:
                    del self._holes[i]
                self.num_free -= size
                return run
        raise NoFreeBlocksError(f"no free run of {size} blocks (largest hole: {self.largest_free})")

    def free(self, run: Run) -> None:
        start, end = run.start, run.start + run.num_blocks
        if start < 0 or end > self.num_blocks:
            raise RuntimeError(f"run [{start}, {end}) is outside the pool")
        i = bisect.bisect_left(self._holes, [start, 0])
        before = self._holes[i - 1] if i else None
        after = self._holes[i] if i < len(self._holes) else None
        if (before and before[0] + before[1] > start) or (after and after[0] < end):
            raise RuntimeError(f"double free of run [{start}, {end})")
        if before and before[0] + before[1] == start:
            before[1] += run.num_blocks
            if after and after[0] == end:
                before[1] += after[1]
                del self._holes[i]
        elif after and after[0] == end:
            after[0], after[1] = start, after[1] + run.num_blocks
        else:
            self._holes.insert(i, [start, run.num_blocks])
        self.num_free += run.num_blocks

    def check_whole(self) -> None:
        if self._holes != ([[0, self.num_blocks]] if self.num_blocks else []):
            raise AssertionError(f"runs still reserved; free holes: {self._holes[:8]}")
