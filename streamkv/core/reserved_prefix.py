"""Reserved shared prefixes (the paper's §4.4): token prefixes an operator registers — a
system prompt, few-shot examples — whose KV blocks are computed once, pinned, and mapped
read-only into every request whose prompt starts with them.

Pinning is a reference the registry itself holds on each block: a block with a ref count
above zero is never on the free list nor in the prefix cache's LRU, so it is never evicted,
and a request that maps it writes a copy (copy-on-write) as with any shared block. Only whole
blocks are shared: a prefix of 40 tokens at block size 16 pins 2 blocks, and each request
recomputes the other 8 tokens in its own block (a shared partial block would be written by
every request's first own token, so it would be copied every time anyway).

A registered prefix is *pending* until a request that starts with it has computed its
blocks; that request (the registration's own one-token request, or the first user) is its
*computer*, and its blocks are captured the step they are computed. Until then other
requests compute their own copy, as they would without the prefix.

Pure Python: the pool is only asked for ref counts (no torch).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from streamkv.core.block_pool import BlockPool


class ReservedPrefixError(ValueError):
    """A registration or removal the registry refuses (too short, unknown id)."""


@dataclass(slots=True)
class ReservedPrefix:
    prefix_id: str
    token_ids: tuple[int, ...]
    num_blocks: int  # whole blocks shared; the tokens past them are recomputed per request
    blocks: list[int] = field(default_factory=list)  # pinned device blocks, once computed
    num_uses: int = 0  # requests that mapped it

    @property
    def ready(self) -> bool:
        return bool(self.blocks)


class ReservedPrefixes:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefixes: dict[str, ReservedPrefix] = {}
        self.computing: dict[int, ReservedPrefix] = {}  # seq id -> the pending prefix it computes
        self._ids = itertools.count(1)

    # -- registration -------------------------------------------------------------------
    def add(
        self, token_ids: list[int] | tuple[int, ...], prefix_id: str | None = None
    ) -> ReservedPrefix:
        """Register ``token_ids`` (the same tokens twice are one prefix); ``prefix_id`` keeps a
        prefix's id across a restart (engine/reserved_prefixes.carry_prefixes)."""
        tokens = tuple(int(t) for t in token_ids)
        num_blocks = len(tokens) // self.block_size
        if num_blocks == 0:
            raise ReservedPrefixError(
                "a reserved prefix must hold at least one "
                f"whole KV block ({self.block_size} tokens); "
                f"this one has {len(tokens)}"
            )
        for p in self.prefixes.values():
            if p.token_ids == tokens:
                return p  # the same text twice is one prefix
        if prefix_id is None:
            prefix_id = f"pfx-{next(self._ids)}"
            while prefix_id in self.prefixes:  # past the ids carried over from before a restart
                prefix_id = f"pfx-{next(self._ids)}"
        elif prefix_id in self.prefixes:
            raise ReservedPrefixError(f"reserved prefix id {prefix_id!r} is taken")
        prefix = ReservedPrefix(prefix_id, tokens, num_blocks)
        self.prefixes[prefix.prefix_id] = prefix
        return prefix

    def remove(self, prefix_id: str) -> ReservedPrefix:
        """Drop the registry's pins; requests still mapping the blocks keep them until they end."""
        prefix = self.prefixes.pop(prefix_id, None)
        if prefix is None:
            raise ReservedPrefixError(f"no reserved prefix {prefix_id!r}")
        for seq_id in [s for s, p in self.computing.items() if p is prefix]:
            del self.computing[seq_id]
        for block in prefix.blocks:
            self.pool.decref(block)
        prefix.blocks = []
        return prefix

    # -- requests -----------------------------------------------------------------------
    def _common_blocks(self, prefix: ReservedPrefix, tokens: list[int], limit: int) -> int:
        bs = self.block_size
        n = min(prefix.num_blocks, limit)
        if n == 0 or tokens[:bs] != list(prefix.token_ids[:bs]):
            return 0
        i = 1
        while i < n and tokens[i * bs : (i + 1) * bs] == list(
            prefix.token_ids[i * bs : (i + 1) * bs]
        ):
            i += 1
        return i

    def match(self, seq_id: int, tokens: list[int], limit: int, claim: bool = True) -> list[int]:
        """The pinned blocks of the longest ready prefix ``tokens`` starts with (at most
        ``limit`` whole blocks). With ``claim`` (the sequence is being allocated), the use is
        counted and ``seq_id`` becomes the computer of a pending prefix it starts with whole."""
        best, best_n = None, 0
        for prefix in self.prefixes.values():
            n = self._common_blocks(prefix, tokens, limit if prefix.ready else prefix.num_blocks)
            if n and prefix.ready and n > best_n:
                best, best_n = prefix, n
            elif (
                claim
                and n == prefix.num_blocks
                and not prefix.ready
                and prefix not in self.computing.values()
            ):
                self.computing[seq_id] = prefix
        if best is None:
            return []
        if claim:
            best.num_uses += 1
        return best.blocks[:best_n]

    def computed(self, seq_id: int, table: list[int], num_computed_tokens: int) -> None:
        """Pin a pending prefix's blocks once its computer has written them."""
        prefix = self.computing.get(seq_id)
        if prefix is None or num_computed_tokens < prefix.num_blocks * self.block_size:
            return
        del self.computing[seq_id]
        prefix.blocks = list(table[: prefix.num_blocks])
        for block in prefix.blocks:
            self.pool.incref(block)

    def forget(self, seq_id: int) -> None:
        """The sequence's blocks are going: a prefix it was computing stays pending."""
        self.computing.pop(seq_id, None)

    # -- accounting ---------------------------------------------------------------------
    def pins(self) -> dict[int, int]:
        """Block -> references the registry holds on it (prefixes may share leading blocks)."""
        out: dict[int, int] = {}
        for prefix in self.prefixes.values():
            for block in prefix.blocks:
                out[block] = out.get(block, 0) + 1
        return out

    def num_pinned_blocks(self) -> int:
        return len(self.pins())

    def describe(self, prefix: ReservedPrefix) -> dict:
        return {
            "id": prefix.prefix_id,
            "object": "reserved_prefix",
            "num_tokens": len(prefix.token_ids),
            "num_shared_tokens": prefix.num_blocks * self.block_size,
            "num_blocks": prefix.num_blocks,
            "status": "ready" if prefix.ready else "pending",
            "num_uses": prefix.num_uses,
        }
