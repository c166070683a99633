"""Loading compiled programs and launching their kernels through the CUDA driver API.

A program from ``nvrtc.compile_program`` (cached on disk) is loaded into the device's
primary context, the one torch uses, and its kernels launch on torch's current stream, so
CUDA graph capture sees them. Kept apart from nvrtc.py so that compiling, which CI does for
every variant without a GPU, never touches the driver.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from functools import cache

from cuda.bindings import driver

from streamkv.kernels.nvrtc import Compiled, compile_program


class CUDADriverError(RuntimeError):
    """A CUDA driver call failed."""


def check(result: tuple) -> object:
    """Unwrap a cuda-python ``(status, *values)`` tuple, raising on a driver error."""
    status, values = result[0], result[1:]
    if status != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(status)
        raise CUDADriverError(f"CUDA driver error {name.decode() if name else status}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


class Kernel:
    """One loaded ``__global__`` function, launchable on a torch stream."""

    def __init__(self, function, name: str) -> None:
        self.function = function
        self.name = name
        self._occupancy: dict[tuple[int, int], int] = {}
        self._dynamic_smem_allowed = 0

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[tuple[type, object]],
        stream: int,
        shared_mem: int = 0,
        pdl: bool = False,
    ) -> None:
        """``args`` are (ctypes type, value) pairs in the kernel's parameter order.

        ``pdl``: programmatic dependent launch (sm_90+; kernels_cu/pdl.cuh): the kernel may
        start before the previous kernel on the stream ends, and must wait for it itself."""
        self._allow_shared_mem(shared_mem)
        holders = [ctype(value) for ctype, value in args]
        params = (ctypes.c_void_p * len(holders))(*(ctypes.addressof(h) for h in holders))
        if pdl:
            check(
                driver.cuLaunchKernelEx(
                    _pdl_config(grid, block, shared_mem, stream),
                    self.function,
                    ctypes.addressof(params),
                    0,
                )
            )
            return
        check(
            driver.cuLaunchKernel(
                self.function, *grid, *block, shared_mem, stream, ctypes.addressof(params), 0
            )
        )

    def _allow_shared_mem(self, shared_mem: int) -> None:
        # Static plus dynamic shared memory over 48 KiB needs the kernel's explicit opt-in;
        # raising the cap is cheap and harmless below it, so do it for any new maximum.
        if shared_mem > self._dynamic_smem_allowed:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(self.function, attr, shared_mem))
            self._dynamic_smem_allowed = shared_mem

    def occupancy(self, threads: int, shared_mem: int) -> int:
        """Resident CTAs per multiprocessor for this launch shape."""
        key = (threads, shared_mem)
        if key not in self._occupancy:
            self._allow_shared_mem(shared_mem)
            self._occupancy[key] = int(
                check(
                    driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        self.function, threads, shared_mem
                    )
                )
            )
        return self._occupancy[key]


def _pdl_config(grid, block, shared_mem: int, stream: int):
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream)
    config.attrs = [attr]
    config.numAttrs = 1
    return config


class Module:
    """A compiled program loaded into the primary context of one device."""

    def __init__(self, compiled: Compiled, device: int) -> None:
        _ensure_context(device)
        self.compiled = compiled
        self.handle = check(driver.cuModuleLoadData(compiled.image))
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            mangled = self.compiled.lowered[name]
            fn = check(driver.cuModuleGetFunction(self.handle, mangled.encode()))
            self._kernels[name] = Kernel(fn, name)
        return self._kernels[name]


def _ensure_context(device: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    check(driver.cuInit(0))
    current = check(driver.cuCtxGetCurrent())
    dev = check(driver.cuDeviceGet(device))
    primary = check(driver.cuDevicePrimaryCtxRetain(dev))
    if current is None or int(current) != int(primary):
        check(driver.cuCtxSetCurrent(primary))


_load_lock = threading.Lock()


@cache
def load(filename: str, names: tuple[str, ...], device: int, arch: int) -> Module:
    """Compile (or fetch from the disk cache) and load a program; one Module per device."""
    with _load_lock:
        return Module(compile_program(filename, names, arch), device)
