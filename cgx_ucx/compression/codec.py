"""The wire format of a compressed segment, its validation, and backend dispatch.

An encoded segment is one contiguous ``uint8`` buffer (DESIGN.md, "Wire format")::

    offset  size            field
    0       24              header (below)
    24      8 * nbuckets    meta: per bucket two float32 (unit, min), bucket after bucket
    24+8nb  ceil(n*bits/8)  codes: value i occupies stream bits [i*bits, (i+1)*bits),
                            stream bit k = bit (k % 8) of code byte k // 8 (little-endian);
                            codes run contiguously across buckets

With ``bits == 32`` (RAW, torch_cgx's "no compression") there is no meta: the header is
followed by the ``numel`` values in their own dtype (``numel * itemsize`` bytes).

The header, little-endian, ``struct`` format ``<4sBBBBIQI``::

    0   4s  magic      b"CGXQ"
    4   B   version    1
    5   B   bits       1..8, or 32 for RAW
    6   B   dtype      0 float32, 1 float16, 2 bfloat16 (the dtype decode produces)
    7   B   flags      bit 0: stochastic rounding was used (informational); others 0
    8   I   bucket     values per (unit, min) pair, >= 1
    12  Q   numel      number of values
    20  I   reserved   0

:func:`read_header` accepts a buffer only when every field is known and its length is
*exactly* :func:`encoded_nbytes` of the header, so a truncated, extended or garbage buffer
is a :class:`~cgx_ucx.errors.CodecError` before anything is allocated or read beyond the
header, and ``numel`` is bounded by the real buffer length (at most 8 values per byte).

Quantization (CGX, Markov et al. 2022, max-min bucketed): per bucket of B values
(the last may be shorter), in float32: ``mn = min + 0``, ``mx = max + 0`` (adding +0 turns
-0 into +0, so every backend picks the same zero), ``unit = (mx - mn) / (2**bits - 1)``,
``code = floor((x - mn) / unit + 0.5)`` clipped to ``[0, 2**bits - 1]`` (``unit == 0``
gives code 0, so constant buckets decode exactly); decode is ``mn + unit * code`` in
float32. Stochastic rounding computes ``t = (x - mn) / unit`` and rounds ``floor(t)`` up
when ``u < t - floor(t)`` with ``u`` in [0, 1) drawn from a counter-based hash of
``(seed, index of the value in the segment)`` (splitmix64), so it is unbiased, never off
by a whole unit, reproducible and identical on every backend. A bucket holding NaN or Inf
gets ``unit = min = NaN`` and codes 0: all its values decode NaN (AMP's GradScaler must
see the overflow); the other buckets are unaffected. A bucket whose range ``max - min``
overflows float32 (beyond 3.4e38) is treated the same way.

The NumPy reference (:mod:`.reference`), the Numba kernels (:mod:`.cpu`) and the CUDA
kernels (:mod:`.gpu`) perform the same float32 operations in the same order, without
fused multiply-add or fast-math, so their bytes are identical.

Array inputs are NumPy arrays (Numba backend) or CuPy arrays (CUDA backend, CuPy is only
imported when a CuPy array is given); bfloat16 means ``ml_dtypes.bfloat16``.
"""

from __future__ import annotations

import importlib
import math
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ..arrays import (
    BFLOAT16,
    MAX_BUCKET_SIZE,
    NO_COMPRESSION_BITS,
    as_uint8_buffer,
    check_bits,
    check_positive_int,
    check_seed,
    is_array,
    is_cupy,
    is_float_dtype,
    xp_of,
)
from ..errors import CodecError
from .kernels import host_kernels_due

__all__ = [
    "HEADER_NBYTES",
    "MAGIC",
    "RAW_BITS",
    "VERSION",
    "CodecHeader",
    "backend_name",
    "chunking",
    "decode",
    "decode_add",
    "encode",
    "encode_decode",
    "encode_sum",
    "encoded_nbytes",
    "host_kernels",
    "read_header",
    "reduce_encode",
]

MAGIC = b"CGXQ"
VERSION = 1
#: bits value of an uncompressed (RAW) segment: torch_cgx's "32 = no compression".
RAW_BITS = NO_COMPRESSION_BITS
_HEADER = struct.Struct("<4sBBBBIQI")
HEADER_NBYTES: int = _HEADER.size
assert HEADER_NBYTES == 24
#: Bytes of meta per bucket: float32 unit and float32 min.
META_NBYTES = 8
#: Flag bits of the header.
FLAG_STOCHASTIC = 1
_KNOWN_FLAGS = FLAG_STOCHASTIC
_BUCKET_LIMIT = MAX_BUCKET_SIZE + 1

_DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.float32): 0,
    np.dtype(np.float16): 1,
    BFLOAT16: 2,
}
_CODE_DTYPES = {code: dt for dt, code in _DTYPE_CODES.items()}


@dataclass(frozen=True)
class CodecHeader:
    """The validated header of an encoded segment: exactly what decoding needs."""

    bits: int
    bucket_size: int
    numel: int
    dtype: np.dtype
    stochastic: bool = False

    @property
    def raw(self) -> bool:
        """True for an uncompressed (bits == 32) segment."""
        return self.bits == RAW_BITS

    @property
    def nbuckets(self) -> int:
        """Number of (unit, min) pairs; 0 for RAW segments."""
        return 0 if self.raw else -(-self.numel // self.bucket_size)

    @property
    def meta_offset(self) -> int:
        return HEADER_NBYTES

    @property
    def codes_offset(self) -> int:
        """Offset of the code bytes (or of the raw values)."""
        return HEADER_NBYTES + META_NBYTES * self.nbuckets

    @property
    def nbytes(self) -> int:
        """Exact length of the encoded segment (the fields are valid: no checks here,
        this is on every encode and decode)."""
        return _segment_nbytes(self.numel, self.bits, self.bucket_size, self.dtype.itemsize)

    def pack(self) -> bytes:
        """The 24 header bytes."""
        flags = FLAG_STOCHASTIC if self.stochastic else 0
        return _HEADER.pack(
            MAGIC,
            VERSION,
            self.bits,
            _DTYPE_CODES[self.dtype],
            flags,
            self.bucket_size,
            self.numel,
            0,
        )


def _value_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise CodecError(f"not a dtype: {dtype!r}") from exc
    if dt not in _DTYPE_CODES:
        raise CodecError(f"values must be float32, float16 or bfloat16, got {dt}")
    return dt


def encoded_nbytes(numel: int, bits: int, bucket_size: int, dtype: Any = np.float32) -> int:
    """Exact byte length of an encoded segment of ``numel`` values.

    Quantized: header + 8 bytes of meta per bucket + ``ceil(numel * bits / 8)`` code bytes.
    RAW (``bits == 32``): header + ``numel * itemsize(dtype)``.
    """
    bits = check_bits(bits)
    bucket_size = check_positive_int(bucket_size, "bucket_size", limit=_BUCKET_LIMIT)
    numel = check_positive_int(numel, "numel", 0, error=CodecError)
    itemsize = _value_dtype(dtype).itemsize if bits == RAW_BITS else 0
    return _segment_nbytes(numel, bits, bucket_size, itemsize)


def _segment_nbytes(numel: int, bits: int, bucket_size: int, itemsize: int) -> int:
    """:func:`encoded_nbytes` of valid arguments (``itemsize`` only matters for RAW)."""
    if bits == RAW_BITS:
        return HEADER_NBYTES + numel * itemsize
    return HEADER_NBYTES + META_NBYTES * -(-numel // bucket_size) + (numel * bits + 7) // 8


# ---------------------------------------------------------------------------------------
# array kinds


def backend_name(x: Any) -> str:
    """``"cupy"`` for CuPy arrays, ``"numba"`` for everything on the host."""
    return "cupy" if is_cupy(x) else "numba"


_BACKENDS: dict[str, ModuleType] = {}


def _backend(name: str) -> ModuleType:
    """The backend module, imported on first use (Numba or CuPy are never imported early)."""
    mod = _BACKENDS.get(name)
    if mod is None:
        modname = {"numba": "cpu", "numpy": "reference", "cupy": "gpu"}[name]
        mod = importlib.import_module(f"{__package__}.{modname}")
        _BACKENDS[name] = mod
    return mod


def _host_header_bytes(buf: Any) -> bytes:
    if is_cupy(buf):
        return bytes(buf[:HEADER_NBYTES].get())
    return buf[:HEADER_NBYTES].tobytes()


# ---------------------------------------------------------------------------------------
# header


def read_header(buf: Any) -> CodecHeader:
    """Parse and validate the header of an encoded segment.

    Raises :class:`~cgx_ucx.errors.CodecError` unless magic, version, bits, dtype, flags,
    bucket size and reserved field are valid and ``len(buf)`` equals the exact encoded
    length the header implies.
    """
    buf = as_uint8_buffer(buf)
    n = int(buf.shape[0])
    if n < HEADER_NBYTES:
        raise CodecError(f"truncated: {n} bytes, a header alone is {HEADER_NBYTES}")
    magic, version, bits, dcode, flags, bucket, numel, reserved = _HEADER.unpack(
        _host_header_bytes(buf)
    )
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}: not a cgx_ucx encoded segment")
    if version != VERSION:
        raise CodecError(f"unsupported codec version {version} (this is {VERSION})")
    if not (1 <= bits <= 8 or bits == RAW_BITS):
        raise CodecError(f"bad bits field {bits}")
    if dcode not in _CODE_DTYPES:
        raise CodecError(f"bad dtype code {dcode}")
    if flags & ~_KNOWN_FLAGS:
        raise CodecError(f"unknown flags 0x{flags:02x}")
    if bucket < 1:
        raise CodecError("bad bucket size 0")
    if reserved != 0:
        raise CodecError(f"reserved header field is {reserved}, expected 0")
    hdr = CodecHeader(bits, bucket, numel, _CODE_DTYPES[dcode], bool(flags & FLAG_STOCHASTIC))
    expected = hdr.nbytes  # Python ints: no overflow for any numel
    if n != expected:
        kind = "truncated" if n < expected else "oversized"
        raise CodecError(f"{kind}: {n} bytes, the header implies exactly {expected}")
    return hdr


# ---------------------------------------------------------------------------------------
# checks shared by every backend


def _check_values(x: Any) -> np.dtype:
    if not is_array(x):
        raise CodecError(f"encode takes a NumPy or CuPy array, got {type(x).__name__}")
    dt = _value_dtype(x.dtype)
    if x.ndim != 1 or not x.flags.c_contiguous:
        raise CodecError(f"encode takes a 1-D contiguous array, got shape {x.shape}")
    return dt


def _same_kind(a: Any, b: Any, what: str) -> None:
    if is_cupy(a) != is_cupy(b):
        raise CodecError(f"{what} must be on the same device as the encoded buffer")
    if is_cupy(a):
        if a.device.id != b.device.id:
            raise CodecError(f"{what} is on device {b.device.id}, the buffer on {a.device.id}")
    elif not isinstance(b, np.ndarray):
        raise CodecError(f"{what} must be a NumPy array, got {type(b).__name__}")


def _check_out(out: Any, numel: int, buf: Any, what: str = "out") -> None:
    _same_kind(buf, out, what)
    if not is_float_dtype(out.dtype):
        raise CodecError(f"{what} must have a float dtype, got {out.dtype}")
    if out.ndim != 1 or not out.flags.c_contiguous:
        raise CodecError(f"{what} must be 1-D contiguous, got shape {out.shape}")
    if out.shape[0] != numel:
        raise CodecError(f"{what} has {out.shape[0]} values, the segment holds {numel}")
    if not getattr(out.flags, "writeable", True):  # CuPy arrays have no such flag
        raise CodecError(f"{what} is read-only")


def _check_addend(x: Any, y: Any, what: str) -> None:
    """``y``, added to ``x`` as a codec step reads it, is contiguous values of ``x``'s
    dtype, shape and device, else CodecError."""
    _same_kind(x, y, what)
    if y.dtype != x.dtype or y.shape != x.shape or not y.flags.c_contiguous:
        raise CodecError(
            f"{what} must be contiguous {x.dtype} of shape {x.shape}, got {y.dtype} {y.shape}"
        )


# ---------------------------------------------------------------------------------------
# encode / decode / decode_add, generic over a backend module


def _encode_target(
    backend: ModuleType,
    x: Any,
    bits: int,
    bucket_size: int,
    out: Any,
    stochastic: bool,
    seed: int,
) -> tuple[CodecHeader, int, Any]:
    """The checked header, seed and output segment of an encode of ``x``."""
    dt = _check_values(x)
    bits = check_bits(bits)
    bucket_size = check_positive_int(bucket_size, "bucket_size", limit=_BUCKET_LIMIT)
    seed = check_seed(seed)
    numel = int(x.shape[0])
    stochastic = bool(stochastic) and bits != RAW_BITS
    hdr = CodecHeader(bits, bucket_size, numel, dt, stochastic)
    nbytes = hdr.nbytes
    if out is None:
        return hdr, seed, backend.empty_bytes(nbytes, like=x)
    if not is_array(out):
        raise CodecError(f"out must be a uint8 array, got {type(out).__name__}")
    _same_kind(x, out, "out")
    if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
        raise CodecError("out must be a 1-D contiguous uint8 array")
    if out.shape[0] < nbytes:
        raise CodecError(f"out holds {out.shape[0]} bytes, the encoding needs {nbytes}")
    return hdr, seed, out[:nbytes]


def encode_with(
    backend: ModuleType,
    x: Any,
    bits: int,
    bucket_size: int = 1024,
    *,
    out: Any = None,
    stochastic: bool = False,
    seed: int = 0,
) -> Any:
    """:func:`encode` through a given backend module (used by :mod:`.reference`)."""
    hdr, seed, buf = _encode_target(backend, x, bits, bucket_size, out, stochastic, seed)
    backend.encode_into(x, hdr, seed, buf)
    return buf


def encode_decode_with(
    backend: ModuleType,
    x: Any,
    bits: int,
    bucket_size: int = 1024,
    *,
    decoded: Any,
    out: Any = None,
    stochastic: bool = False,
    seed: int = 0,
) -> Any:
    """:func:`encode_decode` through a given backend module (used by :mod:`.reference`)."""
    hdr, seed, buf = _encode_target(backend, x, bits, bucket_size, out, stochastic, seed)
    _check_out(decoded, hdr.numel, x, "decoded")
    _encode_decode_checked(backend, x, hdr, seed, buf, decoded)
    return buf


def _encode_decode_checked(
    backend: ModuleType, x: Any, hdr: CodecHeader, seed: int, buf: Any, decoded: Any
) -> None:
    """Encode ``x`` into ``buf`` and decode it into ``decoded`` (arguments checked): in one
    pass where the backend has one, else encode then decode."""
    fused = getattr(backend, "encode_decode_into", None)
    if fused is not None:
        fused(x, hdr, seed, buf, decoded)
        return
    backend.encode_into(x, hdr, seed, buf)
    if hdr.numel:
        backend.decode_into(buf, hdr, decoded)


def reduce_encode_with(
    backend: ModuleType,
    buf: Any,
    acc: Any,
    bits: int,
    bucket_size: int = 1024,
    *,
    decoded: Any,
    divisor: int = 0,
    out: Any = None,
    stochastic: bool = False,
    seed: int = 0,
    addend: Any = None,
) -> Any:
    """:func:`reduce_encode` through a given backend module (used by :mod:`.reference`)."""
    buf = as_uint8_buffer(buf)
    hdr_in = read_header(buf)
    _check_acc(acc, hdr_in.numel, buf)
    if addend is not None:
        _check_addend(acc, addend, "addend")
    if isinstance(divisor, bool) or not isinstance(divisor, int | np.integer) or divisor < 0:
        raise CodecError(f"divisor must be an integer >= 0, got {divisor!r}")
    hdr, seed, target = _encode_target(backend, acc, bits, bucket_size, out, stochastic, seed)
    _check_out(decoded, hdr.numel, acc, "decoded")
    fused = getattr(backend, "reduce_encode_into", None)
    if fused is not None and fused(
        buf, hdr_in, acc, int(divisor), hdr, seed, target, decoded, addend
    ):
        return target
    if addend is not None:
        xp_of(acc).add(acc, addend, out=acc)
    if hdr_in.numel:
        backend.decode_add_into(buf, hdr_in, acc)
    if divisor:
        xp_of(acc).divide(acc, int(divisor), out=acc)
    _encode_decode_checked(backend, acc, hdr, seed, target, decoded)
    return target


def decode_with(backend: ModuleType, buf: Any, out: Any = None) -> Any:
    """:func:`decode` through a given backend module (used by :mod:`.reference`)."""
    buf = as_uint8_buffer(buf)
    hdr = read_header(buf)
    if out is None:
        out = backend.empty_values(hdr.numel, hdr.dtype, like=buf)
    else:
        _check_out(out, hdr.numel, buf)
    if hdr.numel:
        backend.decode_into(buf, hdr, out)
    return out


def decode_add_with(backend: ModuleType, buf: Any, acc: Any) -> Any:
    """:func:`decode_add` through a given backend module (used by :mod:`.reference`)."""
    buf = as_uint8_buffer(buf)
    hdr = read_header(buf)
    _check_acc(acc, hdr.numel, buf)
    if hdr.numel:
        backend.decode_add_into(buf, hdr, acc)
    return acc


def _check_acc(acc: Any, numel: int, buf: Any) -> None:
    """A float32 accumulator of ``numel`` values on ``buf``'s device (decode_add's)."""
    _check_out(acc, numel, buf, "acc")
    if acc.dtype != np.float32:
        raise CodecError(f"acc must be float32, got {acc.dtype}")


def _backend_for(a: Any, numel: int | None = None) -> ModuleType:
    """The backend of a call on ``a``: CuPy's, or on the host the Numba kernels once
    :func:`~.kernels.host_kernels_due` says so (``numel`` values; None: read from the
    segment ``a``), the NumPy reference before."""
    if is_cupy(a):
        return _backend("cupy")
    if numel is None:
        numel = 0 if "numba" in _BACKENDS else read_header(a).numel
    return host_kernels(numel) or _backend("numpy")


def host_kernels(numel: int) -> ModuleType | None:
    """The Numba kernels' module (:mod:`.cpu`) if a host call of ``numel`` values should
    use it (:func:`~.kernels.host_kernels_due`), else None: the NumPy reference's turn."""
    host = _BACKENDS.get("numba")
    if host is not None:
        return host
    return _backend("numba") if host_kernels_due(numel) else None


def chunking(hdr: CodecHeader) -> tuple[int, int]:
    """(buckets per chunk, number of chunks) of a compressed segment's parallel kernels:
    chunks start on whole code bytes."""
    k = 8 // math.gcd(hdr.bucket_size, 8)
    return k, -(-hdr.nbuckets // k)


def encode(
    x: Any,
    bits: int,
    bucket_size: int = 1024,
    *,
    out: Any = None,
    stochastic: bool = False,
    seed: int = 0,
) -> Any:
    """Encode ``x`` (1-D float32/float16/bfloat16, NumPy or CuPy) into a segment.

    ``out``: a uint8 array on the same device with at least :func:`encoded_nbytes` bytes;
    the segment is written to its front and ``out[:nbytes]`` returned (nothing is
    allocated). Without ``out`` a new array is allocated. ``bits`` 1..8 quantize, 32 copies
    the values (RAW). ``stochastic`` selects unbiased stochastic rounding seeded by
    ``seed`` (0 <= seed < 2**64); use a different seed for every segment and step.
    """
    return encode_with(
        _backend_for(x, getattr(x, "size", 0)),
        x,
        bits,
        bucket_size,
        out=out,
        stochastic=stochastic,
        seed=seed,
    )


def encode_sum(
    x: Any,
    y: Any,
    bits: int,
    bucket_size: int = 1024,
    *,
    out: Any = None,
    stochastic: bool = False,
    seed: int = 0,
) -> Any:
    """:func:`encode` of ``x + y`` (one float32 addition per value, as NumPy adds): the
    same segment, without writing the sum where the backend fuses the addition into the
    encode (the host kernels do, for float32 ``x`` and ``y``). ``y``: values like ``x``
    (same dtype, length and device, contiguous), read-only allowed."""
    backend = _backend_for(x, getattr(x, "size", 0))
    hdr, seed, buf = _encode_target(backend, x, bits, bucket_size, out, stochastic, seed)
    _check_addend(x, y, "y")
    fused = getattr(backend, "encode_sum_into", None)
    if fused is not None and x.dtype == np.float32:
        fused(x, y, hdr, seed, buf)
    else:
        backend.encode_into(x + y, hdr, seed, buf)
    return buf


def encode_decode(
    x: Any,
    bits: int,
    bucket_size: int = 1024,
    *,
    decoded: Any,
    out: Any = None,
    stochastic: bool = False,
    seed: int = 0,
) -> Any:
    """:func:`encode`, and ``decoded[...] = decode(segment)``: the values every receiver of
    the segment gets, bit for bit, without a second pass where the backend fuses the two
    (the host kernels do). ``decoded`` (any float dtype, ``numel`` values, same device) may
    be ``x`` itself: an owner requantizing its reduced values in place. Returns the
    segment, as :func:`encode` does."""
    return encode_decode_with(
        _backend_for(x, getattr(x, "size", 0)),
        x,
        bits,
        bucket_size,
        decoded=decoded,
        out=out,
        stochastic=stochastic,
        seed=seed,
    )


def reduce_encode(
    buf: Any,
    acc: Any,
    bits: int,
    bucket_size: int = 1024,
    *,
    decoded: Any,
    divisor: int = 0,
    out: Any = None,
    stochastic: bool = False,
    seed: int = 0,
    addend: Any = None,
) -> Any:
    """The owner's last step on a reduced piece: ``acc += addend`` when given (float32
    like ``acc``), ``acc += decode(buf)`` (as :func:`decode_add`), ``acc /= divisor`` when
    ``divisor`` > 0 (an average), then ``encode_decode(acc, bits, bucket_size,
    decoded=decoded, ...)``. The result (segment, ``acc``, ``decoded``) is bit for bit that
    of those calls; the host kernels do them in one pass where ``buf`` has the same width
    and bucket size as the output. ``decoded`` may be ``acc`` itself. Returns the segment."""
    return reduce_encode_with(
        _backend_for(acc, getattr(acc, "size", 0)),
        buf,
        acc,
        bits,
        bucket_size,
        decoded=decoded,
        divisor=divisor,
        out=out,
        stochastic=stochastic,
        seed=seed,
        addend=addend,
    )


def decode(buf: Any, out: Any = None) -> Any:
    """Decode a segment (validated first) into a new array of its dtype, or into ``out``.

    ``out`` may have any float dtype (values are converted, round-to-nearest-even) and
    must hold exactly ``numel`` values on the buffer's device. NumPy in, NumPy out; CuPy
    in, CuPy out.
    """
    buf = as_uint8_buffer(buf)
    return decode_with(_backend_for(buf), buf, out)


def decode_add(buf: Any, acc: Any) -> Any:
    """``acc += decode(buf)`` in one fused pass; ``acc`` is float32 of ``numel`` values.

    This is the reduction step of the scatter-reduce allreduce. Returns ``acc``.
    """
    buf = as_uint8_buffer(buf)
    return decode_add_with(_backend_for(buf), buf, acc)
