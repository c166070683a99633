"""Paged attention as a model layer: new K/V go into their slots, attention reads K/V back
through block tables. Decode tokens (one per sequence) run as one batched paged-decode call;
each prefill span (a prompt, a chunk of one, or a recompute) runs causal attention over its
paged context, cached prefix included."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from streamkv.kernels import ops


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[T, H, D] x [T, Hkv, D] causal self-attention (grouped-query aware)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


@dataclass
class PrefillSpan:
    start: int  # token rows [start, end) of the batch
    end: int
    block_table: torch.Tensor  # int32 [num_blocks]
    context_len: int  # tokens in the cache once this span is written


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer.

    Decode tokens come first in the batch (rows [0, num_decode)), prefill spans after.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # int32 [num_decode, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # int32 [num_decode]
    # An upper bound on decode_context_lens (the decode kernel's partitions must cover it);
    # a captured CUDA graph uses max_model_len so that one graph serves every context.
    decode_max_context_len: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        d = meta.num_decode
        if d and d == q.shape[0]:  # decode only (every CUDA graph): no output copy
            return ops.paged_attention_decode(
                q, key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale, meta.decode_max_context_len,
            )
        out = torch.empty_like(q)
        if d:
            out[:d] = ops.paged_attention_decode(
                q[:d],
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                meta.decode_max_context_len,
            )
        for span in meta.prefills:
            if span.context_len == span.end - span.start:
                # A fresh prompt: its K/V are all in hand, no need to read them back.
                out[span.start : span.end] = _causal_attention(
                    q[span.start : span.end], k[span.start : span.end], v[span.start : span.end], self.scale
                )
                continue
            out[span.start : span.end] = ops.paged_attention_prefill(
                q[span.start : span.end],
                key_cache,
                value_cache,
                span.block_table,
                span.context_len,
                self.scale,
            )
        return out
