"""The decode kernels' partition-size rule and kernel choice, on a made-up GPU (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cuda.bindings.driver")

from streamkv.kernels import decode_attention, decode_kernels, launch  # noqa: E402

SMS = 132


class FakeKernel:
    def __init__(self, per_sm: int) -> None:
        self.per_sm = per_sm

    def occupancy(self, threads: int, smem: int) -> int:
        return self.per_sm


@pytest.fixture(autouse=True)
def h200_like(monkeypatch):
    monkeypatch.setattr(launch, "sm_count", lambda index: SMS)
    monkeypatch.setattr(launch, "device_index", lambda device: 0)


def choose(per_sm: int, columns: int, context: int, long_waves: int, block: int = 16) -> int:
    return decode_attention.choose_partition_size(
        FakeKernel(per_sm), columns, context, block, lambda p: 0, torch.device("cpu"), long_waves
    )


@pytest.mark.parametrize(
    "batch,context,long_waves,want",
    [
        (64, 1024, 2, 1024),  # 512 CTAs: under one wave of 528, one partition per sequence
        (256, 1024, 2, 1024),  # 2048 CTAs, 3.9 waves: past the tensor-core kernel's 2
        (256, 1024, 8, 512),  # ... but inside the CUDA-core kernel's 1-8 wave gap
        (64, 16384, 8, 1024),  # 15.5 waves
        (16, 1024, 2, 256),  # 128 CTAs at 1024 would idle most of the GPU: 512 at 256
        (1, 1024, 2, 128),  # never enough CTAs: the shortest partition
    ],
)
def test_partition_rule(batch: int, context: int, long_waves: int, want: int) -> None:
    assert choose(4, batch * 8, context, long_waves) == want


def test_tail_of_a_second_wave_is_avoided() -> None:
    # 3 CTAs per multiprocessor (396 slots): 512 CTAs of 1024 tokens are 1.3 waves, so 512
    # tokens (1024 CTAs) are taken even for the tensor-core kernel.
    assert choose(3, 64 * 8, 1024, 2) == 512


def test_kernel_choice() -> None:
    # Tensor cores for fp16 / bf16, head sizes that are multiples of 64, 2+ heads per CTA.
    assert decode_kernels.uses_tensor_cores("__nv_bfloat16", 128, 8)
    assert not decode_kernels.uses_tensor_cores("__nv_bfloat16", 128, 1)
    assert decode_kernels.uses_tensor_cores("__half", 64, 2)
    assert decode_kernels.uses_tensor_cores("__half", 64, 4)
    assert decode_kernels.uses_tensor_cores("__half", 256, 8)
    assert not decode_kernels.uses_tensor_cores("float", 128, 8)
    assert not decode_kernels.uses_tensor_cores("__half", 80, 8)
    # Groups pad to a power of two up to 8; larger groups run in chunks of 8.
    assert [decode_kernels.group_pad(g) for g in (1, 2, 3, 5, 8, 12, 16)] == [1, 2, 4, 8, 8, 8, 8]


def test_one_kernel_per_case() -> None:
    # The defaults the kernels were tuned with: register loads on CUDA cores; on tensor cores
    # the per-CTA softmax and TC_UNROLL's chunks per step. fp8 adds the cache's type.
    name = decode_kernels.decode_name
    assert name("__nv_bfloat16", 128, 16, 4) == (
        "streamkv::paged_attention_decode_tc_kernel<__nv_bfloat16, 128, 16, 4, false, 2>"
    )
    assert name("__half", 64, 8, 2) == (
        "streamkv::paged_attention_decode_tc_kernel<__half, 64, 8, 2, false, 4>"
    )
    assert name("__half", 256, 32, 8, "__nv_fp8_e4m3") == (
        "streamkv::paged_attention_decode_tc_kernel<__half, 256, 32, 8, false, 1, __nv_fp8_e4m3>"
    )
    assert name("__nv_bfloat16", 128, 16, 1) == (
        "streamkv::paged_attention_decode_kernel<__nv_bfloat16, 128, 16, 1, 0>"
    )
    assert name("float", 80, 16, 4, "__nv_fp8_e4m3") == (
        "streamkv::paged_attention_decode_kernel<float, 80, 16, 4, 0, __nv_fp8_e4m3>"
    )
    # The program holds the case's kernel, the other kind at the same padding, and the merge.
    names = decode_kernels.attention_names("__nv_bfloat16", 128, 16, (4,))
    assert names == (
        "streamkv::paged_attention_decode_kernel<__nv_bfloat16, 128, 16, 4, 0>",
        name("__nv_bfloat16", 128, 16, 4),
        "streamkv::paged_attention_reduce_kernel<__nv_bfloat16, 128>",
    )


@pytest.mark.parametrize("block", decode_kernels.BLOCK_SIZES)
def test_partition_holds_whole_blocks_at_every_block_size(block: int) -> None:
    # One sequence never fills the GPU, so the rule falls to its shortest allowed partition:
    # 128 tokens, except at block 256, whose shortest whole-block partition is 256.
    got = choose(4, 8, 1024, 2, block)
    assert got % block == 0
    assert got == max(128, block)


@pytest.mark.parametrize("block", [0, 3, 12, 48, 512, 1024])
def test_decode_refuses_other_block_sizes(block: int) -> None:
    with pytest.raises(ValueError, match="block size must be a power of two from 1 to 256"):
        decode_kernels.check_block_size(block)


def test_kernel_block_sizes_are_the_engines() -> None:
    # config.py (a leaf) states the sizes the engine accepts, decode_kernels.py the ones the
    # kernels instantiate: one fact in two packages that may not import each other.
    from streamkv.config import BLOCK_SIZES

    assert decode_kernels.BLOCK_SIZES == BLOCK_SIZES
