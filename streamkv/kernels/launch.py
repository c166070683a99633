"""What every CUDA launch module shares: the dtype names the .cu templates take, ctypes
argument types, the device's arch / index / multiprocessor count, the current torch stream,
and loading a program through ``cuda_driver.load`` (compiled once, cached on disk).

The lru_caches here memoise facts of a device that never change while the process runs.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from streamkv.kernels import cuda_driver

DTYPE_NAMES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}

# Kernel argument types for cuda_driver.Kernel.launch.
PTR, INT, LONG, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float


# Launch the kernels written for it (kernels_cu/pdl.cuh) with programmatic dependent launch
# where the device has it: a kernel then starts while the one before it drains (the decode
# step at batch 1 is ~400 short kernels; docs/kernels.md, "Decode GEMV").
PDL = True


def arch(device: torch.device) -> int:
    return _arch(device_index(device))


@lru_cache(maxsize=64)
def _arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def use_pdl(device: torch.device) -> bool:
    return PDL and arch(device) >= 90


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def module(source: str, names: tuple[str, ...], device: torch.device) -> cuda_driver.Module:
    return cuda_driver.load(source, names, device_index(device), arch(device))


def stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def aligned16(t: torch.Tensor) -> bool:
    """The data pointer and every stride but the last are multiples of 16 bytes."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])


@lru_cache(maxsize=64)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
