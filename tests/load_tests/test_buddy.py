"""The buddy allocator of the paper's Orca what-if (load_tests/buddy.py): power-of-two,
aligned blocks; buddies merge on free; no block handed out twice; whole again at the end."""

from __future__ import annotations

import random

import pytest

from load_tests.buddy import BuddyAllocator
from streamkv.baselines.first_fit import Run
from streamkv.core.block_pool import NoFreeBlocksError


def test_a_pool_is_its_binary_digits_and_sizes_round_up_aligned():
    a = BuddyAllocator(13)  # roots 8 @ 0, 4 @ 8, 1 @ 12
    assert (a.num_free, a.largest_free, a.num_holes) == (13, 8, 3)
    r3 = a.allocate(3)  # 3 -> 4 blocks: the free 4-block at 8, no split needed
    assert (r3.start, r3.num_blocks) == (8, 4)
    assert (a.allocate(1).start, a.allocate(4).start) == (
        12,
        0,
    )  # the 1-root; the 8 split in halves
    r1 = a.allocate(1)  # [4, 8) split down to [4, 5); [5, 6) and [6, 8) stay free
    assert (r1.start, r1.num_blocks) == (4, 1)
    assert (a.num_free, a.largest_free) == (3, 2)
    # External fragmentation: 3 blocks free but no run of 3 fits.
    assert not a.can_fit([3]) and a.can_fit([2, 1]) and not a.can_fit([2, 2])
    with pytest.raises(NoFreeBlocksError):
        a.allocate(3)
    assert list(a.ref_counts) == [1] * 5 + [0] * 3 + [1] * 5


def test_buddies_merge_back_and_the_pool_is_whole():
    a = BuddyAllocator(8)
    runs = [a.allocate(1) for _ in range(8)]
    assert sorted(r.start for r in runs) == list(range(8))
    for r in runs[::2]:  # every other block: no two free buddies, nothing merges
        a.free(r)
    assert (a.num_free, a.largest_free) == (4, 1)
    for r in runs[1::2]:
        a.free(r)
    assert (a.num_free, a.largest_free, a.num_holes) == (8, 8, 1)
    a.check_whole()


def test_misuse_is_refused():
    a = BuddyAllocator(8)
    r = a.allocate(2)
    with pytest.raises(RuntimeError, match="not a buddy block"):
        a.free(Run(1, 2))  # misaligned
    a.free(r)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(r)
    with pytest.raises(ValueError):
        a.allocate(0)
    a.allocate(1)
    with pytest.raises(AssertionError, match="still reserved"):
        a.check_whole()


def test_random_churn_never_overlaps_and_ends_whole():
    rng = random.Random(0)
    a = BuddyAllocator(983)
    live: list[Run] = []
    for _ in range(3000):
        if live and (rng.random() < 0.45 or not a.can_fit([1])):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.randint(1, 40)
            if a.can_fit([size]):
                run = a.allocate(size)
                assert run.num_blocks >= size and run.num_blocks & (run.num_blocks - 1) == 0
                live.append(run)
            else:
                with pytest.raises(NoFreeBlocksError):
                    a.allocate(size)
        held = sorted(b for r in live for b in r.blocks())
        assert len(held) == len(set(held)) == a.num_used  # no block handed out twice
    for r in live:
        a.free(r)
    a.check_whole()


def test_the_simulated_oracle_runs_on_it(tmp_path):
    """The bench's what-if: orca-oracle with its runs placed by the buddy allocator holds
    the rounding as internal fragmentation, batches fewer requests, and frees everything."""
    import json

    from load_tests.bench import main

    rng = random.Random(1)  # Alpaca-like lengths, as token ids: no data set, no tokenizer
    workload = tmp_path / "requests.json"
    workload.write_text(
        json.dumps(
            [
                {
                    "prompt_ids": [rng.randrange(1000, 5000) for _ in range(rng.randint(8, 40))],
                    "output_len": rng.randint(8, 90),
                }
                for _ in range(120)
            ]
        )
    )
    out = {}
    for alloc in ("first-fit", "buddy"):
        path = tmp_path / f"{alloc}.json"
        assert (
            main(
                [
                    "--backend",
                    "offline",
                    "--simulate",
                    "--num-kv-blocks",
                    "200",
                    "--num-swap-blocks",
                    "0",
                    "--max-model-len",
                    "1024",
                    "--no-enable-prefix-caching",
                    "--kv-allocation",
                    "orca-oracle",
                    "--orca-allocator",
                    alloc,
                    "--workload-file",
                    str(workload),
                    "--num-requests",
                    "120",
                    "--request-rate",
                    "200",
                    "--disable-tqdm",
                    "--json-out",
                    str(path),
                ]
            )
            == 0
        )
        out[alloc] = json.loads(path.read_text())["runs"][0]
    ff, bd = out["first-fit"], out["buddy"]
    assert bd["summary"]["completed"] == ff["summary"]["completed"] == 120
    assert bd["kv"]["shares"]["internal"] > ff["kv"]["shares"]["internal"] + 0.1
    assert bd["kv"]["avg_batched_requests"] < ff["kv"]["avg_batched_requests"]
    with pytest.raises(SystemExit, match="paged has none"):
        main(
            [
                "--backend",
                "offline",
                "--simulate",
                "--num-kv-blocks",
                "200",
                "--orca-allocator",
                "buddy",
                "--json-out",
                str(tmp_path / "x.json"),
            ]
        )
