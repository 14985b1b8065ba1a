"""GPU backend: the CUDA kernels of ``kernels/quantize.cu`` driven through CuPy.

The kernels compute the function of :mod:`.reference` byte for byte (explicit
round-to-nearest float32 intrinsics, compiled with ``--fmad=false --ftz=false``). They are
compiled lazily with NVRTC on first use (a cubin for the GPU's architecture, cached on disk
where :func:`_cache_dir` says) and loaded once per device; importing this module does
not import CuPy, so the build and the launch planning below are usable, and tested,
without a GPU.

Every launch goes through a *runner* (:class:`CupyRunner` here; the tests use a CPU
emulation of the same kernels) that takes the kernel name, grid, block and the arguments
already converted to the exact C types of :data:`SIGNATURES`. Pointers are passed as
64-bit addresses, so a segment may start at any byte of a larger buffer. Work is queued on
CuPy's current stream of the arrays' device; nothing here synchronizes except
:func:`~cgx_ucx.compression.codec.read_header`'s 24-byte device-to-host copy in decode.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import math
import os
import threading
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..arrays import BFLOAT16
from ..config import read_env
from ..errors import CodecError
from . import kernels, nvrtc
from .codec import HEADER_NBYTES, CodecHeader
from .reference import seed_key

__all__ = [
    "KERNELS",
    "NVRTC_OPTIONS",
    "SIGNATURES",
    "CupyRunner",
    "compile_kernels",
    "decode_add_into",
    "decode_into",
    "empty_bytes",
    "empty_values",
    "encode_into",
    "kernel_source",
]

SOURCE = "quantize.cu"
#: NVRTC options: IEEE float32 everywhere, so codes equal the CPU's bit for bit.
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true",
                 "--prec-sqrt=true")  # fmt: skip
#: Threads per block (CGX_BLOCK in the source: 8 warps).
BLOCK = 256
#: Values per encode block: 8 warps x 1024 values, so buckets up to 1024 values get a warp
#: each and the tile (32 KiB of float32) is still in L1 when the codes are packed.
TILE_VALUES = 8192
#: CGX_MAX_TILE_BUCKETS in the source (shared memory: 4 KiB of meta per block).
MAX_TILE_BUCKETS = 512
#: Grid-stride kernels use at most this many blocks per SM (enough to saturate HBM).
BLOCKS_PER_SM = 8

#: C argument types per kernel kind: P pointer (as a 64-bit address), q int64, i int32,
#: Q uint64. Must match the extern "C" signatures in kernels/quantize.cu.
SIGNATURES = {
    "encode": "PqiqiiQPqQQQ",  # x, n, bits, bucket, tile_buckets, stochastic, key, buf,
    #                            codes_off, header words 0..2
    "decode": "PqqiqP",  # buf, codes_off, n, bits, bucket, out
    "raw": "PqP",  # src, n, out
    "header": "PQQQ",  # buf, header words 0..2
}
_CTYPES = {"P": np.uint64, "Q": np.uint64, "q": np.int64, "i": np.int32}

_DT_NAMES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", BFLOAT16: "bf16"}
_OUT_NAMES = {**_DT_NAMES, np.dtype(np.float64): "f64"}


def _kernel_table() -> dict[str, str]:
    table = {f"cgx_encode_{d}": "encode" for d in ("f32", "f16", "bf16")}
    table |= {f"cgx_decode_{o}": "decode" for o in ("f32", "f16", "bf16", "f64", "add")}
    for src in ("f32", "f16", "bf16"):
        for dst in ("f32", "f16", "bf16", "f64", "add"):
            for al in ("a", "u"):
                table[f"cgx_raw_{src}_{dst}_{al}"] = "raw"
    table["cgx_write_header"] = "header"
    return table


#: Every kernel of the source and its kind (a key of SIGNATURES).
KERNELS: dict[str, str] = _kernel_table()


def kernel_source(name: str = SOURCE) -> str:
    """The CUDA source: from the installed ``cgx_ucx.kernels`` package, else the checkout."""
    try:
        res = importlib.resources.files("cgx_ucx.kernels").joinpath(name)
        if res.is_file():
            return res.read_text()
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    path = Path(__file__).resolve().parents[2] / "kernels" / name
    try:
        return path.read_text()
    except OSError as exc:
        raise CodecError(f"CUDA source {name} not found (package data or {path})") from exc


def typed_args(name: str, args: tuple[int, ...]) -> tuple[Any, ...]:
    """``args`` as NumPy scalars of the kernel's C types (CuPy passes them by size)."""
    sig = SIGNATURES[KERNELS[name]]
    if len(sig) != len(args):
        raise AssertionError(f"{name} takes {len(sig)} arguments, got {len(args)}")
    return tuple(_CTYPES[c](a) for c, a in zip(sig, args, strict=True))


class Runner(Protocol):
    """Launches kernels by name; :class:`CupyRunner` on a GPU, an emulator in tests."""

    max_grid: int

    def launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> None: ...

    def ptr(self, a: Any) -> int: ...

    def copy(self, dst: int, src: int, nbytes: int) -> None: ...


# ---------------------------------------------------------------------------------------
# planning (pure Python)


def header_words(hdr: CodecHeader) -> tuple[int, int, int]:
    """The 24 header bytes as three little-endian uint64 kernel arguments."""
    raw = hdr.pack()
    return tuple(int.from_bytes(raw[i : i + 8], "little") for i in (0, 8, 16))  # type: ignore[return-value]


def encode_plan(hdr: CodecHeader) -> tuple[int, int]:
    """(grid, tile_buckets): tiles of whole buckets that start on a code byte."""
    bsize = hdr.bucket_size
    k = 8 // math.gcd(bsize, 8)  # buckets per code-byte-aligned chunk
    tile = max(1, TILE_VALUES // bsize)
    tile = min(-(-tile // k) * k, MAX_TILE_BUCKETS)  # 512 is a multiple of every k
    return -(-hdr.nbuckets // tile), tile


def _grid(work_items: int, max_grid: int) -> int:
    return max(1, min(-(-work_items // BLOCK), max_grid))


# ---------------------------------------------------------------------------------------
# the backend, generic over the runner


def encode_with_runner(run: Runner, x: Any, hdr: CodecHeader, seed: int, buf: Any) -> None:
    h = header_words(hdr)
    bufp = run.ptr(buf)
    n = hdr.numel
    if hdr.raw or n == 0:
        run.launch("cgx_write_header", 1, 32, typed_args("cgx_write_header", (bufp, *h)))
        if hdr.raw and n:
            run.copy(bufp + HEADER_NBYTES, run.ptr(x), n * hdr.dtype.itemsize)
        return
    grid, tile = encode_plan(hdr)
    name = f"cgx_encode_{_DT_NAMES[hdr.dtype]}"
    args = (run.ptr(x), n, hdr.bits, hdr.bucket_size, tile, int(hdr.stochastic),
            seed_key(seed), bufp, hdr.codes_offset, *h)  # fmt: skip
    run.launch(name, grid, BLOCK, typed_args(name, args))


def decode_with_runner(run: Runner, buf: Any, hdr: CodecHeader, out: Any, add: bool) -> None:
    n = hdr.numel
    if n == 0:
        return
    if add:
        target = "add"
    else:
        target = _OUT_NAMES.get(np.dtype(out.dtype))
        if target is None:
            raise CodecError(f"the GPU decodes into float32/16/64 or bfloat16, not {out.dtype}")
    bufp = run.ptr(buf)
    outp = run.ptr(out)
    if hdr.raw:
        src = bufp + HEADER_NBYTES
        if not add and np.dtype(out.dtype) == hdr.dtype:
            run.copy(outp, src, n * hdr.dtype.itemsize)
            return
        aligned = "a" if src % hdr.dtype.itemsize == 0 else "u"
        name = f"cgx_raw_{_DT_NAMES[hdr.dtype]}_{target}_{aligned}"
        run.launch(name, _grid(n, run.max_grid), BLOCK, typed_args(name, (src, n, outp)))
        return
    name = f"cgx_decode_{target}"
    args = (bufp, hdr.codes_offset, n, hdr.bits, hdr.bucket_size, outp)
    # one warp per 256 values: BLOCK threads cover 8 * BLOCK values
    run.launch(name, _grid(-(-n // 8), run.max_grid), BLOCK, typed_args(name, args))


# ---------------------------------------------------------------------------------------
# building: NVRTC directly, not cupy.RawModule, because CuPy appends -ftz=true to every
# NVRTC compile and the last option wins: subnormals would flush to zero on the GPU only.


def compile_kernels(arch: str, source: str | None = None) -> bytes:
    """Compile the kernels with NVRTC: a cubin for ``sm_XY``, PTX for ``compute_XY``.

    Needs only the NVRTC library (no GPU). Raises CodecError with NVRTC's log on failure.
    """
    src = kernel_source() if source is None else source
    return nvrtc.compile_program(src, SOURCE, arch, list(NVRTC_OPTIONS))


def target_arch(compute_capability: int) -> str:
    """A cubin when NVRTC knows the GPU, else PTX of the newest older arch (driver JIT)."""
    supported = nvrtc.supported_archs()
    if compute_capability in supported:
        return f"sm_{compute_capability}"
    older = [a for a in supported if a <= compute_capability]
    if not older:
        raise CodecError(f"NVRTC supports no architecture for compute {compute_capability}")
    return f"compute_{max(older)}"


def _cache_dir(env: Any = None) -> Path:
    """Where compiled CUDA kernels are kept: ``<CGX_UCX_KERNEL_CACHE>/cuda``, else
    ``$XDG_CACHE_HOME/cgx_ucx/kernels`` (``~/.cache`` without ``XDG_CACHE_HOME``): per user,
    next to the host codec's kernels (:func:`.kernels.cache_dir`, which imports Numba;
    a GPU-only job does not)."""
    env = os.environ if env is None else env
    chosen = read_env(kernels.ENV_KERNEL_CACHE, env)
    if chosen:
        return Path(chosen).expanduser() / "cuda"
    return kernels.user_cache_root(env) / "kernels"


def _image(arch: str) -> bytes:
    """The compiled kernels for ``arch``, from a disk cache keyed by source, options, NVRTC."""
    src = kernel_source()
    key = hashlib.sha256(repr((src, NVRTC_OPTIONS, arch, nvrtc.version())).encode()).hexdigest()[
        :24
    ]
    path = _cache_dir() / f"{Path(SOURCE).stem}-{arch}-{key}.bin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    image = compile_kernels(arch, src)
    try:  # best effort: a read-only home only costs a compile per process
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(image)
        os.replace(tmp, path)
    except OSError:
        pass
    return image


_lock = threading.Lock()
_modules: dict[int, Any] = {}  # device id -> cupy.cuda.function.Module
_functions: dict[tuple[int, str], Any] = {}


def _cupy() -> Any:
    import cupy

    return cupy


def _function(device_id: int, name: str) -> Any:
    """The kernel ``name`` on ``device_id``; the module is built once per device."""
    fn = _functions.get((device_id, name))
    if fn is not None:
        return fn
    cupy = _cupy()
    with _lock:
        with cupy.cuda.Device(device_id) as dev:
            mod = _modules.get(device_id)
            if mod is None:
                cc = int(dev.compute_capability)
                mod = cupy.cuda.function.Module()
                mod.load(_image(target_arch(cc)))
                _modules[device_id] = mod
            fn = mod.get_function(name)
        _functions[(device_id, name)] = fn
    return fn


class CupyRunner:
    """Launches on the current CuPy stream of one device."""

    def __init__(self, device_id: int) -> None:
        cupy = _cupy()
        self.device_id = device_id
        self._cupy = cupy
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        self.max_grid = int(props["multiProcessorCount"]) * BLOCKS_PER_SM

    def launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        stream = self._cupy.cuda.get_current_stream()
        _function(self.device_id, name)((grid,), (block,), args, stream=stream)

    def ptr(self, a: Any) -> int:
        return int(a.data.ptr)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        rt = self._cupy.cuda.runtime
        stream = self._cupy.cuda.get_current_stream()
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream.ptr)


_runners: dict[int, CupyRunner] = {}


def _runner(a: Any) -> CupyRunner:
    dev = int(a.device.id)
    run = _runners.get(dev)
    if run is None:
        run = _runners.setdefault(dev, CupyRunner(dev))
    return run


def empty_bytes(nbytes: int, like: Any = None) -> Any:
    cupy = _cupy()
    with like.device:
        return cupy.empty(nbytes, dtype=cupy.uint8)


def empty_values(numel: int, dtype: np.dtype, like: Any = None) -> Any:
    cupy = _cupy()
    with like.device:
        return cupy.empty(numel, dtype=dtype)


def encode_into(x: Any, hdr: CodecHeader, seed: int, buf: Any) -> None:
    with x.device:
        encode_with_runner(_runner(x), x, hdr, seed, buf)


def decode_into(buf: Any, hdr: CodecHeader, out: Any) -> None:
    with buf.device:
        decode_with_runner(_runner(buf), buf, hdr, out, add=False)


def decode_add_into(buf: Any, hdr: CodecHeader, acc: Any) -> None:
    with buf.device:
        decode_with_runner(_runner(buf), buf, hdr, acc, add=True)
