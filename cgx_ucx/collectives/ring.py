"""Ring allreduce: N-1 compressed reduce-scatter hops, then N-1 allgather hops, pipelined
by piece (DESIGN.md "Data path", step 5).

Traffic per link is the same as SRA's, but each rank talks to two neighbours only (better
for large worlds), and partial sums are re-quantized at each hop (error grows with N).
On rank r:

1. Reduce-scatter (:meth:`Ring.reduce_scatter`): step s sends chunk (r - s) to the right
   and receives chunk (r - s - 1) from the left, adds our values and forwards the sum.
2. After N-1 steps chunk (r + 1) is complete: r finalizes it (:meth:`Ring.publish`),
   quantized once, decoded into its own buffer too, and starts it round the ring.
3. Allgather (:meth:`Ring.allgather`): step s receives chunk (r - s) and forwards its
   bytes unchanged, so every replica ends bit-identical.

Raw pieces are sent straight from the accumulators (no copy), so each reduce-scatter
step gets its own; encoded pieces are copied out by the codec, so two alternating
accumulators suffice. Host staging for received and encoded pieces goes back to the pool
as soon as its bytes are consumed or sent (:meth:`~.call.Call.give`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import ProtocolError
from .call import PH_DATA, PH_GATHER, Call, cancel_pending, gather_or_cancel
from .piece_codec import decode_add_piece
from .plan import Chunk, Piece
from .reduction import AllreduceSpec, PieceSteps
from .staging import byte_view, synchronize

__all__ = ["Ring", "ring"]


async def ring(call: Call, x: Any, spec: AllreduceSpec) -> None:
    """Ring allreduce of the flat array ``x``, in place (pipelined by piece)."""
    await Ring(call, x, spec).run()


class Ring(PieceSteps):
    """One ring allreduce on this rank."""

    def __init__(self, call: Call, x: Any, spec: AllreduceSpec) -> None:
        super().__init__(call, x, spec)
        self.left = (self.rank - 1) % self.n_world
        self.right = (self.rank + 1) % self.n_world
        #: Slots per step: piece k of step s travels in slot s * P + k.
        self.P = self.plan.max_pieces
        self.steps = self.n_world - 1
        self.sends: list[asyncio.Future] = []
        self.accs: list[Any] = []

    async def run(self) -> None:
        await self.call.exchange_signatures()
        if self.n_world == 1:
            return
        self.accs = self.accumulators()
        try:
            acc, base = await self.reduce_scatter()
            await self.publish(acc, base)
            await self.allgather()
            await gather_or_cancel(self.sends)
        finally:
            await cancel_pending(self.sends)
        synchronize(self.x)

    def accumulators(self) -> list[Any]:
        spec, xp = self.spec, self.xp
        biggest = max(c.numel for c in self.plan.chunks)
        accs = []
        for _ in range(self.steps if spec.raw else min(2, self.steps)):
            raw_acc = self.call.take(biggest * spec.acc_dtype.itemsize, self.x)
            accs.append(raw_acc.view(spec.acc_dtype) if biggest else xp.empty(0, spec.acc_dtype))
        return accs

    def send(
        self, phase: int, step: int, k: int, payload: Any, count: int, staged: bool = False
    ) -> None:
        """Piece ``k`` of ``step`` to the right neighbour (in the background); ``staged``:
        ``payload`` is staging, given back once sent."""
        slot = step * self.P + k
        fut = asyncio.ensure_future(self.call.send(self.right, phase, slot, payload, count))
        self.sends.append(fut)
        if staged:
            self.call.give_after([fut], payload)

    async def wire(self, src: Any, base: int, piece: Piece) -> Any:
        if self.spec.raw:
            return self.view(src, base, piece)
        return await self.encode(src, base, piece)

    async def encode_partial(self, acc: Any, base: int, piece: Piece) -> Any:
        """Compressed path: a partial sum for the next hop. Its uncompressed segments travel
        in the buffer's dtype, as the receiver expects (rounded, like the raw path's
        partial sums), not in the float32 of the accumulator."""
        dtype = self.dtype
        if dtype == acc.dtype or all(seg.bits != 32 for seg in piece.segments):
            return await self.encode(acc, base, piece)
        tmp = self.call.take(piece.numel * dtype.itemsize, self.x).view(dtype)
        for seg in piece.segments:
            if seg.bits == 32:
                tmp[seg.start - piece.start : seg.stop - piece.start] = acc[
                    seg.start - base : seg.stop - base
                ]
        wire = await self.encode(acc, base, piece, tmp, piece.start)
        self.call.give(tmp)
        return wire

    # -- step 1 --------------------------------------------------------------------------
    async def reduce_scatter(self) -> tuple[Any, int]:
        """Returns the accumulator holding the complete chunk (r + 1), and its start."""
        r, n_world, plan = self.rank, self.n_world, self.plan
        first = plan.chunks[r]
        for k, piece in enumerate(first.pieces):
            wire = await self.wire(self.x, 0, piece)
            self.send(PH_DATA, 0, k, wire, len(first.pieces), staged=not self.spec.raw)
        acc, base = self.accs[0], 0
        for s in range(self.steps):
            chunk = plan.chunks[(r - s - 1) % n_world]
            acc, base = self.accs[s % len(self.accs)], chunk.start
            for k, piece in enumerate(chunk.pieces):
                await self.reduce_piece(s, k, chunk, piece, acc)
        return acc, base

    async def reduce_piece(self, s: int, k: int, chunk: Chunk, piece: Piece, acc: Any) -> None:
        """Step ``s``: our values plus the left neighbour's partial sum, sent on unless last."""
        x, dtype, base, count = self.x, self.dtype, chunk.start, len(chunk.pieces)
        buf = await self.recv_partial(s, k, count, piece)
        a = acc[piece.start - base : piece.stop - base]
        a[...] = x[piece.start : piece.stop]
        if self.spec.raw:
            self.add_raw(a, buf, piece)
        else:
            await self.codec.run(piece.numel, decode_add_piece, buf, piece, acc, base, dtype)
        self.call.give(buf)
        if s == self.steps - 1:
            return
        if self.spec.raw and self.spec.acc_dtype != dtype:
            tmp = self.call.take(piece.numel * dtype.itemsize, x)
            tv = tmp.view(dtype) if piece.numel else self.xp.empty(0, dtype)
            tv[...] = a
            self.send(PH_DATA, s + 1, k, byte_view(tv), count, staged=True)
        elif self.spec.raw:
            self.send(PH_DATA, s + 1, k, self.view(acc, base, piece), count)
        else:
            wire = await self.encode_partial(acc, base, piece)
            self.send(PH_DATA, s + 1, k, wire, count, staged=True)

    async def recv_partial(self, s: int, k: int, count: int, piece: Piece) -> Any:
        buf = self.call.take(self.payload_nbytes(piece), self.x)
        frame = await self.call.recv_piece(self.left, PH_DATA, s * self.P + k, buf)
        if frame.count != count:
            raise ProtocolError(
                f"rank {self.left} announced {frame.count} pieces, {count} expected"
            )
        return buf

    # -- step 2 --------------------------------------------------------------------------
    async def publish(self, acc: Any, base: int) -> None:
        """Finalize the complete chunk (r + 1), write it into our buffer, start the allgather."""
        own = self.plan.chunks[(self.rank + 1) % self.n_world]
        for k, piece in enumerate(own.pieces):
            a = acc[piece.start - base : piece.stop - base]
            if self.spec.avg:
                self.xp.divide(a, self.divisor, out=a)
            if self.spec.raw:
                payload = self.raw_result(piece, a, acc_is_x=False)
            else:
                payload = await self.requantize(piece, acc, base)
            synchronize(payload)
            self.send(PH_GATHER, 0, k, payload, len(own.pieces), staged=not self.spec.raw)

    # -- step 3 --------------------------------------------------------------------------
    async def allgather(self) -> None:
        """Step s receives chunk (r - s), owned by rank (r - s - 1), and forwards it."""
        for s in range(self.steps):
            chunk = self.plan.chunks[(self.rank - s) % self.n_world]
            for k, piece in enumerate(chunk.pieces):
                got = await self.recv_result(self.left, PH_GATHER, s * self.P + k, piece)
                staged = not self.spec.raw
                if s < self.steps - 1:
                    self.send(PH_GATHER, s + 1, k, byte_view(got), len(chunk.pieces), staged)
                elif staged:
                    self.call.give(got)
