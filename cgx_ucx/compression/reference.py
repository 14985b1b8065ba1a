"""The NumPy reference of the codec: plain multi-pass array code, kept for the tests.

It defines the function every backend computes (see :mod:`.codec` for the wire format
and the arithmetic). The Numba kernels (:mod:`.cpu`) and the CUDA kernels (:mod:`.gpu`)
are tested byte for byte against it. It is slow (several passes and temporaries per
call) and meant for checking, not for the hot path.

``encode``, ``decode`` and ``decode_add`` here have the signatures of the public ones in
:mod:`cgx_ucx.compression` but always run this reference on host arrays.

The functions ``empty_bytes``, ``empty_values``, ``encode_into``, ``decode_into`` and
``decode_add_into`` form the backend interface that :mod:`.codec` drives; they receive
validated arguments only.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..arrays import as_uint8_buffer, is_cupy
from ..errors import CodecError
from . import codec
from .codec import HEADER_NBYTES, CodecHeader

__all__ = [
    "decode",
    "decode_add",
    "encode",
    "encode_decode",
    "reduce_encode",
    "seed_key",
    "uniform",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("cgx_ucx's codec writes float32 meta in host order: little-endian only")

_MASK64 = (1 << 64) - 1
#: splitmix64 (Steele, Lea, Flood 2014): golden-ratio increment and finalizer constants.
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
#: u = (hash >> 40) * 2**-24: 24 random bits, exactly representable in float32, u < 1.
U_SHIFT = 40
U_SCALE = np.float32(2.0**-24)
NAN32 = np.float32(np.nan)  # bits 0x7FC00000, the canonical quiet NaN of every backend


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * MIX2) & _MASK64
    return z ^ (z >> 31)


def seed_key(seed: int) -> int:
    """The per-call 64-bit key of stochastic rounding: splitmix64's finalizer of ``seed``."""
    return _mix64_int(int(seed) & _MASK64)


def uniform(key: int, index: np.ndarray) -> np.ndarray:
    """u in [0, 1) (float32) of each value index: ``mix64(key + (index + 1) * GOLDEN)``."""
    i = index.astype(np.uint64) + np.uint64(1)
    z = np.uint64(key) + i * np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(U_SHIFT)).astype(np.float32) * U_SCALE


# ---------------------------------------------------------------------------------------
# backend interface


def empty_bytes(nbytes: int, like: Any = None) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def empty_values(numel: int, dtype: np.dtype, like: Any = None) -> np.ndarray:
    return np.empty(numel, dtype=dtype)


def _meta_view(buf: np.ndarray, hdr: CodecHeader) -> np.ndarray:
    """(nbuckets, 2) float32 view of the meta (unit, min); may be unaligned."""
    return buf[HEADER_NBYTES : hdr.codes_offset].view(np.float32).reshape(hdr.nbuckets, 2)


def quantize_meta(x32: np.ndarray, bits: int, bucket_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-bucket float32 (unit, min); NaN for buckets holding NaN/Inf or overflowing."""
    n = x32.shape[0]
    starts = np.arange(0, n, bucket_size)
    levels = np.float32((1 << bits) - 1)
    with np.errstate(all="ignore"):
        mn = np.minimum.reduceat(x32, starts) + np.float32(0.0)
        mx = np.maximum.reduceat(x32, starts) + np.float32(0.0)
        finite = np.logical_and.reduceat(np.isfinite(x32), starts)
        unit = (mx - mn) / levels
    bad = ~finite | ~np.isfinite(unit)
    unit[bad] = NAN32
    mn[bad] = NAN32
    return unit.astype(np.float32, copy=False), mn.astype(np.float32, copy=False)


def quantize_codes(
    x32: np.ndarray,
    unit: np.ndarray,
    mn: np.ndarray,
    bits: int,
    bucket_size: int,
    stochastic: bool,
    seed: int,
) -> np.ndarray:
    """The code (uint8) of every value, given the per-bucket meta."""
    n = x32.shape[0]
    index = np.arange(n, dtype=np.int64)
    bucket = index // bucket_size
    unit_e = unit[bucket]
    mn_e = mn[bucket]
    levels = np.float32((1 << bits) - 1)
    with np.errstate(all="ignore"):
        t = (x32 - mn_e) / unit_e
        if stochastic:
            floor_t = np.floor(t)
            frac = t - floor_t
            up = uniform(seed_key(seed), index) < frac
            code = floor_t + up.astype(np.float32)
        else:
            code = np.floor(t + np.float32(0.5))
        code = np.clip(code, np.float32(0.0), levels)
    zero = ~(unit_e > np.float32(0.0))  # constant buckets (unit 0) and NaN buckets
    code[zero] = 0
    return code.astype(np.uint8)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Bit-pack codes: value i at stream bits [i*bits, (i+1)*bits), little-endian bytes."""
    planes = (codes[:, None] >> np.arange(bits, dtype=np.uint8)) & np.uint8(1)
    return np.packbits(planes.ravel(), bitorder="little")


def unpack_codes(packed: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: ``n`` codes as uint32."""
    planes = np.unpackbits(packed, count=n * bits, bitorder="little").reshape(n, bits)
    weights = np.uint32(1) << np.arange(bits, dtype=np.uint32)
    return planes.astype(np.uint32) @ weights


def encode_into(x: np.ndarray, hdr: CodecHeader, seed: int, buf: np.ndarray) -> None:
    buf[:HEADER_NBYTES] = np.frombuffer(hdr.pack(), dtype=np.uint8)
    if hdr.raw:
        buf[HEADER_NBYTES:] = x.view(np.uint8)
        return
    if hdr.numel == 0:
        return
    x32 = x.astype(np.float32, copy=False)
    unit, mn = quantize_meta(x32, hdr.bits, hdr.bucket_size)
    meta = _meta_view(buf, hdr)
    meta[:, 0] = unit
    meta[:, 1] = mn
    codes = quantize_codes(x32, unit, mn, hdr.bits, hdr.bucket_size, hdr.stochastic, seed)
    buf[hdr.codes_offset :] = pack_codes(codes, hdr.bits)


def dequantize(buf: np.ndarray, hdr: CodecHeader) -> np.ndarray:
    """The decoded values as float32 (RAW: the values in their own dtype)."""
    if hdr.raw:
        return buf[HEADER_NBYTES:].view(hdr.dtype)
    meta = _meta_view(buf, hdr)
    bucket = np.arange(hdr.numel, dtype=np.int64) // hdr.bucket_size
    codes = unpack_codes(buf[hdr.codes_offset :], hdr.numel, hdr.bits)
    unit_e = meta[bucket, 0]
    mn_e = meta[bucket, 1]
    with np.errstate(over="ignore"):  # a (corrupt) huge unit: Inf, as the kernels give
        return mn_e + unit_e * codes.astype(np.float32)


def decode_into(buf: np.ndarray, hdr: CodecHeader, out: np.ndarray) -> None:
    values = dequantize(buf, hdr)
    with np.errstate(over="ignore"):  # too large for a narrower out: Inf, as IEEE says
        if values.dtype != out.dtype:
            values = values.astype(np.float32).astype(out.dtype)
        out[...] = values


def decode_add_into(buf: np.ndarray, hdr: CodecHeader, acc: np.ndarray) -> None:
    with np.errstate(over="ignore"):
        acc += dequantize(buf, hdr).astype(np.float32, copy=False)


# ---------------------------------------------------------------------------------------
# public API, always through this reference

_SELF = sys.modules[__name__]


def encode(
    x: np.ndarray,
    bits: int,
    bucket_size: int = 1024,
    *,
    out: np.ndarray | None = None,
    stochastic: bool = False,
    seed: int = 0,
) -> np.ndarray:
    """:func:`cgx_ucx.compression.encode` computed by the NumPy reference."""
    if not isinstance(x, np.ndarray):
        raise CodecError("the NumPy reference takes NumPy arrays")
    return codec.encode_with(_SELF, x, bits, bucket_size, out=out, stochastic=stochastic, seed=seed)


def encode_decode(
    x: np.ndarray,
    bits: int,
    bucket_size: int = 1024,
    *,
    decoded: np.ndarray,
    out: np.ndarray | None = None,
    stochastic: bool = False,
    seed: int = 0,
) -> np.ndarray:
    """:func:`cgx_ucx.compression.encode_decode` computed by the NumPy reference (encode,
    then decode: two passes)."""
    if not isinstance(x, np.ndarray):
        raise CodecError("the NumPy reference takes NumPy arrays")
    return codec.encode_decode_with(
        _SELF, x, bits, bucket_size, decoded=decoded, out=out, stochastic=stochastic, seed=seed
    )


def reduce_encode(
    buf: Any,
    acc: np.ndarray,
    bits: int,
    bucket_size: int = 1024,
    *,
    decoded: np.ndarray,
    divisor: int = 0,
    out: np.ndarray | None = None,
    stochastic: bool = False,
    seed: int = 0,
) -> np.ndarray:
    """:func:`cgx_ucx.compression.reduce_encode` computed by the NumPy reference (decode_add,
    divide, encode, decode: one pass each)."""
    return codec.reduce_encode_with(
        _SELF,
        _host(buf),
        acc,
        bits,
        bucket_size,
        decoded=decoded,
        divisor=divisor,
        out=out,
        stochastic=stochastic,
        seed=seed,
    )


def decode(buf: Any, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`cgx_ucx.compression.decode` computed by the NumPy reference."""
    return codec.decode_with(_SELF, _host(buf), out)


def decode_add(buf: Any, acc: np.ndarray) -> np.ndarray:
    """:func:`cgx_ucx.compression.decode_add` computed by the NumPy reference."""
    return codec.decode_add_with(_SELF, _host(buf), acc)


def _host(buf: Any) -> np.ndarray:
    if is_cupy(buf):
        raise CodecError("the NumPy reference takes host buffers")
    return as_uint8_buffer(buf)
