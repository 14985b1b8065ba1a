"""One-round allreduce for small buffers (DESIGN.md "Data path", step 6).

SRA needs two communication steps (scatter-reduce, then allgather), each paying the
per-message cost once more; for a small buffer that cost, not the bytes, is the time of
the call. Here, on rank r of N:

1. r encodes its *whole* buffer once (compressed layouts; uncompressed ones send the
   caller's memory as is) and sends it to every peer in ONE frame, tagged (seq, phase 1,
   slot 0): the frame carries r's signature, exactly as SRA's first piece does, so a
   mismatch is still a :class:`~cgx_ucx.errors.CollectiveMismatchError` on every rank
   before anything is written into the caller's buffer.
2. Every rank reduces the N contributions **in rank order**, its own included as the
   bytes it sent (for compressed layouts: decoded from its own encoding, not its raw
   values). Every rank thus runs the same float operations in the same order on the same
   bytes, and the replicas end bit-identical without a second round.

Each rank sends (N-1) whole buffers instead of SRA's 2(N-1)/N of one, so this wins only
while the per-message cost dominates; :mod:`.allreduce` picks it below a crossover
measured per world size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import is_cupy
from ..errors import ProtocolError
from ..transport.frames import Frame, inlinable
from .call import PH_SIG, Call, gather_or_cancel
from .piece_codec import CODEC_INLINE_NUMEL, decode_add_piece
from .reduction import AllreduceSpec, PieceSteps, encode_one_round, host_run
from .staging import synchronize

__all__ = ["Oneshot", "oneshot"]


async def oneshot(call: Call, x: Any, spec: AllreduceSpec) -> None:
    """One-round allreduce of the flat array ``x``, in place."""
    await Oneshot(call, x, spec).run()


class Oneshot(PieceSteps):
    """One one-round allreduce on this rank. The plan has one chunk of one piece: the
    whole buffer (so the codec sees the same segments on every rank)."""

    def __init__(self, call: Call, x: Any, spec: AllreduceSpec) -> None:
        super().__init__(call, x, spec)
        self.piece = spec.plan.chunks[0].pieces[0]
        r, n_world = self.rank, self.n_world
        #: Peers in send order (r+1, r+2, ...), so no rank is everyone's first target.
        self.peers = [(r + i) % n_world for i in range(1, n_world)]
        #: Per rank, its contribution as wire bytes (uint8), ours included.
        self.got: dict[int, Any] = {}
        self.problems: list[str] = []
        #: Small host buffers of compressed layouts go through the spec's HostRun, on the
        #: loop as the codec runner would run them (larger ones keep its codec thread).
        self.host = not spec.raw and not is_cupy(x) and self.piece.numel < CODEC_INLINE_NUMEL

    def encode_host(self) -> Any:
        """This rank's contribution encoded into staging through the spec's HostRun."""
        out = self.call.take(host_run(self.spec, self.dtype).nbytes, self.x)
        return encode_one_round(self.spec, self.x, out, self.call.seq, self.rank)

    async def run(self) -> None:
        call, piece, x = self.call, self.piece, self.x
        if self.spec.raw:
            own = self.view(x, 0, piece)
        elif self.host:
            own = self.encode_host()
        else:
            own = await self.encode(x, 0, piece)
        # Our sends are awaited with the receives: on the raw path they read the caller's
        # buffer, which the reduction below overwrites.
        if inlinable(own, int(own.nbytes)):
            # Small host buffers: every send and header receive posted at once, under one
            # guard; the payloads arrive inside the headers.
            frames = await call.exchange(self.peers, PH_SIG, 0, own, 1)
            for p, frame in zip(self.peers, frames, strict=True):
                await self.accept(p, frame)
        else:
            await gather_or_cancel(
                [
                    *(call.send(p, PH_SIG, 0, own, 1) for p in self.peers),
                    *(self.receive(p) for p in self.peers),
                ]
            )
        call.raise_mismatches(sorted(self.problems))
        # Every signature matched: from here on we may write into the caller's buffer.
        self.got[self.rank] = own
        if self.spec.raw:
            self.reduce_raw()
        else:
            await self.reduce_compressed()
        synchronize(x)

    async def receive(self, p: int) -> None:
        """Peer ``p``'s whole contribution, after checking its signature."""
        frame = await self.call.recv_header(p, PH_SIG, 0, first=True)
        await self.accept(p, frame)

    async def accept(self, p: int, frame: Frame) -> None:
        """Check peer ``p``'s first header against our signature, then take its payload."""
        call = self.call
        problem = await call.check_first(p, frame)
        if problem:
            self.problems.append(problem)
            return
        if frame.count != 1:
            raise ProtocolError(f"rank {p} sends {frame.count} pieces, 1 expected")
        buf = call.take(self.payload_nbytes(self.piece), self.x)
        await call.recv_payload(p, frame, buf)
        self.got[p] = buf

    def _values(self, q: int) -> Any:
        """Rank ``q``'s raw contribution as values of the buffer's dtype."""
        if q == self.rank:
            return self.x
        buf = self.got[q]
        return buf.view(self.dtype) if buf.size else self.xp.empty(0, self.dtype)

    def reduce_raw(self) -> None:
        """x = ((c_0 + c_1) + c_2) + ... in the accumulator dtype, the same on every rank."""
        spec, x, xp = self.spec, self.x, self.xp
        if spec.inplace and self.rank == 0:
            acc = x  # c_0 is our own buffer: accumulate there
        elif spec.inplace:
            acc = self._values(0)  # rank 0's received bytes, staging we own
        else:
            acc = self.call.take(x.size * spec.acc_dtype.itemsize, x)
            acc = acc.view(spec.acc_dtype) if x.size else xp.empty(0, spec.acc_dtype)
            acc[...] = self._values(0)
        for q in range(1, self.n_world):
            xp.add(acc, self._values(q), out=acc)
        if spec.avg:
            xp.divide(acc, self.n_world, out=acc)
        if acc is not x:
            x[...] = acc

    async def reduce_compressed(self) -> None:
        """x = sum over ranks in rank order of decode(contribution), in float32."""
        x, piece = self.x, self.piece
        acc = self.call.take(x.size * 4, x)
        acc = acc.view(np.float32) if x.size else self.xp.empty(0, np.float32)
        acc[...] = 0
        if self.host:
            run = host_run(self.spec, self.dtype)
            for q in range(self.n_world):
                run.decode_add(self.got[q], acc)
        else:
            for q in range(self.n_world):
                await self.codec.run(
                    piece.numel, decode_add_piece, self.got[q], piece, acc, 0, self.dtype
                )
        if self.spec.avg:
            self.xp.divide(acc, self.n_world, out=acc)
        x[...] = acc
