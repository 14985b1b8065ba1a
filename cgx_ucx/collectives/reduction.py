"""What one allreduce is asked to do (:class:`AllreduceSpec`) and the per-piece steps its
algorithms share (:class:`PieceSteps`): encode a piece for the wire, add a received piece
into an accumulator, and turn a reduced piece into the caller's result plus the bytes
every peer decodes.

Two paths, chosen per call by the layout:

- raw (every layer uncompressed): the caller's memory goes to UCX as is (a byte view, no
  staging, no copy); received pieces are added with the array module's ``add``.
- compressed: pieces are encoded into staging by the codec (inline or on the codec thread,
  :class:`~.piece_codec.CodecRunner`); received pieces are dequantize-added into a float32
  accumulator by one fused kernel.

The owner of a reduced piece quantizes it once and decodes those bytes into its own
buffer too, so every replica ends bit-identical (:func:`~.piece_codec.requantize_piece`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..arrays import xp_of
from ..errors import ProtocolError
from ..transport.frames import Algo
from .call import Call
from .piece_codec import (
    decode_add_piece,
    decode_piece,
    encode_piece,
    mix_seed,
    reduce_requantize_piece,
    requantize_piece,
)
from .plan import Piece, Plan
from .staging import byte_view, synchronize

if TYPE_CHECKING:
    from ..compression.host_run import HostRun

__all__ = ["AllreduceSpec", "PieceSteps", "encode_one_round", "host_run"]


@dataclass(frozen=True)
class AllreduceSpec:
    """An allreduce, validated: how the buffer is cut and how its pieces are reduced."""

    plan: Plan
    raw: bool  # every layer uncompressed: no codec, zero-copy sends
    avg: bool
    acc_dtype: np.dtype  # accumulator dtype
    # Accumulate straight into the caller's buffer (its dtype is the accumulator's): the
    # raw path, and the compressed one on float32, whose owner quantizes its reduced
    # piece from there and decodes it back over the same values (encode, then decode).
    inplace: bool
    stochastic: bool
    seed: int
    algorithm: Algo = Algo.SRA
    #: With ``avg``: how many contributions the sum is divided by, where that is not the
    #: group's size (the two-level allreduce's cross-node stage averages over the whole
    #: world while it requantizes, so no pass after it divides); 0: the group's size.
    divisor: int = 0
    #: What a path derives from this spec once and reuses on every call of the same
    #: arguments (the spec is kept per argument set): e.g. the mailbox path's
    #: :class:`~cgx_ucx.compression.host_run.HostRun`. Not an argument: a spec made with
    #: ``dataclasses.replace`` starts empty.
    memo: dict[Any, Any] = field(default_factory=dict, init=False, compare=False, repr=False)


def host_run(spec: AllreduceSpec, dtype: np.dtype) -> HostRun:
    """The host codec of the one piece of a compressed one-round ``spec`` (the mailbox
    path, :mod:`.local`, and the message path, :mod:`.oneshot`) on values of ``dtype``,
    built once per spec: the same bytes and sums as :func:`.encode_piece` /
    :func:`.decode_add_piece`, without their per-segment checks in Python."""
    key = ("host_run", dtype)
    run = spec.memo.get(key)
    if run is None:
        from ..compression.host_run import HostRun, RunSegment  # imports Numba

        piece = spec.plan.chunks[0].pieces[0]
        segs = [RunSegment(s.start - piece.start, s.numel, s.bits, s.bucket_size)
                for s in piece.segments]  # fmt: skip
        run = spec.memo[key] = HostRun(segs, dtype, spec.stochastic)
    return run


def encode_one_round(spec: AllreduceSpec, x: Any, out: Any, seq: int, rank: int) -> Any:
    """Rank ``rank``'s contribution to the one-round allreduce ``seq`` of host buffer ``x``
    encoded into ``out`` through :func:`host_run` (seeded as :func:`.encode_piece` seeds
    each segment); returns the wire bytes."""
    segments = spec.plan.chunks[0].pieces[0].segments
    seeds = (
        [mix_seed(spec.seed, seq, rank, s.layer, s.start) for s in segments]
        if spec.stochastic
        else ()
    )
    return host_run(spec, x.dtype).encode(x, out, seeds)


class PieceSteps:
    """The per-piece operations of an allreduce of the flat array ``x`` on one rank."""

    def __init__(self, call: Call, x: Any, spec: AllreduceSpec) -> None:
        self.call = call
        self.codec = call.codec
        self.x = x
        self.spec = spec
        self.plan = spec.plan
        self.dtype = x.dtype
        self.xp = xp_of(x)
        self.rank = call.rank
        self.n_world = call.world_size
        #: What ``op="avg"`` divides the sum by.
        self.divisor = spec.divisor or call.world_size

    def payload_nbytes(self, piece: Piece) -> int:
        """Bytes of ``piece`` on the wire."""
        if self.spec.raw:
            return piece.numel * self.dtype.itemsize
        return piece.wire_nbytes(self.dtype)

    @staticmethod
    def view(src: Any, base: int, piece: Piece) -> Any:
        """Raw path: the bytes of ``piece`` in ``src`` (which starts at ``base``), no copy."""
        return byte_view(src[piece.start - base : piece.stop - base])

    async def encode(
        self,
        src: Any,
        base: int,
        piece: Piece,
        raw_src: Any = None,
        raw_base: int = 0,
        addend: Any = None,
        dst: Any = None,
    ) -> Any:
        """Compressed path: ``piece`` of ``src`` (starting at ``base``) encoded into staging
        (or into ``dst``, the piece's wire bytes exactly); uncompressed segments from
        ``raw_src`` (starting at ``raw_base``) when given; ``src + addend`` when ``addend``
        (host values laid out as ``src``) is given."""
        spec = self.spec
        buf = dst if dst is not None else self.call.take(piece.wire_nbytes(self.dtype), self.x)
        out = await self.codec.run(
            piece.numel,
            encode_piece,
            src,
            base,
            piece,
            buf,
            spec.stochastic,
            spec.seed,
            self.call.seq,
            self.rank,
            raw_src,
            raw_base,
            None,
            addend,
        )
        synchronize(out)
        return out

    async def decode_add(self, buf: Any, piece: Piece, acc: Any, base: int) -> None:
        """Compressed path: ``acc`` (starting at ``base``) += the piece decoded from
        ``buf``."""
        await self.codec.run(piece.numel, decode_add_piece, buf, piece, acc, base, self.dtype)

    async def reduce_requantize_into(
        self, buf: Any, piece: Piece, acc: Any, base: int, out: Any, addend: Any = None
    ) -> Any:
        """Compressed path, the owner's last step on a piece: :meth:`decode_add` of
        ``buf`` (and ``addend``), the average if asked, then the sum requantized into
        ``out`` and decoded into the caller's buffer, in one pass
        (:func:`~.piece_codec.reduce_requantize_piece`). Returns the wire bytes."""
        spec = self.spec
        return await self.codec.run(
            piece.numel,
            reduce_requantize_piece,
            buf,
            piece,
            acc,
            base,
            self.x,
            self.divisor if spec.avg else 0,
            out,
            spec.stochastic,
            spec.seed,
            self.call.seq,
            self.rank,
            addend,
        )

    def add_raw(self, a: Any, buf: Any, piece: Piece) -> None:
        """Raw path: ``a`` (the accumulator's slice for ``piece``) += received bytes."""
        self.xp.add(a, buf.view(self.dtype) if piece.numel else buf[:0].view(self.dtype), out=a)

    def raw_result(self, piece: Piece, a: Any, acc_is_x: bool) -> Any:
        """Raw path: the reduced ``a`` written into the caller's buffer; its bytes."""
        x = self.x
        if not acc_is_x:
            x[piece.start : piece.stop] = a
        return byte_view(x[piece.start : piece.stop])

    async def requantize(self, piece: Piece, acc: Any, base: int) -> Any:
        """Compressed path: the reduced piece (in ``acc``, starting at ``base``) quantized
        once and decoded into the caller's buffer; returns the wire bytes."""
        x, spec = self.x, self.spec
        for seg in piece.segments:
            if seg.bits == 32:
                x[seg.start : seg.stop] = acc[seg.start - base : seg.stop - base]
        buf = self.call.take(piece.wire_nbytes(self.dtype), x)
        return await self.codec.run(
            piece.numel,
            requantize_piece,
            acc,
            base,
            piece,
            buf,
            x,
            spec.stochastic,
            spec.seed,
            self.call.seq,
            self.rank,
        )

    async def recv_result(
        self, peer: int, phase: int, slot: int, piece: Piece, count: int | None = None
    ) -> Any:
        """Receive the reduced ``piece`` that ``peer`` sends on (phase, slot) into the
        caller's buffer (``count``: the pieces its header must announce); returns what
        arrived (the buffer's slice on the raw path, the wire bytes otherwise)."""
        if self.spec.raw:
            buf = self.x[piece.start : piece.stop]
        else:
            buf = self.call.take(piece.wire_nbytes(self.dtype), self.x)
        frame = await self.call.recv_piece(peer, phase, slot, buf)
        if count is not None and frame.count != count:
            raise ProtocolError(f"rank {peer} announced {frame.count} pieces, {count} expected")
        if self.spec.raw:
            return buf
        await self.codec.run(piece.numel, decode_piece, buf, piece, self.x, 0, self.dtype)
        return buf
