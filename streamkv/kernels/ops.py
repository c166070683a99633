"""The kernel seam: every KV-cache operation the model needs, with one signature.

CUDA tensors go to the NVRTC-compiled kernels in ``kernels_cu/`` (see ``cuda_ops.py``);
anything else runs the pure-torch reference (``reference.py``). Both use the same layout:

    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_size]

One (block, kv head) tile is therefore ``block_size * head_size`` contiguous elements, so a
decode kernel that walks a block table reads each tile as one coalesced burst and every KV
block is read once per KV head, whatever the GQA ratio (docs/kernels.md).

A flat slot is ``block_id * block_size + offset``; slot -1 marks padding and is skipped.

An fp8 cache (``torch.float8_e4m3fn``, kernels/fp8.py) holds ``x / scale`` saturated to ±448:
writes quantize with the layer's ``k_scale`` / ``v_scale``, reads dequantize in the query's
dtype. Any other cache dtype ignores the scales (they are 1.0).
"""

from __future__ import annotations

import torch

from streamkv.kernels.reference import (
    copy_blocks_ref,
    paged_attention_decode_ref,
    paged_attention_prefill_varlen_ref,
    reshape_and_cache_ref,
    swap_blocks_ref,
)


def _use_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's K/V into its slot (quantized when the cache is fp8)."""
    if _use_cuda(key):
        from streamkv.kernels import cuda_ops

        return cuda_ops.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )
    reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, padded with any valid id
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_context_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query token per sequence attending over its whole paged context."""
    if _use_cuda(query):
        from streamkv.kernels import cuda_ops

        return cuda_ops.paged_attention_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            max_context_len,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return paged_attention_decode_ref(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        max_context_len,
        k_scale,
        v_scale,
    )


def paged_attention_prefill_varlen(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]: the spans' rows back to back
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_spans, max_blocks] int32, padded with any valid id
    cu_query_lens: torch.Tensor,  # [num_spans + 1] int32: span i is rows cu[i] .. cu[i + 1]
    context_lens: torch.Tensor,  # [num_spans] int32: tokens in the cache, the span's included
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size], query's dtype
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention for every prefill span of a step, each being the last
    ``cu[i + 1] - cu[i]`` tokens of its sequence, over its paged context.

    One call (one launch on CUDA) serves prompts, prompt chunks, recompute after preemption
    and prefix-cache hits alike: the cached prefix and the new tokens (already written by
    reshape_and_cache) are read the same way, through the block table. fp16 / bf16 caches
    (and fp8 caches under fp16 / bf16 queries) on CUDA run kernels_cu/prefill_attention.cu;
    anything else runs the reference.
    """
    if _use_cuda(query):
        from streamkv.kernels import prefill

        if prefill.supports(key_cache.dtype, query.shape[-1], query.dtype):
            return prefill.paged_attention_prefill_varlen(
                query,
                key_cache,
                value_cache,
                block_tables,
                cu_query_lens,
                context_lens,
                scale,
                out,
                k_scale=k_scale,
                v_scale=v_scale,
            )
    return paged_attention_prefill_varlen_ref(
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_query_lens,
        context_lens,
        scale,
        out,
        k_scale,
        v_scale,
    )


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # [n, 2] int64 (src, dst)
) -> None:
    """Copy-on-write: copy every (src, dst) block pair in every layer."""
    if block_mapping.numel() == 0:
        return
    if _use_cuda(key_caches[0]):
        from streamkv.kernels import cuda_ops

        return cuda_ops.copy_blocks(key_caches, value_caches, block_mapping)
    copy_blocks_ref(key_caches, value_caches, block_mapping)


def swap_blocks(
    src_caches: list[torch.Tensor],
    dst_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # [n, 2] int64 (src block in src pool, dst block in dst pool)
) -> None:
    """Move blocks between the device pool and the (pinned) CPU pool, all layers."""
    if block_mapping.numel() == 0:
        return
    if src_caches[0].is_cuda or dst_caches[0].is_cuda:
        from streamkv.kernels import cuda_ops

        return cuda_ops.swap_blocks(src_caches, dst_caches, block_mapping)
    swap_blocks_ref(src_caches, dst_caches, block_mapping)
