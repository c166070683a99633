"""The CUDA side of ``ops.py``, by concern:

- ``decode_attention``: paged decode launches and the partition rule;
- ``decode_variants``: the decode kernels' names, the ``DecodeVariant`` record of the
  experimental variants (tests and benchmarks), shared memory sizes;
- ``cache_ops``: reshape-and-cache, copy-on-write block copies; ``block_swap``: swaps;
- ``launch``: what every launch module shares (dtype names, device facts, streams);
- ``fused`` / ``fused_cuda``: the elementwise kernels around the matmuls.

This module keeps the names ops.py, the prefill launcher, the tests and
``benchmarks/bench_kernels.py`` import from here; nothing in it holds state. Decode
variants are passed as a ``DecodeVariant`` record (``variant=``).
"""

from __future__ import annotations

from streamkv.kernels import launch
from streamkv.kernels.block_swap import swap_blocks  # noqa: F401
from streamkv.kernels.cache_ops import (  # noqa: F401
    CACHE_OPS_SOURCE,
    COPY_UNITS,
    cache_ops_names,
    copy_blocks,
    move_blocks,
    reshape_and_cache,
)
from streamkv.kernels.decode_attention import (  # noqa: F401
    CUDA_CORE_LONG_WAVES,
    TC_LONG_WAVES,
    choose_partition_size,
    paged_attention_decode,
)
from streamkv.kernels.decode_variants import (  # noqa: F401
    ATTENTION_SOURCE,
    ATTENTION_THREADS,
    ATTENTION_WARPS,
    BLOCK_SIZES,
    GROUP_PADS,
    HEAD_SIZES,
    PARTITION_SIZES,
    TC_UNROLL,
    TC_WARP_SOFTMAX,
    TENSOR_CORE_DTYPES,
    DecodeVariant,
    attention_names,
    attention_smem,
    decode_name,
    reduce_name,
    resolve_kernel,
    tensor_core_ok,
)
from streamkv.kernels.launch import DTYPE_NAMES  # noqa: F401

# The production defaults, under the names the benchmarks print.
DECODE_KERNEL = DecodeVariant().kernel
DECODE_STAGES = DecodeVariant().stages
FUSED_MERGE = DecodeVariant().fused_merge

# Launch helpers under their former private names (kernels/prefill.py, bench_kernels.py).
_P, _I, _LL, _F = launch.PTR, launch.INT, launch.LONG, launch.FLOAT
_arch = launch.arch
_device_index = launch.device_index
_module = launch.module
_stream = launch.stream
_next_pow2 = launch.next_pow2
_aligned16 = launch.aligned16
_sm_count = launch.sm_count
