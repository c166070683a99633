"""Paged varlen prefill attention: the reference on CPU, the kernel on CUDA (marked cuda).

Both are checked against a float64 causal attention over each span's context laid out
contiguously. Inputs: random block tables over a large pool, spans of 1..2k tokens whose
cached prefixes end inside blocks; outputs start as NaN so a row the kernel never writes
fails, and pool slots no span owns hold NaN so a kernel that reads past a context fails too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from streamkv.kernels import ops

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass(slots=True)
class Batch:
    query: torch.Tensor  # [tokens, heads, head]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    cu: torch.Tensor
    ctx: torch.Tensor
    keys: list[torch.Tensor]  # per span, [kv_heads, ctx, head] in float64
    values: list[torch.Tensor]


def make_batch(
    spans: list[tuple[int, int]],  # (prefix, query length)
    heads: int,
    kv_heads: int,
    head: int,
    block: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    spare_blocks: int = 64,
) -> Batch:
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = [-(-(p + q) // block) for p, q in spans]
    pool = sum(counts) + spare_blocks
    shape = (pool, kv_heads, block, head)
    key_cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    value_cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    perm = torch.randperm(pool, generator=gen, device=device)
    tables = torch.zeros((len(spans), max(counts) + 3), dtype=torch.int32, device=device)
    keys, values, first = [], [], 0
    for i, ((prefix, q_len), n) in enumerate(zip(spans, counts)):
        ids = perm[first : first + n]
        first += n
        tables[i, :n] = ids.to(torch.int32)
        ctx = prefix + q_len
        k = torch.randn((kv_heads, ctx, head), generator=gen, device=device).to(dtype)
        v = torch.randn((kv_heads, ctx, head), generator=gen, device=device).to(dtype)
        pos = torch.arange(ctx, device=device)
        key_cache[ids[pos // block], :, pos % block] = k.transpose(0, 1)
        value_cache[ids[pos // block], :, pos % block] = v.transpose(0, 1)
        keys.append(k.double())
        values.append(v.double())
    lens = [q for _, q in spans]
    tokens = sum(lens)
    query = torch.randn((tokens, heads, head), generator=gen, device=device).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    ctx = torch.tensor([p + q for p, q in spans], dtype=torch.int32, device=device)
    return Batch(query, key_cache, value_cache, tables, cu, ctx, keys, values)


def reference64(b: Batch, scale: float) -> torch.Tensor:
    out = torch.empty(b.query.shape, dtype=torch.float64, device=b.query.device)
    cu = b.cu.tolist()
    for i, (k, v) in enumerate(zip(b.keys, b.values)):
        q = b.query[cu[i] : cu[i + 1]].double().transpose(0, 1)  # [H, q, D]
        q_len, ctx = q.shape[1], k.shape[1]
        group = q.shape[0] // k.shape[0]
        kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ kk.transpose(1, 2) * scale
        rows = torch.arange(q_len, device=q.device)[:, None] + ctx - q_len
        cols = torch.arange(ctx, device=q.device)[None, :]
        scores.masked_fill_(cols > rows, -math.inf)
        out[cu[i] : cu[i + 1]] = (scores.softmax(-1) @ vv).transpose(0, 1)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return math.inf
    return ((out.double() - ref).norm() / ref.norm()).item()


def run(b: Batch, scale: float, fn=ops.paged_attention_prefill_varlen) -> torch.Tensor:
    out = torch.full_like(b.query, math.nan)
    fn(b.query, b.key_cache, b.value_cache, b.block_tables, b.cu, b.ctx, scale, out=out)
    return out


# (prefix, query length): fresh prompts, chunks after a prefix that ends mid-block, single
# tokens, spans of one block exactly, an empty span between others.
CPU_SPANS = [(0, 37), (13, 21), (0, 1), (45, 1), (16, 16), (5, 0), (100, 70)]


@pytest.mark.parametrize("block", (1, 4, 16))
@pytest.mark.parametrize("heads,kv_heads", ((4, 4), (8, 2)))
def test_reference_matches_float64(block: int, heads: int, kv_heads: int) -> None:
    b = make_batch(CPU_SPANS, heads, kv_heads, 32, block, torch.float32, "cpu")
    scale = 32**-0.5
    assert rel_err(run(b, scale), reference64(b, scale)) < TOLERANCE[torch.float32]


def test_reference_fresh_prompt_equals_plain_causal_sdpa() -> None:
    # A fresh prompt (no prefix) must give what causal SDPA gives on its own K/V.
    b = make_batch([(0, 50)], 4, 2, 16, 8, torch.float32, "cpu", seed=3)
    out = run(b, 0.25)
    q = b.query.transpose(0, 1)
    k, v = b.keys[0].float(), b.values[0].float()
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.25, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- CUDA
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A 2k fresh prompt, single tokens with and without a prefix, chunks after prefixes that end
# mid-block, an empty span, a span whose rows straddle one query tile.
GPU_SPANS = [(0, 2048), (0, 1), (1000, 1), (333, 777), (0, 129), (17, 64), (0, 0), (4001, 95)]
# (query heads, KV heads): groups 1, 2, 4, 8 (heads packed per CTA) and 3 (one head per CTA).
GROUPS = ((8, 8), (16, 8), (32, 8), (16, 2), (12, 4))


def random_spans(seed: int, n: int, max_len: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (n,), generator=gen).tolist()
    prefixes = torch.randint(0, 2 * max_len, (n,), generator=gen).tolist()
    fresh = torch.rand(n, generator=gen).lt(0.4).tolist()
    return [(0 if f else p, q) for p, q, f in zip(prefixes, lens, fresh)]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("head", (64, 80, 96, 128, 256))
@pytest.mark.parametrize("heads,kv_heads", GROUPS)
def test_kernel_matches_float64(dtype, head, heads, kv_heads) -> None:
    spans = GPU_SPANS if head == 128 else GPU_SPANS[1:]
    b = make_batch(spans, heads, kv_heads, head, 16, dtype, "cuda", seed=head + heads)
    scale = head**-0.5
    assert rel_err(run(b, scale), reference64(b, scale)) < TOLERANCE[dtype]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("block", (1, 2, 4, 8, 16, 32, 64, 128, 256))
def test_kernel_every_block_size(block: int) -> None:
    b = make_batch(random_spans(block, 24, 300), 32, 8, 128, block, torch.bfloat16, "cuda")
    assert rel_err(run(b, 128**-0.5), reference64(b, 128**-0.5)) < TOLERANCE[torch.bfloat16]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("seed", range(4))
def test_kernel_random_spans(seed: int) -> None:
    b = make_batch(random_spans(seed, 60, 400), 32, 8, 128, 16, torch.bfloat16, "cuda", seed)
    assert rel_err(run(b, 0.1), reference64(b, 0.1)) < TOLERANCE[torch.bfloat16]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("scale", (0.003, 0.5, 3.0))
def test_kernel_lazy_rescale(dtype, scale: float) -> None:
    # A row's running max moves only when a tile passes it by 2^8: a tiny scale never moves
    # it after the first tile, a large one (logits of spread ~30) moves it in most tiles,
    # some rows of a warp at a time; both must match the exact softmax.
    b = make_batch(GPU_SPANS, 32, 8, 128, 16, dtype, "cuda", seed=int(scale * 1000))
    assert rel_err(run(b, scale), reference64(b, scale)) < TOLERANCE[dtype]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("warps,m_tiles,block_n", ((4, 1, 64), (4, 2, 32), (8, 1, 64), (4, 2, 128)))
def test_kernel_other_tiles(warps: int, m_tiles: int, block_n: int) -> None:
    from streamkv.kernels import prefill

    tile = prefill.Tile(warps, m_tiles, block_n)
    b = make_batch(GPU_SPANS, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=7)

    def fn(*args, out):
        return prefill.paged_attention_prefill_varlen(*args, out=out, tile=tile)

    assert rel_err(run(b, 0.09, fn), reference64(b, 0.09)) < TOLERANCE[torch.bfloat16]


@pytest.mark.cuda
@needs_cuda
def test_kernel_strided_query_and_output() -> None:
    # The model hands q as a view of the fused qkv projection and out as rows of a buffer
    # whose decode rows come first.
    b = make_batch(GPU_SPANS[1:], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=11)
    tokens = b.query.shape[0]
    qkv = torch.randn((tokens, 48, 128), device="cuda", dtype=torch.bfloat16)
    qkv[:, :32] = b.query
    buf = torch.full((tokens + 5, 32, 128), math.nan, device="cuda", dtype=torch.bfloat16)
    args = (b.block_tables, b.cu, b.ctx, 0.09)
    ops.paged_attention_prefill_varlen(qkv[:, :32], b.key_cache, b.value_cache, *args, out=buf[5:])
    assert torch.isnan(buf[:5]).all()
    assert rel_err(buf[5:], reference64(b, 0.09)) < TOLERANCE[torch.bfloat16]


@pytest.mark.cuda
@needs_cuda
def test_float32_cache_takes_the_reference() -> None:
    b = make_batch(GPU_SPANS[1:6], 8, 2, 64, 16, torch.float32, "cuda")
    assert rel_err(run(b, 0.125), reference64(b, 0.125)) < TOLERANCE[torch.float32]


# ------------------------------------------------------------- layer + step metadata
def _step_case(device: str, dtype: torch.dtype, block: int = 8):
    """A mixed step as the model runner builds it: two decodes, a fresh prompt, a chunk
    after a prefix that ends mid-block and a 1-token chunk, over shuffled block tables. The
    cached prefixes are written first; returns (layer, q, k, v, caches, meta, expected)."""
    from streamkv.layers.attention import PagedAttention
    from streamkv.worker.input_batch import SeqInput
    from streamkv.worker.model_runner import ModelRunner

    heads, kv_heads, head = 8, 2, 64
    gen = torch.Generator().manual_seed(5)
    # (tokens cached before this step, tokens computed now), in the scheduler's order.
    shapes = [(0, 23), (40, 1), (13, 30), (7, 1), (0, 9), (61, 2)]
    pool = 64
    perm = torch.randperm(pool, generator=gen).tolist()
    seqs, full_k, full_v, first = [], [], [], 0
    for i, (cached, new) in enumerate(shapes):
        n = -(-(cached + new) // block)
        seqs.append(SeqInput(i, list(range(new)), cached, perm[first : first + n]))
        first += n
        full_k.append(torch.randn(cached + new, kv_heads, head, generator=gen))
        full_v.append(torch.randn(cached + new, kv_heads, head, generator=gen))
    runner = ModelRunner(torch.nn.Identity(), block, torch.device(device))
    _, positions, meta, ordered = runner.prepare(seqs)
    cache_shape = (pool, kv_heads, block, head)
    # Slots past the contexts hold large finite garbage (the decode reference multiplies
    # masked slots by 0, so NaN would poison it): reading one shows as a large error.
    key_cache = torch.full(cache_shape, 1e4, dtype=dtype, device=device)
    value_cache = torch.full(cache_shape, 1e4, dtype=dtype, device=device)
    for s in seqs:  # the cached prefixes, written as earlier steps would have
        pos = torch.arange(s.start_pos)
        table = torch.tensor(s.block_table)
        slots = (table[pos // block] * block + pos % block).to(device)
        ops.reshape_and_cache(
            full_k[s.seq_id][: s.start_pos].to(device, dtype),
            full_v[s.seq_id][: s.start_pos].to(device, dtype),
            key_cache,
            value_cache,
            slots,
        )
    q_rows, k_rows, v_rows, want = [], [], [], []
    for s in ordered:
        k, v = full_k[s.seq_id], full_v[s.seq_id]
        new = len(s.token_ids)
        q = torch.randn(new, heads, head, generator=gen)
        q_rows.append(q)
        k_rows.append(k[s.start_pos :])
        v_rows.append(v[s.start_pos :])
        scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(4, 1)) / 8
        rows = torch.arange(new)[:, None] + s.start_pos
        scores.masked_fill_(torch.arange(len(k))[None, :] > rows, -math.inf)
        want.append(
            torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double().repeat_interleave(4, 1))
        )
    assert positions.tolist() == [
        p for s in ordered for p in range(s.start_pos, s.start_pos + len(s.token_ids))
    ]
    layer = PagedAttention(heads, kv_heads, head, 1 / 8)
    cat = [torch.cat(x).to(device, dtype) for x in (q_rows, k_rows, v_rows)]
    return layer, *cat, (key_cache, value_cache), meta, torch.cat(want).to(device)


def test_step_metadata_is_one_varlen_call() -> None:
    _, q, k, v, caches, meta, _ = _step_case("cpu", torch.float32)
    assert meta.num_decode == 2  # 1-token spans come first, in one decode call
    assert meta.prefill_cu_query_lens.tolist() == [0, 23, 53, 62, 64]
    assert meta.prefill_context_lens.tolist() == [23, 43, 9, 63]
    assert meta.decode_context_lens.tolist() == [41, 8]
    assert meta.decode_max_context_len == 41
    # Decode and prefill rows view one device buffer of block tables.
    assert meta.decode_block_tables.shape[1] == meta.prefill_block_tables.shape[1]


@pytest.mark.parametrize(
    "device,dtype",
    [
        ("cpu", torch.float32),
        pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.cuda, needs_cuda]),
    ],
)
def test_layer_mixed_step_matches_float64(device: str, dtype: torch.dtype) -> None:
    layer, q, k, v, caches, meta, want = _step_case(device, dtype)
    out = layer(q, k, v, caches, meta)
    assert rel_err(out, want) < TOLERANCE[dtype]
