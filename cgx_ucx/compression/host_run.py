"""A fixed run of segments encoded back to back on the host, with its checks made once.

A one-round allreduce of a small buffer encodes one run of segments (a piece: each
segment a part of one layer with its own bits and bucket size) and decode-adds N of them.
Through :func:`~.codec.encode` / :func:`~.codec.decode_add` each segment pays the generic
argument checks, a header pack or parse and the kernel set-up in Python, which for a small
segment take many times the kernel's own time. A :class:`HostRun` does that work once per
layout: the headers, offsets, chunking and scratch sizes are computed when it is built; a
call checks what can differ between calls (the buffers' sizes, the meta's alignment: an
unaligned float32 view is another Numba type, see ``cpu._meta_view``; and, on decode,
every header byte) and calls the kernels of :mod:`.cpu` directly (or, while a kernel is
not compiled yet or nothing has needed the kernels yet (:func:`~.codec.host_kernels`),
the NumPy reference, whose bytes are the same).

The bytes written and the values accumulated are exactly those of
:func:`~.codec.encode` and :func:`~.codec.decode_add` segment by segment (the same
kernels with the same arguments). What it cannot take on its fast path (a buffer whose
float32 meta would be unaligned, a header that is not the expected one, a length that is
not the run's) goes through those functions, which raise the same
:class:`~cgx_ucx.errors.CodecError` they always do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..arrays import as_uint8_buffer
from ..errors import CodecError
from . import codec, reference
from .codec import HEADER_NBYTES, RAW_BITS, CodecHeader, chunking, host_kernels

__all__ = ["HostRun", "RunSegment"]


@dataclass(frozen=True)
class RunSegment:
    """One segment of a run: values [start, start + numel) of the run's source."""

    start: int
    numel: int
    bits: int
    bucket_size: int


@dataclass(frozen=True)
class _Prog:
    """What the kernels need for one segment, computed once."""

    start: int
    stop: int
    offset: int  # first byte of the segment in the run
    end: int  # one past its last byte
    header: bytes
    header_u8: np.ndarray
    hdr: CodecHeader
    codes: int  # first byte of the codes (or raw values), from the run's start
    k: int  # buckets per chunk
    nchunks: int
    nsc: int  # scratch values


class HostRun:
    """The codec of a run of ``segments`` of values of ``dtype`` (float32, float16 or
    bfloat16), rounding stochastically when ``stochastic`` (then every encode takes one
    seed per segment)."""

    def __init__(self, segments: Sequence[RunSegment], dtype: np.dtype, stochastic: bool) -> None:
        self.dtype = np.dtype(dtype)
        self.stochastic = bool(stochastic)
        progs = []
        pos = 0
        for s in segments:
            st = self.stochastic and s.bits != RAW_BITS
            hdr = CodecHeader(s.bits, s.bucket_size, s.numel, self.dtype, st)
            header = hdr.pack()
            k, nchunks = (1, 0) if hdr.raw else chunking(hdr)
            progs.append(
                _Prog(
                    start=s.start,
                    stop=s.start + s.numel,
                    offset=pos,
                    end=pos + hdr.nbytes,
                    header=header,
                    header_u8=np.frombuffer(header, np.uint8),
                    hdr=hdr,
                    codes=pos + hdr.codes_offset,
                    k=k,
                    nchunks=nchunks,
                    nsc=min(k * s.bucket_size, s.numel),
                )
            )
            pos += hdr.nbytes
        self._progs = tuple(progs)
        #: Bytes of the whole run, and values of its source.
        self.nbytes = pos
        self.numel = max((p.stop for p in progs), default=0)

    @property
    def segments(self) -> int:
        return len(self._progs)

    def encode(self, x: np.ndarray, out: np.ndarray, seeds: Sequence[int] = ()) -> np.ndarray:
        """Encode ``x`` (values of the run's dtype, the run's source) into the front of
        ``out`` (uint8, at least :attr:`nbytes`); returns ``out[:nbytes]``. ``seeds``:
        one per segment when the run is stochastic."""
        out = as_uint8_buffer(out, "out")[: self.nbytes]
        if out.shape[0] != self.nbytes:
            raise CodecError(f"out holds {out.shape[0]} bytes, the run needs {self.nbytes}")
        self._check_values(x, self.dtype, "x")
        for i, p in enumerate(self._progs):
            part = x[p.start : p.stop]
            seg = out[p.offset : p.end]
            if p.hdr.raw:  # the header and the values' bytes, as the codec writes them
                seg[:HEADER_NBYTES] = p.header_u8
                seg[HEADER_NBYTES:] = part.view(np.uint8)
                continue
            seed = seeds[i] if p.hdr.stochastic else 0
            meta = out[p.offset + HEADER_NBYTES : p.codes].view(np.float32)
            if not meta.flags.aligned:
                codec.encode(
                    part, p.hdr.bits, p.hdr.bucket_size, out=seg, stochastic=p.hdr.stochastic,
                    seed=seed,
                )  # fmt: skip
                continue
            seg[:HEADER_NBYTES] = p.header_u8
            if not p.hdr.numel:
                continue
            cpu = host_kernels(p.hdr.numel)
            if cpu is None or not cpu.encode_chunks_direct(
                part, p.hdr, seed, meta, out[p.codes : p.end], p.k, p.nchunks, p.nsc
            ):
                reference.encode_into(part, p.hdr, seed, seg)  # the kernel is not compiled yet
        return out

    def decode_add(self, buf: np.ndarray, acc: np.ndarray) -> None:
        """``acc += decode(buf)`` segment by segment, ``buf`` a run of this layout
        (possibly read-only: a peer's mapped bytes), ``acc`` float32 of the run's values
        (the source's indices). Any header byte that is not this run's, or a length that
        is not, goes through :func:`~.codec.decode_add`'s checks (CodecError)."""
        buf = as_uint8_buffer(buf)  # 1-D contiguous uint8 (the kernels' type), else CodecError
        self._check_values(acc, np.dtype(np.float32), "acc")
        if buf.shape[0] != self.nbytes:
            self._decode_add_checked(buf, acc)
            return
        for p in self._progs:
            seg = buf[p.offset : p.end]
            a = acc[p.start : p.stop]
            if seg[:HEADER_NBYTES].tobytes() != p.header:
                codec.decode_add(seg, a)  # raises the CodecError that names the difference
                continue
            if p.hdr.raw:  # added as the codec adds uncompressed values (any alignment)
                with np.errstate(over="ignore"):
                    np.add(a, seg[HEADER_NBYTES:].view(self.dtype), out=a)
                continue
            meta = buf[p.offset + HEADER_NBYTES : p.codes].view(np.float32)
            if not meta.flags.aligned:
                codec.decode_add(seg, a)
                continue
            if not p.hdr.numel:
                continue
            cpu = host_kernels(p.hdr.numel)
            if cpu is None or not cpu.decode_add_direct(
                buf[p.codes : p.end], meta, p.hdr, a, p.k, p.nchunks, p.nsc
            ):
                reference.decode_add_into(seg, p.hdr, a)  # the kernel is not compiled yet

    def _check_values(self, a: np.ndarray, dtype: np.dtype, what: str) -> None:
        """``a`` is the 1-D contiguous array of the run's source (``numel`` values of
        ``dtype``) on the host, else CodecError."""
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1:
            raise CodecError(f"{what} must be a 1-D NumPy array of {dtype}")
        if not a.flags.c_contiguous or a.shape[0] != self.numel:
            raise CodecError(
                f"{what} must be contiguous with {self.numel} values, got shape {a.shape}"
            )

    def _decode_add_checked(self, buf: np.ndarray, acc: np.ndarray) -> None:
        """The generic path, segment by segment, for a buffer the fast one refuses."""
        if buf.shape[0] < self.nbytes:
            raise CodecError(f"truncated: {buf.shape[0]} bytes, the run is {self.nbytes}")
        if buf.shape[0] > self.nbytes:
            raise CodecError(f"oversized: {buf.shape[0]} bytes, the run is {self.nbytes}")
        for p in self._progs:
            codec.decode_add(buf[p.offset : p.end], acc[p.start : p.stop])
