"""The pure-torch reference ops against a naive per-sequence loop in float64 (CPU)."""

from __future__ import annotations

import pytest
import torch

from streamkv.kernels import ops


def _naive_decode(q, kc, vc, bt, cl, scale):
    out = torch.empty_like(q, dtype=torch.float64)
    group = q.shape[1] // kc.shape[1]
    for s in range(q.shape[0]):
        n = int(cl[s])
        blocks = bt[s, : (n + kc.shape[2] - 1) // kc.shape[2]].long()
        k = kc[blocks].permute(1, 0, 2, 3).reshape(kc.shape[1], -1, kc.shape[3])[:, :n].double()
        v = vc[blocks].permute(1, 0, 2, 3).reshape(vc.shape[1], -1, vc.shape[3])[:, :n].double()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        p = (torch.einsum("hd,hnd->hn", q[s].double(), k) * scale).softmax(-1)
        out[s] = torch.einsum("hn,hnd->hd", p, v)
    return out


@pytest.mark.parametrize("num_seqs", [3, 40])  # 40 takes the sorted, chunked path
@pytest.mark.parametrize("group", [1, 3])
def test_decode_reference_matches_naive(num_seqs, group):
    gen = torch.Generator().manual_seed(num_seqs * 10 + group)
    kvh, bs, hd, pool = 2, 8, 16, 512
    kc = torch.randn(pool, kvh, bs, hd, generator=gen)
    vc = torch.randn(pool, kvh, bs, hd, generator=gen)
    cl = torch.randint(1, 200, (num_seqs,), generator=gen, dtype=torch.int32)
    bt = torch.stack([torch.randperm(pool, generator=gen)[:25] for _ in range(num_seqs)]).int()
    q = torch.randn(num_seqs, kvh * group, hd, generator=gen)
    out = ops.paged_attention_decode(q, kc, vc, bt, cl, 0.25)
    ref = _naive_decode(q, kc, vc, bt, cl, 0.25)
    assert torch.allclose(out.double(), ref, atol=1e-5)
