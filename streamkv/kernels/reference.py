"""The pure-torch reference of every op in ``ops.py``: what runs off CUDA, and what the
CUDA kernels are tested against (tests/kernels, random block tables).

Same signatures and the same layout as ``ops.py`` (its docstring): caches are
``[num_blocks, num_kv_heads, block_size, head_size]``, slot -1 is padding, an fp8 cache holds
``x / scale`` and is read and written as bytes. Written for clarity first; where the CPU
path is hot (decode) the speed-ups say why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamkv.kernels.fp8 import as_bytes, dequantize, is_fp8, quantize


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the cache's dtype; for an fp8 cache its bytes (written through as_bytes(cache))."""
    return as_bytes(quantize(x, scale)) if is_fp8(cache.dtype) else x.to(cache.dtype)


def reshape_and_cache_ref(
    key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0
) -> None:
    num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # Advanced indexing on (block, :, offset) puts the token axis first: [n, kv_heads, head].
    # fp8 caches are indexed as bytes: torch's float8 index ops do not cover every device.
    as_bytes(key_cache)[blocks, :, offsets] = _to_cache(key, key_cache, k_scale)
    as_bytes(value_cache)[blocks, :, offsets] = _to_cache(value, value_cache, v_scale)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_seqs, num_kv_heads, num_blocks * block_size, head_size] view of each context."""
    _, num_kv_heads, block_size, head_size = cache.shape
    bt = block_tables[:, :num_blocks].long()
    tiles = cache.index_select(0, bt.reshape(-1))  # [S * nb, kvh, bs, hd]
    tiles = tiles.view(bt.shape[0], num_blocks, num_kv_heads, block_size, head_size)
    return tiles.permute(0, 2, 1, 3, 4).reshape(
        bt.shape[0], num_kv_heads, num_blocks * block_size, head_size
    )


# The reference gathers each sequence's blocks into a contiguous copy padded to the longest
# context. Sorting by length and working in small chunks cuts the padding and keeps the copy
# cache-resident: 2x faster at 48 sequences of 100-768 tokens on the 2-core CPU machine.
_DECODE_CHUNK = 16


def _gather_read(cache, block_tables, num_blocks: int, scale: float, dtype: torch.dtype):
    """gather_kv, dequantized to ``dtype`` when the cache is fp8."""
    if not is_fp8(cache.dtype):
        return gather_kv(cache, block_tables, num_blocks)
    kv = gather_kv(as_bytes(cache), block_tables, num_blocks).view(cache.dtype)
    return dequantize(kv, scale, dtype)


def paged_attention_decode_ref(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    max_context_len=None,
    k_scale=1.0,
    v_scale=1.0,
) -> torch.Tensor:
    num_seqs, num_heads, head_size = query.shape
    if num_seqs > _DECODE_CHUNK:
        order = torch.argsort(context_lens)
        out = torch.empty_like(query)
        for i in range(0, num_seqs, _DECODE_CHUNK):
            sel = order[i : i + _DECODE_CHUNK]
            out[sel] = paged_attention_decode_ref(
                query[sel],
                key_cache,
                value_cache,
                block_tables[sel],
                context_lens[sel],
                scale,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    num_blocks = (max_context_len + block_size - 1) // block_size
    k = _gather_read(key_cache, block_tables, num_blocks, k_scale, query.dtype)
    v = _gather_read(value_cache, block_tables, num_blocks, v_scale, query.dtype)
    group = num_heads // num_kv_heads
    # [S, kvh, group, hd] @ [S, kvh, hd, T] -> [S, kvh, group, T]: no K/V repeat for GQA.
    q = query.view(num_seqs, num_kv_heads, group, head_size).to(k.dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = positions[None, :] >= context_lens[:, None].to(positions.dtype)
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [S, kvh, group, hd]
    return out.reshape(num_seqs, num_heads, head_size).to(query.dtype)


def paged_attention_prefill_varlen_ref(
    query,
    key_cache,
    value_cache,
    block_tables,
    cu_query_lens,
    context_lens,
    scale,
    out=None,
    k_scale=1.0,
    v_scale=1.0,
) -> torch.Tensor:
    """Each span through torch's SDPA on its gathered K/V (docs/kernels.md)."""
    if out is None:
        out = torch.empty_like(query)
    cu = cu_query_lens.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        if cu[i + 1] > cu[i]:
            out[cu[i] : cu[i + 1]] = _prefill_span_ref(
                query[cu[i] : cu[i + 1]],
                key_cache,
                value_cache,
                block_tables[i],
                ctx,
                scale,
                k_scale,
                v_scale,
            )
    return out


def _prefill_span_ref(
    query,
    key_cache,
    value_cache,
    block_table,
    context_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    q_len, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    num_blocks = (context_len + block_size - 1) // block_size
    bt = block_table[:num_blocks].view(1, -1)
    k = _gather_read(key_cache, bt, num_blocks, k_scale, query.dtype)[0, :, :context_len]
    v = _gather_read(value_cache, bt, num_blocks, v_scale, query.dtype)[0, :, :context_len]
    gqa = num_heads != num_kv_heads
    q = query.transpose(0, 1).to(k.dtype)  # [H, q_len, hd]
    if q_len == context_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # SDPA's is_causal aligns the diagonal top-left; a span's rows sit at the bottom.
        prefix = context_len - q_len
        rows = torch.arange(q_len, device=query.device)[:, None] + prefix
        cols = torch.arange(context_len, device=query.device)[None, :]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=cols <= rows, scale=scale, enable_gqa=gqa
        )
    return out.transpose(0, 1).to(query.dtype)


def copy_blocks_ref(key_caches, value_caches, block_mapping) -> None:
    src = block_mapping[:, 0].to(key_caches[0].device)
    dst = block_mapping[:, 1].to(key_caches[0].device)
    for cache in (*key_caches, *value_caches):
        cache = as_bytes(cache)  # the bytes as they are: torch has no fp8 index_copy_ on the CPU
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks_ref(src_caches, dst_caches, block_mapping) -> None:
    src = block_mapping[:, 0].to(src_caches[0].device)
    dst = block_mapping[:, 1].to(dst_caches[0].device)
    for s, d in zip(src_caches, dst_caches):
        s, d = as_bytes(s), as_bytes(d)
        d.index_copy_(0, dst, s.index_select(0, src).to(d.device))
