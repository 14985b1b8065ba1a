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
:func:`~cgx_ucx.compression.codec.read_header`'s 24-byte device-to-host copy in decode,
and the 4-byte status a batched decode returns.

Several segments packed back to back (a pipeline piece: parts of several layers) take one
launch each way: :func:`encode_segments` and :func:`decode_segments` describe the
segments in a small device array (:data:`ENC_FIELDS`, :data:`DEC_FIELDS`; uploaded once
per distinct content and stream, then reused) instead of paying a Python-side launch
(35-40 us) per segment.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..arrays import (
    BFLOAT16,
    CODEC_DTYPES,
    MAX_BUCKET_SIZE,
    as_uint8_buffer,
    check_bits,
    check_positive_int,
    check_seed,
    is_array,
    is_cupy,
)
from ..config import read_env
from ..errors import CodecError
from . import kernels, nvrtc
from .codec import HEADER_NBYTES, CodecHeader
from .reference import seed_key

__all__ = [
    "DEC_FIELDS",
    "ENC_FIELDS",
    "KERNELS",
    "NVRTC_OPTIONS",
    "SIGNATURES",
    "CupyRunner",
    "compile_kernels",
    "decode_add_into",
    "decode_into",
    "decode_segments",
    "empty_bytes",
    "empty_values",
    "encode_decode_into",
    "encode_into",
    "encode_segments",
    "kernel_source",
]

SOURCE = "quantize.cu"
#: NVRTC options: IEEE float32 everywhere, so codes equal the CPU's bit for bit.
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true",
                 "--prec-sqrt=true")  # fmt: skip
#: Threads per block (CGX_BLOCK in the source: 8 warps).
BLOCK = 256
#: Values an encode block holds in registers (a round: CGX_ROUND_CHUNKS chunks of 8, 32
#: values a thread). A tile of whole buckets up to this size reads its values once; larger
#: tiles (buckets over 8192 values) take several rounds and read them twice.
TILE_VALUES = 8192
#: CGX_MAX_TILE_BUCKETS in the source (shared memory: 10 KiB of keys and meta per block).
MAX_TILE_BUCKETS = 512
#: Grid-stride kernels use at most this many blocks per SM (enough to saturate HBM); an
#: encode cuts its tiles small enough to have at least that many blocks where the buckets
#: allow (a 16 MiB float32 encode: 1024 blocks of 4096 values on 132 SMs, not 512 of 8192).
BLOCKS_PER_SM = 8
#: Values per block of a batched decode (CGX_DECODE_BLOCK_VALUES: a warp per 256 values).
DECODE_BLOCK_VALUES = 8 * BLOCK
#: Bytes of a RAW segment's payload per block of a batched encode (CGX_RAW_BLOCK_BYTES);
#: payloads over RAW_KERNEL_MAX bytes are copied with cudaMemcpyAsync instead.
RAW_BLOCK_BYTES = 4096
RAW_KERNEL_MAX = 1 << 20

#: C argument types per kernel kind: P pointer (as a 64-bit address), q int64, i int32,
#: Q uint64. Must match the extern "C" signatures in kernels/quantize.cu.
SIGNATURES = {
    # segments (ENC_FIELDS rows; 0: the one segment of the next arguments), their count;
    # one segment: out kind of its decoded values, x, n, bits, bucket, tile_buckets,
    # stochastic, key, buf, codes_off, header words 0..2, decoded (0: none)
    "encode": "PiiPqiqiiQPqQQQP",
    "decode": "PqqiqP",  # buf, codes_off, n, bits, bucket, out
    "decode_batch": "PiP",  # segments (DEC_FIELDS rows), count, int32 status
    "raw": "PqP",  # src, n, out
    "header": "PQQQ",  # buf, header words 0..2
}
_CTYPES = {"P": np.uint64, "Q": np.uint64, "q": np.int64, "i": np.int32}

#: The fields of struct cgx_enc_seg / cgx_dec_seg in kernels/quantize.cu, in order, each a
#: 64-bit word: one row of a batched launch's segment array.
ENC_FIELDS = ("x", "buf", "decoded", "key", "n", "bits", "bsize", "tile_buckets", "stochastic",
              "codes_off", "block0", "raw_nbytes", "h0", "h1", "h2", "out_kind")  # fmt: skip
DEC_FIELDS = ("buf", "out", "h0", "h1", "h2", "n", "bits", "bsize", "codes_off", "block0",
              "src_dt", "pad")  # fmt: skip
_E = {f: i for i, f in enumerate(ENC_FIELDS)}
_D = {f: i for i, f in enumerate(DEC_FIELDS)}
#: Header word 0's stochastic flag (byte 7, bit 0): informational, not compared on decode.
_FLAG_STOCHASTIC_WORD = 1 << 56

_DT_NAMES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", BFLOAT16: "bf16"}
_OUT_NAMES = {**_DT_NAMES, np.dtype(np.float64): "f64"}
#: Codes of value types in the kernels (codec dtype codes, float64 after them).
_TYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BFLOAT16: 2,
               np.dtype(np.float64): 3}  # fmt: skip


def _kernel_table() -> dict[str, str]:
    table = {f"cgx_encode_{d}": "encode" for d in ("f32", "f16", "bf16")}
    table |= {f"cgx_decode_{o}": "decode" for o in ("f32", "f16", "bf16", "f64", "add")}
    table |= {f"cgx_decode_{o}_batch": "decode_batch" for o in ("f32", "f16", "bf16", "f64", "add")}
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

    def upload(self, rows: np.ndarray) -> int:
        """The device address of a copy of ``rows`` (uint64), valid for launches queued
        after this call."""
        ...

    def status(self) -> Any:
        """A device int32 for a kernel to report into."""
        ...

    def read_status(self, st: Any) -> int:
        """Its value once the work queued so far is complete (synchronizes)."""
        ...


# ---------------------------------------------------------------------------------------
# planning (pure Python)


@functools.lru_cache(maxsize=4096)
def header_words(hdr: CodecHeader) -> tuple[int, int, int]:
    """The 24 header bytes as three little-endian uint64 kernel arguments."""
    raw = hdr.pack()
    return tuple(int.from_bytes(raw[i : i + 8], "little") for i in (0, 8, 16))  # type: ignore[return-value]


def encode_plan(hdr: CodecHeader, min_blocks: int = 1) -> tuple[int, int]:
    """(grid, tile_buckets): tiles of whole buckets that start on a code byte, as large as
    a block holds in registers (TILE_VALUES), and small enough that the encode has at least
    ``min_blocks`` blocks where the buckets allow (small inputs use the whole GPU)."""
    bsize = hdr.bucket_size
    k = 8 // math.gcd(bsize, 8)  # buckets per code-byte-aligned chunk
    tile = min(max(k, TILE_VALUES // bsize // k * k), MAX_TILE_BUCKETS)  # 512: k divides it
    want = -(-hdr.nbuckets // max(1, min_blocks))
    tile = max(k, min(tile, -(-want // k) * k))
    return -(-hdr.nbuckets // tile), tile


def _grid(work_items: int, max_grid: int) -> int:
    return max(1, min(-(-work_items // BLOCK), max_grid))


# ---------------------------------------------------------------------------------------
# the backend, generic over the runner


def encode_with_runner(
    run: Runner, x: Any, hdr: CodecHeader, seed: int, buf: Any, decoded: Any = None
) -> None:
    """Encode ``x`` into ``buf``; ``decoded`` (float32/16/64 or bfloat16, compressed
    segments only) also receives what the codes decode to, in the same pass."""
    h = header_words(hdr)
    bufp = run.ptr(buf)
    n = hdr.numel
    if hdr.raw or n == 0:
        run.launch("cgx_write_header", 1, 32, typed_args("cgx_write_header", (bufp, *h)))
        if hdr.raw and n:
            run.copy(bufp + HEADER_NBYTES, run.ptr(x), n * hdr.dtype.itemsize)
        return
    grid, tile = encode_plan(hdr, run.max_grid)
    name = f"cgx_encode_{_DT_NAMES[hdr.dtype]}"
    dec, kind = (0, 0) if decoded is None else (run.ptr(decoded), _TYPE_CODES[decoded.dtype])
    args = (0, 0, kind, run.ptr(x), n, hdr.bits, hdr.bucket_size, tile, int(hdr.stochastic),
            seed_key(seed), bufp, hdr.codes_offset, *h, dec)  # fmt: skip
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


#: One segment of a batched encode: values, their header, the seed, and where what the
#: codes decode to goes (None: nowhere; compressed segments only).
EncodeItem = tuple[Any, CodecHeader, int, Any]


def encode_batch_with_runner(run: Runner, items: Sequence[EncodeItem], buf: Any) -> int:
    """Encode ``items`` back to back from the start of ``buf``; returns the bytes written.

    Compressed segments of one value dtype share a launch (a piece's segments all do);
    RAW and empty segments join the first launch. A RAW payload over
    RAW_KERNEL_MAX bytes is copied with cudaMemcpyAsync. The blocks are shared out in
    proportion to the segments' sizes (:func:`encode_plan`'s ``min_blocks``).
    """
    bufp = run.ptr(buf)
    qnumel = sum(h.numel for _, h, _, _ in items if not h.raw) or 1
    groups: dict[np.dtype, list[tuple[int, list[int]]]] = {}
    loose: list[tuple[int, list[int]]] = []  # RAW and empty segments
    copies = []
    pos = 0
    for x, hdr, seed, dec in items:
        row = [0] * len(ENC_FIELDS)
        row[_E["x"]] = run.ptr(x) if hdr.numel else 0
        row[_E["buf"]] = bufp + pos
        row[_E["n"]] = hdr.numel
        row[_E["bits"]] = hdr.bits
        row[_E["bsize"]] = hdr.bucket_size
        row[_E["h0"]], row[_E["h1"]], row[_E["h2"]] = header_words(hdr)
        if hdr.raw or hdr.numel == 0:
            nbytes = hdr.numel * hdr.dtype.itemsize
            if nbytes > RAW_KERNEL_MAX:
                copies.append((bufp + pos + HEADER_NBYTES, row[_E["x"]], nbytes))
                nbytes = 0
            row[_E["raw_nbytes"]] = nbytes
            loose.append((max(1, -(-nbytes // RAW_BLOCK_BYTES)), row))
        else:
            blocks, tile = encode_plan(hdr, -(-run.max_grid * hdr.numel // qnumel))
            row[_E["decoded"]] = 0 if dec is None else run.ptr(dec)
            row[_E["out_kind"]] = 0 if dec is None else _TYPE_CODES[dec.dtype]
            row[_E["key"]] = seed_key(seed) if hdr.stochastic else 0
            row[_E["tile_buckets"]] = tile
            row[_E["stochastic"]] = int(hdr.stochastic)
            row[_E["codes_off"]] = hdr.codes_offset
            groups.setdefault(hdr.dtype, []).append((blocks, row))
        pos += hdr.nbytes
    if loose:
        first = next(iter(groups.values()), None)
        if first is None:
            groups[np.dtype(np.float32)] = loose
        else:
            first.extend(loose)
    for dt, rows in groups.items():
        block = 0
        for blocks, row in rows:
            row[_E["block0"]] = block
            block += blocks
        table = np.array([row for _, row in rows], dtype=np.uint64)
        name = f"cgx_encode_{_DT_NAMES[dt]}"
        args = (run.upload(table), len(rows), *[0] * 14)
        run.launch(name, block, BLOCK, typed_args(name, args))
    for dst, src, nbytes in copies:
        run.copy(dst, src, nbytes)
    return pos


def decode_batch_with_runner(
    run: Runner, buf: Any, items: Sequence[tuple[CodecHeader, Any]], add: bool
) -> bool:
    """Decode (``add``: decode-add into float32) the segments packed back to back in
    ``buf``, each into its own output, in one launch; ``items`` are (expected header,
    output). Returns True once decoded. Returns False, having written nothing, when a
    header in ``buf`` is not the expected one (the stochastic flag aside), when ``buf``'s
    length is not the segments', or when the outputs are not of one supported dtype: the
    caller then takes the segment-by-segment path, whose checks raise the codec's error.
    """
    dtypes = {np.dtype(out.dtype) for _, out in items}
    if len(dtypes) != 1:
        return False
    (odt,) = dtypes
    target = "add" if add else _OUT_NAMES.get(odt)
    if target is None or (add and odt != np.float32):
        return False
    if int(buf.shape[0]) != sum(h.nbytes for h, _ in items):
        return False
    bufp = run.ptr(buf)
    rows = []
    pos = block = 0
    for hdr, out in items:
        row = [0] * len(DEC_FIELDS)
        h0, h1, h2 = header_words(hdr)
        row[_D["buf"]] = bufp + pos
        row[_D["out"]] = run.ptr(out) if hdr.numel else 0
        row[_D["h0"]], row[_D["h1"]], row[_D["h2"]] = h0 & ~_FLAG_STOCHASTIC_WORD, h1, h2
        row[_D["n"]] = hdr.numel
        row[_D["bits"]] = hdr.bits
        row[_D["bsize"]] = hdr.bucket_size
        row[_D["codes_off"]] = hdr.codes_offset
        row[_D["block0"]] = block
        row[_D["src_dt"]] = _TYPE_CODES[hdr.dtype]
        rows.append(row)
        block += -(-hdr.numel // DECODE_BLOCK_VALUES)
        pos += hdr.nbytes
    if block == 0:  # nothing to decode: the segment-by-segment path checks the headers
        return False
    st = run.status()
    name = f"cgx_decode_{target}_batch"
    args = (run.upload(np.array(rows, dtype=np.uint64)), len(rows), run.ptr(st))
    run.launch(name, block, BLOCK, typed_args(name, args))
    return run.read_status(st) == 0


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


#: Segment tables a CupyRunner keeps on the device, by content and stream: a training loop
#: repeats its pieces (same layout, same staging buffers), so most launches upload nothing.
UPLOAD_CACHE = 256


class CupyRunner:
    """Launches on the current CuPy stream of one device."""

    def __init__(self, device_id: int) -> None:
        cupy = _cupy()
        self.device_id = device_id
        self._cupy = cupy
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        self.max_grid = int(props["multiProcessorCount"]) * BLOCKS_PER_SM
        self._uploads: OrderedDict[tuple[int, bytes], Any] = OrderedDict()
        self._uploads_lock = threading.Lock()

    def launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        stream = self._cupy.cuda.get_current_stream()
        _function(self.device_id, name)((grid,), (block,), args, stream=stream)

    def ptr(self, a: Any) -> int:
        return int(a.data.ptr)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        rt = self._cupy.cuda.runtime
        stream = self._cupy.cuda.get_current_stream()
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream.ptr)

    def upload(self, rows: np.ndarray) -> int:
        # cupy.asarray copies through pinned memory, queued on the current stream; an array
        # dropped from the cache returns to that stream's pool, so it is reused only after
        # the launches queued behind it
        key = (self._cupy.cuda.get_current_stream().ptr, rows.tobytes())
        with self._uploads_lock:
            a = self._uploads.get(key)
            if a is None:
                a = self._uploads[key] = self._cupy.asarray(rows)
                if len(self._uploads) > UPLOAD_CACHE:
                    self._uploads.popitem(last=False)
            else:
                self._uploads.move_to_end(key)
            return int(a.data.ptr)

    def status(self) -> Any:
        return self._cupy.empty(1, dtype=self._cupy.int32)

    def read_status(self, st: Any) -> int:
        return int(st.get()[0])


_runners: dict[int, CupyRunner] = {}


def _device(a: Any) -> Any:
    """The context that makes ``a``'s device current."""
    return a.device


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


def encode_decode_into(x: Any, hdr: CodecHeader, seed: int, buf: Any, decoded: Any) -> None:
    """:func:`encode_into`, and ``decoded`` (may be ``x``) = decode(buf): one pass over
    ``x`` for a compressed segment."""
    with x.device:
        run = _runner(x)
        if hdr.raw or hdr.numel == 0 or np.dtype(decoded.dtype) not in _TYPE_CODES:
            encode_with_runner(run, x, hdr, seed, buf)
            if hdr.numel:
                decode_with_runner(run, buf, hdr, decoded, add=False)
            return
        encode_with_runner(run, x, hdr, seed, buf, decoded)


def _check_array(a: Any, buf: Any, what: str, dtypes: Any) -> None:
    """``a`` is a 1-D contiguous array of one of ``dtypes`` on ``buf``'s device."""
    if is_cupy(a) != is_cupy(buf) or not is_array(a):
        raise CodecError(f"{what} must be an array on the same device as the encoded buffer")
    if is_cupy(a) and a.device.id != buf.device.id:
        raise CodecError(f"{what} is on device {a.device.id}, the buffer on {buf.device.id}")
    if np.dtype(a.dtype) not in dtypes:
        raise CodecError(
            f"{what} has dtype {a.dtype}, the GPU codec's are {sorted(map(str, dtypes))}"
        )
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise CodecError(f"{what} must be 1-D contiguous, got shape {a.shape}")


def encode_segments(items: Sequence[tuple[Any, int, int, bool, int, Any]], out: Any) -> Any:
    """Encode several segments back to back into the front of ``out`` (a CuPy uint8 array)
    in one launch; returns ``out[:nbytes]``. ``items``: (values, bits, bucket size,
    stochastic, seed, decoded or None) per segment, with :func:`~.codec.encode`'s checks
    and meaning; ``decoded`` (compressed segments only) receives what the codes decode to,
    as :func:`~.codec.encode_decode`. The bytes are those of encoding each segment alone.
    """
    out = as_uint8_buffer(out, "out")
    parts: list[EncodeItem] = []
    for x, bits, bucket_size, stochastic, seed, dec in items:
        _check_array(x, out, "values", CODEC_DTYPES)
        bits = check_bits(bits)
        bucket_size = check_positive_int(bucket_size, "bucket_size", limit=MAX_BUCKET_SIZE + 1)
        numel = int(x.shape[0])
        hdr = CodecHeader(
            bits, bucket_size, numel, np.dtype(x.dtype), bool(stochastic) and bits != 32
        )
        if dec is not None:
            if hdr.raw:
                raise CodecError("an uncompressed segment has no decoded values to write")
            _check_array(dec, out, "decoded", _TYPE_CODES)
            if dec.shape[0] != numel:
                raise CodecError(f"decoded has {dec.shape[0]} values, the segment holds {numel}")
        parts.append((x, hdr, check_seed(seed), dec))
    nbytes = sum(p[1].nbytes for p in parts)
    if out.shape[0] < nbytes:
        raise CodecError(f"out holds {out.shape[0]} bytes, the segments need {nbytes}")
    if parts:
        with _device(out):
            encode_batch_with_runner(_runner(out), parts, out)
    return out[:nbytes]


def decode_segments(
    buf: Any, items: Sequence[tuple[int, int, np.dtype, Any]], add: bool = False
) -> bool:
    """Decode (``add``: decode-add) the segments packed back to back in ``buf`` (CuPy) in
    one launch; ``items``: (bits, bucket size, dtype, output) per segment, the layout the
    caller expects (outputs: float32/16/64 or bfloat16 on ``buf``'s device, else
    CodecError). True once done; False, having written nothing, when ``buf`` is not that
    layout (a header, the length) or the outputs do not share one dtype: then decode
    segment by segment (:func:`~.codec.decode`, :func:`~.codec.decode_add`), which raises
    the codec's error for the segment at fault."""
    buf = as_uint8_buffer(buf)
    parts = []
    for bits, bucket_size, dtype, out in items:
        _check_array(out, buf, "out", _TYPE_CODES)
        parts.append((CodecHeader(bits, bucket_size, int(out.shape[0]), np.dtype(dtype)), out))
    if not parts:
        return False
    with _device(buf):
        return decode_batch_with_runner(_runner(buf), buf, parts, add)
