"""The codec applied to pipeline pieces, and where that work runs.

A piece (:class:`~.plan.Piece`) is a run of segments, each a part of one layer with its
own bits and bucket size; its wire form is the segments' encodings back to back (each
carries its own header, so a payload is self-describing). :class:`CodecRunner` runs
small pieces inline on the event loop and large ones on one codec thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ..arrays import is_cupy, xp_of
from ..compression import decode, decode_add, encode, encode_decode, encode_sum, reduce_encode
from ..transport.progress import no_spare_core
from .plan import Piece

__all__ = [
    "CODEC_INLINE_NUMEL",
    "CodecRunner",
    "decode_add_piece",
    "decode_piece",
    "encode_piece",
    "mix_seed",
    "reduce_requantize_piece",
    "requantize_piece",
]

T = TypeVar("T")

#: Pieces smaller than this run the codec inline on the event loop; larger ones on the
#: communicator's codec thread, so the loop keeps driving UCX while a piece is encoded
#: (the kernels release the GIL). 256 Ki values: a fraction of a millisecond of 4-bit
#: encoding, the order of a thread hand-off.
CODEC_INLINE_NUMEL = 1 << 18


class CodecRunner:
    """Runs codec work for pieces: small ones inline, large ones on one codec thread,
    unless the host has no spare core (then inline too: the hand-off would cost two
    thread wake-ups, each waiting for a time slice, and no parallelism)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def run(self, numel: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, for a piece of ``numel`` values."""
        if numel < CODEC_INLINE_NUMEL or no_spare_core():
            return fn(*args)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cgx-codec")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


def _gpu_batch(a: Any, piece: Piece) -> Any:
    """The GPU codec (:mod:`cgx_ucx.compression.gpu`) when ``a`` is a CuPy array and
    ``piece`` has several segments: it encodes or decodes them all in one launch instead of
    one launch (35-40 us from Python) per segment; else None."""
    if len(piece.segments) > 1 and is_cupy(a):
        from ..compression import gpu

        return gpu
    return None


def mix_seed(*parts: int) -> int:
    """A 64-bit seed from (seed, sequence, rank, layer, offset): splitmix64 chaining."""
    h = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    for p in parts:
        h = (h ^ (p & mask)) & mask
        h = (h + 0x9E3779B97F4A7C15) & mask
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        h = z ^ (z >> 31)
    return h


def encode_piece(
    src: Any,
    base: int,
    piece: Piece,
    out: Any,
    stochastic: bool,
    seed: int,
    seq: int,
    rank: int,
    raw_src: Any = None,
    raw_base: int = 0,
    decoded: Any = None,
    addend: Any = None,
) -> Any:
    """Encode values [piece.start, piece.stop) of ``src`` (which starts at ``base``).

    Uncompressed segments are taken from ``raw_src`` when given (the owner's reduced
    values already written back to the caller's buffer, in its dtype). ``decoded``
    (starting at ``raw_base``) also receives what the compressed segments decode to.
    ``addend`` (host values like ``src``, starting at ``base``): the values encoded are
    ``src + addend``, summed as the encode reads them (:func:`~.codec.encode_sum`).
    """
    if addend is not None:
        return _encode_sum_piece(src, addend, base, piece, out, stochastic, seed, seq, rank)
    items = []
    for seg in piece.segments:
        if seg.bits == 32 and raw_src is not None:
            part = raw_src[seg.start - raw_base : seg.stop - raw_base]
        else:
            part = src[seg.start - base : seg.stop - base]
        s = mix_seed(seed, seq, rank, seg.layer, seg.start) if stochastic else 0
        dst = None
        if decoded is not None and seg.bits != 32:
            dst = decoded[seg.start - raw_base : seg.stop - raw_base]
        items.append((part, seg.bits, seg.bucket_size, stochastic and seg.bits != 32, s, dst))
    gpu = _gpu_batch(out, piece)
    if gpu is not None:
        return gpu.encode_segments(items, out)
    pos = 0
    for seg, (part, bits, bucket_size, st, s, dst) in zip(piece.segments, items, strict=True):
        n = seg.wire_nbytes(part.dtype)
        kw = {"out": out[pos : pos + n], "stochastic": st, "seed": s}
        if dst is None:
            encode(part, bits, bucket_size, **kw)
        else:
            encode_decode(part, bits, bucket_size, decoded=dst, **kw)
        pos += n
    return out[:pos]


def _encode_sum_piece(
    src: Any, addend: Any, base: int, piece: Piece, out: Any, stochastic: bool, seed: int,
    seq: int, rank: int,
) -> Any:  # fmt: skip
    """:func:`encode_piece` of ``src + addend`` (host arrays), segment by segment."""
    pos = 0
    for seg in piece.segments:
        lo, hi = seg.start - base, seg.stop - base
        n = seg.wire_nbytes(src.dtype)
        st = stochastic and seg.bits != 32
        s = mix_seed(seed, seq, rank, seg.layer, seg.start) if st else 0
        encode_sum(src[lo:hi], addend[lo:hi], seg.bits, seg.bucket_size, out=out[pos : pos + n],
                   stochastic=st, seed=s)  # fmt: skip
        pos += n
    return out[:pos]


def _outputs(piece: Piece, out: Any, base: int, dtype: np.dtype) -> list[tuple[Any, ...]]:
    """(bits, bucket size, wire dtype, output slice) of each segment, for a batched decode
    (which returns False, having written nothing, where the buffer is not this layout: the
    segment-by-segment path then raises the codec's error)."""
    return [(s.bits, s.bucket_size, dtype, out[s.start - base : s.stop - base])
            for s in piece.segments]  # fmt: skip


def decode_add_piece(buf: Any, piece: Piece, acc: Any, base: int, dtype: np.dtype) -> None:
    """acc[piece] += decode(buf) segment by segment (acc float32, starting at ``base``)."""
    gpu = _gpu_batch(acc, piece)
    if gpu is not None and gpu.decode_segments(buf, _outputs(piece, acc, base, dtype), add=True):
        return
    pos = 0
    for seg in piece.segments:
        n = seg.wire_nbytes(dtype)
        decode_add(buf[pos : pos + n], acc[seg.start - base : seg.stop - base])
        pos += n


def decode_piece(buf: Any, piece: Piece, out: Any, base: int, dtype: np.dtype) -> None:
    """out[piece] = decode(buf) segment by segment (out starting at ``base``)."""
    gpu = _gpu_batch(out, piece)
    if gpu is not None and gpu.decode_segments(buf, _outputs(piece, out, base, dtype)):
        return
    pos = 0
    for seg in piece.segments:
        n = seg.wire_nbytes(dtype)
        decode(buf[pos : pos + n], out=out[seg.start - base : seg.stop - base])
        pos += n


def requantize_piece(
    acc: Any,
    base: int,
    piece: Piece,
    buf: Any,
    x: Any,
    stochastic: bool,
    seed: int,
    seq: int,
    rank: int,
) -> Any:
    """The owner of a reduced piece: quantize it once (into ``buf``) and decode it into its
    own buffer ``x`` too, so its replica equals what every peer decodes; returns the wire
    bytes. ``acc`` (float32, starting at ``base``) holds the reduced values; uncompressed
    segments must already be written back to ``x``, and are sent from there.
    """
    return encode_piece(
        acc, base, piece, buf, stochastic, seed, seq, rank, raw_src=x, raw_base=0, decoded=x
    )


def reduce_requantize_piece(
    buf: Any,
    piece: Piece,
    acc: Any,
    base: int,
    x: Any,
    divisor: int,
    out: Any,
    stochastic: bool,
    seed: int,
    seq: int,
    rank: int,
    addend: Any = None,
) -> Any:
    """The owner's last contribution to a piece and its requantization at once:
    ``acc[piece] += addend[piece]`` (when given: values laid out as ``acc``),
    ``decode_add_piece(buf, ...)``, ``acc[piece] /= divisor`` (when > 0), then
    ``requantize_piece(...)`` into ``out``, with the same bytes and values as those steps
    (one pass per compressed segment, :func:`~cgx_ucx.compression.reduce_encode`).
    ``buf`` is the peer's encoding of the piece (segments of the caller's dtype ``x.dtype``);
    returns the wire bytes."""
    if _gpu_batch(acc, piece) is not None:  # the same steps, one launch each way
        if addend is not None:  # the segments are consecutive: one addition over the piece
            lo, hi = piece.segments[0].start - base, piece.segments[-1].stop - base
            xp_of(acc).add(acc[lo:hi], addend[lo:hi], out=acc[lo:hi])
        decode_add_piece(buf, piece, acc, base, x.dtype)
        if divisor:  # the segments are consecutive: one division over the piece
            a = acc[piece.segments[0].start - base : piece.segments[-1].stop - base]
            xp_of(a).divide(a, divisor, out=a)
        for seg in piece.segments:
            if seg.bits == 32:
                x[seg.start : seg.stop] = acc[seg.start - base : seg.stop - base]
        return requantize_piece(acc, base, piece, out, x, stochastic, seed, seq, rank)
    pos_in = pos = 0
    for seg in piece.segments:
        n_in = seg.wire_nbytes(x.dtype)
        part_in = buf[pos_in : pos_in + n_in]
        a = acc[seg.start - base : seg.stop - base]
        y = None if addend is None else addend[seg.start - base : seg.stop - base]
        dst = x[seg.start : seg.stop]
        if seg.bits == 32:
            if y is not None:
                xp_of(a).add(a, y, out=a)
            decode_add(part_in, a)
            if divisor:
                xp_of(a).divide(a, divisor, out=a)
            dst[...] = a
            n = seg.wire_nbytes(x.dtype)
            encode(dst, 32, seg.bucket_size, out=out[pos : pos + n])
        else:
            n = seg.wire_nbytes(a.dtype)
            s = mix_seed(seed, seq, rank, seg.layer, seg.start) if stochastic else 0
            reduce_encode(
                part_in,
                a,
                seg.bits,
                seg.bucket_size,
                decoded=dst,
                divisor=divisor,
                out=out[pos : pos + n],
                stochastic=stochastic,
                seed=s,
                addend=y,
            )
        pos_in += n_in
        pos += n
    return out[:pos]
