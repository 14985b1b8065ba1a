"""NVRTC through ctypes: compiles the CUDA kernels with no GPU and no CuPy.

The GPU backend needs CuPy to launch kernels, but building them needs only the NVRTC
library (``nvidia-cuda-nvrtc-cu12`` on PyPI, or a CUDA toolkit's ``libnvrtc.so``). Binding
the dozen C functions used here keeps CPU machines (and CI) able to catch kernel build
errors without installing CuPy.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
from pathlib import Path

from ..errors import CodecError

__all__ = ["NvrtcError", "compile_program", "supported_archs", "version"]


class NvrtcError(CodecError):
    """NVRTC is missing or refused a call; a failed compile carries NVRTC's log."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message if not log else f"{message}:\n{log}")
        self.log = log


def _candidates() -> list[str]:
    found = []
    # The PyPI wheels: nvidia/cuda_nvrtc/lib/ (CUDA 12), nvidia/cu13/lib/ (CUDA 13).
    for module in ("nvidia.cuda_nvrtc", "nvidia.cu13"):
        try:
            pkg = importlib.import_module(module)
        except ImportError:
            continue
        for root in pkg.__path__:
            lib = Path(root) / "lib"
            found += [str(p) for p in sorted(lib.glob("libnvrtc.so*")) if ".alt." not in p.name]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += [str(Path(cuda_home) / "lib64" / "libnvrtc.so")]
    return [*found, "libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"]


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    tried = []
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            tried.append(f"{name}: {exc}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        return lib
    raise NvrtcError(
        "NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12, or set CUDA_HOME); "
        "tried " + "; ".join(tried)
    )


def _check(result: int, call: str, log: str = "") -> None:
    if result != 0:
        text = _lib().nvrtcGetErrorString(result).decode(errors="replace")
        raise NvrtcError(f"{call} failed: {text} ({result})", log)


def version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_lib().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def supported_archs() -> list[int]:
    """The ``sm_XY`` numbers this NVRTC can build cubins for (e.g. 90 for sm_90)."""
    lib = _lib()
    n = ctypes.c_int()
    _check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * n.value)()
    _check(lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return list(archs)


def _strings(items: list[str]) -> ctypes.Array:
    return (ctypes.c_char_p * len(items))(*(s.encode() for s in items))


def _read(lib: ctypes.CDLL, prog: ctypes.c_void_p, what: str) -> bytes:
    size = ctypes.c_size_t()
    _check(getattr(lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)), f"nvrtcGet{what}Size")
    buf = ctypes.create_string_buffer(size.value)
    _check(getattr(lib, f"nvrtcGet{what}")(prog, buf), f"nvrtcGet{what}")
    return buf.raw


def compile_program(source: str, name: str, arch: str, options: list[str]) -> bytes:
    """Compile ``source`` for ``arch``: a cubin for ``sm_XY``, PTX for ``compute_XY``.

    Raises :class:`NvrtcError` (a :class:`CodecError`) with NVRTC's log on a build error.
    """
    lib = _lib()
    prog = ctypes.c_void_p()
    _check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        flags = [f"--gpu-architecture={arch}", *options]
        if lib.nvrtcCompileProgram(prog, len(flags), _strings(flags)) != 0:
            log = _read(lib, prog, "ProgramLog").rstrip(b"\0").decode(errors="replace")
            raise NvrtcError(f"NVRTC cannot build {name} for {arch}", log)
        # PTX keeps its NUL: cuModuleLoadData reads it as a C string.
        return _read(lib, prog, "CUBIN" if arch.startswith("sm_") else "PTX")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
