"""CUDA launch of the sampler's per-row kernel (kernels_cu/sampling.cu): one CTA per draw
over the whole vocabulary, reading the logits in their own dtype. A draw is GREEDY (argmax
and its logprob), SAMPLE (the exponential race, top-p rounds and min-p inside the kernel) or
SCORE (the logprob of a token already in ``chosen``, e.g. a top-k row's); see the .cu file.

No host sync: the draw table crosses in one pinned copy, unseeded rows' key bases come from
the caller's torch generator on the device, and ``chosen`` is final when the kernel ends."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from streamkv.kernels import cuda_driver, launch
from streamkv.kernels.launch import INT, LONG, PTR

SAMPLING_SOURCE = "sampling.cu"
GREEDY, SAMPLE, SCORE = 0, 1, 2
UNSEEDED = 4  # a flag on SAMPLE: the key base comes from the generator, not the table
THREADS = 512  # the kernel's launch bound: two CTAs (rows) per SM at 64 registers a thread
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FIELDS = 8  # int32 words per draw: row, mode, base lo/hi, temperature, top_p, min_p, pad


def kernel_name(dtype: str) -> str:
    return f"streamkv::sampling::sample_kernel<{dtype}>"


def sampling_names() -> tuple[str, ...]:
    """Name expressions of the one program: the kernel for every logits dtype."""
    return tuple(kernel_name(launch.DTYPE_NAMES[t]) for t in DTYPES)


@lru_cache(maxsize=16)
def _kernel(dtype: str, device: int) -> cuda_driver.Kernel:
    module = launch.module(SAMPLING_SOURCE, sampling_names(), torch.device("cuda", device))
    return module.kernel(kernel_name(dtype))


def load(device: torch.device) -> None:
    """Compile (or fetch from the disk cache) and load the program now, so that no step pays
    for it: a first compile takes seconds, and step times feed the prefill cap's fit."""
    for t in DTYPES:
        _kernel(launch.DTYPE_NAMES[t], launch.device_index(device))


def draw_table(
    rows: list[int],
    modes: list[int],
    temperatures: list[float],
    top_ps: list[float],
    min_ps: list[float],
    bases: np.ndarray,
) -> torch.Tensor:
    """The kernel's per-draw records (int32 [draws, 8], on the host): ``bases`` are uint64
    (stream_hash.stream_bases; anything for rows without a seed)."""
    n = len(rows)
    table = np.zeros((n, _FIELDS), dtype=np.int32)
    table[:, 0] = rows
    table[:, 1] = modes
    table[:, 2:4] = np.ascontiguousarray(bases, dtype=np.uint64).view(np.int32).reshape(n, 2)
    floats = np.array([temperatures, top_ps, min_ps], dtype=np.float32).T
    table[:, 4:7] = np.ascontiguousarray(floats).view(np.int32)
    return torch.from_numpy(table)


def threads_for(vocab: int, dtype: torch.dtype) -> int:
    vectors = -(-vocab * torch.finfo(dtype).bits // 128)
    return min(THREADS, max(32, -(-vectors // 32) * 32))


def sample(
    logits: torch.Tensor,
    table: torch.Tensor,
    chosen: torch.Tensor,
    random_bases: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs the draws of ``table`` (draw_table's, already on the logits' device) over
    ``logits`` [rows, vocab] (unit stride along the vocabulary): writes the GREEDY and SAMPLE
    tokens into ``chosen`` (int64 [draws]) and returns every draw's logprob (float32).
    ``random_bases`` (int64 [draws]): the key bases of UNSEEDED draws."""
    draws, vocab = table.shape[0], logits.shape[1]
    if logits.dtype not in DTYPES or logits.stride(1) != 1:
        raise ValueError(f"sampling kernel: logits {logits.dtype} with strides {logits.stride()}")
    if chosen.shape != (draws,) or chosen.dtype != torch.int64 or not chosen.is_contiguous():
        raise ValueError(
            f"sampling kernel: chosen {chosen.dtype} {tuple(chosen.shape)} for {draws} draws"
        )
    logprobs = torch.empty(draws, dtype=torch.float32, device=logits.device)
    if draws == 0:
        return logprobs
    dev = logits.device
    _kernel(launch.DTYPE_NAMES[logits.dtype], launch.device_index(dev)).launch(
        (draws, 1, 1),
        (threads_for(vocab, logits.dtype), 1, 1),
        [
            (PTR, logits.data_ptr()),
            (LONG, logits.stride(0)),
            (INT, vocab),
            (PTR, table.data_ptr()),
            (PTR, 0 if random_bases is None else random_bases.data_ptr()),
            (PTR, chosen.data_ptr()),
            (PTR, logprobs.data_ptr()),
        ],
        launch.stream(dev),
        pdl=launch.use_pdl(dev),
    )
    return logprobs
