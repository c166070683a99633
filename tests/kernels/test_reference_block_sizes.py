"""Paging at every block size (1-256) reproduces dense attention in the pure-torch reference
(CPU): K/V written slot by slot through reshape_and_cache onto random block tables, then
decode and varlen prefill read back through the tables."""

from __future__ import annotations

import pytest
import torch

from streamkv.config import BLOCK_SIZES
from streamkv.kernels import ops

KV_HEADS, GROUP, HEAD = 2, 3, 16


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """Causal attention (the reference softmax is fp32, hence the tolerances) of q's rows
    (positions first_pos, ...) over k, v [tokens, kvh, hd]."""
    k = k.double().repeat_interleave(GROUP, 1)
    v = v.double().repeat_interleave(GROUP, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * HEAD**-0.5
    pos = torch.arange(q.shape[0])[:, None] + first_pos
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def paged(lens: list[int], block: int, gen: torch.Generator):
    """Caches holding each sequence's random K/V on a random block table."""
    counts = [-(-n // block) for n in lens]
    pool = 2 * sum(counts) + 1
    # Garbage (finite: the reference multiplies masked slots by zero) wherever no sequence
    # wrote, so reading past a context shows.
    kc = 1e3 * torch.randn((pool, KV_HEADS, block, HEAD), generator=gen, dtype=torch.float64)
    vc = 1e3 * torch.randn((pool, KV_HEADS, block, HEAD), generator=gen, dtype=torch.float64)
    ids = torch.randperm(pool, generator=gen)
    tables = torch.zeros((len(lens), max(counts)), dtype=torch.int32)
    kvs, first = [], 0
    for s, (n, c) in enumerate(zip(lens, counts, strict=True)):
        tables[s, :c] = ids[first : first + c].int()
        first += c
        k = torch.randn((n, KV_HEADS, HEAD), generator=gen, dtype=torch.float64)
        v = torch.randn((n, KV_HEADS, HEAD), generator=gen, dtype=torch.float64)
        pos = torch.arange(n)
        slots = tables[s, pos // block].long() * block + pos % block
        ops.reshape_and_cache(k, v, kc, vc, slots)
        kvs.append((k, v))
    return kc, vc, tables, kvs


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_decode_and_prefill_match_dense_at_every_block_size(block: int) -> None:
    gen = torch.Generator().manual_seed(block)
    lens = [1, block, block + 1, 300, 2 * block + 5]
    kc, vc, tables, kvs = paged(lens, block, gen)
    heads = KV_HEADS * GROUP
    q = torch.randn((len(lens), heads, HEAD), generator=gen, dtype=torch.float64)
    cl = torch.tensor(lens, dtype=torch.int32)
    out = ops.paged_attention_decode(q, kc, vc, tables, cl, HEAD**-0.5)
    for s, (k, v) in enumerate(kvs):
        want = dense(q[s : s + 1], k, v, lens[s] - 1)[0]
        torch.testing.assert_close(out[s].double(), want, rtol=1e-5, atol=1e-6)

    # Prefill: each span's last q_len tokens attend causally to its whole context.
    q_lens = [min(n, 7) for n in lens]
    rows = torch.randn((sum(q_lens), heads, HEAD), generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    got = ops.paged_attention_prefill_varlen(rows, kc, vc, tables, cu, cl, HEAD**-0.5)
    for s, (k, v) in enumerate(kvs):
        span = rows[cu[s] : cu[s + 1]]
        want = dense(span, k, v, lens[s] - q_lens[s])
        torch.testing.assert_close(got[cu[s] : cu[s + 1]].double(), want, rtol=1e-5, atol=1e-6)
