"""Which decode-attention kernel of ``kernels_cu/paged_attention.cu`` serves a case (dtype,
head size, block size, query heads per CTA), by name: the one production launches
(``decode_name``), the program that holds it (``attention_names``) and its dynamic shared
memory. No GPU needed: CI compiles every program.

``dtype`` is always the query's (and output's) CUDA type. An fp8 cache adds its element
type as the kernels' last template argument (``cache=FP8_CUDA_NAME``); ``cache=None`` is a
cache of the query's type.
"""

from __future__ import annotations

from streamkv.kernels.launch import next_pow2

ATTENTION_SOURCE = "paged_attention.cu"
HEAD_SIZES = (64, 80, 96, 128, 256)
# Tokens per KV block: every power of two from 1 to 256 (the paper's Fig 18b sweep). BLOCK
# only addresses a token's row and sizes the partition's block-id array, so each size is one
# more instantiation of the same kernels; docs/kernels.md's tuning was measured at
# TUNED_BLOCK_SIZES, the others are tested for correctness only.
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TUNED_BLOCK_SIZES = (8, 16, 32)
GROUP_PADS = (1, 2, 4, 8)  # query heads per CTA; larger groups are split into chunks of 8
# Tokens per CTA. A partition holds whole blocks, so block 256 uses only 1024, 512 and 256.
PARTITION_SIZES = (1024, 512, 256, 128)
TENSOR_CORE_DTYPES = ("__half", "__nv_bfloat16")
# Tensor-core kernel: 16-token chunks a warp loads per step (UNROLL) by head size
# (docs/kernels.md has the measurements); its softmax is per CTA (WARP_SOFTMAX false).
TC_UNROLL = {64: 4, 128: 2, 256: 1}
ATTENTION_THREADS = 128  # kThreads in paged_attention.cu
ATTENTION_WARPS = ATTENTION_THREADS // 32


def check_block_size(block: int) -> None:
    """The decode kernels serve BLOCK_SIZES only (kMaxPartition % BLOCK == 0 in the source)."""
    if block not in BLOCK_SIZES:
        raise ValueError(
            f"block size must be a power of two from 1 to {BLOCK_SIZES[-1]}, got {block}"
        )


def group_pad(group: int) -> int:
    """Query heads a CTA serves (GPAD) for ``group`` query heads per KV head."""
    return min(8, next_pow2(group))


def tensor_core_ok(dtype: str, head: int) -> bool:
    return dtype in TENSOR_CORE_DTYPES and head % 64 == 0


def uses_tensor_cores(dtype: str, head: int, gpad: int) -> bool:
    """The tensor-core kernel where it applies and a KV head serves 2 or more query heads
    (padded). With one (multi-head attention) the CUDA-core kernel does few enough
    multiply-adds per byte to keep up, in fewer registers (docs/kernels.md)."""
    return tensor_core_ok(dtype, head) and gpad >= 2


def _cuda_core_name(dtype: str, head: int, block: int, gpad: int, tail: str) -> str:
    return f"streamkv::paged_attention_decode_kernel<{dtype}, {head}, {block}, {gpad}, 0{tail}>"


def _tensor_core_name(dtype: str, head: int, block: int, gpad: int, tail: str) -> str:
    unroll = TC_UNROLL.get(head, 1)
    return (
        f"streamkv::paged_attention_decode_tc_kernel<{dtype}, {head}, {block}, {gpad}, false, "
        f"{unroll}{tail}>"
    )


def decode_name(dtype: str, head: int, block: int, gpad: int, cache: str | None = None) -> str:
    """The kernel a case launches. ``cache``: the cache's element type when it is not
    ``dtype`` (the fp8 cache)."""
    tail = "" if cache is None else f", {cache}"
    if uses_tensor_cores(dtype, head, gpad):
        return _tensor_core_name(dtype, head, block, gpad, tail)
    return _cuda_core_name(dtype, head, block, gpad, tail)


def reduce_name(dtype: str, head: int) -> str:
    return f"streamkv::paged_attention_reduce_kernel<{dtype}, {head}>"


def attention_names(
    dtype: str, head: int, block: int, gpads=GROUP_PADS, cache: str | None = None
) -> tuple[str, ...]:
    """Name expressions of one program: the CUDA-core kernel for each of ``gpads``, the
    tensor-core one for each where the dtype and head size allow, and the merge.

    A case launches one of the two, but its program holds both: the code NVVM emits for a
    kernel depends on the others in its program (the tensor-core kernel's SASS changed when
    compiled without the CUDA-core one), and these programs are the ones measured."""
    tail = "" if cache is None else f", {cache}"
    names = [_cuda_core_name(dtype, head, block, g, tail) for g in gpads]
    if tensor_core_ok(dtype, head):
        names += [_tensor_core_name(dtype, head, block, g, tail) for g in gpads]
    names.append(reduce_name(dtype, head))
    return tuple(names)


def decode_smem(partition_size: int, gpad: int, head: int, tensor_cores: bool) -> int:
    """Dynamic shared memory of a case's kernel (mirrors paged_attention.cu): the logits,
    reused for the cross-warp output sums."""
    if tensor_cores:  # logits [partition][8]
        return max(partition_size * 8, ATTENTION_WARPS * gpad * head) * 4
    return max(partition_size, ATTENTION_WARPS * head) * gpad * 4
