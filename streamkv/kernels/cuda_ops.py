"""CUDA implementations of the ops in ``ops.py``: same signatures, same logical layout.

Each op picks the kernel instantiation for its tensors (dtype, head size, block size, query
heads per KV head), gets it from ``nvrtc.load`` (compiled once, cached on disk) and
launches it on torch's current stream. Nothing here synchronises the host except swaps,
which need the block mapping on the host to plan their transfers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache

import torch
from cuda.bindings import driver

from streamkv.kernels import nvrtc

ATTENTION_SOURCE = "paged_attention.cu"
CACHE_OPS_SOURCE = "cache_ops.cu"
DTYPE_NAMES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
HEAD_SIZES = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)
GROUP_PADS = (1, 2, 4, 8)  # query heads per CTA; larger groups are split into chunks of 8
PARTITION_SIZES = (1024, 512, 256, 128)  # tokens per CTA, multiples of every block size
DECODE_STAGES = 0  # CUDA-core decode kernel: 0 = register loads, >= 2 = cp.async ring depth
# "tensor_core" (mma.sync; fp16 / bf16 caches, head sizes that are multiples of 64) or
# "cuda_core" (fp32 multiply-adds, every dtype and head size); "auto" takes the tensor-core
# kernel where it applies and a CTA serves 2+ query heads (resolve_kernel). docs/kernels.md has the measurements behind the choice.
DECODE_KERNEL = "auto"
TENSOR_CORE_DTYPES = ("__half", "__nv_bfloat16")
TC_WARP_SOFTMAX = False  # tensor-core kernel: softmax per warp (True) or per CTA (False)
# Tensor-core kernel: 16-token chunks a warp loads per step (UNROLL, 1-4) by head size;
# docs/kernels.md has the measurements.
TC_UNROLL = {64: 4, 128: 2, 256: 1}
# Partitions merged by the decode kernel's last CTA instead of a second launch: faster with
# a few partitions per sequence, much slower with many (one CTA merges them all), so off.
FUSED_MERGE = False
# choose_partition_size's long_waves: 1024-token partitions when the grid fits one wave or
# spans at least this many (per kernel; docs/kernels.md has the sweeps).
TC_LONG_WAVES = 2
CUDA_CORE_LONG_WAVES = 8
ATTENTION_THREADS = 128  # kThreads in paged_attention.cu
ATTENTION_WARPS = ATTENTION_THREADS // 32
COPY_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}

_P, _I, _LL, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float


def tensor_core_ok(dtype: str, head: int) -> bool:
    return dtype in TENSOR_CORE_DTYPES and head % 64 == 0


def resolve_kernel(kernel: str, dtype: str, head: int, gpad: int = 8) -> str:
    """``auto``: the tensor-core kernel where it applies and a KV head serves 2 or more
    query heads (padded). With one (multi-head attention) the CUDA-core kernel does few
    enough multiply-adds per byte to keep up, in fewer registers (docs/kernels.md)."""
    if kernel not in ("auto", "tensor_core", "cuda_core"):
        raise ValueError(f"decode kernel must be auto, tensor_core or cuda_core, got {kernel!r}")
    if kernel == "auto":
        return "tensor_core" if tensor_core_ok(dtype, head) and gpad >= 2 else "cuda_core"
    if kernel == "tensor_core" and not tensor_core_ok(dtype, head):
        raise ValueError(
            f"the tensor-core decode kernel needs an fp16 / bf16 cache and a head size that is a "
            f"multiple of 64, got {dtype} and {head}"
        )
    return kernel


def decode_name(
    dtype: str,
    head: int,
    block: int,
    gpad: int,
    stages: int,
    kernel: str,
    warp_softmax: bool | None = None,
    unroll: int | None = None,
) -> str:
    """``warp_softmax``: the tensor-core kernel's softmax per warp instead of per CTA
    (``WARP_SOFTMAX``; None: ``TC_WARP_SOFTMAX``); ``unroll``: its chunks per warp step
    (``UNROLL``; None: ``TC_UNROLL`` for the head size)."""
    if resolve_kernel(kernel, dtype, head, gpad) == "tensor_core":
        ws = TC_WARP_SOFTMAX if warp_softmax is None else warp_softmax
        un = TC_UNROLL.get(head, 1) if unroll is None else unroll
        if not 1 <= un <= 4:
            raise ValueError(f"tensor-core unroll must be 1 to 4 chunks, got {un}")
        return (
            f"streamkv::paged_attention_decode_tc_kernel<{dtype}, {head}, {block}, {gpad}, "
            f"{'true' if ws else 'false'}, {un}>"
        )
    return f"streamkv::paged_attention_decode_kernel<{dtype}, {head}, {block}, {gpad}, {stages}>"


def reduce_name(dtype: str, head: int) -> str:
    return f"streamkv::paged_attention_reduce_kernel<{dtype}, {head}>"


def attention_names(
    dtype: str,
    head: int,
    block: int,
    gpads=GROUP_PADS,
    stages: int | None = None,
    warp_softmax: bool | None = None,
    unroll: int | None = None,
) -> tuple[str, ...]:
    """Name expressions of one attention program: the CUDA-core decode kernel for each of
    ``gpads``, the tensor-core one for each of them where the dtype and head size allow, and
    the reduce."""
    stages = DECODE_STAGES if stages is None else stages
    names = [decode_name(dtype, head, block, g, stages, "cuda_core") for g in gpads]
    if tensor_core_ok(dtype, head):
        names += [
            decode_name(dtype, head, block, g, stages, "tensor_core", warp_softmax, unroll)
            for g in gpads
        ]
    names.append(reduce_name(dtype, head))
    return tuple(names)


def cache_ops_names() -> tuple[str, ...]:
    return tuple(
        f"streamkv::{k}<{u}>"
        for u in COPY_UNITS.values()
        for k in ("reshape_and_cache_kernel", "move_blocks_kernel")
    )


def _arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _module(source: str, names: tuple[str, ...], device: torch.device) -> nvrtc.Module:
    return nvrtc.load(source, names, _device_index(device), _arch(device))


@lru_cache(maxsize=256)
def _attention_kernels(
    dtype: str,
    head: int,
    block: int,
    gpad: int,
    stages: int,
    kernel: str,
    warp_softmax: bool | None,
    unroll: int | None,
    device: int,
) -> tuple[str, nvrtc.Kernel, nvrtc.Kernel]:
    """(resolved kernel kind, decode kernel, merge kernel) for one variant on one device:
    looked up once, not on every layer's call."""
    kind = resolve_kernel(kernel, dtype, head, gpad)
    names = attention_names(dtype, head, block, (gpad,), stages, warp_softmax, unroll)
    module = _module(ATTENTION_SOURCE, names, torch.device("cuda", device))
    decode = module.kernel(
        decode_name(dtype, head, block, gpad, stages, kind, warp_softmax, unroll)
    )
    return kind, decode, module.kernel(reduce_name(dtype, head))


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _aligned16(t: torch.Tensor) -> bool:
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])


@lru_cache(maxsize=64)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_partition_size(
    kernel: nvrtc.Kernel,
    ctas_per_partition: int,
    max_context_len: int,
    block_size: int,
    shared_mem: Callable[[int], int],
    device: torch.device,
    long_waves: int = 8,
) -> int:
    """Longest partition that still fills most of the GPU's CTA slots.

    Long partitions amortise each CTA's fixed cost (block ids, q, the cross-warp output sum)
    and keep the merge small; short ones keep multiprocessors busy when there are few
    sequences. The rule, from the sweeps of benchmarks/bench_kernels.py on an H200: the
    longest size whose grid is at least 3/4 of a wave; 1024 only when its grid fits one wave
    (one partition per sequence, no merge) or spans ``long_waves`` or more, since between
    those 512's finer grain balanced the multiprocessors better (8 for the CUDA-core kernel;
    2 for the tensor-core kernel, whose 1024-token CTAs were as fast or faster from 2 waves).
    """
    sizes = [p for p in PARTITION_SIZES if p % block_size == 0]
    index = _device_index(device)
    for p in sizes:
        slots = _sm_count(index) * max(1, kernel.occupancy(ATTENTION_THREADS, shared_mem(p)))
        ctas = ctas_per_partition * -(-max_context_len // p)
        if 4 * ctas < 3 * slots:
            continue
        if p > 512 and slots < ctas < long_waves * slots:
            continue
        return p
    return sizes[-1]


def attention_smem(
    partition_size: int, gpad: int, head: int, dtype, stages: int, kernel: str = "cuda_core"
) -> int:
    """Dynamic shared memory of a decode kernel (mirrors paged_attention.cu)."""
    if kernel == "tensor_core":  # logits [partition][8], reused for the cross-warp sums
        return max(partition_size * 8, ATTENTION_WARPS * gpad * head) * 4
    vec = 16 // dtype.itemsize
    nv = head // vec
    tg = min(32, _next_pow2(nv))
    nvt = -(-nv // tg)
    unroll = (8 if stages == 0 else 4) // nvt
    ring = stages * unroll * nvt * ATTENTION_THREADS * 16
    return ring + max(partition_size, ATTENTION_WARPS * head) * gpad * 4


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_GRAPH_COUNTERS: list[torch.Tensor] = []


def _merge_counters(device: torch.device, n: int) -> int:
    """Arrival counters of the fused merge, one per CTA column (sequence, kv head chunk).

    Zeroed once when allocated; the kernel's merging CTAs put them back to zero, so a launch
    needs no memset. One buffer per (device, stream): launches on one stream never overlap.
    Under CUDA graph capture a fresh zeroed buffer belongs to the graph (its memset replays
    with it), so a graph never shares counters with eager launches.
    """
    if torch.cuda.is_current_stream_capturing():
        buf = torch.zeros(n, dtype=torch.int32, device=device)
        _GRAPH_COUNTERS.append(buf)  # the graph's memory pool owns it; keep the tensor alive
        return buf.data_ptr()
    index = _device_index(device)
    key = (index, _stream(device))
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf.data_ptr()


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    out: torch.Tensor | None = None,
    stages: int = DECODE_STAGES,
    fused_merge: bool = FUSED_MERGE,
    kernel: str = DECODE_KERNEL,
    warp_softmax: bool | None = None,
    unroll: int | None = None,
) -> torch.Tensor:
    """``partition_size`` (tokens per CTA), ``out`` (cache dtype, [seqs, heads, head]),
    ``stages``, ``fused_merge``, ``kernel``, ``warp_softmax`` and ``unroll`` are for tests
    and benchmarks; ops.py leaves them be."""
    num_seqs, num_heads, head = query.shape
    _, num_kv_heads, block_size, cache_head = key_cache.shape
    dtype = key_cache.dtype
    if dtype not in DTYPE_NAMES or value_cache.dtype != dtype:
        raise TypeError(f"unsupported KV cache dtype {dtype} / {value_cache.dtype}")
    if cache_head != head or value_cache.shape != key_cache.shape:
        raise ValueError(f"query head size {head} vs caches {tuple(key_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    if (
        not (_aligned16(key_cache) and _aligned16(value_cache))
        or (head * key_cache.element_size()) % 16
    ):
        raise ValueError("KV cache rows must be 16-byte aligned")
    q = query.to(dtype)
    if q.stride(-1) != 1 or q.stride(1) != head or not _aligned16(q):
        q = q.contiguous()
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0

    if out is None:
        out = torch.empty((num_seqs, num_heads, head), dtype=dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous [seqs, heads, head] tensor of the cache dtype")
    if num_seqs == 0:
        return out.to(query.dtype)
    group = num_heads // num_kv_heads
    gpad = min(8, _next_pow2(group))
    chunks = -(-group // gpad)
    kernel, decode, reduce = _attention_kernels(
        DTYPE_NAMES[dtype],
        head,
        block_size,
        gpad,
        stages,
        kernel,
        warp_softmax,
        unroll,
        _device_index(query.device),
    )
    if partition_size is None:
        partition_size = choose_partition_size(
            decode,
            num_seqs * num_kv_heads * chunks,
            max_context_len,
            block_size,
            lambda p: attention_smem(p, gpad, head, dtype, stages, kernel),
            query.device,
            TC_LONG_WAVES if kernel == "tensor_core" else CUDA_CORE_LONG_WAVES,
        )
    if partition_size % block_size or not 0 < partition_size <= PARTITION_SIZES[0]:
        raise ValueError(f"partition size {partition_size} vs block size {block_size}")
    max_parts = max(1, -(-max_context_len // partition_size))
    if max_parts > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, max_parts, head), dtype=torch.float32, device=query.device
        )
        part_stats = torch.empty(
            (2, num_seqs, num_heads, max_parts), dtype=torch.float32, device=query.device
        )
        part_ptrs = (part_out.data_ptr(), part_stats[0].data_ptr(), part_stats[1].data_ptr())
    else:
        part_ptrs = (0, 0, 0)
    fused = fused_merge and max_parts > 1
    counters_ptr = _merge_counters(query.device, num_seqs * num_kv_heads * chunks) if fused else 0
    stream = _stream(query.device)
    decode.launch(
        (max_parts, num_kv_heads * chunks, num_seqs),
        (ATTENTION_THREADS, 1, 1),
        [
            (_P, out.data_ptr()),
            (_P, part_ptrs[0]),
            (_P, part_ptrs[1]),
            (_P, part_ptrs[2]),
            (_P, counters_ptr),
            (_P, q.data_ptr()),
            (_P, key_cache.data_ptr()),
            (_P, value_cache.data_ptr()),
            (_P, block_tables.data_ptr()),
            (_P, context_lens.data_ptr()),
            (_F, scale),
            (_LL, q.stride(0)),
            (_I, block_tables.stride(0)),
            (_I, num_kv_heads),
            (_I, group),
            (_I, partition_size),
            (_I, max_parts),
        ],
        stream,
        attention_smem(partition_size, gpad, head, dtype, stages, kernel),
    )
    if max_parts > 1 and not fused:
        reduce.launch(
            (num_heads, num_seqs, 1),
            (ATTENTION_THREADS, 1, 1),
            [
                (_P, out.data_ptr()),
                (_P, part_ptrs[0]),
                (_P, part_ptrs[1]),
                (_P, part_ptrs[2]),
                (_P, context_lens.data_ptr()),
                (_I, num_heads),
                (_I, partition_size),
                (_I, max_parts),
            ],
            stream,
            max_parts * 4,
        )
    return out if query.dtype == dtype else out.to(query.dtype)


def _copy_unit(nbytes: int, *addresses: int) -> int:
    """Widest access (16, 8, 4, 2 or 1 bytes) that divides every size and address given."""
    for unit in COPY_UNITS:
        if nbytes % unit == 0 and all(a % unit == 0 for a in addresses):
            return unit
    return 1


def _cache_ops_kernel(kind: str, unit: int, device: torch.device) -> nvrtc.Kernel:
    module = _module(CACHE_OPS_SOURCE, cache_ops_names(), device)
    return module.kernel(f"streamkv::{kind}<{COPY_UNITS[unit]}>")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head = key.shape
    if num_tokens == 0:
        return
    _, cache_heads, block_size, cache_head = key_cache.shape
    if (cache_heads, cache_head) != (num_kv_heads, head) or value.shape != key.shape:
        raise ValueError(f"K/V {tuple(key.shape)} do not fit caches {tuple(key_cache.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if key.stride(-1) != 1 or key.stride(1) != head:
        key = key.contiguous()
    if value.stride(-1) != 1 or value.stride(1) != head:
        value = value.contiguous()
    es = key.element_size()
    row_bytes = head * es
    unit = _copy_unit(
        row_bytes,
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key.stride(0) * es,
        value.stride(0) * es,
    )
    slots = slot_mapping.to(device=key.device, dtype=torch.int64).contiguous()
    row_units = row_bytes // unit
    threads = min(512, -(-num_kv_heads * row_units // 32) * 32)
    _cache_ops_kernel("reshape_and_cache_kernel", unit, key.device).launch(
        (num_tokens, 1, 1),
        (threads, 1, 1),
        [
            (_P, key.data_ptr()),
            (_P, value.data_ptr()),
            (_P, key_cache.data_ptr()),
            (_P, value_cache.data_ptr()),
            (_P, slots.data_ptr()),
            (_LL, key.stride(0) * es // unit),
            (_LL, value.stride(0) * es // unit),
            (_I, num_kv_heads),
            (_I, block_size),
            (_I, row_units),
        ],
        _stream(key.device),
    )


@lru_cache(maxsize=64)
def _pointer_table(device: torch.device, pointers: tuple[int, ...]) -> torch.Tensor:
    # Pools live as long as the engine, so their table is built (one H2D copy) only once.
    return torch.tensor(pointers, dtype=torch.int64).to(device)


def _strided_table(device: torch.device, base: int, stride: int, count: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64, device=device) * stride + base


def _to_device(mapping: list[list[int]], device: torch.device) -> torch.Tensor:
    host = torch.tensor(mapping, dtype=torch.int64).reshape(-1, 2)
    if torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def move_blocks(
    src_table: torch.Tensor,
    dst_table: torch.Tensor,
    mapping: torch.Tensor,
    block_bytes: int,
    unit: int,
) -> None:
    """One launch: for every pool p and pair (s, d), block d of dst p = block s of src p."""
    device = mapping.device
    _cache_ops_kernel("move_blocks_kernel", unit, device).launch(
        (mapping.shape[0], src_table.shape[0], 1),
        (256, 1, 1),
        [
            (_P, src_table.data_ptr()),
            (_P, dst_table.data_ptr()),
            (_P, mapping.data_ptr()),
            (_LL, block_bytes // unit),
        ],
        _stream(device),
    )


def _check_pools(pools: list[torch.Tensor]) -> int:
    """Validates a list of per-layer pools and returns the bytes of one block."""
    first = pools[0]
    for p in pools:
        if p.shape[1:] != first.shape[1:] or p.dtype != first.dtype or not p.is_contiguous():
            raise ValueError("pools must be contiguous and share block shape and dtype")
    return first[0].numel() * first.element_size()


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    pools = [*key_caches, *value_caches]
    block_bytes = _check_pools(pools)
    device = pools[0].device
    pointers = tuple(p.data_ptr() for p in pools)
    table = _pointer_table(device, pointers)
    mapping = block_mapping.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    move_blocks(table, table, mapping, block_bytes, _copy_unit(block_bytes, *pointers))


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index into ids, first id, length) of each run of consecutive ids in sorted ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _host_copy(
    to_host: bool,
    dev_base: int,
    dev_pitch: int,
    host_ptrs: tuple[int, ...],
    host_offset: int,
    nbytes: int,
    stream: int,
) -> None:
    """Copy nbytes per layer between staging rows (dev_base + l * dev_pitch) and host pools.

    Layer pools that are slices of one host tensor (a uniform stride) move in a single 2D
    copy whatever the number of layers; otherwise one copy per layer.
    """
    layers = len(host_ptrs)
    stride = host_ptrs[1] - host_ptrs[0] if layers > 1 else 0
    if stride >= nbytes and all(h == host_ptrs[0] + i * stride for i, h in enumerate(host_ptrs)):
        cp = driver.CUDA_MEMCPY2D()
        dev_type, host_type = (
            driver.CUmemorytype.CU_MEMORYTYPE_DEVICE,
            driver.CUmemorytype.CU_MEMORYTYPE_HOST,
        )
        if to_host:
            cp.srcMemoryType, cp.srcDevice, cp.srcPitch = dev_type, dev_base, dev_pitch
            cp.dstMemoryType, cp.dstHost, cp.dstPitch = (
                host_type,
                host_ptrs[0] + host_offset,
                stride,
            )
        else:
            cp.srcMemoryType, cp.srcHost, cp.srcPitch = (
                host_type,
                host_ptrs[0] + host_offset,
                stride,
            )
            cp.dstMemoryType, cp.dstDevice, cp.dstPitch = dev_type, dev_base, dev_pitch
        cp.WidthInBytes, cp.Height = nbytes, layers
        if driver.cuMemcpy2DAsync(cp, stream)[0] == driver.CUresult.CUDA_SUCCESS:
            return
        # A pitch past the driver's limit (huge pools): fall back to a copy per layer.
    for layer, host in enumerate(host_ptrs):
        dev = dev_base + layer * dev_pitch
        if to_host:
            nvrtc.check(driver.cuMemcpyDtoHAsync(host + host_offset, dev, nbytes, stream))
        else:
            nvrtc.check(driver.cuMemcpyHtoDAsync(dev, host + host_offset, nbytes, stream))


def swap_blocks(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Move blocks between device pools and (pinned) host pools, all layers at once.

    Device -> host: one kernel gathers every (layer, block) into a staging buffer, then each
    run of consecutive destination ids is one transfer for all layers. Host -> device: the
    mirror image, runs into staging then one scatter kernel. The transfers are asynchronous
    on the current stream: synchronise it before reading a host pool from the CPU.
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError("src and dst have different numbers of layers")
    block_bytes = _check_pools(src_caches)
    if _check_pools(dst_caches) != block_bytes or src_caches[0].dtype != dst_caches[0].dtype:
        raise ValueError("src and dst pools have different block shapes or dtypes")
    pairs = [(int(s), int(d)) for s, d in block_mapping.tolist()]
    src_dev, dst_dev = src_caches[0].is_cuda, dst_caches[0].is_cuda
    device = (src_caches if src_dev else dst_caches)[0].device
    src_ptrs = tuple(p.data_ptr() for p in src_caches)
    dst_ptrs = tuple(p.data_ptr() for p in dst_caches)
    if src_dev and dst_dev:
        unit = _copy_unit(block_bytes, *src_ptrs, *dst_ptrs)
        move_blocks(
            _pointer_table(device, src_ptrs),
            _pointer_table(device, dst_ptrs),
            _to_device(pairs, device),
            block_bytes,
            unit,
        )
        return
    n, layers = len(pairs), len(src_caches)
    staging = torch.empty((layers, n, block_bytes), dtype=torch.uint8, device=device)
    pitch = n * block_bytes
    staging_table = _strided_table(device, staging.data_ptr(), pitch, layers)
    stream = _stream(device)
    if src_dev:
        pairs.sort(key=lambda p: p[1])
        unit = _copy_unit(block_bytes, staging.data_ptr(), *src_ptrs)
        gather = _to_device([[s, i] for i, (s, _) in enumerate(pairs)], device)
        move_blocks(_pointer_table(device, src_ptrs), staging_table, gather, block_bytes, unit)
        for i, first, length in _runs([d for _, d in pairs]):
            _host_copy(
                True,
                staging.data_ptr() + i * block_bytes,
                pitch,
                dst_ptrs,
                first * block_bytes,
                length * block_bytes,
                stream,
            )
    else:
        pairs.sort()
        unit = _copy_unit(block_bytes, staging.data_ptr(), *dst_ptrs)
        for i, first, length in _runs([s for s, _ in pairs]):
            _host_copy(
                False,
                staging.data_ptr() + i * block_bytes,
                pitch,
                src_ptrs,
                first * block_bytes,
                length * block_bytes,
                stream,
            )
        scatter = _to_device([[i, d] for i, (_, d) in enumerate(pairs)], device)
        move_blocks(staging_table, _pointer_table(device, dst_ptrs), scatter, block_bytes, unit)
