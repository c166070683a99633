"""Run-time compilation of ``kernels_cu/*.cu`` with NVRTC, and the on-disk cubin cache.

Kernels are compiled for the exact architecture of the device (sm_90 on an H200) and for
the exact template arguments in use (dtype, head size, block size...), which NVRTC
instantiates from name expressions. Cubins are cached on disk under
``$STREAMKV_CACHE_DIR`` (default ``~/.cache/streamkv/kernels``), keyed by the sources, the
options, the architecture and the NVRTC version, so a process pays for compilation once per
configuration per machine. Compilation needs no GPU, which is how CI checks every variant;
loading and launching the result is ``cuda_driver.py``'s.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import site
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cuda.bindings import nvrtc

# Shipped in the package as streamkv/kernels_cu (setup.py); the repository's kernels_cu/ in a
# checkout.
_PACKAGED = Path(__file__).resolve().parents[1] / "kernels_cu"
KERNELS_DIR = (
    _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[2] / "kernels_cu"
)
_BASE_OPTIONS = ("-std=c++17", "-DNDEBUG")


class NVRTCError(RuntimeError):
    """NVRTC rejected a program; the message carries NVRTC's log."""


@dataclass(frozen=True, slots=True)
class Compiled:
    image: bytes  # cubin, or PTX when NVRTC is older than the device
    lowered: dict[str, str]  # name expression -> mangled kernel name
    log: str


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
