"""CUDA launch of the token-mask ban (kernels_cu/token_mask.cu): one kernel for every masked
row of a step, in place of torch's unpack / compare / fill (three launches and their host
overhead, which is what a small model's step is made of; docs/benchmarks.md, "Structured
outputs")."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from cuda.bindings import driver

from streamkv.kernels import cuda_driver, launch
from streamkv.kernels.launch import INT, LONG, PTR

SOURCE = "token_mask.cu"
NAME = "streamkv::ban_outside_mask_kernel<float>"
THREADS = 256
TOKENS_PER_THREAD = 4


@lru_cache(maxsize=16)
def _kernel(device: int) -> cuda_driver.Kernel:
    return launch.module(SOURCE, (NAME,), torch.device("cuda", device)).kernel(NAME)


def ban_outside_masks(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor | None) -> None:
    """``logits`` float32 [batch, vocab] (rows contiguous), ``words`` int32 [n, num_words] on
    its device, ``rows`` int32 [n] (None: rows 0..n-1): ban, in place, every token of logits
    row rows[i] whose bit in words[i] is clear."""
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("the token-mask kernel takes float32 logits with contiguous rows")
    n, num_words = words.shape
    vocab = logits.shape[1]
    if n == 0:
        return
    blocks = -(-vocab // (THREADS * TOKENS_PER_THREAD))
    _kernel(launch.device_index(logits.device)).launch(
        (blocks, n, 1),
        (THREADS, 1, 1),
        [
            (PTR, logits.data_ptr()),
            (PTR, words.data_ptr()),
            (PTR, rows.data_ptr() if rows is not None else 0),
            (LONG, logits.stride(0)),
            (INT, num_words),
            (INT, vocab),
        ],
        launch.stream(logits.device),
    )


class BanLaunch:
    """``ban_outside_masks`` for one persistent words / rows buffer (layers/token_mask.py):
    the kernel and its argument block are made once, a call sets the logits pointer and the
    row count. Building a launch's ctypes arguments costs the host microseconds a step, which
    is what a small model's structured step is made of."""

    def __init__(
        self,
        device: torch.device,
        words: torch.Tensor,
        rows: torch.Tensor,
        vocab: int,
        row_stride: int,
    ) -> None:
        self.key = (words.data_ptr(), rows.data_ptr(), words.shape[1], vocab, row_stride)
        self.function = _kernel(launch.device_index(device)).function
        self.blocks = -(-vocab // (THREADS * TOKENS_PER_THREAD))
        self._logits = PTR(0)
        self._args = [
            self._logits,
            PTR(words.data_ptr()),
            PTR(rows.data_ptr()),
            LONG(row_stride),
            INT(words.shape[1]),
            INT(vocab),
        ]  # kept: the params block points at them
        self._params = (ctypes.c_void_p * len(self._args))(
            *(ctypes.addressof(a) for a in self._args)
        )

    def __call__(self, logits: torch.Tensor, n: int) -> None:
        """Ban logits row rows[r] outside words[r], r < ``n`` (the buffer's first rows)."""
        if n == 0:
            return
        self._logits.value = logits.data_ptr()
        cuda_driver.check(
            driver.cuLaunchKernel(
                self.function,
                self.blocks,
                n,
                1,
                THREADS,
                1,
                1,
                0,
                launch.stream(logits.device),
                ctypes.addressof(self._params),
                0,
            )
        )
