"""A buddy allocator over the block pool: the allocator the paper assumes its Orca baselines
use (§6.1: "we assume that Orca uses the buddy allocation algorithm to determine the memory
address to store KV cache"), for a what-if beside the engine's own first-fit one.

Benchmark use only (``python -m load_tests.bench --orca-allocator buddy``): it replaces the
first-fit slot space of ``streamkv/baselines/contiguous.py``'s managers before the first
request, with the same interface (``FirstFitAllocator``'s), so the reservations, the
scheduler and the waste accounting are unchanged; only where runs go, and their size,
differ:

- a run of k blocks takes an aligned block of 2^ceil(log2 k) (the rounding is held by the
  request: the waste accounting counts it as internal fragmentation);
- a free block is split in halves down to the size asked; a freed block merges with its
  buddy when that is free too, so free space is only ever whole aligned power-of-two blocks.

A pool that is not a power of two is the sum of its binary digits (983 = 512 + 256 + 128 +
64 + 16 + 4 + 2 + 1), each an independent root: blocks never merge across roots.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamkv.baselines.first_fit import Run
from streamkv.core.block_pool import NoFreeBlocksError


def _order(size: int) -> int:
    return (size - 1).bit_length()


class BuddyAllocator:
    num_evictions = 0  # no prefix cache (read like BlockPool's)

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_free = num_blocks
        self._free: dict[int, set[int]] = {}  # order -> start ids of free blocks of 2^order
        self._root_order: dict[int, int] = {}  # root start -> its order
        start = 0
        for order in range(num_blocks.bit_length() - 1, -1, -1):
            if num_blocks >> order & 1:
                self._free.setdefault(order, set()).add(start)
                self._root_order[start] = order
                start += 1 << order
        self._roots = sorted(self._root_order)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def largest_free(self) -> int:
        return max((1 << o for o, starts in self._free.items() if starts), default=0)

    @property
    def num_holes(self) -> int:
        return sum(len(s) for s in self._free.values())

    @property
    def ref_counts(self) -> bytearray:
        counts = bytearray(b"\x01") * self.num_blocks
        for order, starts in self._free.items():
            for s in starts:
                counts[s : s + (1 << order)] = bytes(1 << order)
        return counts

    def _take(self, free: dict[int, list[int]], order: int) -> int | None:
        """Lowest free block of ``order`` from ``free`` (splitting a larger one), or None."""
        for o in range(order, max(free, default=-1) + 1):
            if free.get(o):
                start = min(free[o])
                free[o].remove(start)
                while o > order:  # keep the lower half, free the upper one
                    o -= 1
                    free.setdefault(o, []).append(start + (1 << o))
                return start
        return None

    def can_fit(self, sizes: Iterable[int]) -> bool:
        free = {o: sorted(s) for o, s in self._free.items()}
        return all(self._take(free, _order(size)) is not None for size in sizes)

    def allocate(self, size: int) -> Run:
        if size < 1:
            raise ValueError(f"a run needs at least one block, got {size}")
        order = _order(size)
        free = {o: sorted(s) for o, s in self._free.items()}
        start = self._take(free, order)
        if start is None:
            raise NoFreeBlocksError(
                f"no free buddy block of {1 << order} blocks for {size} "
                f"(largest free: {self.largest_free})"
            )
        self._free = {o: set(s) for o, s in free.items() if s}
        self.num_free -= 1 << order
        return Run(start, 1 << order)

    def _root_of(self, start: int) -> tuple[int, int]:
        root = max(r for r in self._roots if r <= start)
        return root, self._root_order[root]

    def free(self, run: Run) -> None:
        order = _order(run.num_blocks)
        if run.num_blocks != 1 << order or not 0 <= run.start < self.num_blocks:
            raise RuntimeError(
                f"run [{run.start}, {run.start + run.num_blocks}) is not a buddy block"
            )
        root, root_order = self._root_of(run.start)
        if (run.start - root) % (1 << order) or order > root_order:
            raise RuntimeError(
                f"run [{run.start}, {run.start + run.num_blocks}) is not a buddy block"
            )
        if any(
            self._overlaps(run.start, 1 << order, o, s) for o, ss in self._free.items() for s in ss
        ):
            raise RuntimeError(f"double free of run [{run.start}, {run.start + run.num_blocks})")
        self.num_free += 1 << order
        start = run.start
        while order < root_order:
            buddy = root + ((start - root) ^ (1 << order))
            if buddy not in self._free.get(order, ()):
                break
            self._free[order].discard(buddy)
            start, order = min(start, buddy), order + 1
        self._free.setdefault(order, set()).add(start)

    @staticmethod
    def _overlaps(start: int, size: int, order: int, other: int) -> bool:
        return start < other + (1 << order) and other < start + size

    def check_whole(self) -> None:
        whole = {o: {r} for r, o in self._root_order.items()}  # one root per binary digit
        got = {o: set(s) for o, s in self._free.items() if s}
        if got != whole:
            raise AssertionError(
                f"runs still reserved; free buddy blocks: {sorted(got.items())[:8]}"
            )
