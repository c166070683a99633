"""Run-time compilation of ``kernels_cu/*.cu`` with NVRTC, a cubin cache, and launches.

Kernels are compiled for the exact architecture of the device (sm_90 on an H200) and for
the exact template arguments in use (dtype, head size, block size...), which NVRTC
instantiates from name expressions. Cubins are cached on disk under
``$STREAMKV_CACHE_DIR`` (default ``~/.cache/streamkv/kernels``), keyed by the sources, the
options, the architecture and the NVRTC version, so a process pays for compilation once per
configuration per machine. Modules are loaded and launched through the driver API on
torch's current stream. Compilation needs no GPU, which is how CI checks every variant.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import site
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from cuda.bindings import driver, nvrtc

# Shipped in the package as streamkv/kernels_cu (setup.py); the repository's kernels_cu/ in a
# checkout.
_PACKAGED = Path(__file__).resolve().parents[1] / "kernels_cu"
KERNELS_DIR = (
    _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[2] / "kernels_cu"
)
_BASE_OPTIONS = ("-std=c++17", "-DNDEBUG")


class NVRTCError(RuntimeError):
    """NVRTC rejected a program; the message carries NVRTC's log."""


class CUDADriverError(RuntimeError):
    """A CUDA driver call failed."""


@dataclass(frozen=True, slots=True)
class Compiled:
    image: bytes  # cubin, or PTX when NVRTC is older than the device
    lowered: dict[str, str]  # name expression -> mangled kernel name
    log: str


def check(result: tuple) -> object:
    """Unwrap a cuda-python ``(status, *values)`` tuple, raising on a driver error."""
    status, values = result[0], result[1:]
    if status != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(status)
        raise CUDADriverError(f"CUDA driver error {name.decode() if name else status}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _nvrtc_check(result: tuple, prog=None) -> object:
    status, values = result[0], result[1:]
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = program_log(prog) if prog is not None else ""
        raise NVRTCError(f"NVRTC error {status.name}\n{log}")
    return values[0] if len(values) == 1 else (values or None)


def program_log(prog) -> str:
    size = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(prog))
    buf = b" " * size
    _nvrtc_check(nvrtc.nvrtcGetProgramLog(prog, buf))
    return buf.rstrip(b"\x00 ").decode(errors="replace")


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    major, minor = _nvrtc_check(nvrtc.nvrtcVersion())
    return int(major), int(minor)


@lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    return tuple(int(a) for a in _nvrtc_check(nvrtc.nvrtcGetSupportedArchs()))


@lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding cuda_fp16.h / cuda_bf16.h, from the CUDA runtime wheel first."""
    found: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        d = find_nvidia_header_directory("cudart")
        if d:
            found.append(d)
    except Exception:  # an older cuda-pathfinder, or none: fall back to looking ourselves
        pass
    if not found:
        roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
        for root in roots:
            # nvidia/cu13/include (CUDA 13 wheels) or nvidia/cuda_runtime/include (CUDA 12).
            for header in sorted(
                glob.glob(os.path.join(root, "nvidia", "*", "include", "cuda_fp16.h"))
            ):
                found.append(os.path.dirname(header))
        for env in ("CUDA_HOME", "CUDA_PATH"):
            if os.environ.get(env):
                found.append(os.path.join(os.environ[env], "include"))
        found.append("/usr/local/cuda/include")
    dirs = [d for d in dict.fromkeys(found) if os.path.isfile(os.path.join(d, "cuda_fp16.h"))]
    if not dirs:
        raise NVRTCError(
            "CUDA headers (cuda_fp16.h) not found: install the nvidia-cuda-runtime wheel "
            "(pip install 'streamkv[cuda]') or set CUDA_HOME"
        )
    return tuple(dirs[:1])


def cache_dir() -> Path:
    return Path(os.environ.get("STREAMKV_CACHE_DIR") or Path.home() / ".cache/streamkv/kernels")


def _target(arch: int) -> tuple[str, bool]:
    """(NVRTC --gpu-architecture value, whether the result is a cubin)."""
    if arch in supported_archs():
        return f"sm_{arch}", True
    older = [a for a in supported_archs() if a <= arch]
    if not older:
        raise NVRTCError(f"NVRTC {nvrtc_version()} cannot target sm_{arch}")
    # A device newer than this NVRTC: emit PTX for the newest known arch; the driver JITs it.
    return f"compute_{max(older)}", False


def _sources_digest(filename: str) -> str:
    h = hashlib.sha256()
    for path in [KERNELS_DIR / filename, *sorted(KERNELS_DIR.glob("*.cuh"))]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def compile_program(
    filename: str, names: Sequence[str], arch: int, options: Sequence[str] = ()
) -> Compiled:
    """Compile ``kernels_cu/<filename>`` instantiating ``names`` for ``sm_<arch>``, cached."""
    target, is_cubin = _target(arch)
    opts = [
        f"--gpu-architecture={target}",
        *_BASE_OPTIONS,
        *(f"-I{d}" for d in (str(KERNELS_DIR), *cuda_include_dirs())),
        *options,
    ]
    key_src = json.dumps(
        [_sources_digest(filename), filename, list(names), opts, nvrtc_version()]
    ).encode()
    key = hashlib.sha256(key_src).hexdigest()[:40]
    root = cache_dir()
    image_path, meta_path = root / f"{key}.bin", root / f"{key}.json"
    if image_path.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            return Compiled(image_path.read_bytes(), meta["lowered"], meta["log"])
        except (OSError, ValueError, KeyError):
            pass  # a damaged entry is rebuilt below
    compiled = _compile(filename, names, opts, is_cubin)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _atomic_write(image_path, compiled.image)
        meta = {"lowered": compiled.lowered, "log": compiled.log, "options": opts}
        _atomic_write(meta_path, json.dumps(meta).encode())
    except OSError:
        pass  # a read-only cache only costs recompilation
    return compiled


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _compile(filename: str, names: Sequence[str], opts: list[str], is_cubin: bool) -> Compiled:
    source = (KERNELS_DIR / filename).read_bytes()
    prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(source, filename.encode(), 0, [], []))
    try:
        for name in names:
            _nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), prog)
        encoded = [o.encode() for o in opts]
        status = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)[0]
        log = program_log(prog)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NVRTCError(
                f"NVRTC failed to compile {filename} ({status.name}) with {' '.join(opts)}:\n{log}"
            )
        if is_cubin:
            size = _nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), prog)
            image = b" " * size
            _nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, image), prog)
        else:
            size = _nvrtc_check(nvrtc.nvrtcGetPTXSize(prog), prog)
            image = b" " * size
            _nvrtc_check(nvrtc.nvrtcGetPTX(prog, image), prog)
        lowered = {
            n: _nvrtc_check(nvrtc.nvrtcGetLoweredName(prog, n.encode()), prog).decode()
            for n in names
        }
        return Compiled(image, lowered, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


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
