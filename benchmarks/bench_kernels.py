"""Build, check and time streamkv's CUDA kernels on one GPU, in one run.

1. Build: compile (NVRTC) and load the benchmark's kernels, cold and from the disk cache.
2. Check: every op against the reference in streamkv/kernels/ops.py (float64 for attention).
3. Time (CUDA graphs, median of replays, inputs rotated so they do not sit in L2):
   - decode attention at batch x context, bf16, head 128, 32 query / 8 KV heads, block 16,
     against the device-to-device copy bandwidth and torch SDPA (flash) on the same data
     laid out contiguously, and over the partition sizes and the kernel variants of
     benchmarks/decode_variants.py (the production kernel is the ``ours`` column);
   - reshape_and_cache and copy_blocks in GB/s;
   - swap out / in in GB/s against one large pinned cudaMemcpy of the same bytes.
Prints tables and writes everything to --out as JSON.

    python benchmarks/bench_kernels.py --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import decode_variants as dv  # noqa: E402
from streamkv.kernels import decode_attention as da  # noqa: E402
from streamkv.kernels import decode_kernels as dk  # noqa: E402
from streamkv.kernels import launch, nvrtc, ops, reference  # noqa: E402

HEAD, Q_HEADS, KV_HEADS, BLOCK = 128, 32, 8, 16
DTYPE = torch.bfloat16
L2_ROTATE_BYTES = 256 << 20  # rotate inputs until one timed replay touches this much
SWEEP_STAGES = (0, 2, 3, 4)
KERNELS = ("tensor_core", "cuda_core")
WARMUP_S = 0.3  # seconds of the default configuration before a row's first timing
SPIN_CYCLES = 200_000  # ~100 µs: the host queues the timed work while the GPU spins


def gpu_time_ms(
    fn: Callable[[], object], iters: int, graph: bool = True, busy: bool | None = None
) -> float:
    """Median time of fn, replayed from a CUDA graph or called eagerly.

    ``busy`` (default: with graphs) queues a spin kernel ahead of the start event, so the
    event pair brackets device time only: on an idle stream the start event is stamped at
    once and the interval also holds the host's submission of the graph (several µs, most
    of the difference at 64 x 1k in an earlier run). Eager timings keep the launch costs in.
    """
    busy = graph if busy is None else busy
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    for _ in range(3):
        run()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy:
            torch.cuda._sleep(SPIN_CYCLES)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_time_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return math.inf
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ---------------------------------------------------------------------------------- build
def build() -> dict:
    names = dk.attention_names(launch.DTYPE_NAMES[DTYPE], HEAD, BLOCK, (4,))
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("STREAMKV_CACHE_DIR")
        os.environ["STREAMKV_CACHE_DIR"] = tmp
        t = time.perf_counter()
        compiled = nvrtc.compile_program(dk.ATTENTION_SOURCE, names, arch)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        nvrtc.compile_program(dk.ATTENTION_SOURCE, names, arch)
        warm = time.perf_counter() - t
        if old is None:
            del os.environ["STREAMKV_CACHE_DIR"]
        else:
            os.environ["STREAMKV_CACHE_DIR"] = old
    verbose = nvrtc.compile_program(dk.ATTENTION_SOURCE, names, arch, ("--ptxas-options=-v",)).log
    regs = [line.strip() for line in verbose.splitlines() if "registers" in line]
    return {
        "arch": f"sm_{arch}",
        "nvrtc": ".".join(map(str, nvrtc.nvrtc_version())),
        "compile_cold_s": round(cold, 3),
        "compile_cached_s": round(warm, 4),
        "cubin_bytes": len(compiled.image),
        "ptxas": regs,
    }


# ---------------------------------------------------------------------------------- checks
def paged_inputs(
    batch: int,
    ctx: list[int],
    gen,
    dtype=None,
    group: int = 4,
    extra: int = 0,
    head: int = HEAD,
    cache_dtype=None,
):
    """Random pool with a random block table per sequence (+ `extra` unused blocks), in
    ``cache_dtype`` (default: the query's)."""
    dtype = dtype or DTYPE
    counts = [-(-c // BLOCK) for c in ctx]
    num_blocks = sum(counts) + extra
    shape = (num_blocks, KV_HEADS, BLOCK, head)
    key = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    value = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    if cache_dtype is not None:
        key, value = key.to(cache_dtype), value.to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    tables = torch.zeros((batch, max(counts)), dtype=torch.int32, device="cuda")
    first = 0
    for s, n in enumerate(counts):
        tables[s, :n] = perm[first : first + n]
        first += n
    query = torch.randn((batch, KV_HEADS * group, head), generator=gen, device="cuda", dtype=dtype)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    return query, key, value, tables, lens


def checks() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    limits = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    cases = [(torch.bfloat16, 4, 512, st, "cuda_core", True) for st in SWEEP_STAGES]
    for kernel in KERNELS:
        for fused in (True, False):
            cases += [
                (torch.bfloat16, 4, None, 0, kernel, fused),
                (torch.bfloat16, 8, 128, 0, kernel, fused),
                (torch.float16, 1, 256, 0, kernel, fused),
                (torch.bfloat16, 4, 128, 0, kernel, fused),
            ]
    cases.append((torch.float32, 4, 512, 0, "cuda_core", True))
    for dtype, group, partition, stages, kernel, fused in cases:
        ctx = [1, 127, 128, 129, 513, 1500, 4100, 37]
        q, k, v, bt, lens = paged_inputs(len(ctx), ctx, gen, dtype, group, extra=1000)
        out = torch.full_like(q, math.nan)
        name = (
            f"decode {kernel} {dtype} group {group} partition {partition} stages {stages} "
            f"fused {fused}"
        )
        try:
            dv.launch_variant(
                dv.DecodeVariant(kernel=kernel, stages=stages, fused_merge=fused),
                q,
                k,
                v,
                bt,
                lens,
                HEAD**-0.5,
                max(ctx),
                partition,
                out,
            )
        except Exception as e:
            results.append({"check": name, "ok": False, "error": str(e)})
            continue
        ref = ops.paged_attention_decode_ref(
            q.double(), k.double(), v.double(), bt, lens, HEAD**-0.5
        )
        err = rel_err(out, ref)
        results.append({"check": name, "rel_err": err, "ok": err <= limits[dtype]})
    # reshape_and_cache, copy_blocks, swap: exact copies.
    q, k, v, bt, lens = paged_inputs(4, [100, 200, 300, 50], gen, extra=500)
    slots = torch.randperm(k.shape[0] * BLOCK, device="cuda", generator=gen)[:333]
    slots[::7] = -1
    nk = torch.randn((333, KV_HEADS, HEAD), device="cuda", generator=gen, dtype=DTYPE)
    rk, rv, ck, cv = k.clone(), v.clone(), k.clone(), v.clone()
    ops.reshape_and_cache_ref(nk, nk * 2, rk, rv, slots)
    ops.reshape_and_cache(nk, nk * 2, ck, cv, slots)
    results.append(
        {"check": "reshape_and_cache", "ok": torch.equal(ck, rk) and torch.equal(cv, rv)}
    )
    pairs = torch.randperm(k.shape[0], device="cuda", generator=gen)[:64].view(32, 2)
    keys, vals = [k.clone(), v.clone()], [v.clone(), k.clone()]
    rkeys, rvals = [t.clone() for t in keys], [t.clone() for t in vals]
    ops.copy_blocks_ref(rkeys, rvals, pairs)
    ops.copy_blocks(keys, vals, pairs)
    ok = all(torch.equal(a, b) for a, b in zip(keys + vals, rkeys + rvals, strict=True))
    results.append({"check": "copy_blocks", "ok": ok})
    host = torch.zeros((2, 256, KV_HEADS, BLOCK, HEAD), dtype=DTYPE).pin_memory()
    hosts = list(host.unbind(0))
    mapping = torch.stack([torch.randperm(k.shape[0])[:40], torch.randperm(256)[:40]], 1)
    ref = [t.clone() for t in hosts]
    ops.swap_blocks_ref([k, v], ref, mapping)
    ops.swap_blocks([k, v], hosts, mapping)
    torch.cuda.synchronize()
    ok = all(torch.equal(a, b) for a, b in zip(hosts, ref, strict=True))
    back = [torch.zeros_like(k), torch.zeros_like(v)]
    ref_back = [t.clone() for t in back]
    ops.swap_blocks_ref(hosts, ref_back, mapping.flip(1))
    ops.swap_blocks(hosts, back, mapping.flip(1))
    ok = ok and all(torch.equal(a, b) for a, b in zip(back, ref_back, strict=True))
    results.append({"check": "swap out + in", "ok": ok})
    return results


# ---------------------------------------------------------------------------------- attention
def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = gpu_time_ms(lambda: dst.copy_(src), 20, graph=False)
    return 2 * n / ms / 1e6


def sdpa_variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Flash SDPA on contiguous [B, H, T, D] K/V, two equivalent ways to express GQA decode."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads, head = q.shape
    group = heads // k.shape[1]
    q_heads = q.unsqueeze(2)  # [B, 32, 1, D] with enable_gqa
    q_rows = q.view(batch, k.shape[1], group, head)  # [B, 8, 4, D]: a group's heads as rows

    def gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q_heads, k, v, scale=scale, enable_gqa=True)

    def rows():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q_rows, k, v, scale=scale)

    return {
        "enable_gqa": (gqa, lambda o: o.view(batch, heads, head)),
        "heads_as_rows": (rows, lambda o: o.reshape(batch, heads, head)),
    }


def bench_attention(
    batch: int,
    ctx: int,
    iters: int,
    copy_gbs: float,
    sweep: bool,
    group: int = Q_HEADS // KV_HEADS,
    head: int = HEAD,
    bound: int | None = None,
    cache_dtype=None,
) -> dict:
    """One batch x context point. With an fp8 ``cache_dtype`` (unit scales) SDPA is skipped:
    flash SDPA reads 16-bit K/V only."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + ctx)
    fp8 = cache_dtype is not None
    kv_bytes = 2 * batch * ctx * KV_HEADS * head * (1 if fp8 else 2)
    io_bytes = kv_bytes + 2 * batch * KV_HEADS * group * head * 2
    sets = max(1, min(32, -(-L2_ROTATE_BYTES // kv_bytes)))
    scale = head**-0.5
    inputs = [
        paged_inputs(batch, [ctx] * batch, gen, group=group, head=head, cache_dtype=cache_dtype)
        for _ in range(sets)
    ]
    row: dict = {
        "batch": batch,
        "context": ctx,
        "head": head,
        "q_heads": KV_HEADS * group,
        "bytes": io_bytes,
        "rotated_sets": sets,
        "bound": bound or ctx,
        "kv_cache_dtype": str(cache_dtype or DTYPE).removeprefix("torch."),
    }
    mcl = bound or ctx  # max_context_len: a CUDA graph's bucket bound, or the batch's own

    def ours(partition=None, **variant):
        """The production kernel, or a variant (dv.DecodeVariant's fields) of it."""
        kv = dv.DecodeVariant(**variant)
        if kv == dv.PRODUCTION and partition is None:
            return lambda: [
                da.paged_attention_decode(q, k, v, bt, lens, scale, mcl)
                for q, k, v, bt, lens in inputs
            ]
        return lambda: [
            dv.launch_variant(kv, q, k, v, bt, lens, scale, mcl, partition)
            for q, k, v, bt, lens in inputs
        ]

    # The default configuration is timed three times spread over the row (first, after the
    # sweep, after SDPA) and the median reported: single measurements of one configuration
    # drifted by up to ~10% within a run, and a row's first timing read high until the GPU had
    # run the new inputs for a while (79.3 first vs 72.7 later at 64 x 1k), hence
    # the warm-up.
    default = ours()
    t_end = time.perf_counter() + WARMUP_S
    while time.perf_counter() < t_end:
        default()
        torch.cuda.synchronize()
    default_ms: list[float] = []

    def time_default() -> None:
        default_ms.append(gpu_time_ms(default, iters) / sets)

    time_default()
    row["ours_eager_us"] = gpu_time_ms(default, iters, graph=False) / sets * 1e3
    row["ours_idle_stream_us"] = gpu_time_ms(default, iters, busy=False) / sets * 1e3
    if sweep:
        row["sweep_us"] = _sweep(ours, ctx, head, iters, sets)
        best = min((v, k) for k, v in row["sweep_us"].items() if isinstance(v, float))
        row["sweep_best"] = {
            "config": best[1],
            "us": best[0],
            "of_copy_bw": io_bytes / best[0] / 1e3 / copy_gbs,
        }

    time_default()

    best = None if fp8 else _time_sdpa(inputs, ctx, scale, iters, sets, row)
    time_default()
    ms = statistics.median(default_ms)
    row.update(
        ours_us=ms * 1e3, ours_gbs=io_bytes / ms / 1e6, ours_each_us=[t * 1e3 for t in default_ms]
    )
    if best is not None:
        q, k, v, bt, lens = inputs[0]
        ours_out = da.paged_attention_decode(q, k, v, bt, lens, scale, ctx)
        row.update(
            sdpa_us=best[0] * 1e3,
            sdpa_form=best[1],
            vs_sdpa=ms / best[0],
            rel_err_vs_sdpa=rel_err(ours_out, best[2]),
        )
    row["of_copy_bw"] = row["ours_gbs"] / copy_gbs
    return row


def _sweep(ours, ctx: int, head: int, iters: int, sets: int) -> dict:
    """Kernel x merge x partition size (None: the automatic choice), ring depths, the other
    warp softmax and unrolls: each configuration's time in us, or its error."""
    sweep_us: dict = {}

    def measure(label: str, **kw) -> None:
        try:
            sweep_us[label] = gpu_time_ms(ours(**kw), iters) / sets * 1e3
        except Exception as e:  # keep measuring the rest
            sweep_us[label] = f"error: {e}"

    for kernel in KERNELS:
        for fused in (False, True):
            for p in (None, *dk.PARTITION_SIZES):
                if p is not None and p > 2 * ctx:
                    continue  # one partition already holds the context
                measure(
                    f"{kernel} fused {fused} partition {p}",
                    partition=p,
                    fused_merge=fused,
                    kernel=kernel,
                )
    measure("cuda_core fused False partition None stages 0", stages=0, kernel="cuda_core")
    for p in (None, 512):
        measure(
            f"tensor_core warp softmax True partition {p}",
            partition=p,
            kernel="tensor_core",
            warp_softmax=True,
        )
    for unroll in dv.TC_UNROLLS:
        if unroll != dk.TC_UNROLL.get(head, 1):
            measure(
                f"tensor_core unroll {unroll} partition None",
                kernel="tensor_core",
                unroll=unroll,
            )
    return sweep_us


def _time_sdpa(inputs: list, ctx: int, scale: float, iters: int, sets: int, row: dict):
    """SDPA on contiguous copies of exactly the same K/V, in each form: each one's time (or why
    it is unavailable) into ``row``; the fastest as (ms, form, output), None if none ran."""
    contiguous = []
    for q, k, v, bt, _ in inputs:
        nb = bt.shape[1]
        kc = reference.gather_kv(k, bt, nb)[:, :, :ctx].contiguous()
        vc = reference.gather_kv(v, bt, nb)[:, :, :ctx].contiguous()
        contiguous.append((q, kc, vc))
    best = None
    for name in ("enable_gqa", "heads_as_rows"):
        try:
            fns = [sdpa_variants(q, kc, vc, scale)[name] for q, kc, vc in contiguous]
            ref_out = fns[0][1](fns[0][0]())
            sdpa_ms = gpu_time_ms(lambda fns=fns: [f() for f, _ in fns], iters) / sets
        except RuntimeError as e:  # the flash backend refused this form
            row[f"sdpa_{name}"] = f"unavailable: {str(e).splitlines()[0][:120]}"
            continue
        row[f"sdpa_{name}_us"] = sdpa_ms * 1e3
        if best is None or sdpa_ms < best[0]:
            best = (sdpa_ms, name, ref_out)
    return best


def bench_reduce_alone(batch: int, ctx: int, partition: int, iters: int) -> dict:
    """The partition-merge kernel by itself, to see what a fused merge could save."""
    parts = -(-ctx // partition)
    names = dk.attention_names(launch.DTYPE_NAMES[DTYPE], HEAD, BLOCK, (4,))
    reduce = launch.module(dk.ATTENTION_SOURCE, names, torch.device("cuda")).kernel(names[-1])
    out = torch.empty((batch, Q_HEADS, HEAD), dtype=DTYPE, device="cuda")
    part_out = torch.randn((batch, Q_HEADS, parts, HEAD), device="cuda")
    stats = torch.rand((2, batch, Q_HEADS, parts), device="cuda") + 0.5
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")

    def run():
        reduce.launch(
            (Q_HEADS, batch, 1),
            (dk.ATTENTION_THREADS, 1, 1),
            [
                (launch.PTR, out.data_ptr()),
                (launch.PTR, part_out.data_ptr()),
                (launch.PTR, stats[0].data_ptr()),
                (launch.PTR, stats[1].data_ptr()),
                (launch.PTR, lens.data_ptr()),
                (launch.INT, Q_HEADS),
                (launch.INT, partition),
                (launch.INT, parts),
            ],
            torch.cuda.current_stream().cuda_stream,
            parts * 4,
        )

    return {
        "batch": batch,
        "context": ctx,
        "partition": partition,
        "reduce_us": gpu_time_ms(run, iters) * 1e3,
    }


# ---------------------------------------------------------------------------------- cache ops
def bench_reshape(tokens: int, iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    blocks = max(4096, 4 * tokens // BLOCK)
    cache_k = torch.zeros((blocks, KV_HEADS, BLOCK, HEAD), dtype=DTYPE, device="cuda")
    cache_v = torch.zeros_like(cache_k)
    qkv = torch.randn(
        (tokens, Q_HEADS + 2 * KV_HEADS, HEAD), generator=gen, device="cuda", dtype=DTYPE
    )
    key, value = qkv[:, Q_HEADS : Q_HEADS + KV_HEADS], qkv[:, Q_HEADS + KV_HEADS :]
    slots = torch.randperm(blocks * BLOCK, generator=gen, device="cuda")[:tokens]
    ms = gpu_time_ms(lambda: ops.reshape_and_cache(key, value, cache_k, cache_v, slots), iters)
    moved = 2 * 2 * tokens * KV_HEADS * HEAD * 2  # K and V, read + written
    return {
        "op": "reshape_and_cache",
        "size": f"{tokens} tokens",
        "us": ms * 1e3,
        "gbs": moved / ms / 1e6,
    }


def bench_copy(pairs: int, layers: int, iters: int) -> dict:
    blocks = 2048
    pools = [
        torch.randn((blocks, KV_HEADS, BLOCK, HEAD), device="cuda", dtype=DTYPE)
        for _ in range(2 * layers)
    ]
    ids = torch.randperm(blocks, device="cuda")[: 2 * pairs].view(pairs, 2)
    ms = gpu_time_ms(lambda: ops.copy_blocks(pools[:layers], pools[layers:], ids), iters)
    moved = 2 * pairs * 2 * layers * pools[0][0].numel() * 2
    return {
        "op": "copy_blocks",
        "size": f"{pairs} blocks x {2 * layers} pools (1 launch)",
        "us": ms * 1e3,
        "gbs": moved / ms / 1e6,
    }


def bench_swap(layers: int, blocks: int, iters: int) -> list[dict]:
    """Swap `blocks` blocks of 2*layers pools, as cache_engine does, both directions."""
    pools = 2 * layers
    shape = (KV_HEADS, BLOCK, HEAD)
    dev = [torch.randn((4 * blocks, *shape), device="cuda", dtype=DTYPE) for _ in range(pools)]
    stacked = torch.empty((pools, 2 * blocks, *shape), dtype=DTYPE, pin_memory=True)
    per_layer = [
        torch.empty((2 * blocks, *shape), dtype=DTYPE, pin_memory=True) for _ in range(pools)
    ]
    nbytes = pools * blocks * dev[0][0].numel() * 2
    rows = []
    one_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    one_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    base_out = wall_time_ms(lambda: one_host.copy_(one_dev, non_blocking=True), iters)
    base_in = wall_time_ms(lambda: one_dev.copy_(one_host, non_blocking=True), iters)
    rows.append(
        {
            "op": "one pinned cudaMemcpy D2H",
            "size": f"{nbytes >> 20} MiB",
            "us": base_out * 1e3,
            "gbs": nbytes / base_out / 1e6,
        }
    )
    rows.append(
        {
            "op": "one pinned cudaMemcpy H2D",
            "size": f"{nbytes >> 20} MiB",
            "us": base_in * 1e3,
            "gbs": nbytes / base_in / 1e6,
        }
    )
    src = torch.randperm(4 * blocks)[:blocks]
    for layout, host in (
        ("host pools stacked", list(stacked.unbind(0))),
        ("host pool per layer", per_layer),
    ):
        for ids_name, dst in (
            ("contiguous ids", torch.arange(blocks) + blocks // 2),
            ("scattered ids", torch.randperm(2 * blocks)[:blocks]),
        ):
            mapping = torch.stack([src, dst], 1)
            out_ms = wall_time_ms(lambda h=host, m=mapping: ops.swap_blocks(dev, h, m), iters)
            in_ms = wall_time_ms(
                lambda h=host, m=mapping.flip(1): ops.swap_blocks(h, dev, m), iters
            )
            for direction, ms, base in (
                ("swap out", out_ms, base_out),
                ("swap in", in_ms, base_in),
            ):
                rows.append(
                    {
                        "op": f"{direction}, {layout}, {ids_name}",
                        "size": f"{blocks} blocks x {pools} pools",
                        "us": ms * 1e3,
                        "gbs": nbytes / ms / 1e6,
                        "vs_one_memcpy": base / ms,
                    }
                )
    return rows


# ---------------------------------------------------------------------------------- report
def print_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    print("  ".join(f"{title:>{len(title) if len(title) > 9 else 9}}" for _, title, _ in cols))
    for r in rows:
        cells = []
        for key, title, fmt in cols:
            v = r.get(key, "")
            width = len(title) if len(title) > 9 else 9
            cells.append(
                f"{v:{fmt}}".rjust(width) if isinstance(v, int | float) else str(v).rjust(width)
            )
        print("  ".join(cells))


def print_attention_tables(rows: list[dict], gpu: str, copy_gbs: float) -> None:
    print(
        f"\nDecode attention, {DTYPE} queries, head {HEAD}, {KV_HEADS} KV heads, block {BLOCK}, "
        f"{gpu}; copy {copy_gbs:.0f} GB/s; ours: the production kernel per case "
        f"(streamkv/kernels/decode_attention.py)"
    )
    for r in rows:
        best = r.get("sweep_best")
        if best:
            r["best_config"], r["best_us"], r["best_of_copy"] = (
                best["config"],
                best["us"],
                best["of_copy_bw"],
            )
    print_table(
        rows,
        [
            ("batch", "batch", "d"),
            ("context", "context", "d"),
            ("head", "head", "d"),
            ("q_heads", "q heads", "d"),
            ("kv_cache_dtype", "cache", "s"),
            ("ours_us", "ours us", ".1f"),
            ("ours_gbs", "GB/s", ".0f"),
            ("of_copy_bw", "of copy", ".2f"),
            ("sdpa_us", "sdpa us", ".1f"),
            ("vs_sdpa", "ours/sdpa", ".3f"),
            ("ours_eager_us", "eager us", ".1f"),
            ("ours_idle_stream_us", "idle-stream us", ".1f"),
            ("best_us", "best us", ".1f"),
            ("best_of_copy", "best of copy", ".2f"),
            ("best_config", "best config", "s"),
        ],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="kernels_bench.json", help="JSON results path")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 16384])
    p.add_argument("--iters", type=int, default=30, help="timed replays per measurement")
    p.add_argument(
        "--bound",
        type=int,
        default=None,
        help="max_context_len the kernels get, as a decode graph's context bucket gives it "
        "(default: each row's context)",
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the partition-size sweep")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument(
        "--other-groups",
        type=int,
        nargs="*",
        default=[1, 2, 8],
        help="GQA ratios besides 4 timed (with the kernel sweep) at batch 64/256, context 1k/4k",
    )
    p.add_argument(
        "--other-heads",
        type=int,
        nargs="*",
        default=[64, 256],
        help="head sizes besides 128 timed (with the kernel sweep) at GQA 4, 64 x 1k and 256 x 4k",
    )
    p.add_argument(
        "--only-attention", action="store_true", help="skip the cache-op and swap timings"
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16"),
        default="bfloat16",
        help="the element type of every timed tensor (queries, caches, swaps) but an fp8 cache",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="fp8: decode attention over an e4m3 cache (unit scales; no SDPA; its bytes, so "
        "its bandwidth, are half bf16's); the cache-op and swap timings stay in --dtype",
    )
    args = p.parse_args(argv)
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    props = torch.cuda.get_device_properties(0)
    report: dict = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }

    def save() -> None:  # after every section, so a crash keeps what was measured
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    report["build"] = build()
    print(f"GPU {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    print(f"build: {json.dumps(report['build'], indent=1)}")
    if not args.skip_checks:
        report["checks"] = checks()
        for c in report["checks"]:
            print(f"check {'OK  ' if c['ok'] else 'FAIL'} {c['check']} {c.get('rel_err', '')}")

    copy_gbs = copy_bandwidth()
    report["copy_gbs"] = copy_gbs
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")

    def time_rows(
        key: str, points, group: int = Q_HEADS // KV_HEADS, head: int = HEAD
    ) -> list[dict]:
        rows = []
        for batch, ctx in points:
            try:
                row = bench_attention(
                    batch,
                    ctx,
                    args.iters,
                    copy_gbs,
                    not args.no_sweep,
                    group,
                    head,
                    args.bound,
                    cache_dtype,
                )
            except Exception as e:  # out of memory, or a failure: keep the other sizes
                row = {"batch": batch, "context": ctx, "skipped": f"{type(e).__name__}: {e}"}
            rows.append(row)
            report[key] = rows
            save()
            torch.cuda.empty_cache()
            print(json.dumps(row))
            sys.stdout.flush()
        return rows

    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
    rows = time_rows("attention", [(b, c) for b in args.batches for c in args.contexts])
    other = []
    for group in args.other_groups:
        points = ((64, 1024), (64, 4096), (256, 1024), (256, 4096))
        other += time_rows(f"attention_group_{group}", points, group)
    for head in args.other_heads:
        points = ((64, 1024), (256, 4096))
        other += time_rows(f"attention_head_{head}", points, head=head)
    report["attention_other_groups"] = other
    if args.only_attention:
        save()
        print_attention_tables(rows + other, props.name, copy_gbs)
        return 0
    report["reduce_alone"] = [
        bench_reduce_alone(b, c, 512, args.iters) for b, c in ((64, 1024), (256, 4096))
    ]
    print(json.dumps(report["reduce_alone"]))
    report["cache_ops"] = [
        bench_reshape(256, args.iters),
        bench_reshape(8192, args.iters),
        bench_copy(64, 32, args.iters),
        bench_copy(512, 32, args.iters),
    ]
    save()
    report["swap"] = bench_swap(32, 256, 5)
    save()

    print_attention_tables(rows + other, props.name, copy_gbs)
    print("\nCache ops")
    print_table(
        report["cache_ops"] + report["swap"],
        [
            ("op", "op", "s"),
            ("size", "size", "s"),
            ("us", "us", ".1f"),
            ("gbs", "GB/s", ".1f"),
            ("vs_one_memcpy", "vs 1 memcpy", ".2f"),
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
