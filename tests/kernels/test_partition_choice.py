"""The decode kernels' partition-size rule and kernel choice, on a made-up GPU (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cuda.bindings.driver")

from streamkv.kernels import decode_attention, decode_variants, launch  # noqa: E402

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
    assert decode_variants.resolve_kernel("auto", "__nv_bfloat16", 128) == "tensor_core"
    assert decode_variants.resolve_kernel("auto", "__nv_bfloat16", 128, gpad=1) == "cuda_core"
    assert decode_variants.resolve_kernel("auto", "__half", 64, gpad=2) == "tensor_core"
    assert decode_variants.resolve_kernel("auto", "__half", 64, gpad=4) == "tensor_core"
    assert decode_variants.resolve_kernel("auto", "__half", 256, gpad=8) == "tensor_core"
    assert decode_variants.resolve_kernel("auto", "float", 128) == "cuda_core"
    assert decode_variants.resolve_kernel("auto", "__half", 80) == "cuda_core"
    assert decode_variants.resolve_kernel("cuda_core", "__half", 128) == "cuda_core"
    with pytest.raises(ValueError, match="multiple of 64"):
        decode_variants.resolve_kernel("tensor_core", "float", 128)
    with pytest.raises(ValueError, match="decode kernel"):
        decode_variants.resolve_kernel("three_pass", "__half", 128)


@pytest.mark.parametrize("block", decode_variants.BLOCK_SIZES)
def test_partition_holds_whole_blocks_at_every_block_size(block: int) -> None:
    # One sequence never fills the GPU, so the rule falls to its shortest allowed partition:
    # 128 tokens, except at block 256, whose shortest whole-block partition is 256.
    got = choose(4, 8, 1024, 2, block)
    assert got % block == 0
    assert got == max(128, block)


@pytest.mark.parametrize("block", [0, 3, 12, 48, 512, 1024])
def test_decode_refuses_other_block_sizes(block: int) -> None:
    with pytest.raises(ValueError, match="block size must be a power of two from 1 to 256"):
        decode_variants.check_block_size(block)
