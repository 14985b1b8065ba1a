"""Host backend: fused Numba kernels, one pass over memory per bucket, parallel across cores.

Work is split into *chunks* of ``k = 8 // gcd(bucket_size, 8)`` buckets, so every chunk
starts at a value index that is a multiple of 8 and therefore at a whole code byte: no two
threads ever write the same byte, whatever the bit width. Each bucket of a chunk is loaded
once from memory, reduced to (min, max) and quantized into a per-thread scratch of codes
while it is still in L1; the chunk's codes are then bit-packed from that scratch. With the
usual bucket sizes (multiples of 8, e.g. 512 or 1024) a chunk is one bucket. Decode runs
the same way backwards (unpack to scratch, then dequantize or accumulate). Large calls
share their chunks with helper threads (:func:`.cpu_threads.run_chunks`); the kernels run
without the GIL.

The float32 arithmetic is the reference's (see :mod:`.codec`) with no fast-math and no
fused multiply-add, so the bytes equal :mod:`.reference`'s exactly; the tests check it.

float16 and bfloat16 have no Numba type: their bits travel as ``uint16`` (float16) and
``int16`` (bfloat16) views, and the element type selects the conversion at compile time
(:func:`_load`, :func:`_store`). Kernels are compiled per signature when calls need
them and kept in a per-user disk cache (:mod:`.kernels`); in a connected process they
compile on a background thread, and calls run the NumPy reference (the same bytes) until then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..arrays import BFLOAT16
from . import reference
from .codec import HEADER_NBYTES, CodecHeader, chunking
from .cpu_threads import (
    BATCH_VALUES,
    PARALLEL_MIN_NUMEL,
    num_threads,
    run_chunks,
    set_num_threads,
    threads_chosen,
)
from .kernels import Kernel, compiling_here
from .reference import GOLDEN, MIX1, MIX2, U_SHIFT, empty_bytes, empty_values, seed_key

__all__ = [
    "BATCH_VALUES",
    "PARALLEL_MIN_NUMEL",
    "chunking",
    "decode_add_direct",
    "decode_add_into",
    "decode_into",
    "empty_bytes",
    "empty_values",
    "encode_chunks_direct",
    "encode_decode_into",
    "encode_into",
    "encode_sum_into",
    "num_threads",
    "reduce_encode_into",
    "set_num_threads",
    "threads_chosen",
    "warm_up",
    "warmup",
]

_GOLDEN = np.uint64(GOLDEN)
_MIX1 = np.uint64(MIX1)
_MIX2 = np.uint64(MIX2)
_U_SHIFT = np.uint64(U_SHIFT)
_U_SCALE = np.float32(2.0**-24)
_NAN32 = np.float32(np.nan)
_INF32 = np.float32(np.inf)
_ZERO32 = np.float32(0.0)
_HALF32 = np.float32(0.5)
_KEY_INF, _KEY_NEG_INF = np.int32(0x7F800000), np.int32(-0x7F800001)  # see _bucket_meta
#: 2**112 rescales float16 bits shifted into float32 position (exponent bias 127 - 15).
_F16_SCALE = np.float32(2.0**112)
#: The rounding key of seed 0 (deterministic rounding's, which never reads it).
_KEY0 = np.uint64(seed_key(0))


# ---------------------------------------------------------------------------------------
# element conversions (exact; float32 -> float16/bfloat16 round half to even, as NumPy
# and ml_dtypes do). Numba widens integer arithmetic to 64 bits, so np.uint32()/np.int32()
# narrow a value before each bit-cast (.view).


@njit
def _f16_to_f32(h):
    h32 = np.uint32(h)
    mag = np.uint32((h32 & 0x7FFF) << 13)
    # normals and subnormals: an exact rescale by 2**112; Inf/NaN: exponent all ones
    normal = np.float32(np.uint32(mag).view(np.float32) * _F16_SCALE).view(np.uint32)
    special = np.uint32(mag | 0x7F800000)
    bits = special if (h32 & 0x7C00) == 0x7C00 else normal
    return np.uint32(bits | ((h32 & 0x8000) << 16)).view(np.float32)


@njit
def _bf16_to_f32(h):
    return np.uint32(np.uint32(np.uint16(h)) << 16).view(np.float32)


@njit
def _f32_to_f16(v):
    f = np.int64(np.float32(v).view(np.uint32))
    sign = f & 0x80000000
    f = f ^ sign
    if f >= 0x47800000:  # >= 65536: Inf (NaN stays a quiet NaN)
        o = 0x7E00 if f > 0x7F800000 else 0x7C00
    elif f < 0x38800000:  # below the smallest normal half: the FPU rounds (0.5 = 0x3F000000)
        g = np.uint32(f).view(np.float32) + _HALF32
        o = np.int64(np.float32(g).view(np.uint32)) - 0x3F000000
    else:  # rebias the exponent 127 -> 15 and round half to even; a carry may give Inf
        o = (f - 0x38000000 + 0xFFF + ((f >> 13) & 1)) >> 13
    return np.uint16(o | (sign >> 16))


@njit
def _f32_to_bf16(v):
    f = np.int64(np.float32(v).view(np.uint32))
    if (f & 0x7FFFFFFF) > 0x7F800000:  # NaN: quiet, keep the sign
        o = (f >> 16) | 0x40
    else:
        o = (f + 0x7FFF + ((f >> 16) & 1)) >> 16
    return np.int16(np.uint16(o & 0xFFFF))


def _load(x, i):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_load)
def _ol_load(x, i):
    dt = x.dtype
    if dt == types.float32:
        return lambda x, i: x[i]
    if dt == types.uint16:
        return lambda x, i: _f16_to_f32(x[i])
    if dt == types.int16:
        return lambda x, i: _bf16_to_f32(x[i])
    return None


def _store(out, i, v):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_store)
def _ol_store(out, i, v):
    dt = out.dtype
    if dt == types.uint16:

        def store_f16(out, i, v):
            out[i] = _f32_to_f16(v)

        return store_f16
    if dt == types.int16:

        def store_bf16(out, i, v):
            out[i] = _f32_to_bf16(v)

        return store_bf16
    if isinstance(dt, types.Float):

        def store_float(out, i, v):
            out[i] = v

        return store_float
    return None


@njit
def _uniform(key, index):
    """u in [0, 1): splitmix64 of (key, index), top 24 bits (see reference.uniform)."""
    z = key + (np.uint64(index) + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return np.float32(z >> _U_SHIFT) * _U_SCALE


# ---------------------------------------------------------------------------------------
# encode. Loops run over slices from index 0 so LLVM sees non-negative indices (no
# wrap-around code) and vectorizes them: min/max on integer keys, quantize, pack.


@njit
def _bucket_meta(xb, levels):
    """(unit, min) of one bucket: min/max and the finiteness test in one vectorized pass.
    Min and max run on integer keys (the float bits with the magnitude flipped for
    negatives, ordered like the floats): integer min/max vectorize without fast-math,
    float compare-select reductions do not. NaNs key beyond the infinities of their sign
    (the keys of +-inf: _KEY_INF, _KEY_NEG_INF), so the extremes also tell non-finite."""
    kmn = np.int32(0x7FFFFFFF)
    kmx = np.int32(-0x80000000)
    for i in range(xb.shape[0]):
        u = np.float32(_load(xb, i)).view(np.int32)
        k = np.int32(u ^ ((u >> 31) & 0x7FFFFFFF))
        kmn = min(kmn, k)
        kmx = max(kmx, k)
    # + 0 turns -0 into +0, so every backend agrees on the zero
    mn = np.int32(kmn ^ ((kmn >> 31) & 0x7FFFFFFF)).view(np.float32) + _ZERO32
    mx = np.int32(kmx ^ ((kmx >> 31) & 0x7FFFFFFF)).view(np.float32) + _ZERO32
    unit = (mx - mn) / levels
    bad = kmx >= _KEY_INF or kmn <= _KEY_NEG_INF  # NaN or Inf
    if bad or unit - unit != _ZERO32:  # non-finite values or range overflow
        return _NAN32, _NAN32
    return unit, mn


@njit
def _quantize(xb, sc, unit, mn, levels, stochastic, key, base):
    """Codes (uint8) of one bucket into ``sc``; ``base`` is the bucket's first index."""
    n = xb.shape[0]
    if not (unit > _ZERO32):  # constant (unit 0) or non-finite (NaN) bucket
        for i in range(n):
            sc[i] = 0
    elif stochastic:
        for i in range(n):
            t = (_load(xb, i) - mn) / unit
            f = np.floor(t)
            if _uniform(key, base + i) < t - f:
                f = f + np.float32(1.0)
            f = levels if f > levels else f
            sc[i] = np.uint8(f)
    else:
        for i in range(n):
            c = np.floor((_load(xb, i) - mn) / unit + _HALF32)
            c = levels if c > levels else c
            sc[i] = np.uint8(c)


@njit
def _pack(sc, m, bits, cb):
    """Bit-pack codes sc[:m] into cb (ceil(m*bits/8) bytes), little-endian stream."""
    nfull = m // 8  # 8 codes fill exactly `bits` bytes
    if bits == 8:
        for i in range(8 * nfull):
            cb[i] = sc[i]
    elif bits == 4:
        for i in range(4 * nfull):
            cb[i] = np.uint8(sc[2 * i] | (sc[2 * i + 1] << 4))
    elif bits == 2:
        for i in range(2 * nfull):
            cb[i] = np.uint8(
                sc[4 * i] | (sc[4 * i + 1] << 2) | (sc[4 * i + 2] << 4) | (sc[4 * i + 3] << 6)
            )
    elif bits == 1:
        for i in range(nfull):
            v = np.uint32(0)
            for j in range(8):
                v |= np.uint32(sc[8 * i + j]) << np.uint32(j)
            cb[i] = np.uint8(v)
    else:
        for g in range(nfull):
            word = np.uint64(0)
            for j in range(8):
                word |= np.uint64(sc[8 * g + j]) << np.uint64(j * bits)
            for q in range(bits):
                cb[g * bits + q] = np.uint8((word >> np.uint64(8 * q)) & np.uint64(0xFF))
    rest = m - 8 * nfull
    if rest:
        word = np.uint64(0)
        for j in range(rest):
            word |= np.uint64(sc[8 * nfull + j]) << np.uint64(j * bits)
        for q in range((rest * bits + 7) // 8):
            cb[nfull * bits + q] = np.uint8((word >> np.uint64(8 * q)) & np.uint64(0xFF))


@njit
def _chunk_span(n, bsize, k, chunk):
    """(first bucket, end bucket, first value, end value) of chunk ``chunk``."""
    b0 = chunk * k
    b1 = min(b0 + k, (n + bsize - 1) // bsize)
    return b0, b1, b0 * bsize, min(b1 * bsize, n)


@njit
def _encode_bucket(xb, b, s, levels, stochastic, key, meta, scb, dec):
    """Bucket ``b`` (values ``xb``, the first at index ``s``): meta, codes into ``scb``,
    and (``dec`` not None) its decoded values into ``dec[s:]``."""
    unit, mn = _bucket_meta(xb, levels)
    meta[2 * b] = unit
    meta[2 * b + 1] = mn
    _quantize(xb, scb, unit, mn, levels, stochastic, key, s)
    if dec is not None:  # a compile-time branch: None is its own type
        _dequantize(scb, dec[s : s + xb.shape[0]], unit, mn, False)


@njit
def _encode_chunk(x, y, n, bits, bsize, k, stochastic, key, meta, codes, chunk, sc, dec, tb):
    """Encode chunk ``chunk`` (k buckets, starting on a code byte) using scratch ``sc``.

    Each bucket is reduced and quantized back to back while it is in L1; the chunk's
    codes are then packed from the scratch (k*bsize bytes, also in L1). ``dec`` (None,
    or an array like ``x``, which it may be) also receives each bucket's decoded values,
    computed as :func:`_decode_chunk` computes them from the same codes and meta, while
    the bucket is still in L1: a requantization in one pass instead of two. ``y`` (None,
    or float32 like a float32 ``x``): ``x + y`` is encoded, each bucket summed into the
    scratch ``tb`` as NumPy adds, never written back: a reduction and its encode in one pass.
    """
    levels = np.float32((1 << bits) - 1)
    b0, b1, cs, ce = _chunk_span(n, bsize, k, chunk)
    for b in range(b0, b1):
        s = b * bsize
        e = min(s + bsize, n)
        if y is not None:  # compile-time, as dec
            xb, yb, sb = x[s:e], y[s:e], tb[: e - s]
            for i in range(e - s):  # from 0 over slices: no wrap-around code, vectorized
                sb[i] = xb[i] + yb[i]
            _encode_bucket(sb, b, s, levels, stochastic, key, meta, sc[s - cs : e - cs], dec)
        else:
            _encode_bucket(x[s:e], b, s, levels, stochastic, key, meta, sc[s - cs : e - cs], dec)
    m = ce - cs
    off = (cs // 8) * bits
    _pack(sc, m, bits, codes[off : off + (m * bits + 7) // 8])


@Kernel
def _encode_range(x, y, n, bits, bsize, k, stochastic, key, meta, codes, c0, c1, nsc, dec):
    """Chunks [c0, c1), without the GIL; the scratches are this call's only allocations."""
    sc = np.empty(nsc, dtype=np.uint8)
    tb = np.empty(bsize if y is not None else 0, dtype=np.float32)
    for c in range(c0, c1):
        _encode_chunk(x, y, n, bits, bsize, k, stochastic, key, meta, codes, c, sc, dec, tb)


# ---------------------------------------------------------------------------------------
# decode / decode_add


@njit
def _unpack(cb, m, bits, sc):
    """Inverse of :func:`_pack`: codes of m values from cb into sc[:m]."""
    nfull = m // 8
    if bits == 8:
        for i in range(8 * nfull):
            sc[i] = cb[i]
    elif bits == 4:
        for i in range(4 * nfull):
            v = cb[i]
            sc[2 * i] = v & 0xF
            sc[2 * i + 1] = v >> 4
    elif bits == 2:
        for i in range(2 * nfull):
            v = cb[i]
            sc[4 * i] = v & 3
            sc[4 * i + 1] = (v >> 2) & 3
            sc[4 * i + 2] = (v >> 4) & 3
            sc[4 * i + 3] = v >> 6
    elif bits == 1:
        for i in range(nfull):
            v = cb[i]
            for j in range(8):
                sc[8 * i + j] = (v >> j) & 1
    else:
        mask = np.uint64((1 << bits) - 1)
        for g in range(nfull):
            word = np.uint64(0)
            for q in range(bits):
                word |= np.uint64(cb[g * bits + q]) << np.uint64(8 * q)
            for j in range(8):
                sc[8 * g + j] = np.uint8((word >> np.uint64(j * bits)) & mask)
    rest = m - 8 * nfull
    if rest:
        mask = np.uint64((1 << bits) - 1)
        word = np.uint64(0)
        for q in range((rest * bits + 7) // 8):
            word |= np.uint64(cb[nfull * bits + q]) << np.uint64(8 * q)
        for j in range(rest):
            sc[8 * nfull + j] = np.uint8((word >> np.uint64(j * bits)) & mask)


@njit
def _dequantize(sc, ob, unit, mn, add):
    """ob = mn + unit * code (add: ob += ...), float32 arithmetic, no FMA."""
    if add:
        for i in range(ob.shape[0]):
            ob[i] += mn + unit * np.float32(sc[i])
    else:
        for i in range(ob.shape[0]):
            _store(ob, i, mn + unit * np.float32(sc[i]))


@njit
def _decode_chunk(codes, meta, n, bits, bsize, k, out, add, chunk, sc):
    b0, b1, cs, ce = _chunk_span(n, bsize, k, chunk)
    m = ce - cs
    off = (cs // 8) * bits
    _unpack(codes[off : off + (m * bits + 7) // 8], m, bits, sc)
    for b in range(b0, b1):
        s = b * bsize
        e = min(s + bsize, n)
        _dequantize(sc[s - cs : e - cs], out[s:e], meta[2 * b], meta[2 * b + 1], add)


@Kernel
def _decode_range(codes, meta, n, bits, bsize, k, out, add, c0, c1, nsc):
    sc = np.empty(nsc, dtype=np.uint8)
    for c in range(c0, c1):
        _decode_chunk(codes, meta, n, bits, bsize, k, out, add, c, sc)


# ---------------------------------------------------------------------------------------
# reduce_encode: the owner's last step on a piece (add the last contribution, average,
# requantize) in one pass per bucket


@njit
def _reduce_encode_chunk(cin, min_, acc, y, n, bits, bsize, k, div, stochastic, key, meta,
                         codes, chunk, sc, dec):  # fmt: skip
    """Chunk ``chunk``: acc += y (None: nothing), acc += decode(cin, min_) (as
    :func:`_decode_chunk` adds), acc /= div when div > 0, then encode acc into (meta, codes)
    and decode it into ``dec`` (as :func:`_encode_chunk` does), bucket by bucket while each
    is in L1. The incoming codes of a bucket are consumed before its outgoing codes
    overwrite them in ``sc``."""
    levels = np.float32((1 << bits) - 1)
    b0, b1, cs, ce = _chunk_span(n, bsize, k, chunk)
    m = ce - cs
    off = (cs // 8) * bits
    nb = (m * bits + 7) // 8
    _unpack(cin[off : off + nb], m, bits, sc)
    for b in range(b0, b1):
        s = b * bsize
        e = min(s + bsize, n)
        ab = acc[s:e]
        if y is not None:  # compile-time, as in _encode_chunk
            yb = y[s:e]
            for i in range(ab.shape[0]):
                ab[i] = ab[i] + yb[i]
        _dequantize(sc[s - cs : e - cs], ab, min_[2 * b], min_[2 * b + 1], True)
        if div > 0:
            d = np.float32(div)
            for i in range(ab.shape[0]):
                ab[i] = ab[i] / d
        unit, mn = _bucket_meta(ab, levels)
        meta[2 * b] = unit
        meta[2 * b + 1] = mn
        _quantize(ab, sc[s - cs : e - cs], unit, mn, levels, stochastic, key, s)
        _dequantize(sc[s - cs : e - cs], dec[s:e], unit, mn, False)
    _pack(sc, m, bits, codes[off : off + nb])


@Kernel
def _reduce_encode_range(cin, min_, acc, y, n, bits, bsize, k, div, stochastic, key, meta,
                         codes, c0, c1, nsc, dec):  # fmt: skip
    sc = np.empty(nsc, dtype=np.uint8)
    for c in range(c0, c1):
        _reduce_encode_chunk(cin, min_, acc, y, n, bits, bsize, k, div, stochastic, key, meta,
                             codes, c, sc, dec)  # fmt: skip


# ---------------------------------------------------------------------------------------
# backend interface (validated arguments only; see codec.py)


def _kernel_view(a: np.ndarray) -> np.ndarray | None:
    """``a`` as the array type the kernels take (bits of half types), None if unsupported."""
    dt = a.dtype
    if dt == np.float32 or dt == np.float64:
        return a
    if dt == np.float16:
        return a.view(np.uint16)
    if dt == BFLOAT16:
        return a.view(np.int16)
    return None


def _meta_view(buf: np.ndarray, hdr: CodecHeader) -> tuple[np.ndarray, bool]:
    """The meta as float32 for the kernels, and whether it is a view of ``buf``: an
    unaligned float32 view (segments packed back to back start at any byte) would be
    another Numba type, another compile, so such meta goes through a small aligned copy."""
    raw = buf[HEADER_NBYTES : hdr.codes_offset]
    if raw.ctypes.data % 4 == 0:
        return raw.view(np.float32), True
    return np.frombuffer(raw.tobytes(), dtype=np.float32).copy(), False


def encode_into(x: np.ndarray, hdr: CodecHeader, seed: int, buf: np.ndarray) -> None:
    _encode(x, hdr, seed, buf, None)


def encode_sum_into(
    x: np.ndarray, y: np.ndarray, hdr: CodecHeader, seed: int, buf: np.ndarray
) -> None:
    """Encode ``x + y`` (float32 both, ``hdr.numel`` values) into ``buf`` without writing
    the sum anywhere: the bytes :func:`encode_into` writes for ``np.add(x, y)``."""
    args = _encode_args(x, y, hdr, None)
    if hdr.raw or not _encode_chunks(hdr, seed, buf, _encode_range, args):
        _encode(np.add(x, y), hdr, seed, buf, None)


def encode_decode_into(
    x: np.ndarray, hdr: CodecHeader, seed: int, buf: np.ndarray, decoded: np.ndarray
) -> None:
    """:func:`encode_into`, and ``decoded`` (may be ``x``) = decode(buf), in one pass."""
    dec = _kernel_view(decoded)
    if hdr.raw or dec is None or _overlap_shifted(x, decoded):
        dec = None  # a copy, an exotic float, an overlap: two passes
    if (not _encode(x, hdr, seed, buf, dec) or dec is None) and hdr.numel:
        decode_into(buf, hdr, decoded)


def reduce_encode_into(buf_in: np.ndarray, hdr_in: CodecHeader, acc: np.ndarray, divisor: int,
                       hdr: CodecHeader, seed: int, buf: np.ndarray, decoded: np.ndarray,
                       y: np.ndarray | None = None) -> bool:  # fmt: skip
    """acc += y (when given, float32); acc += decode(buf_in); acc /= divisor (when > 0);
    encode acc into ``buf`` and ``decoded`` = decode(buf), in one pass. False (nothing
    done) where the pass does not apply: widths or buckets that differ in and out,
    uncompressed segments, an exotic ``decoded`` dtype, ``decoded`` overlapping ``acc``
    shifted, or a kernel not compiled yet."""
    dec = _kernel_view(decoded)
    same = (hdr_in.bits, hdr_in.bucket_size, hdr_in.numel) == (hdr.bits, hdr.bucket_size, hdr.numel)
    if not same or hdr.raw or dec is None or acc.dtype != np.float32:
        return False
    if _overlap_shifted(acc, decoded):
        return False
    meta_in, _ = _meta_view(buf_in, hdr_in)
    codes_in = buf_in[hdr_in.codes_offset :]
    n, bits, bsize, div, st = hdr.numel, hdr.bits, hdr.bucket_size, divisor, hdr.stochastic

    def args(meta: Any, codes: Any, k: int, key: Any, nsc: int, c0: int, c1: int) -> tuple:
        return (codes_in, meta_in, acc, y, n, bits, bsize, k, div, st, key, meta, codes, c0,
                c1, nsc, dec)  # fmt: skip

    return _encode_chunks(hdr, seed, buf, _reduce_encode_range, args)


def _overlap_shifted(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` overlaps ``a`` at another start. The one-pass kernels write a bucket's
    decoded values right after reading it: fine on the same bucket, wrong shifted."""
    return b.ctypes.data != a.ctypes.data and np.may_share_memory(a, b)


def _encode(x: np.ndarray, hdr: CodecHeader, seed: int, buf: np.ndarray, dec: Any) -> bool:
    """Encode ``x`` into ``buf``; True if the kernel ran (and decoded into ``dec``, unless
    None), False if the NumPy reference encoded (``dec`` untouched)."""
    if hdr.raw:
        buf[:HEADER_NBYTES] = np.frombuffer(hdr.pack(), dtype=np.uint8)
        if hdr.numel:
            buf[HEADER_NBYTES:] = x.view(np.uint8)
        return True
    if _encode_chunks(hdr, seed, buf, _encode_range, _encode_args(x, None, hdr, dec)):
        return True
    reference.encode_into(x, hdr, seed, buf)
    return False


def _encode_args(x: np.ndarray, y: Any, hdr: CodecHeader, dec: Any) -> Callable[..., tuple]:
    """The argument builder of :func:`_encode_range` for :func:`_encode_chunks`."""
    xk = _kernel_view(x)
    n, bits, bsize, st = hdr.numel, hdr.bits, hdr.bucket_size, hdr.stochastic

    def args(meta: Any, codes: Any, k: int, key: Any, nsc: int, c0: int, c1: int) -> tuple:
        return (xk, y, n, bits, bsize, k, st, key, meta, codes, c0, c1, nsc, dec)

    return args


def _encode_chunks(
    hdr: CodecHeader, seed: int, buf: np.ndarray, kernel: Kernel, args: Callable[..., tuple]
) -> bool:
    """Write the header of a compressed segment into ``buf`` and :func:`_run` ``kernel``
    on its meta and codes (False, having run nothing, if it is not compiled yet)."""
    buf[:HEADER_NBYTES] = np.frombuffer(hdr.pack(), dtype=np.uint8)
    n = hdr.numel
    if n == 0:
        return True
    meta, is_view = _meta_view(buf, hdr)
    k, nchunks = chunking(hdr)
    nsc = min(k * hdr.bucket_size, n)  # scratch: one chunk of codes, never more than numel
    key = np.uint64(seed_key(seed))
    if not _run(kernel, args, meta, buf[hdr.codes_offset :], k, nchunks, key, nsc, hdr):
        return False
    if not is_view:
        buf[HEADER_NBYTES : hdr.codes_offset] = meta.view(np.uint8)
    return True


def _run(kernel: Kernel, args: Callable[..., tuple], meta: Any, codes: Any, k: int,
         nchunks: int, key: Any, nsc: int, hdr: CodecHeader) -> bool:  # fmt: skip
    """``kernel`` over the chunks of the segment ``hdr`` (shared with helper threads) with
    ``args(meta, codes, k, key, nsc, c0, c1)``: ``k`` buckets per chunk, the rounding key,
    the scratch size, the chunks. False, having run nothing, if not compiled yet."""
    n = hdr.numel
    if not kernel.ready(args(meta, codes, k, key, nsc, 0, 0), n):
        return False
    run = lambda c0, c1: kernel(*args(meta, codes, k, key, nsc, c0, c1))  # noqa: E731
    run_chunks(run, n, nchunks, k * hdr.bucket_size)
    return True


def _decode(buf: np.ndarray, hdr: CodecHeader, out: np.ndarray, add: bool) -> None:
    n = hdr.numel
    target = _kernel_view(out)
    if target is None and not hdr.raw:  # exotic float (longdouble): via float32, then cast
        tmp = np.empty(n, dtype=np.float32)
        _decode(buf, hdr, tmp, add=False)
        with np.errstate(over="ignore"):
            out[...] = tmp
        return
    if hdr.raw:  # NumPy's (and ml_dtypes') exact conversions, any alignment: one pass
        src = buf[HEADER_NBYTES:].view(hdr.dtype)
        with np.errstate(over="ignore"):  # too large for a narrower out: Inf, as IEEE says
            if add:
                np.add(out, src, out=out)
            elif src.dtype == out.dtype or np.float32 in (src.dtype, out.dtype):
                out[...] = src
            else:  # half to another half type: through float32, as the reference
                out[...] = src.astype(np.float32)
        return
    meta, _ = _meta_view(buf, hdr)
    k, nchunks = chunking(hdr)
    nsc = min(k * hdr.bucket_size, n)
    args = _decode_args(hdr, target, add)
    if not _run(_decode_range, args, meta, buf[hdr.codes_offset :], k, nchunks, None, nsc, hdr):
        (reference.decode_add_into if add else reference.decode_into)(buf, hdr, out)


def _decode_args(hdr: CodecHeader, out: np.ndarray, add: bool) -> Callable[..., tuple]:
    """The argument builder of :func:`_decode_range` for :func:`_run`."""
    n, bits, bsize = hdr.numel, hdr.bits, hdr.bucket_size

    def args(meta: Any, codes: Any, k: int, _key: Any, nsc: int, c0: int, c1: int) -> tuple:
        return (codes, meta, n, bits, bsize, k, out, add, c0, c1, nsc)

    return args


def encode_chunks_direct(x: np.ndarray, hdr: CodecHeader, seed: int, meta: np.ndarray,
                         codes: np.ndarray, k: int, nchunks: int, nsc: int) -> bool:  # fmt: skip
    """The kernels of :func:`encode_into` on a compressed segment whose header is written
    and whose meta (an aligned float32 view) and codes are given: for callers that
    checked everything once (:class:`.host_run.HostRun`). False, having written nothing,
    if the kernel is not compiled yet (then the caller runs the NumPy reference)."""
    key = np.uint64(seed_key(seed)) if seed else _KEY0
    return _run(_encode_range, _encode_args(x, None, hdr, None), meta, codes, k, nchunks, key, nsc,
                hdr)  # fmt: skip


def decode_add_direct(codes: np.ndarray, meta: np.ndarray, hdr: CodecHeader, acc: np.ndarray,
                      k: int, nchunks: int, nsc: int) -> bool:  # fmt: skip
    """The kernels of :func:`decode_add_into` on a compressed segment whose header was
    checked, its meta (an aligned float32 view) and codes given (as above; False, having
    added nothing, if the kernel is not compiled yet)."""
    return _run(_decode_range, _decode_args(hdr, acc, True), meta, codes, k, nchunks, None, nsc,
                hdr)  # fmt: skip


def decode_into(buf: np.ndarray, hdr: CodecHeader, out: np.ndarray) -> None:
    _decode(buf, hdr, out, add=False)


def decode_add_into(buf: np.ndarray, hdr: CodecHeader, acc: np.ndarray) -> None:
    _decode(buf, hdr, acc, add=True)


def warmup(dtypes: tuple[Any, ...] = (np.float32,)) -> None:
    """Compile (or load from the kernel cache), on the calling thread, the kernels the
    collectives use for ``dtypes``: encode, decode_add and decode, and the requantization
    of a float32 accumulator into each (serial and parallel calls, both roundings).
    Without it each signature compiles in the background once calls need it, and calls
    run the NumPy reference until then."""
    n = 8
    acc_hdr = CodecHeader(4, 1024, n, np.dtype(np.float32), False)
    acc, peer = np.zeros(n, np.float32), np.zeros(n, np.float32)
    peer.flags.writeable = False  # a node peer's mapped bytes
    acc_buf, out = empty_bytes(acc_hdr.nbytes), empty_bytes(acc_hdr.nbytes)
    with compiling_here():
        for dt in dtypes:
            x = np.zeros(n, dtype=dt)
            hdr = CodecHeader(4, 1024, n, np.dtype(dt), False)
            buf = empty_bytes(hdr.nbytes)
            encode_into(x, hdr, 0, buf)
            decode_into(buf, hdr, np.empty(n, dtype=dt))
            decode_add_into(buf, hdr, np.zeros(n, np.float32))
            # A peer's bytes mapped read-only (node-local mailboxes, the wire bytes a
            # two-level owner forwards) are kernels' arguments of another type.
            frozen = buf.copy()
            frozen.flags.writeable = False
            decode_add_into(frozen, hdr, np.zeros(n, np.float32))
            decode_into(frozen, hdr, np.empty(n, dtype=dt))
            encode_decode_into(np.zeros(n, np.float32), acc_hdr, 0, buf, np.empty(n, dtype=dt))
            encode_into(np.zeros(n, np.float32), acc_hdr, 0, acc_buf)
            reduce_encode_into(acc_buf, acc_hdr, acc, 2, acc_hdr, 0, out, np.empty(n, dtype=dt))
            # A peer's bytes read in its segment (one host, SRA's steps): read-only.
            ro = np.frombuffer(acc_buf.tobytes(), np.uint8)
            reduce_encode_into(ro, acc_hdr, acc, 2, acc_hdr, 0, out, np.empty(n, dtype=dt))
        # The two-level allreduce's sums with a node peer's bytes: encoded, and added by
        # the owner's requantization (float32 only).
        encode_sum_into(acc, peer, acc_hdr, 0, acc_buf)
        reduce_encode_into(acc_buf, acc_hdr, acc, 0, acc_hdr, 0, out, acc, peer)


def warm_up() -> None:
    """:func:`warmup` for every dtype the codec takes (float32, float16, bfloat16): no
    later call of the host codec compiles or runs the NumPy reference."""
    warmup((np.float32, np.float16, BFLOAT16))
