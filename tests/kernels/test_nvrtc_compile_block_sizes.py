"""The decode kernels at the block sizes beyond the tuned ones (1, 2, 4, 64, 128, 256) compile
with NVRTC for sm_80 and sm_90; no GPU needed (runs in CI).

BLOCK only addresses a token's row and sizes the block-id array, so each size compiles every
kernel kind and GQA padding at the head sizes that stress the rest of the kernel: bf16 / 128
(both kernels, every padding), fp16 / 64 (tensor cores, the most chunks per step), fp16 / 80
(a row that is not a power-of-two number of vectors) and fp32 / 256 (the most registers).
The full (dtype, head, padding) matrix of the tuned sizes is test_nvrtc_compile.py's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from streamkv.kernels import decode_kernels as dk  # noqa: E402
from streamkv.kernels import nvrtc  # noqa: E402

ARCHS = (80, 90)
NEW_BLOCK_SIZES = tuple(b for b in dk.BLOCK_SIZES if b not in dk.TUNED_BLOCK_SIZES)
CASES = (
    ("__nv_bfloat16", 128, dk.GROUP_PADS),
    ("__half", 64, (2, 8)),
    ("__half", 80, (4,)),
    ("float", 256, (1, 8)),
)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    return tmp_path


def block_program(block: int) -> tuple[str, ...]:
    names = (n for d, h, g in CASES for n in dk.attention_names(d, h, block, g))
    return tuple(dict.fromkeys(names))


def test_new_sizes_are_the_rest_of_the_sweep() -> None:
    assert NEW_BLOCK_SIZES == (1, 2, 4, 64, 128, 256)
    assert dk.TUNED_BLOCK_SIZES == (8, 16, 32)


def test_every_kernel_kind_is_in_each_program() -> None:
    names = block_program(256)
    assert sum("decode_tc_kernel<" in n for n in names) == len(dk.GROUP_PADS) + 2
    assert sum("decode_kernel<" in n for n in names) == len(dk.GROUP_PADS) + 5
    assert all(", 256, " in n for n in names if "reduce" not in n)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_kernels_compile_at_every_new_block_size(arch: int, fresh_cache) -> None:
    jobs = [block_program(b) for b in NEW_BLOCK_SIZES]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(
            pool.map(lambda names: nvrtc.compile_program(dk.ATTENTION_SOURCE, names, arch), jobs)
        )
    for names, compiled in zip(jobs, results, strict=True):
        assert set(compiled.lowered) == set(names)
        for mangled in compiled.lowered.values():
            assert mangled.encode() in compiled.image, f"{mangled} missing from the cubin"


def test_a_block_that_does_not_divide_a_partition_is_a_compile_error(fresh_cache) -> None:
    # The launch code refuses it first (check_block_size); the kernel's static_assert is the
    # backstop for a name built by hand.
    names = (dk.decode_name("__half", 64, 48, 1),)
    with pytest.raises(nvrtc.NVRTCError) as err:
        nvrtc.compile_program(dk.ATTENTION_SOURCE, names, 90)
    assert "whole blocks" in str(err.value)
