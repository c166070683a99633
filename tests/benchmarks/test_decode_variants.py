"""benchmarks/decode_variants.py: the default variant is production's kernel, every variant
compiles with NVRTC for sm_80 and sm_90 (no GPU needed, runs in CI), and on a GPU each one
matches the float64 reference as production's kernels do (tests/kernels/test_cuda_kernels.py).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc")

from benchmarks import decode_variants as dv  # noqa: E402
from streamkv.kernels import decode_kernels as dk  # noqa: E402
from streamkv.kernels import launch, nvrtc  # noqa: E402
from streamkv.kernels.fp8 import FP8_CUDA_NAME, FP8_DTYPE  # noqa: E402

ARCHS = (80, 90)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STAGE_CASES = ((torch.bfloat16, 128), (torch.float32, 256), (torch.float16, 80))
RING_DEPTHS = (2, 3, 4, 6)
TC_DTYPES = (torch.float16, torch.bfloat16)
TC_HEADS = ((64, 8), (128, 16), (256, 32))  # (head size, block size)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def name(dtype: torch.dtype) -> str:
    return launch.DTYPE_NAMES[dtype]


@pytest.mark.parametrize("cache", [None, FP8_CUDA_NAME])
def test_default_variant_is_production(cache) -> None:
    # Same names, same programs, same shared memory: the benchmark's default row is production.
    for dtype in DTYPES:
        for head in dk.HEAD_SIZES:
            for block in dk.BLOCK_SIZES:
                for g in dk.GROUP_PADS:
                    d = name(dtype)
                    assert dv.decode_name(d, head, block, g, dv.PRODUCTION, cache) == (
                        dk.decode_name(d, head, block, g, cache)
                    )
                    assert dv.attention_names(d, head, block, (g,), dv.PRODUCTION, cache) == (
                        dk.attention_names(d, head, block, (g,), cache)
                    )
                    tc = dk.uses_tensor_cores(d, head, g)
                    for p in dk.PARTITION_SIZES:
                        assert dv.shared_mem(p, g, head, dtype, 0, tc) == dk.decode_smem(
                            p, g, head, tc
                        )


def test_ring_shared_memory() -> None:
    # bf16 head 128: 16 vectors a row, one per thread, 4 tokens per thread in each ring stage.
    assert dv.shared_mem(512, 8, 128, torch.bfloat16, 2, False) == (2 * 4 * 128 * 16 + 512 * 8 * 4)
    # fp32 head 256: 64 vectors a row, two per thread, so 2 tokens per thread per stage.
    assert dv.shared_mem(128, 1, 256, torch.float32, 4, False) == 4 * 2 * 2 * 128 * 16 + 1024 * 4


def test_kernel_kind_only_where_it_applies() -> None:
    assert dv.resolve_kernel("auto", "__nv_bfloat16", 128, 4) == "tensor_core"
    assert dv.resolve_kernel("auto", "__nv_bfloat16", 128, 1) == "cuda_core"
    assert dv.resolve_kernel("cuda_core", "__half", 128) == "cuda_core"
    with pytest.raises(ValueError, match="multiple of 64"):
        dv.resolve_kernel("tensor_core", "float", 128)
    with pytest.raises(ValueError, match="decode kernel"):
        dv.resolve_kernel("three_pass", "__half", 128)
    with pytest.raises(ValueError, match="unroll"):
        dv.decode_name("__half", 64, 16, 4, dv.DecodeVariant(unroll=5))


def variant_programs() -> list[tuple[str, ...]]:
    """Every variant the tests and the sweeps use, a program per (dtype, head, cache)."""
    programs = []
    for dtype, head in STAGE_CASES:
        variants = [dv.DecodeVariant(kernel="cuda_core", stages=s) for s in RING_DEPTHS]
        programs.append((name(dtype), head, 16, (8,), variants, None))
    for dtype in TC_DTYPES:
        for head, block in TC_HEADS:
            variants = [dv.DecodeVariant(warp_softmax=True)]
            variants += [dv.DecodeVariant(unroll=u) for u in dv.TC_UNROLLS]
            programs.append((name(dtype), head, block, (4, 8), variants, None))
    fp8 = [dv.DecodeVariant(stages=2), dv.DecodeVariant(warp_softmax=True, unroll=1)]
    programs.append(("__half", 128, 16, (1, 4), fp8, FP8_CUDA_NAME))
    return [
        tuple(dict.fromkeys(n for v in vs for n in dv.attention_names(d, h, b, g, v, cache)))
        for d, h, b, g, vs, cache in programs
    ]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_variants_compile(arch: int, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    jobs = variant_programs()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(
            pool.map(lambda names: nvrtc.compile_program(dk.ATTENTION_SOURCE, names, arch), jobs)
        )
    for names, compiled in zip(jobs, results, strict=True):
        assert set(compiled.lowered) == set(names)
        for mangled in compiled.lowered.values():
            assert mangled.encode() in compiled.image, f"{mangled} missing from the cubin"


# -- on a GPU: each variant against the float64 reference -----------------------------------
def case(dtype, head, block, group, lens, partition, seed, variant, **kw) -> float:
    from tests.kernels.test_cuda_kernels import attention_case

    run = partial(dv.launch_variant, variant)
    return attention_case(dtype, head, block, group, lens, partition, seed, launch=run, **kw)


def tolerance(dtype) -> float:
    from tests.kernels.test_cuda_kernels import TOLERANCE

    return TOLERANCE[dtype]


@cuda
@pytest.mark.parametrize("stages", (0, *RING_DEPTHS))
@pytest.mark.parametrize("dtype,head", STAGE_CASES, ids=str)
def test_ring_depths(dtype, head: int, stages: int) -> None:
    # fp32 head 256 at depth 6 needs more than 48 KiB of shared memory (the opt-in path).
    lens = [1, 700, 1500, 63]
    v = dv.DecodeVariant(kernel="cuda_core", stages=stages)
    err = case(dtype, head, 16, 8, lens, 512, stages, v)
    assert err <= tolerance(dtype), f"relative error {err:.2e}"


@cuda
@pytest.mark.parametrize("unroll", dv.TC_UNROLLS)
@pytest.mark.parametrize("head,block", TC_HEADS, ids=str)
@pytest.mark.parametrize("dtype", TC_DTYPES, ids=str)
def test_tensor_core_chunks_per_step(dtype, head: int, block: int, unroll: int) -> None:
    # Contexts that end inside a step (partial chunks, whole chunks past the context within a
    # step) and partitions of every size.
    lens = [1, 17, 100, 129, 700, 1025, 1500, 2100]
    v = dv.DecodeVariant(kernel="tensor_core", unroll=unroll)
    for group, partition in ((8, 128), (4, 512), (3, 1024), (2, 256), (8, None)):
        err = case(dtype, head, block, group, lens, partition, unroll * 10 + group + head, v)
        assert err <= tolerance(dtype), f"group {group}: relative error {err:.2e}"


@cuda
@pytest.mark.parametrize(
    "variant",
    [
        dv.DecodeVariant(kernel="tensor_core"),
        dv.DecodeVariant(kernel="tensor_core", warp_softmax=True),
        dv.DecodeVariant(kernel="cuda_core"),
    ],
    ids=["tensor_core", "warp_softmax", "cuda_core"],
)
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("head,block", TC_HEADS, ids=str)
@pytest.mark.parametrize("dtype", TC_DTYPES, ids=str)
def test_forced_kernel_kinds(dtype, head: int, block: int, group: int, variant) -> None:
    # Each kind where production would run the other (tensor cores at group 1, CUDA cores at
    # 4 and 8), and the per-warp softmax.
    lens = [1, block - 1, 511, 512, 513, 1100, 1500]
    err = case(dtype, head, block, group, lens, 512, group + head, variant)
    assert err <= tolerance(dtype), f"relative error {err:.2e}"


FUSED = [
    dv.DecodeVariant(fused_merge=True),
    dv.DecodeVariant(kernel="cuda_core", fused_merge=True),
    dv.DecodeVariant(kernel="tensor_core", warp_softmax=True, fused_merge=True),
]
FUSED_IDS = ["auto", "cuda_core", "warp_softmax"]


@cuda
@pytest.mark.parametrize("variant", FUSED, ids=FUSED_IDS)
@pytest.mark.parametrize("partition_size", [None, 128, 512, 1024])
def test_fused_merge_long_context_and_strided_query(partition_size, variant) -> None:
    # 20k tokens: 20-157 partitions for the last CTA of a column to merge; q is a view.
    lens = [20000, 3, 9000, 512]
    err = case(
        torch.bfloat16,
        128,
        16,
        4,
        lens,
        partition_size,
        7,
        variant,
        num_kv_heads=8,
        strided_query=True,
    )
    assert err <= tolerance(torch.bfloat16), f"relative error {err:.2e}"


@cuda
@pytest.mark.parametrize("variant", FUSED, ids=FUSED_IDS)
def test_fused_merge_empty_context_gives_zeros(variant) -> None:
    from tests.kernels.test_cuda_kernels import empty_context_case

    empty_context_case(4, partial(dv.launch_variant, variant))


@cuda
@pytest.mark.parametrize("variant", FUSED, ids=FUSED_IDS)
def test_fused_merge_counters_reset_across_launches_and_graph_replays(variant) -> None:
    # The counters: zeroed per launch (a memset node in the graph), left at zero by the
    # merging CTAs; the merge must be right on every launch and every replay.
    from tests.kernels.test_cuda_kernels import TOLERANCE, make_paged, reference, rel_err

    gen = torch.Generator(device="cuda").manual_seed(11)
    lens = [3000, 700, 129]
    key, value, tables = make_paged(lens, 2, 16, 128, torch.bfloat16, gen)
    query = torch.randn((3, 8, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref = reference(query, key, value, tables, lens_t, 0.08)
    out = torch.full_like(query, math.nan)

    def launch():
        dv.launch_variant(variant, query, key, value, tables, lens_t, 0.08, 3000, 128, out)

    for _ in range(3):
        out.fill_(math.nan)
        launch()
        assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        out.fill_(math.nan)
        graph.replay()
        assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@cuda
def test_fp8_cache_variant_matches_reference() -> None:
    # The cp.async ring over an fp8 cache (16 elements a vector); the caller folds the scales.
    from streamkv.kernels import ops
    from streamkv.kernels.fp8 import quantize

    gen = torch.Generator().manual_seed(3)
    k = quantize(torch.randn(256, 2, 16, 128, generator=gen), 0.5).cuda()
    v = quantize(torch.randn(256, 2, 16, 128, generator=gen), 0.5).cuda()
    assert k.dtype == FP8_DTYPE
    lens = torch.tensor([1, 300, 1500, 17], dtype=torch.int32).cuda()
    tables = torch.stack([torch.randperm(256, generator=gen)[:100] for _ in range(4)])
    tables = tables.int().cuda()
    q = torch.randn(4, 8, 128, generator=gen).half().cuda()
    out = dv.launch_variant(
        dv.DecodeVariant(kernel="cuda_core", stages=2), q, k, v, tables, lens, 0.5 / 128**0.5
    )
    ref = ops.paged_attention_decode_ref(q.double(), k, v, tables, lens, 128**-0.5, None, 0.5, 0.5)
    err = ((out.double() * 0.5 - ref).norm() / ref.norm()).item()
    assert err < 2e-3
