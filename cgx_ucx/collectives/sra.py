"""Scatter-reduce-allgather (SRA) allreduce (CGX, Markov et al. 2022; DESIGN.md "Data path").

On rank r of N:

1. The buffer is cut into N chunks on allowed boundaries (:mod:`.plan`); chunk i belongs
   to rank i. Each chunk is cut into pieces (one message each, pipelined).
2. Scatter (:meth:`Sra.scatter_send`): r quantizes every piece of every peer's chunk and
   sends it to that peer; the first piece to each peer carries r's signature (numel,
   dtype, op, layout, bits).
3. Reduce (:meth:`Sra.reduce_and_gather`): once every peer's signature matched
   (:meth:`Sra.scatter_recv`), r adds the pieces it receives for its own chunk into an
   accumulator (fused dequantize-add), peers in rank order so the result does not depend
   on arrival order.
4. Allgather: r quantizes each reduced piece once, decodes it into its *own* buffer too,
   and sends the same bytes to every peer, which decode them into theirs
   (:meth:`Sra.gather_recv`): every replica ends bit-identical. Pieces go out as soon as
   they are reduced (steps 3 and 4 overlap).

Uncompressed layouts send the caller's memory as is (no staging, no copy) and reduce in
place for float32/float64/integer buffers, so integer sums and exactly representable
float sums equal NumPy's.

Staging is bounded by the pieces in flight, not by the buffer: a rank receives at most
:data:`RECV_WINDOW_BYTES` (at least two pieces) from each peer ahead of its reduction, and
every host staging buffer goes back to the pool as soon as its bytes are consumed or sent,
so the next piece reuses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ..transport.frames import Frame
from .call import PH_DATA, PH_SIG, Call, cancel_pending, gather_or_cancel
from .reduction import AllreduceSpec, PieceSteps
from .staging import synchronize

__all__ = [
    "RECV_WINDOW_BYTES",
    "ResultHook",
    "Sra",
    "Table",
    "keep_results",
    "result_table",
    "sra",
]

#: Received bytes a rank holds per peer ahead of reducing them (at least two pieces, so
#: receiving piece k+1 still overlaps reducing piece k). Without a bound a peer's whole
#: chunk can sit in staging when receiving outruns reducing (one host, shared memory):
#: 128 MiB of a 256 MiB uncompressed allreduce on 2 ranks.
RECV_WINDOW_BYTES = 16 << 20


#: ``on_result(c, k, wire)``: piece ``k`` of rank ``c``'s chunk reduced, as the bytes every
#: rank decodes it from (compressed layouts only); called before those bytes are reused.
ResultHook = Callable[[int, int, Any], None]


#: ``{(chunk, piece): (offset, nbytes)}``: where each reduced piece's wire bytes lie when
#: kept back to back (:func:`result_table`).
Table = dict[tuple[int, int], tuple[int, int]]


def result_table(spec: AllreduceSpec, dtype: np.dtype) -> tuple[Table, int]:
    """Where the wire bytes of every reduced piece of an SRA of ``spec`` lie when kept back
    to back (chunks in rank order, each chunk's pieces in order), and their total; made
    once per spec (``spec.memo``), not at every call. Read-only."""
    key = ("result_table", dtype)
    known = spec.memo.get(key)
    if known is not None:
        return known
    table: Table = {}
    pos = 0
    for c, chunk in enumerate(spec.plan.chunks):
        for k, piece in enumerate(chunk.pieces):
            n = piece.wire_nbytes(dtype)
            table[(c, k)] = (pos, n)
            pos += n
    spec.memo[key] = (table, pos)
    return table, pos


def keep_results(out: Any, offset: int, table: Table) -> ResultHook:
    """An ``on_result`` hook that copies each reduced piece's wire bytes into the byte
    array ``out`` (from ``offset``) where ``table`` puts them."""

    def keep(c: int, k: int, wire: Any) -> None:
        pos, n = table[(c, k)]
        if wire.nbytes != n:
            raise ProtocolError(f"piece {k} of chunk {c} has {wire.nbytes} wire bytes, {n} due")
        out[offset + pos : offset + pos + n] = wire

    return keep


async def sra(
    call: Call,
    x: Any,
    spec: AllreduceSpec,
    on_result: ResultHook | None = None,
    addend: Any = None,
) -> None:
    """Scatter-reduce-allgather allreduce of the flat array ``x``, in place.

    ``on_result`` sees every reduced piece's wire bytes (this rank's and every peer's) on
    a compressed layout: the two-level allreduce forwards them to node peers, which decode
    them into their buffers as every replica does. ``addend`` (compressed layouts, host
    values laid out as ``x``): this rank's contribution is ``x + addend``; the pieces it
    sends are encoded from the sum as they are read (never written), its own chunk gets
    the addend added before the peers' pieces. The two-level allreduce passes a node
    peer's shared-memory bytes: one pass over them fewer than adding them first.
    """
    await Sra(call, x, spec, on_result, addend).run()


def _consumed(f: asyncio.Future) -> Any:
    return f.cancelled() or f.exception()


class _Streams:
    """Futures for pieces arriving from peers, filled by one receiving task per peer."""

    def __init__(self) -> None:
        self.futs: dict[tuple[int, int], asyncio.Future] = {}

    def fut(self, peer: int, k: int) -> asyncio.Future:
        f = self.futs.get((peer, k))
        if f is None:
            f = self.futs[(peer, k)] = asyncio.get_running_loop().create_future()
            f.add_done_callback(_consumed)
        return f

    def arrival(self, peer: int, k: int, buf: Any) -> Callable[[asyncio.Future], None]:
        """A done-callback for the receive of ``peer``'s piece ``k`` into ``buf``: its
        future gets ``buf``, or the receive's error."""

        def done(got: asyncio.Future) -> None:
            f = self.fut(peer, k)
            if f.done():
                return
            if got.cancelled():
                f.cancel()
            elif got.exception() is not None:
                f.set_exception(got.exception())  # type: ignore[arg-type]
            else:
                f.set_result(buf)

        return done

    def fail_peer(self, peer: int, exc: BaseException) -> None:
        for (p, _), f in self.futs.items():
            if p == peer and not f.done():
                f.set_exception(exc)


class Sra(PieceSteps):
    """One SRA allreduce on this rank: its tasks share the state kept here."""

    def __init__(
        self,
        call: Call,
        x: Any,
        spec: AllreduceSpec,
        on_result: ResultHook | None = None,
        addend: Any = None,
    ) -> None:
        super().__init__(call, x, spec)
        if addend is not None and (spec.raw or addend.shape != x.shape):
            raise ValueError("an addend needs a compressed layout and values laid out as x")
        r, n_world = self.rank, self.n_world
        self.on_result = None if spec.raw else on_result
        self.addend = addend
        self.own = self.plan.chunks[r]
        #: Our chunk's share of ``addend``, still to add (one peer: in its requantization).
        self.own_addend = None if addend is None else addend[self.own.start : self.own.stop]
        #: Peers in send order (r+1, r+2, ...), so no rank is everyone's first target.
        self.peers = [(r + i) % n_world for i in range(1, n_world)]
        self.scatter = _Streams()
        loop = asyncio.get_running_loop()
        #: Per peer: True once its signature matched, False when it differed.
        self.sig_futs = {p: loop.create_future() for p in self.peers}
        for f in self.sig_futs.values():
            f.add_done_callback(_consumed)
        self.problems: list[str] = []
        self.gather_tasks: list[asyncio.Future] = []
        biggest = max((self.payload_nbytes(q) for q in self.own.pieces), default=0)
        window = max(2, RECV_WINDOW_BYTES // max(biggest, 1))
        #: Per peer: pieces it may still have received and not yet reduced.
        self.window = {p: asyncio.Semaphore(window) for p in self.peers}

    async def run(self) -> None:
        try:
            await gather_or_cancel(
                [
                    self.scatter_send(),
                    *(self.scatter_recv(p) for p in self.peers),
                    self.reduce_and_gather(),
                ]
            )
            self.call.raise_mismatches(sorted(self.problems))
            await gather_or_cancel(self.gather_tasks)
        finally:
            await cancel_pending(self.gather_tasks)
        synchronize(self.x)

    # -- step 2: scatter ---------------------------------------------------------------
    async def scatter_send(self) -> None:
        """Every piece of every peer's chunk to that peer, piece k to all before k+1."""
        call, plan, x, raw = self.call, self.plan, self.x, self.spec.raw
        sends = []
        for k in range(plan.max_pieces):
            for p in self.peers:
                pieces = plan.chunks[p].pieces
                if k >= len(pieces):
                    continue
                piece = pieces[k]
                if raw:
                    payload = self.view(x, 0, piece)
                else:
                    payload = await self.encode(x, 0, piece, addend=self.addend)
                sends.append(asyncio.ensure_future(call.send(p, PH_SIG, k, payload, len(pieces))))
                if not raw:
                    call.give_after(sends[-1:], payload)
        await gather_or_cancel(sends)

    async def scatter_recv(self, p: int) -> None:
        """The pieces of our chunk from peer ``p``, after checking its signature. Each
        piece's receive is posted as soon as the window lets it, not once the piece before
        it arrived: over TCP, UCX copies a piece that arrives before its receive twice."""
        call, pieces = self.call, self.own.pieces
        posted: list[asyncio.Future] = []
        try:
            if not pieces:
                return
            frame = await call.recv_header(p, PH_SIG, 0, first=True)
            if not await self.accept_signature(p, frame):
                return
            for k, piece in enumerate(pieces):
                await self.window[p].acquire()
                buf = call.take(self.payload_nbytes(piece), self.x)
                if k == 0:
                    got = asyncio.ensure_future(call.recv_payload(p, frame, buf))
                else:
                    got = asyncio.ensure_future(call.recv_piece(p, PH_SIG, k, buf))
                got.add_done_callback(self.scatter.arrival(p, k, buf))
                posted.append(got)
            await gather_or_cancel(posted)
        except BaseException as exc:
            if not self.sig_futs[p].done():
                self.sig_futs[p].set_exception(exc)
            self.scatter.fail_peer(p, exc)
            raise
        finally:
            await cancel_pending(posted)

    async def accept_signature(self, p: int, frame: Frame) -> bool:
        """Whether peer ``p`` called the same collective (if not, it is drained and noted)."""
        problem = await self.call.check_first(p, frame)
        if problem:
            self.problems.append(problem)
            self.sig_futs[p].set_result(False)
            return False
        expected = len(self.own.pieces)
        if frame.count != expected:
            raise ProtocolError(f"rank {p} sends {frame.count} pieces, {expected} expected")
        self.sig_futs[p].set_result(True)
        return True

    # -- steps 3 and 4: reduce our chunk, allgather ---------------------------------------
    def accumulator(self) -> Any:
        """Where our chunk is reduced: the caller's buffer itself, or staging."""
        own, spec = self.own, self.spec
        if spec.inplace:
            return self.x[own.start : own.stop]
        acc_bytes = self.call.take(own.numel * spec.acc_dtype.itemsize, self.x)
        acc = acc_bytes.view(spec.acc_dtype) if own.numel else self.xp.empty(0, spec.acc_dtype)
        acc[...] = self.x[own.start : own.stop]
        return acc

    async def reduce_and_gather(self) -> None:
        """Reduce each piece of our chunk in rank order, then send it to every peer."""
        ok = await asyncio.gather(*self.sig_futs.values())
        if not all(ok):
            # Nothing is reduced: the peers that matched are received to the end unheld.
            for window in self.window.values():
                for _ in self.own.pieces:
                    window.release()
            return
        # All signatures matched: from here on we may write into the caller's buffer.
        call, spec, own = self.call, self.spec, self.own
        for p in self.peers:
            self.gather_tasks.append(asyncio.ensure_future(self.gather_recv(p)))
        acc = self.accumulator()
        if self.own_addend is not None and len(self.peers) > 1:
            self.xp.add(acc, self.own_addend, out=acc)
            self.own_addend = None  # added: the pieces' requantization adds nothing more
        count = len(own.pieces)
        for k, piece in enumerate(own.pieces):
            if spec.raw:
                a = await self.reduce_piece(acc, k, piece)
                payload = self.raw_result(piece, a, spec.inplace)
            else:
                payload = await self.reduce_requantize(acc, k, piece)
            synchronize(payload)
            if self.on_result is not None:
                self.on_result(self.rank, k, payload)
            sends = [
                asyncio.ensure_future(call.send(p, PH_DATA, k, payload, count)) for p in self.peers
            ]
            self.gather_tasks.extend(sends)
            if not spec.raw:
                call.give_after(sends, payload)

    async def reduce_piece(self, acc: Any, k: int, piece: Any) -> Any:
        """Add every peer's piece ``k`` of our chunk into ``acc`` in rank order (so the
        result does not depend on arrival order), average if asked; returns the piece's
        slice of ``acc``."""
        a = await self.add_pieces(acc, k, piece, sorted(self.peers))
        if self.spec.avg:
            self.xp.divide(a, self.divisor, out=a)
        return a

    async def add_pieces(self, acc: Any, k: int, piece: Any, peers: list[int]) -> Any:
        """Add the pieces ``k`` of ``peers``, in that order, into ``acc``; returns the
        piece's slice of ``acc``."""
        base = self.own.start
        a = acc[piece.start - base : piece.stop - base]
        for p in peers:
            buf = await self.scatter.fut(p, k)
            if self.spec.raw:
                self.add_raw(a, buf, piece)
            else:
                await self.decode_add(buf, piece, acc, base)
            self.consumed(p, buf)
        return a

    def consumed(self, p: int, buf: Any) -> None:
        """Peer ``p``'s received piece ``buf`` is reduced: its staging goes back to the
        pool and the peer's next piece may be received."""
        self.call.give(buf)
        self.window[p].release()

    async def reduce_requantize(self, acc: Any, k: int, piece: Any) -> Any:
        """Compressed path: :meth:`reduce_piece`, then :meth:`requantize`, with the last
        peer's piece added, averaged and requantized in one pass
        (:func:`~.piece_codec.reduce_requantize_piece`): the same bytes and values, one
        pass over the piece fewer. Returns the wire bytes."""
        *first, last = sorted(self.peers)
        await self.add_pieces(acc, k, piece, first)
        buf = await self.scatter.fut(last, k)
        out = self.call.take(piece.wire_nbytes(self.dtype), self.x)
        wire = await self.reduce_requantize_into(
            buf, piece, acc, self.own.start, out, self.own_addend
        )
        self.consumed(last, buf)
        return wire

    async def gather_recv(self, p: int) -> None:
        """Peer ``p``'s reduced chunk, piece by piece, into the caller's buffer."""
        pieces = self.plan.chunks[p].pieces
        if self.spec.raw:
            # Each piece lands in the caller's buffer, so every receive is posted at once
            # and costs no staging: a piece that arrives before its receive is posted is
            # copied twice by UCX over TCP.
            await gather_or_cancel(
                self.recv_result(p, PH_DATA, k, piece, len(pieces))
                for k, piece in enumerate(pieces)
            )
            return
        for k, piece in enumerate(pieces):
            got = await self.recv_result(p, PH_DATA, k, piece, len(pieces))
            if self.on_result is not None:
                self.on_result(p, k, got)
            if not self.spec.raw:
                self.call.give(got)
