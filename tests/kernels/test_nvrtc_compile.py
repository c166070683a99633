"""Every program production loads compiles with NVRTC for sm_80 and sm_90; no GPU needed (runs
in CI). The decode kernels' experimental variants: tests/benchmarks/test_decode_variants.py."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from streamkv.kernels import cuda_ops, launch, nvrtc  # noqa: E402
from streamkv.kernels import decode_kernels as dk  # noqa: E402

ARCHS = (80, 90)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    return tmp_path


def _assert_complete(compiled: nvrtc.Compiled, names: tuple[str, ...]) -> None:
    assert set(compiled.lowered) == set(names)
    for mangled in compiled.lowered.values():
        assert mangled.encode() in compiled.image, f"{mangled} missing from the cubin"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", sorted(launch.DTYPE_NAMES.values()))
def test_attention_programs_compile(dtype: str, arch: int, fresh_cache) -> None:
    # One program per (dtype, head, block) holds every GQA padding and the reduce kernel, so
    # the front end runs once per program; NVRTC releases the GIL, so threads share the CPUs.
    # The other block sizes: test_nvrtc_compile_block_sizes.py.
    jobs = [
        dk.attention_names(dtype, head, block)
        for head in dk.HEAD_SIZES
        for block in dk.TUNED_BLOCK_SIZES
    ]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(
            pool.map(lambda names: nvrtc.compile_program(dk.ATTENTION_SOURCE, names, arch), jobs)
        )
    for names, compiled in zip(jobs, results, strict=True):
        _assert_complete(compiled, names)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", sorted(launch.DTYPE_NAMES.values()))
def test_fp8_cache_attention_programs_compile(dtype: str, arch: int, fresh_cache) -> None:
    # The fp8 cache's decode kernels for a `dtype` query, every head size; the block size only
    # addresses rows (the default programs compile every one of them).
    from streamkv.kernels.fp8 import FP8_CUDA_NAME

    jobs = [dk.attention_names(dtype, head, 16, cache=FP8_CUDA_NAME) for head in dk.HEAD_SIZES]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(
            pool.map(lambda names: nvrtc.compile_program(dk.ATTENTION_SOURCE, names, arch), jobs)
        )
    for names, compiled in zip(jobs, results, strict=True):
        assert all(name.endswith(f", {FP8_CUDA_NAME}>") for name in names if "reduce" not in name)
        _assert_complete(compiled, names)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_ops_compile(arch: int, fresh_cache) -> None:
    names = cuda_ops.cache_ops_names()
    _assert_complete(nvrtc.compile_program(cuda_ops.CACHE_OPS_SOURCE, names, arch), names)


def test_compile_error_carries_nvrtc_log(fresh_cache) -> None:
    # A bf16 head of 12 elements is not a whole number of 16-byte vectors: a static_assert.
    names = ("streamkv::paged_attention_decode_kernel<__nv_bfloat16, 12, 16, 4, 4>",)
    with pytest.raises(nvrtc.NVRTCError) as err:
        nvrtc.compile_program(dk.ATTENTION_SOURCE, names, 90)
    assert "multiple of 16 bytes" in str(err.value)
    assert "paged_attention.cu" in str(err.value)


@pytest.mark.slow
def test_disk_cache_is_reused(fresh_cache, monkeypatch) -> None:
    names = dk.attention_names("__half", 64, 16, (4,))
    first = nvrtc.compile_program(dk.ATTENTION_SOURCE, names, 90)
    assert list(fresh_cache.glob("*.bin")) and list(fresh_cache.glob("*.json"))

    def no_compile(*args, **kwargs):
        raise AssertionError("recompiled despite a cache entry")

    monkeypatch.setattr(nvrtc, "_compile", no_compile)
    again = nvrtc.compile_program(dk.ATTENTION_SOURCE, names, 90)
    assert again.image == first.image and again.lowered == first.lowered
    # Another architecture is another key.
    monkeypatch.undo()
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(fresh_cache))
    other = nvrtc.compile_program(dk.ATTENTION_SOURCE, names, 80)
    assert other.image != first.image
    assert len(list(fresh_cache.glob("*.bin"))) == 2


def test_cuda_headers_found() -> None:
    (include,) = nvrtc.cuda_include_dirs()
    assert os.path.isfile(os.path.join(include, "cuda_bf16.h"))
