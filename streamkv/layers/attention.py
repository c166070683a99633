"""Paged attention as a model layer: new K/V go into their slots, attention reads K/V back
through block tables. Decode tokens (one per sequence) run as one batched paged-decode call;
every prefill span of the step (prompts, chunks of them, recompute, prefix-cache hits) runs
as one varlen call over its paged context, cached prefix included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from streamkv.kernels import ops


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer.

    Decode tokens come first in the batch (rows [0, num_decode)), prefill spans after, back
    to back: span i is rows num_decode + cu[i] .. num_decode + cu[i + 1].
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # int32 [num_decode, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # int32 [num_decode]
    # An upper bound on decode_context_lens (the decode kernel's partitions must cover it);
    # a captured CUDA graph uses its context bucket (worker/cuda_graphs.py).
    decode_max_context_len: int = 0
    prefill_cu_query_lens: torch.Tensor | None = None  # int32 [num_spans + 1], from 0
    prefill_context_lens: torch.Tensor | None = None  # int32 [num_spans], span included
    prefill_block_tables: torch.Tensor | None = None  # int32 [num_spans, max_blocks]
    # Set only while worker/piecewise_graphs.py captures a mixed step: attention calls go to it.
    piecewise: Any = None

    @property
    def num_prefill_spans(self) -> int:
        return 0 if self.prefill_context_lens is None else self.prefill_context_lens.shape[0]

    @classmethod
    def for_prompt(
        cls, num_tokens: int, block_table: list[int], block_size: int, device=None
    ) -> AttentionMetadata:
        """One fresh prompt written into ``block_table`` from position 0 (tests, tools)."""
        blocks = torch.tensor(block_table, dtype=torch.int64)
        pos = torch.arange(num_tokens)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        return cls(
            slot_mapping=slots.to(device),
            prefill_cu_query_lens=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            prefill_context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            prefill_block_tables=blocks.to(torch.int32).view(1, -1).to(device),
        )


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # An fp8 cache stores K / k_scale and V / v_scale (vLLM's per-layer _k_scale and
        # _v_scale, 1.0 without calibrated scales); other caches ignore them (kernels/fp8.py).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.piecewise is not None:  # capturing a mixed step's graphs around this call
            return meta.piecewise.attention(self, q, k, v, kv_cache)
        return self.attend(q, k, v, kv_cache, meta)

    def attend(
        self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Write the step's K/V into their slots, then attend: decode rows in one call, every
        prefill span in one varlen call. Rows past the decodes and spans are left as they are."""
        key_cache, value_cache = kv_cache
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, **scales)
        d = meta.num_decode
        if out is None and d and d == q.shape[0]:  # decode only (every CUDA graph): no output copy
            return ops.paged_attention_decode(
                q,
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                meta.decode_max_context_len,
                **scales,
            )
        if out is None:
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
                **scales,
            )
        if meta.num_prefill_spans:
            ops.paged_attention_prefill_varlen(
                q[d:],
                key_cache,
                value_cache,
                meta.prefill_block_tables,
                meta.prefill_cu_query_lens,
                meta.prefill_context_lens,
                self.scale,
                out=out[d:],
                **scales,
            )
        return out
