"""How a buffer is cut into per-rank chunks and pipeline pieces (DESIGN.md, "Data path").

Chunk boundaries may split a layer only at a multiple of that layer's bucket size from
the layer's start, so every quantization bucket of a chunk is a bucket of the whole
layer: quantizing per chunk gives the same buckets (and the same error bound) as
quantizing the layer at once. Uncompressed layers may be cut anywhere.

Each chunk is further cut (by the same rule) into pieces of about :data:`PIECE_BYTES`
of input: every piece is one message, so encoding piece k+1 overlaps sending piece k,
and receiving piece k+1 overlaps reducing piece k.

Plans depend only on (layout, world size, piece size), all of which every rank agrees
on (the layout digest is checked in every header), so every rank computes the same cuts
without talking. They are cached: a training loop reuses a handful of layouts.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import numpy as np

from ..compression import encoded_nbytes
from ..layout import Layout

__all__ = [
    "PIECE_BYTES",
    "PIECE_GROWTH",
    "Chunk",
    "Piece",
    "Plan",
    "Segment",
    "flat_piece_bytes",
    "make_plan",
]

#: Input bytes per pipeline piece. 4 MiB: large enough that per-message overhead
#: (two UCX messages, a few Python awaits: ~0.1 ms) stays under 5% at 2 GB/s, small
#: enough that a 64 MiB buffer on 2 ranks still gets 8 pieces per chunk to overlap.
PIECE_BYTES = 4 << 20
#: Flat allreduces of large chunks take larger pieces, up to this many times the base
#: size: each piece costs a rendezvous hand-shake per message and a hand-off to the codec
#: thread (on 2 vCPUs, 2 ranks, 64 MiB at 4 bits over loopback: 1 MiB pieces 78 ms,
#: 2 MiB 57, 4 MiB 44, 8 MiB 40, 16 MiB 39; over the emulated 10 Gbit/s link, interleaved,
#: 8 MiB 45.6-49.8 ms against 4 MiB 50.3-52.5; measured with this constant varied by
#: ``python -m cgx_ucx.bench allreduce --world 2 --sizes 64 --bits 4`` and
#: ``python -m cgx_ucx.bench link --rates 10gbit --world 2 --sizes 64``).
PIECE_GROWTH = 2
#: ... while each chunk keeps at least this many pieces to overlap codec and wire (16 MiB
#: at 1 Gbit/s on 2 ranks: 31 ms as one 8 MiB piece per chunk, 25 ms as two of 4 MiB;
#: ``python -m cgx_ucx.bench link --rates 1gbit --world 2 --sizes 16``).
MIN_PIECES = 4


def flat_piece_bytes(chunk_bytes: int, base: int = PIECE_BYTES) -> int:
    """Input bytes per piece of a flat allreduce whose chunks hold ``chunk_bytes``:
    ``base``, up to PIECE_GROWTH times it for chunks of more than MIN_PIECES pieces."""
    return min(max(base, chunk_bytes // MIN_PIECES), PIECE_GROWTH * base)


@functools.lru_cache(maxsize=4096)
def _wire_nbytes(numel: int, bits: int, bucket_size: int, dtype: np.dtype) -> int:
    """:func:`encoded_nbytes`, remembered: every piece of every call asks for it."""
    return encoded_nbytes(numel, bits, bucket_size, dtype)


@dataclass(frozen=True)
class Segment:
    """Values [start, stop) of one layer, quantized with (bits, bucket_size); 32 = raw."""

    start: int
    stop: int
    bits: int
    bucket_size: int
    layer: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def wire_nbytes(self, dtype: np.dtype) -> int:
        return _wire_nbytes(self.numel, self.bits, self.bucket_size, np.dtype(dtype))


@dataclass(frozen=True)
class Piece:
    start: int
    stop: int
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def wire_nbytes(self, dtype: np.dtype) -> int:
        return sum(s.wire_nbytes(dtype) for s in self.segments)


@dataclass(frozen=True)
class Chunk:
    start: int
    stop: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    chunks: tuple[Chunk, ...]

    @property
    def max_pieces(self) -> int:
        return max(len(c.pieces) for c in self.chunks)


class _Cutter:
    def __init__(self, layout: Layout) -> None:
        self.layers = layout.layers
        self.offsets = [spec.offset for spec in self.layers]
        self.numel = layout.numel

    def cut(self, target: int, lo: int, hi: int) -> int:
        """The allowed cut nearest to ``target`` inside [lo, hi] (lo, hi are allowed cuts)."""
        if target <= lo:
            return lo
        if target >= hi:
            return hi
        i = bisect.bisect_right(self.offsets, target) - 1
        spec = self.layers[i]
        if not spec.compressed:
            return target
        k = (target - spec.offset + spec.bucket_size // 2) // spec.bucket_size
        return min(max(spec.offset + k * spec.bucket_size, lo), min(spec.end, hi))

    def segments(self, start: int, stop: int) -> tuple[Segment, ...]:
        out = []
        if start >= stop:
            return ()
        i = bisect.bisect_right(self.offsets, start) - 1
        while i < len(self.layers) and self.layers[i].offset < stop:
            spec = self.layers[i]
            a, b = max(spec.offset, start), min(spec.end, stop)
            if b > a:
                out.append(Segment(a, b, spec.bits, spec.bucket_size, i))
            i += 1
        return tuple(out)

    def split(self, start: int, stop: int, parts: int) -> list[int]:
        """``parts + 1`` allowed cuts from start to stop, as even as the rule allows."""
        cuts = [start]
        for j in range(1, parts):
            target = start + (stop - start) * j // parts
            cuts.append(self.cut(target, cuts[-1], stop))
        cuts.append(stop)
        return cuts


@functools.lru_cache(maxsize=64)
def make_plan(layout: Layout, world_size: int, piece_numel: int, max_pieces: int) -> Plan:
    """Chunks (one per rank) and their pieces (at most ``max_pieces`` per chunk, >= 1)."""
    cutter = _Cutter(layout)
    bounds = cutter.split(0, layout.numel, world_size)
    chunks = []
    for r in range(world_size):
        a, b = bounds[r], bounds[r + 1]
        npieces = max(1, min(max_pieces, -(-(b - a) // max(piece_numel, 1))))
        cuts = cutter.split(a, b, npieces)
        pieces = tuple(
            Piece(cuts[k], cuts[k + 1], cutter.segments(cuts[k], cuts[k + 1]))
            for k in range(npieces)
        )
        chunks.append(Chunk(a, b, pieces))
    return Plan(tuple(chunks))
