"""Reserved shared prefixes (core/reserved_prefix.py): computed once, pinned, mapped read-only
into every request that starts with them, with the prefix cache on or off. Through the
offline engine: tests/engine/test_reserved_prefixes.py."""

from __future__ import annotations

import pytest

from streamkv.core.block_manager import BlockManager
from streamkv.core.block_pool import NoFreeBlocksError
from streamkv.core.reserved_prefix import ReservedPrefixError
from streamkv.sequence import Sequence

BS = 4
PREFIX = list(range(100, 110))  # 2 whole blocks + 2 tokens


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """What a step does for ``seq``: slots for its uncomputed tokens, then they are computed."""
    bm.ensure_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.mark_computed(seq)


def _ready_bm(caching: bool, num_blocks: int = 16) -> tuple[BlockManager, str]:
    bm = BlockManager(BS, num_blocks, 0, enable_prefix_caching=caching, watermark=0.0)
    prefix = bm.reserved.add(PREFIX)
    computer = Sequence(0, list(PREFIX))
    assert bm.allocate(computer) == 0
    assert not prefix.ready
    _compute(bm, computer)
    assert prefix.ready and len(prefix.blocks) == 2
    bm.free(computer)
    return bm, prefix.prefix_id


@pytest.mark.parametrize("caching", [False, True])
def test_prefix_is_computed_once_and_shared_read_only(caching):
    bm, pid = _ready_bm(caching)
    blocks = bm.reserved.prefixes[pid].blocks
    assert [bm.device.ref_counts[b] for b in blocks] == [1, 1]  # the pin alone
    assert bm.num_pinned_blocks() == 2
    seqs = [Sequence(i + 1, PREFIX + [7, i, 9]) for i in range(5)]
    for seq in seqs:
        assert bm.allocate(seq) == 2 * BS  # both whole blocks mapped: 8 tokens not computed
        assert bm.block_table(seq)[:2] == blocks
    assert [bm.device.ref_counts[b] for b in blocks] == [6, 6]
    # Each request's own tail (prefix tokens 9-10 and its suffix) lives in its own blocks.
    tails = {bm.block_table(s)[2] for s in seqs}
    assert len(tails) == 5 and not tails & set(blocks)
    for seq in seqs:
        _compute(bm, seq)  # appends past the shared blocks: no copy-on-write of a pinned one
    assert bm.num_cow_copies == 0
    for seq in seqs:
        bm.free(seq)
    bm.check_no_leaks()  # only the pins remain
    bm.reserved.remove(pid)
    assert bm.num_pinned_blocks() == 0
    bm.check_no_leaks()
    assert bm.device.num_free == 16


def test_the_partial_last_block_and_the_last_token_are_computed():
    bm, pid = _ready_bm(False)
    exact = Sequence(1, PREFIX[:8])  # the two whole blocks alone: the last token needs logits
    assert bm.allocate(exact) == BS
    partial = Sequence(2, PREFIX[:6] + [1, 2, 3])  # diverges inside the second block
    assert bm.allocate(partial) == BS
    other = Sequence(3, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(other) == 0
    for s in (exact, partial, other):
        bm.free(s)
    bm.reserved.remove(pid)
    bm.check_no_leaks()


@pytest.mark.parametrize("caching", [False, True])
def test_pinned_blocks_survive_memory_pressure(caching):
    bm, pid = _ready_bm(caching, num_blocks=8)
    pinned = set(bm.reserved.prefixes[pid].blocks)
    hogs = []
    with pytest.raises(NoFreeBlocksError):
        for i in range(10):
            seq = Sequence(50 + i, [900 + i] * BS)  # one block each, distinct content
            bm.allocate(seq)
            _compute(bm, seq)
            hogs.append(seq)
    assert len(hogs) == 6  # 8 blocks minus the 2 pinned ones
    assert not pinned & {b for s in hogs for b in bm.block_table(s)}
    bm.device.reset_prefix_cache()
    assert {b for b, rc in enumerate(bm.device.ref_counts) if rc and b in pinned} == pinned
    for s in hogs:
        bm.free(s)
    user = Sequence(99, PREFIX + [1])
    assert bm.allocate(user) == 2 * BS  # still mapped after the pool was drained
    bm.free(user)
    bm.reserved.remove(pid)
    bm.check_no_leaks()


def test_removal_while_in_use_frees_after_the_last_user():
    bm, pid = _ready_bm(False)
    blocks = list(bm.reserved.prefixes[pid].blocks)
    user = Sequence(1, PREFIX + [5])
    bm.allocate(user)
    bm.reserved.remove(pid)
    assert [bm.device.ref_counts[b] for b in blocks] == [1, 1]
    later = Sequence(2, PREFIX + [5])
    assert bm.allocate(later) == 0  # no longer shared
    bm.free(user)
    bm.free(later)
    bm.check_no_leaks()


def test_a_computer_that_leaves_early_hands_the_prefix_to_the_next():
    bm = BlockManager(BS, 16, 0, watermark=0.0)
    prefix = bm.reserved.add(PREFIX)
    first = Sequence(0, PREFIX + [1])
    bm.allocate(first)
    bm.free(first)  # aborted before computing
    assert not prefix.ready
    second = Sequence(1, PREFIX + [2])
    bm.allocate(second)
    _compute(bm, second)
    assert prefix.ready
    bm.free(second)
    bm.reserved.remove(prefix.prefix_id)
    bm.check_no_leaks()


def test_nested_prefixes_share_their_common_blocks():
    bm, short_id = _ready_bm(False)
    long_prefix = bm.reserved.add(PREFIX + list(range(200, 206)))  # 4 whole blocks
    computer = Sequence(5, list(long_prefix.token_ids))
    assert bm.allocate(computer) == 2 * BS  # the short prefix's blocks, then it computes the rest
    _compute(bm, computer)
    bm.free(computer)
    short = bm.reserved.prefixes[short_id].blocks
    assert long_prefix.blocks[:2] == short
    assert [bm.device.ref_counts[b] for b in long_prefix.blocks] == [2, 2, 1, 1]
    user = Sequence(6, list(long_prefix.token_ids) + [3])
    assert bm.allocate(user) == 4 * BS
    bm.free(user)
    bm.reserved.remove(short_id)
    bm.reserved.remove(long_prefix.prefix_id)
    bm.check_no_leaks()


def test_bad_registrations_are_refused():
    bm = BlockManager(BS, 16, 0)
    with pytest.raises(ReservedPrefixError, match="whole KV block"):
        bm.reserved.add([1, 2, 3])
    with pytest.raises(ReservedPrefixError, match="no reserved prefix"):
        bm.reserved.remove("pfx-404")
    assert bm.reserved.add(PREFIX) is bm.reserved.add(PREFIX)  # the same tokens are one prefix
