"""The CUDA side of ``ops.py``, by concern:

- ``decode_attention``: paged decode attention (kernel names, the partition rule, launches);
- ``cache_ops``: reshape-and-cache, copy-on-write block copies; ``block_swap``: swaps;
- ``launch``: what every launch module shares (dtype names, device facts, streams);
- ``fused`` / ``fused_cuda``: the elementwise kernels around the matmuls.

This module keeps the names ops.py and the tests import from here; nothing in it holds
state. The decode kernels' experimental variants live in ``benchmarks/decode_variants.py``.
"""

from __future__ import annotations

from streamkv.kernels.block_swap import swap_blocks  # noqa: F401
from streamkv.kernels.cache_ops import (  # noqa: F401
    CACHE_OPS_SOURCE,
    COPY_UNITS,
    cache_ops_names,
    copy_blocks,
    move_blocks,
    reshape_and_cache,
)
from streamkv.kernels.decode_attention import paged_attention_decode  # noqa: F401
from streamkv.kernels.launch import DTYPE_NAMES  # noqa: F401
