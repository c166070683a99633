"""Launches of the paged varlen prefill kernel (``kernels_cu/prefill_attention.cu``).

One launch per layer covers every prompt span of a step, each over its paged context. The
variant is picked from the tensors: dtype, head size, and how many query heads share a KV
head (packed side by side in a CTA's rows). The block size is a run-time argument, so any
power of two takes the same compiled code. docs/kernels.md ("Prefill") has the design.

An fp8 cache runs the kernel of the query's dtype with the cache type as its last template
argument (widened in shared memory); the K scale folds into the softmax scale and the V scale
multiplies the output (only when it is not 1.0).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from streamkv.kernels import cuda_driver
from streamkv.kernels.fp8 import FP8_CUDA_NAME, is_fp8

SOURCE = "prefill_attention.cu"
DTYPE_NAMES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
HEAD_SIZES = (64, 80, 96, 128, 256)
HEAD_PACKS = (1, 2, 4, 8)  # query heads of one KV head per CTA
MAX_BLOCK_SIZE = 1 << 30
_PAD = 8  # kPad in prefill_attention.cu


@dataclass(frozen=True, slots=True)
class Tile:
    """A CTA's shape: ``warps`` warps of ``m_tiles`` x 16 query rows, ``block_n`` keys a step."""

    warps: int
    m_tiles: int
    block_n: int

    @property
    def rows(self) -> int:
        return self.warps * self.m_tiles * 16

    def shared_bytes(self, head: int, fp8: bool = False) -> int:
        """Q, one K and one V tile of padded 16-bit rows, and two tiles of 8-byte row offsets;
        for an fp8 cache then the staging area, 8 bytes per 16-byte chunk of a tile rounded up
        to whole rounds of the CTA's threads (ChunkMap in the kernel)."""
        size = (self.rows + 2 * self.block_n) * (head + _PAD) * 2 + 2 * self.block_n * 8
        if fp8:
            threads, per_row = self.warps * 32, head // 8
            if threads % per_row == 0:
                rounds = -(-self.block_n // (threads // per_row))
            else:
                rounds = -(-self.block_n * per_row // threads)
            size += rounds * threads * 8
        return size


# FlashAttention-2's shapes for mma.sync: 128 rows and 64 keys, 32 rows per warp (so each K/V
# fragment loaded from shared memory feeds two m16 tiles) up to head 128; at 256 the output
# alone is 128 registers per thread at 16 rows per warp, so warps of 16 rows. Heads 64 and
# 256 take the shapes that timed fastest on the H200 (docs/kernels.md, "Prefill").
TILES = {
    64: Tile(4, 2, 128),  # 0.98x flash SDPA at 4x4096 vs 1.05x with (4, 2, 64)
    80: Tile(4, 2, 64),
    96: Tile(4, 2, 64),
    128: Tile(4, 2, 64),
    256: Tile(4, 1, 64),  # 1.08x vs 1.12x with (8, 1, 64)
}

_P, _I, _LL, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float


def supports(dtype: torch.dtype, head: int, query_dtype: torch.dtype | None = None) -> bool:
    """A kernel for a ``dtype`` cache; an fp8 cache needs a 16-bit ``query_dtype``."""
    if is_fp8(dtype):
        return query_dtype in DTYPE_NAMES and head in TILES
    return dtype in DTYPE_NAMES and head in TILES


def head_pack(group: int) -> int:
    """Largest of HEAD_PACKS that divides the GQA group (1 for multi-head attention)."""
    return max(p for p in HEAD_PACKS if group % p == 0)


def kernel_name(
    dtype: str, head: int, pack: int, tile: Tile | None = None, cache: str | None = None
) -> str:
    """``dtype``: the query's CUDA type; ``cache``: the fp8 cache's, None for a cache of
    ``dtype`` (then the name is the one it always was)."""
    t = tile or TILES[head]
    tail = "" if cache is None else f", {cache}"
    return (
        f"streamkv::prefill::paged_prefill_kernel<{dtype}, {head}, {pack}, "
        f"{t.warps}, {t.m_tiles}, {t.block_n}{tail}>"
    )


def program_names(
    dtype: str, head: int, tile: Tile | None = None, cache: str | None = None
) -> tuple[str, ...]:
    """Every head packing of one (dtype, head size): one program, one front-end pass."""
    return tuple(kernel_name(dtype, head, p, tile, cache) for p in HEAD_PACKS)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@lru_cache(maxsize=128)
def _kernel(
    dtype: str, head: int, pack: int, tile: Tile, device: int, cache: str | None = None
) -> cuda_driver.Kernel:
    major, minor = torch.cuda.get_device_capability(device)
    module = cuda_driver.load(
        SOURCE, program_names(dtype, head, tile, cache), device, major * 10 + minor
    )
    return module.kernel(kernel_name(dtype, head, pack, tile, cache))


def _rows_ok(t: torch.Tensor, head: int) -> bool:
    """[tokens, heads, head] with contiguous heads and 16-byte aligned token rows."""
    es = t.element_size()
    return (
        t.stride(-1) == 1
        and t.stride(1) == head
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * es) % 16 == 0
    )


def paged_attention_prefill_varlen(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    tile: Tile | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """See ops.paged_attention_prefill_varlen; ``tile`` overrides TILES (benchmarks)."""
    _check_inputs(query, key_cache, value_cache)
    head = query.shape[-1]
    fp8 = is_fp8(key_cache.dtype)
    # The kernel's T: the cache's 16-bit type, or the query's over an fp8 cache.
    dtype = query.dtype if fp8 else key_cache.dtype
    q = query if query.dtype == dtype and _rows_ok(query, head) else query.to(dtype).contiguous()
    out = _checked_out(out, query)
    if query.shape[0] == 0 or context_lens.shape[0] == 0:
        return out
    dst = out if out.dtype == dtype and _rows_ok(out, head) else torch.empty_like(q)
    scale = scale * (k_scale if fp8 else 1.0)
    _launch(dst, q, key_cache, value_cache, block_tables, cu_query_lens, context_lens, scale, tile)
    if fp8 and v_scale != 1.0:
        dst.mul_(v_scale)
    if dst is not out:
        out.copy_(dst)
    return out


def _check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """TypeError for a case without a kernel, ValueError for caches it cannot read."""
    _, num_heads, head = query.shape
    _, num_kv_heads, block_size, cache_head = key_cache.shape
    cache_dtype = key_cache.dtype
    if not supports(cache_dtype, head, query.dtype) or value_cache.dtype != cache_dtype:
        raise TypeError(f"no prefill kernel for a {cache_dtype} cache with head size {head}")
    if cache_head != head or value_cache.shape != key_cache.shape:
        raise ValueError(f"query head size {head} vs caches {tuple(key_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if block_size & (block_size - 1) or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block size must be a power of two, got {block_size}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    if key_cache.data_ptr() % 16 or value_cache.data_ptr() % 16:
        raise ValueError("KV caches must be 16-byte aligned")


def _checked_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The caller's ``out`` once checked, or a new one: [tokens, heads, head] of the query's
    dtype."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must be a [tokens, heads, head] tensor of the query's dtype")
    return out


def _launch(
    dst: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    tile: Tile | None,
) -> None:
    """One launch for every span of the step, into ``dst`` (q's dtype and row layout, as the
    kernel writes). ``scale``: the softmax's, an fp8 cache's K scale folded in."""
    num_tokens, num_heads, head = q.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    num_spans = context_lens.shape[0]
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    cu = cu_query_lens.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    fp8 = is_fp8(key_cache.dtype)
    group = num_heads // num_kv_heads
    pack = head_pack(group)
    t = tile or TILES[head]
    tokens_per_cta = t.rows // pack
    device = _device_index(q.device)
    kernel = _kernel(DTYPE_NAMES[q.dtype], head, pack, t, device, FP8_CUDA_NAME if fp8 else None)
    # Span i's tiles start at slot cu[i] // tokens_per_cta + i (span_of in the kernel), so
    # this many slots cover every span without a host-side tile map; each slot is one CTA
    # per group of `pack` heads, the groups of a slot adjacent in the 1-D grid.
    slots = num_tokens // tokens_per_cta + num_spans
    kernel.launch(
        (slots * (num_heads // pack), 1, 1),
        (t.warps * 32, 1, 1),
        [
            (_P, dst.data_ptr()),
            (_LL, dst.stride(0)),
            (_P, q.data_ptr()),
            (_LL, q.stride(0)),
            (_P, key_cache.data_ptr()),
            (_P, value_cache.data_ptr()),
            (_P, block_tables.data_ptr()),
            (_I, block_tables.stride(0)),
            (_P, cu.data_ptr()),
            (_P, ctx.data_ptr()),
            (_I, num_spans),
            (_F, scale * math.log2(math.e)),
            (_I, num_kv_heads),
            (_I, group),
            (_I, block_size.bit_length() - 1),
        ],
        torch.cuda.current_stream(q.device).cuda_stream,
        t.shared_bytes(head, fp8),
    )
