"""cache_salt (vLLM's, issue 26): a salted sequence's prefix-cache keys start from its salt's
root, so equal prompts share blocks only under equal salts (or both unsalted); reserved
prefixes stay public text, shared whatever the salt."""

from __future__ import annotations

import pytest

from streamkv.core.block_manager import AllocStatus, BlockManager
from streamkv.core.block_pool import root_key
from streamkv.sampling_params import InvalidParameter, SamplingParams
from streamkv.sequence import Sequence, SequenceGroup

BS = 4
PROMPT = list(range(13))  # 3 whole blocks + 1 token: 12 tokens can be hits


def _seq(seq_id: int, salt: str | None, tokens: list[int] = PROMPT) -> Sequence:
    return Sequence(seq_id, list(tokens), cache_root=root_key(salt))


def _computed(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq)
    bm.ensure_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.mark_computed(seq)


def test_root_key_is_none_without_a_salt_and_differs_per_salt():
    assert root_key(None) is None
    assert root_key("a") == root_key("a") != root_key("b")
    assert root_key("") not in (None, root_key("a"))


@pytest.mark.parametrize(
    "first,second,hits",
    [
        (None, None, 12),
        ("tenant-a", "tenant-a", 12),
        ("tenant-a", "tenant-b", 0),
        ("tenant-a", None, 0),
        (None, "tenant-a", 0),
    ],
)
def test_same_prompt_hits_only_under_the_same_salt(first, second, hits):
    bm = BlockManager(BS, 32, 0, enable_prefix_caching=True, watermark=0.0)
    a = _seq(0, first)
    _computed(bm, a)
    bm.free(a)
    b = _seq(1, second)
    assert bm.allocate(b) == hits
    b.num_computed_tokens = len(b)
    bm.mark_computed(b)  # registers its own blocks under its own keys
    bm.free(b)
    c = _seq(2, second)  # whatever the first did, the second salt's blocks are now cached
    assert bm.allocate(c) == 12
    bm.free(c)
    bm.check_no_leaks()


def test_in_flight_sharing_waits_only_for_the_same_salt():
    """A running sequence computing the same blocks makes a new one wait a step to share
    them (SHARE_LATER) only when their salts match."""
    bm = BlockManager(BS, 32, 0, enable_prefix_caching=True, watermark=0.0)
    running = _seq(0, "a")
    bm.allocate(running)  # allocated, not computed yet
    same = SequenceGroup("same", [_seq(1, "a")], SamplingParams())
    other = SequenceGroup("other", [_seq(2, "b")], SamplingParams())
    public = SequenceGroup("public", [_seq(3, None)], SamplingParams())
    assert bm.can_allocate(same) == AllocStatus.SHARE_LATER
    assert bm.can_allocate(other) == AllocStatus.OK
    assert bm.can_allocate(public) == AllocStatus.OK
    bm.free(running)
    bm.check_no_leaks()


def test_forks_keep_their_parents_salt():
    bm = BlockManager(BS, 32, 0, enable_prefix_caching=True, watermark=0.0)
    parent = _seq(0, "a")
    child = parent.fork(1, 1)
    assert child.cache_root == parent.cache_root == root_key("a")
    _computed(bm, parent)
    bm.free(parent)
    assert bm.allocate(_seq(2, "a")) == 12
    assert bm.allocate(_seq(3, "b")) == 0
    for i in (2, 3):
        bm.free(Sequence(i, []))
    bm.check_no_leaks()


@pytest.mark.parametrize("salt", [None, "a"])
def test_reserved_prefixes_are_shared_whatever_the_salt(salt):
    bm = BlockManager(BS, 32, 0, enable_prefix_caching=True, watermark=0.0)
    prefix = bm.reserved.add(PROMPT[:8])
    _computed(bm, _seq(0, None, PROMPT[:8]))
    bm.free(Sequence(0, []))
    assert prefix.ready
    seq = _seq(1, salt, PROMPT[:8] + [50, 51, 52, 53, 54])
    assert bm.allocate(seq) == 8
    assert bm.block_table(seq)[:2] == prefix.blocks
    bm.free(seq)
    bm.check_no_leaks()


@pytest.mark.parametrize("salt", ["", "x" * 257, 5])
def test_bad_salts_are_refused_by_name(salt):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(cache_salt=salt)
    assert e.value.param == "cache_salt"


def test_the_salt_stays_out_of_the_request_log():
    # --enable-log-requests logs the parameters' repr; a salt is a tenant's secret.
    assert "tenant-secret" not in repr(SamplingParams(cache_salt="tenant-secret"))
