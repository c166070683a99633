"""Each CUDA kernel production launches against the pure-torch reference in ops.py (skipped
without a GPU). The decode kernels' experimental variants: tests/benchmarks/test_decode_variants.py.

Inputs are fresh random data on random block tables over a large pool; outputs start as
NaN so an element the kernel never writes fails; cache slots no sequence owns hold NaN so a
kernel that reads past a context fails too. Attention is compared with a float64 reference.
"""

from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch

from streamkv.kernels import ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HEADS = (64, 80, 96, 128, 256)
BLOCKS = (8, 16, 32)
# The rest of the paper's 1-256 sweep: the same kernels instantiated at other BLOCKs, tested
# on a few shapes each (decode: a tensor-core and a CUDA-core case).
NEW_BLOCKS = (1, 2, 4, 64, 128, 256)
NEW_BLOCK_SHAPES = ((torch.bfloat16, 128, 4), (torch.float32, 256, 2))  # dtype, head, group
# Production's decode kernel by case: tensor cores for fp16 / bf16 at head 64, 128, 256 with
# 2+ query heads per KV head (groups 4, 8), the CUDA-core kernel for the rest (group 1,
# fp32, head 80 / 96).
GROUPS = (1, 4, 8)
POOL_BLOCKS = 2048


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every program this module uses at once, in threads (NVRTC drops the GIL)."""
    if not torch.cuda.is_available():
        return
    from streamkv.kernels import cuda_ops, nvrtc
    from streamkv.kernels import decode_kernels as dk
    from streamkv.kernels.launch import DTYPE_NAMES

    major, minor = torch.cuda.get_device_capability()
    jobs = [
        (dk.ATTENTION_SOURCE, dk.attention_names(DTYPE_NAMES[d], h, b, (g,)))
        for d in DTYPES
        for h in HEADS
        for b in BLOCKS
        for g in dk.GROUP_PADS
    ]
    jobs += [
        (dk.ATTENTION_SOURCE, dk.attention_names(DTYPE_NAMES[d], h, b, (dk.group_pad(g),)))
        for b in NEW_BLOCKS
        for d, h, g in NEW_BLOCK_SHAPES
    ]
    jobs.append((cuda_ops.CACHE_OPS_SOURCE, cuda_ops.cache_ops_names()))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda j: nvrtc.compile_program(*j, major * 10 + minor), jobs))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaN (unwritten or read a poisoned slot)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_paged(
    context_lens: list[int],
    num_kv_heads: int,
    block: int,
    head: int,
    dtype,
    gen,
    pool_blocks: int = POOL_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN pools where only the slots inside each context hold random data."""
    max_blocks = max(-(-c // block) for c in context_lens)
    counts = [-(-c // block) for c in context_lens]
    num_blocks = max(pool_blocks, 2 * sum(counts))
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    used = perm[: sum(counts)]
    shape = (num_blocks, num_kv_heads, block, head)
    key = torch.full(shape, math.nan, dtype=dtype, device="cuda")
    value = torch.full_like(key, math.nan)
    data_shape = (len(used), num_kv_heads, block, head)
    key[used] = torch.randn(data_shape, generator=gen, device="cuda").to(dtype)
    value[used] = torch.randn(data_shape, generator=gen, device="cuda").to(dtype)
    # Padding entries point at random blocks (NaN or someone else's): never to be read.
    pad = torch.randint(
        0, num_blocks, (len(context_lens), max_blocks), generator=gen, device="cuda"
    )
    tables = perm[pad].to(torch.int32)
    first = 0
    for s, (c, n) in enumerate(zip(context_lens, counts, strict=True)):
        tables[s, :n] = used[first : first + n].to(torch.int32)
        last = int(used[first + n - 1])
        key[last, :, c - (n - 1) * block :] = math.nan  # the unused tail of the last block
        value[last, :, c - (n - 1) * block :] = math.nan
        first += n
    return key, value, tables


def reference(query, key, value, tables, lens, scale) -> torch.Tensor:
    """float64 attention from the torch reference, the pools' NaN poison read as zeros."""
    return ops.paged_attention_decode_ref(
        query.double(),
        key.nan_to_num(0.0).double(),
        value.nan_to_num(0.0).double(),
        tables,
        lens,
        scale,
    )


def attention_case(
    dtype,
    head: int,
    block: int,
    group: int,
    context_lens: list[int],
    partition_size,
    seed: int,
    num_kv_heads: int = 2,
    strided_query: bool = False,
    pool_blocks: int = POOL_BLOCKS,
    launch=None,
) -> float:
    """Relative error of a decode launch (default: production's kernel for the case at
    ``partition_size``; ``launch(query, key, value, tables, lens, scale, max_context,
    partition_size, out)`` for another) against the float64 reference."""
    from streamkv.kernels import decode_attention as da

    gen = torch.Generator(device="cuda").manual_seed(seed)
    key, value, tables = make_paged(
        context_lens, num_kv_heads, block, head, dtype, gen, pool_blocks
    )
    num_heads = num_kv_heads * group
    seqs = len(context_lens)
    if strided_query:  # a slice of a fused qkv projection, as the model produces it
        qkv = torch.randn((seqs, num_heads + 2 * num_kv_heads, head), generator=gen, device="cuda")
        query = qkv.to(dtype)[:, :num_heads]
    else:
        query = torch.randn((seqs, num_heads, head), generator=gen, device="cuda").to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    scale = head**-0.5
    out = torch.full((seqs, num_heads, head), math.nan, dtype=dtype, device="cuda")
    if launch is None:
        launch = partial(da.launch_decode, da.kernels_for(query, key))
    launch(query, key, value, tables, lens, scale, max(context_lens), partition_size, out)
    ref = reference(query, key, value, tables, lens, scale)
    return rel_err(out, ref)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_decode(dtype, head: int, block: int, group: int) -> None:
    seed = zlib.crc32(f"{dtype}{head}{block}{group}auto".encode())
    rng = torch.Generator().manual_seed(seed)
    partition = (128, 256, 512, 1024)[seed % 4]
    # Contexts around partition and block boundaries, plus random ones.
    lens = [1, block - 1, partition - 1, partition, partition + 1, 2 * partition + block + 3]
    lens += torch.randint(1, 1500, (4,), generator=rng).tolist()
    lens = [max(1, n) for n in lens]
    err = attention_case(dtype, head, block, group, lens, partition, seed)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("shape", NEW_BLOCK_SHAPES, ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("block", NEW_BLOCKS)
def test_paged_attention_decode_new_block_sizes(block: int, shape) -> None:
    # Contexts around block and partition edges; a partition that holds whole blocks (block
    # 256 has no 128-token partition), or the launch's own choice; one context long enough
    # for several partitions to merge. The pool holds about as many tokens at every size.
    from streamkv.kernels import decode_kernels as dk

    dtype, head, group = shape
    seed = zlib.crc32(f"{block}{dtype}{head}".encode())
    sizes = [p for p in dk.PARTITION_SIZES if p % block == 0]
    partition = [*sizes, None][seed % (len(sizes) + 1)]
    p = partition or 1024
    rng = torch.Generator().manual_seed(seed)
    lens = [1, block, block + 1, p - 1, p + 1, 2 * p + block + 3, 5000]
    lens += torch.randint(1, 1500, (3,), generator=rng).tolist()
    err = attention_case(
        dtype,
        head,
        block,
        group,
        lens,
        partition,
        seed,
        pool_blocks=max(64, 16384 // block),
    )
    assert err <= TOLERANCE[dtype], f"partition {partition}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "group,num_kv_heads", [(3, 3), (7, 2), (16, 1), (12, 2)], ids=["g3", "g7", "g16", "g12"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_uneven_and_large_groups(dtype, group: int, num_kv_heads: int) -> None:
    # Groups that are not a power of two pad the CTA's heads; groups over 8 split into chunks.
    lens = [5, 300, 777, 2049]
    err = attention_case(dtype, 64, 16, group, lens, None, group, num_kv_heads=num_kv_heads)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("partition_size", [None, 128, 512, 1024])
def test_decode_long_context_and_strided_query(partition_size) -> None:
    # 20k tokens: 20-157 partitions to merge; q is a view into qkv.
    lens = [20000, 3, 9000, 512]
    err = attention_case(
        torch.bfloat16,
        128,
        16,
        4,
        lens,
        partition_size,
        7,
        num_kv_heads=8,
        strided_query=True,
    )
    assert err <= TOLERANCE[torch.bfloat16], f"relative error {err:.2e}"


@pytest.mark.parametrize("group", [1, 4], ids=["cuda-core", "tensor-core"])
def test_decode_empty_context_gives_zeros(group: int) -> None:
    empty_context_case(group)


def empty_context_case(group: int, launch=None) -> None:
    """A padded batch slot (context 0) next to multi-partition sequences gets zeros; ``launch``
    as attention_case's."""
    from streamkv.kernels import decode_attention as da

    gen = torch.Generator(device="cuda").manual_seed(4)
    key, value, tables = make_paged([700, 1, 300], 2, 16, 64, torch.float16, gen)
    query = torch.randn((3, 2 * group, 64), generator=gen, device="cuda", dtype=torch.float16)
    lens = torch.tensor([700, 0, 300], dtype=torch.int32, device="cuda")
    out = torch.full_like(query, math.nan)
    if launch is None:
        launch = partial(da.launch_decode, da.kernels_for(query, key))
    launch(query, key, value, tables, lens, 0.125, 700, 128, out)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = torch.tensor([0, 2], device="cuda")
    ref = reference(query[keep], key, value, tables[keep], lens[keep], 0.125)
    assert rel_err(out[keep], ref) <= TOLERANCE[torch.float16]


def test_decode_through_ops_seam_matches_reference() -> None:
    # ops.paged_attention_decode picks the CUDA path for CUDA tensors, with default arguments.
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens = [33, 700, 1]
    key, value, tables = make_paged(lens, 4, 16, 128, torch.float16, gen)
    query = torch.randn((3, 16, 128), generator=gen, device="cuda", dtype=torch.float16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = ops.paged_attention_decode(query, key, value, tables, lens_t, 0.1)
    ref = reference(query, key, value, tables, lens_t, 0.1)
    assert out.dtype == query.dtype
    assert rel_err(out, ref) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache(dtype, head: int, block: int) -> None:
    reshape_and_cache_case(dtype, head, block)


@pytest.mark.parametrize("dtype,head", [(torch.bfloat16, 128), (torch.float32, 80)], ids=str)
@pytest.mark.parametrize("block", NEW_BLOCKS)
def test_reshape_and_cache_new_block_sizes(block: int, dtype, head: int) -> None:
    reshape_and_cache_case(dtype, head, block)


def reshape_and_cache_case(dtype, head: int, block: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(head * 100 + block)
    num_kv_heads, num_heads, tokens, num_blocks = 4, 8, 300, 512
    key_cache = torch.randn((num_blocks, num_kv_heads, block, head), generator=gen, device="cuda")
    key_cache = key_cache.to(dtype)
    value_cache = torch.randn_like(key_cache, dtype=torch.float32).to(dtype)
    slots = torch.randperm(num_blocks * block, generator=gen, device="cuda")[:tokens]
    slots[torch.rand(tokens, generator=gen, device="cuda") < 0.1] = -1
    # K and V as views into a fused qkv output: strided rows, like the model passes them.
    qkv = torch.randn((tokens, num_heads + 2 * num_kv_heads, head), generator=gen, device="cuda")
    qkv = qkv.to(dtype)
    key, value = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    ops.reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)


def test_reshape_and_cache_converts_dtype() -> None:
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = torch.zeros((64, 2, 16, 80), dtype=torch.bfloat16, device="cuda")
    key = torch.randn((40, 2, 80), generator=gen, device="cuda")
    slots = torch.randperm(64 * 16, generator=gen, device="cuda")[:40]
    ref_k, ref_v = cache.clone(), cache.clone()
    ops.reshape_and_cache_ref(key, key * 2, ref_k, ref_v, slots)
    k, v = cache.clone(), cache.clone()
    ops.reshape_and_cache(key, key * 2, k, v, slots)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def _pools(layers: int, blocks: int, shape, dtype, device, gen, stacked: bool = False, pin=False):
    if stacked:  # one tensor sliced per layer: the layout whose swaps are one 2D copy per run
        whole = torch.randn((layers, blocks, *shape), generator=gen, device=gen.device)
        whole = whole.to(dtype).to(device)
        if pin:
            whole = whole.pin_memory()
        return list(whole.unbind(0))
    out = []
    for _ in range(layers):
        t = torch.randn((blocks, *shape), generator=gen, device=gen.device).to(dtype).to(device)
        out.append(t.pin_memory() if pin else t)
    return out


def _mapping(n: int, src_blocks: int, dst_blocks: int, gen, runs: bool) -> torch.Tensor:
    src = torch.randperm(src_blocks, generator=gen)[:n]
    if runs:  # three runs of consecutive ids, as a fresh free list hands them out
        lengths = [n // 2, n // 4, n - n // 2 - n // 4]
        third = dst_blocks // 3
        dst = torch.cat(
            [
                torch.arange(length)
                + i * third
                + int(torch.randint(0, third - length, (1,), generator=gen))
                for i, length in enumerate(lengths)
            ]
        )
    else:
        dst = torch.randperm(dst_blocks, generator=gen)[:n]
    order = torch.randperm(n, generator=gen)  # the scheduler's order is not sorted
    return torch.stack([src, dst], dim=1).to(torch.int64)[order]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_all_layers_one_launch(dtype) -> None:
    copy_blocks_case(dtype, 16)


@pytest.mark.parametrize("block", NEW_BLOCKS)
def test_copy_blocks_new_block_sizes(block: int) -> None:
    copy_blocks_case(torch.float16, block)


def copy_blocks_case(dtype, block: int) -> None:
    gen = torch.Generator().manual_seed(5)
    shape = (4, block, 96)
    keys = _pools(3, 300, shape, dtype, "cuda", gen)
    values = _pools(3, 300, shape, dtype, "cuda", gen)
    ids = torch.randperm(300, generator=gen)[:80]
    mapping = torch.stack([ids[:40], ids[40:]], dim=1).to(torch.int64)  # disjoint src / dst
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    ops.copy_blocks_ref(ref_k, ref_v, mapping)
    ops.copy_blocks(keys, values, mapping.cuda())
    for a, b in zip(keys + values, ref_k + ref_v, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("runs", [True, False], ids=["runs", "scattered"])
def test_swap_out_and_in(stacked: bool, runs: bool) -> None:
    swap_case(stacked, runs, 16)


@pytest.mark.parametrize("block", NEW_BLOCKS)
def test_swap_out_and_in_new_block_sizes(block: int) -> None:
    # Stacked host pools with runs: the 2D-copy path, whose rows are block-size multiples.
    swap_case(True, True, block)


def swap_case(stacked: bool, runs: bool, block: int) -> None:
    gen = torch.Generator().manual_seed(int(stacked) * 2 + int(runs))
    shape, layers = (2, block, 128), 4
    device_pools = _pools(layers, 256, shape, torch.bfloat16, "cuda", gen)
    host_pools = _pools(layers, 128, shape, torch.bfloat16, "cpu", gen, stacked=stacked, pin=True)
    out_map = _mapping(40, 256, 128, gen, runs)
    ref_host = [h.clone() for h in host_pools]
    ops.swap_blocks_ref(device_pools, ref_host, out_map)
    ops.swap_blocks(device_pools, host_pools, out_map)
    torch.cuda.synchronize()
    for a, b in zip(host_pools, ref_host, strict=True):
        assert torch.equal(a, b)

    in_map = _mapping(40, 128, 256, gen, runs)
    ref_dev = [d.clone() for d in device_pools]
    ops.swap_blocks_ref(host_pools, ref_dev, in_map)
    ops.swap_blocks(host_pools, device_pools, in_map)
    for a, b in zip(device_pools, ref_dev, strict=True):
        assert torch.equal(a, b)


def test_swap_between_device_pools() -> None:
    gen = torch.Generator().manual_seed(9)
    src = _pools(2, 64, (2, 8, 64), torch.float16, "cuda", gen)
    dst = _pools(2, 64, (2, 8, 64), torch.float16, "cuda", gen)
    mapping = _mapping(10, 64, 64, gen, False)
    ref = [d.clone() for d in dst]
    ops.swap_blocks_ref(src, ref, mapping)
    ops.swap_blocks(src, dst, mapping)
    for a, b in zip(dst, ref, strict=True):
        assert torch.equal(a, b)
