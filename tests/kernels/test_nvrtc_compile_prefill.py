"""Every prefill attention variant compiles with NVRTC for sm_80 and sm_90; no GPU needed
(runs in CI)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from streamkv.kernels import nvrtc, prefill  # noqa: E402

ARCHS = (80, 90)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_variants_compile(arch: int, fresh_cache) -> None:
    # One program per (dtype, head size) holds every head packing; NVRTC drops the GIL.
    from streamkv.kernels.fp8 import FP8_CUDA_NAME

    jobs = [
        prefill.program_names(dtype, head, cache=cache)
        for dtype in prefill.DTYPE_NAMES.values()
        for head in prefill.HEAD_SIZES
        for cache in (None, FP8_CUDA_NAME)  # a cache of the query's dtype, and the fp8 cache
    ]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda n: nvrtc.compile_program(prefill.SOURCE, n, arch), jobs))
    for names, compiled in zip(jobs, results, strict=True):
        assert set(compiled.lowered) == set(names)
        for mangled in compiled.lowered.values():
            assert mangled.encode() in compiled.image, f"{mangled} missing from the cubin"


def test_every_model_head_size_has_a_tile() -> None:
    # The decode kernels' head sizes are the model zoo's; prefill must cover each of them.
    from streamkv.kernels import decode_kernels

    assert set(decode_kernels.HEAD_SIZES) <= set(prefill.TILES)
    for head, tile in prefill.TILES.items():
        assert tile.rows % max(prefill.HEAD_PACKS) == 0
        assert tile.shared_bytes(head) <= 227 * 1024  # sm_90's opt-in limit per CTA
        assert tile.shared_bytes(head) < tile.shared_bytes(head, fp8=True) <= 227 * 1024


def test_head_pack_divides_the_group() -> None:
    assert [prefill.head_pack(g) for g in (1, 2, 3, 4, 6, 7, 8, 16)] == [1, 2, 1, 4, 2, 1, 8, 8]


def test_unsupported_head_size_is_a_compile_error(fresh_cache) -> None:
    names = ("streamkv::prefill::paged_prefill_kernel<__half, 72, 1, 4, 2, 64>",)
    with pytest.raises(nvrtc.NVRTCError) as err:
        nvrtc.compile_program(prefill.SOURCE, names, 90)
    assert "multiple of 16" in str(err.value)
