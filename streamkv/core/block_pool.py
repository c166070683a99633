"""Physical KV blocks: a free list, reference counts, and the prefix-cache index.

Pure Python (no torch): the pool only hands out block ids; the tensors live in workers.

A full block may be registered under a content key that chains its parent's key with its
token ids through SHA-256. The chain of a sequence with a ``cache_salt`` starts from a root
of that salt (``root_key``), so tenants with different salts never share a block and cannot
learn from the cache whether another tenant sent a prompt (vLLM's defence, issue 26).
Registered blocks whose ref count drops to zero are not freed:
they wait in an LRU list and are reused on a hit or evicted when the pool needs space.
A reserved prefix's blocks (core/reserved_prefix.py) keep a reference of their own, so they
never reach that list: pinned.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque


def cdiv(a: int, b: int) -> int:
    """Blocks that ``a`` tokens fill at ``b`` tokens a block (ceiling division)."""
    return -(-a // b)


def root_key(cache_salt: str | None) -> bytes | None:
    """The parent key of a sequence's first block: None (the shared root) without a salt.
    The NUL keeps a salt from ever spelling the unsalted root."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"salt\0" + cache_salt.encode()).digest()


def block_key(parent_key: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.sha256(parent_key or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # key -> block id, and block id -> (key, token ids) for confirming a hit.
        self._cached: dict[bytes, int] = {}
        self._block_content: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        # Cached blocks with ref count 0, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0
        # Blocks with more than one reference, kept as a count: the stats read it every
        # 0.25 s, and a scan of ~50,000 ref counts was ~1% of the engine thread's time.
        self.num_shared = 0

    # -- counting -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that an allocation can get: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # -- allocate / free ----------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError("KV block pool exhausted")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self._evictable.pop(block, None)
        rc = self.ref_counts[block] + 1
        self.ref_counts[block] = rc
        if rc == 2:
            self.num_shared += 1

    def decref(self, block: int) -> None:
        rc = self.ref_counts[block]
        if rc <= 0:
            raise RuntimeError(f"double free of block {block}")
        self.ref_counts[block] = rc - 1
        if rc == 2:
            self.num_shared -= 1
        elif rc == 1:
            if block in self._block_content:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # -- prefix cache -------------------------------------------------------------------
    def lookup(self, key: bytes, token_ids: tuple[int, ...]) -> int | None:
        """A cached block holding exactly these tokens under this key, or None."""
        block = self._cached.get(key)
        if block is None:
            return None
        stored_key, stored_tokens = self._block_content[block]
        # A hash collision must never hand out another sequence's KV.
        if stored_key != key or stored_tokens != token_ids:
            return None
        return block

    def register(self, block: int, key: bytes, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or block in self._block_content:
            return
        if key in self._cached:
            return  # another block already holds this content; keep the first
        self._cached[key] = block
        self._block_content[block] = (key, token_ids)

    def _uncache(self, block: int) -> None:
        key, _ = self._block_content.pop(block)
        if self._cached.get(key) == block:
            del self._cached[key]

    def reset_prefix_cache(self) -> None:
        for block in list(self._evictable):
            self._uncache(block)
            self._free.append(block)
        self._evictable.clear()

    def check_whole(self, pins: dict[int, int] | None = None) -> None:
        """Raise unless every block is unreferenced and reachable (free or evictable), but
        for ``pins`` (block -> references held by reserved prefixes)."""
        pins = pins or {}
        leaked = [b for b, rc in enumerate(self.ref_counts) if rc != pins.get(b, 0)]
        if leaked:
            raise AssertionError(f"blocks still referenced: {leaked[:16]}...")
        if len(set(self._free)) + len(self._evictable) + len(pins) != self.num_blocks:
            raise AssertionError("free list is not whole")
