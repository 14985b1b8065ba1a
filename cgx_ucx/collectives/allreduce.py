"""Allreduce: compressed scatter-reduce-allgather (SRA) and the compressed ring.

SRA (CGX, Markov et al. 2022; DESIGN.md "Data path"), on rank r of N:

1. The buffer is cut into N chunks on allowed boundaries (:mod:`.plan`); chunk i belongs
   to rank i. Each chunk is cut into pieces (one message each, pipelined).
2. Scatter: r quantizes every piece of every peer's chunk and sends it to that peer; the
   first piece to each peer carries r's signature (numel, dtype, op, layout, bits).
3. Reduce: once every peer's signature matched, r adds the pieces it receives for its own
   chunk into a float32 accumulator (fused dequantize-add), peers in rank order so the
   result does not depend on arrival order.
4. Allgather: r quantizes each reduced piece once, decodes it into its *own* buffer too,
   and sends the same bytes to every peer, which decode them into theirs: every replica
   ends bit-identical. Pieces go out as soon as they are reduced (step 3 and 4 overlap).

Uncompressed layouts (bits=32 everywhere) send the caller's memory as is (no staging, no
copy) and reduce in place for float32/float64/integer buffers, so integer sums and
exactly representable float sums equal NumPy's.

Ring (N-1 compressed reduce-scatter hops then N-1 allgather hops, pipelined by piece):
traffic per link is the same as SRA, but each rank talks to two neighbours only (better
for large worlds) and partial sums are re-quantized at each hop (error grows with N).
The final chunk is quantized once by its owner and forwarded byte for byte, so replicas
are bit-identical here too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError
from .arrays import (
    byte_view,
    decode_add_piece,
    decode_piece,
    encode_piece,
    synchronize,
    xp_of,
)
from .call import PH_DATA, PH_GATHER, PH_SIG, Call, gather_or_cancel
from .plan import Piece, Plan

__all__ = ["AllreduceSpec", "ring", "sra"]


@dataclass(frozen=True)
class AllreduceSpec:
    plan: Plan
    raw: bool  # every layer uncompressed: no codec, zero-copy sends
    avg: bool
    acc_dtype: np.dtype  # accumulator dtype
    inplace: bool  # raw path accumulating straight into the caller's buffer
    stochastic: bool
    seed: int


def _payload_nbytes(spec: AllreduceSpec, piece: Piece, dtype: np.dtype) -> int:
    return piece.numel * dtype.itemsize if spec.raw else piece.wire_nbytes(dtype)


class _Streams:
    """Futures for pieces arriving from peers, filled by one receiving task per peer."""

    def __init__(self) -> None:
        self.futs: dict[tuple[int, int], asyncio.Future] = {}

    def fut(self, peer: int, k: int) -> asyncio.Future:
        f = self.futs.get((peer, k))
        if f is None:
            f = self.futs[(peer, k)] = asyncio.get_running_loop().create_future()
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        return f

    def fail_peer(self, peer: int, exc: BaseException) -> None:
        for (p, _), f in self.futs.items():
            if p == peer and not f.done():
                f.set_exception(exc)


async def sra(call: Call, x: Any, spec: AllreduceSpec) -> None:
    """Scatter-reduce-allgather allreduce of the flat array ``x``, in place."""
    comm, mesh = call.comm, call.mesh
    n_world, r = mesh.world_size, mesh.rank
    plan, dtype, xp = spec.plan, x.dtype, xp_of(x)
    own = plan.chunks[r]
    peers = [(r + i) % n_world for i in range(1, n_world)]
    K = len(own.pieces)
    base = own.start
    scatter = _Streams()
    sig_futs = {p: asyncio.get_running_loop().create_future() for p in peers}
    for f in sig_futs.values():
        f.add_done_callback(lambda f: f.cancelled() or f.exception())
    problems: list[str] = []

    async def scatter_recv(p: int) -> None:
        try:
            for k in range(K):
                frame = await call.recv_header(p, PH_SIG, k, first=k == 0)
                if k == 0:
                    problem = await call.check_first(p, frame)
                    if problem:
                        problems.append(problem)
                        sig_futs[p].set_result(False)
                        return
                    if frame.count != K:
                        raise ProtocolError(f"rank {p} sends {frame.count} pieces, {K} expected")
                    sig_futs[p].set_result(True)
                buf = call.take(_payload_nbytes(spec, own.pieces[k], dtype), x)
                await call.recv_payload(p, frame, buf)
                scatter.fut(p, k).set_result(buf)
        except BaseException as exc:
            if not sig_futs[p].done():
                sig_futs[p].set_exception(exc)
            scatter.fail_peer(p, exc)
            raise

    async def scatter_send() -> None:
        sends = []
        for k in range(plan.max_pieces):
            for p in peers:
                chunk = plan.chunks[p]
                if k >= len(chunk.pieces):
                    continue
                piece = chunk.pieces[k]
                if spec.raw:
                    payload = byte_view(x[piece.start : piece.stop])
                else:
                    buf = call.take(piece.wire_nbytes(dtype), x)
                    payload = await comm._codec.run(
                        piece.numel,
                        encode_piece,
                        x,
                        0,
                        piece,
                        buf,
                        spec.stochastic,
                        spec.seed,
                        call.seq,
                        r,
                    )
                    synchronize(payload)
                sends.append(
                    asyncio.ensure_future(call.send(p, PH_SIG, k, payload, len(chunk.pieces)))
                )
        await gather_or_cancel(sends)

    async def gather_recv(p: int) -> None:
        chunk = plan.chunks[p]
        for k, piece in enumerate(chunk.pieces):
            frame = await call.recv_header(p, PH_DATA, k)
            if frame.count != len(chunk.pieces):
                raise ProtocolError(f"rank {p} announced {frame.count} pieces")
            if spec.raw:
                await call.recv_payload(p, frame, x[piece.start : piece.stop])
            else:
                buf = call.take(piece.wire_nbytes(dtype), x)
                await call.recv_payload(p, frame, buf)
                await comm._codec.run(piece.numel, decode_piece, buf, piece, x, 0, dtype)

    async def reduce_and_gather(gather_sends: list) -> None:
        ok = await asyncio.gather(*sig_futs.values())
        if not all(ok):
            return
        # All signatures matched: from here on we may write into the caller's buffer.
        for p in peers:
            gather_sends.append(asyncio.ensure_future(gather_recv(p)))
        if spec.inplace:
            acc = x[own.start : own.stop]
        else:
            acc_bytes = call.take(own.numel * spec.acc_dtype.itemsize, x)
            acc = acc_bytes.view(spec.acc_dtype) if own.numel else xp.empty(0, spec.acc_dtype)
            acc[...] = x[own.start : own.stop]
        ordered = sorted(peers)
        for k, piece in enumerate(own.pieces):
            a = acc[piece.start - base : piece.stop - base]
            for p in ordered:
                buf = await scatter.fut(p, k)
                if spec.raw:
                    add = buf.view(dtype) if piece.numel else buf[:0].view(dtype)
                    xp.add(a, add, out=a)
                else:
                    await comm._codec.run(
                        piece.numel, decode_add_piece, buf, piece, acc, base, dtype
                    )
            if spec.avg:
                xp.divide(a, n_world, out=a)
            if spec.raw:
                if not spec.inplace:
                    x[piece.start : piece.stop] = a
                payload = byte_view(x[piece.start : piece.stop])
            else:
                for seg in piece.segments:
                    if seg.bits == 32:
                        x[seg.start : seg.stop] = acc[seg.start - base : seg.stop - base]
                buf = call.take(piece.wire_nbytes(dtype), x)
                payload = await comm._codec.run(
                    piece.numel,
                    _requantize,
                    acc,
                    base,
                    piece,
                    buf,
                    x,
                    dtype,
                    spec,
                    call.seq,
                    r,
                )
            synchronize(payload)
            for p in peers:
                gather_sends.append(asyncio.ensure_future(call.send(p, PH_DATA, k, payload, K)))

    gather_tasks: list = []
    try:
        await gather_or_cancel(
            [scatter_send(), *(scatter_recv(p) for p in peers), reduce_and_gather(gather_tasks)]
        )
        call.raise_mismatches(sorted(problems))
        await gather_or_cancel(gather_tasks)
    finally:
        for t in gather_tasks:
            if not t.done():
                t.cancel()
        if gather_tasks:
            await asyncio.gather(*gather_tasks, return_exceptions=True)
    synchronize(x)


def _requantize(
    acc: Any,
    base: int,
    piece: Piece,
    buf: Any,
    x: Any,
    dtype: np.dtype,
    spec: AllreduceSpec,
    seq: int,
    rank: int,
) -> Any:
    """Owner: quantize the reduced piece once and decode it into its own buffer too."""
    payload = encode_piece(
        acc, base, piece, buf, spec.stochastic, spec.seed, seq, rank, raw_src=x, raw_base=0
    )
    decode_piece(payload, piece, x, 0, dtype)
    return payload


async def ring(call: Call, x: Any, spec: AllreduceSpec) -> None:
    """Ring allreduce of the flat array ``x``, in place (pipelined by piece)."""
    comm, mesh = call.comm, call.mesh
    n_world, r = mesh.world_size, mesh.rank
    plan, dtype, xp = spec.plan, x.dtype, xp_of(x)
    await call.exchange_signatures()
    if n_world == 1:
        return
    left, right = (r - 1) % n_world, (r + 1) % n_world
    P = plan.max_pieces
    steps = n_world - 1
    # Accumulators: raw pieces are sent straight from them (no copy), so each
    # reduce-scatter step gets its own; encoded pieces are copied out by the codec, so
    # two alternating ones suffice.
    biggest = max(c.numel for c in plan.chunks)
    accs = []
    for _ in range(steps if spec.raw else min(2, steps)):
        raw_acc = call.take(biggest * spec.acc_dtype.itemsize, x)
        accs.append(raw_acc.view(spec.acc_dtype) if biggest else xp.empty(0, spec.acc_dtype))
    sends: list = []

    def send(phase: int, step: int, k: int, payload: Any, count: int) -> None:
        sends.append(asyncio.ensure_future(call.send(right, phase, step * P + k, payload, count)))

    async def encode_from(src: Any, base: int, piece: Piece) -> Any:
        if spec.raw:
            return byte_view(src[piece.start - base : piece.stop - base])
        buf = call.take(piece.wire_nbytes(dtype), x)
        out = await comm._codec.run(
            piece.numel,
            encode_piece,
            src,
            base,
            piece,
            buf,
            spec.stochastic,
            spec.seed,
            call.seq,
            r,
        )
        synchronize(out)
        return out

    async def recv_piece(phase: int, step: int, k: int, count: int, piece: Piece) -> Any:
        frame = await call.recv_header(left, phase, step * P + k)
        if frame.count != count:
            raise ProtocolError(f"rank {left} announced {frame.count} pieces, {count} expected")
        buf = call.take(_payload_nbytes(spec, piece, dtype), x)
        await call.recv_payload(left, frame, buf)
        return buf

    try:
        # Reduce-scatter: step s sends chunk (r - s) and receives chunk (r - s - 1).
        first = plan.chunks[r]
        for k, piece in enumerate(first.pieces):
            send(PH_DATA, 0, k, await encode_from(x, 0, piece), len(first.pieces))
        acc = accs[0]
        base = 0
        for s in range(steps):
            chunk = plan.chunks[(r - s - 1) % n_world]
            acc = accs[s % len(accs)]
            base = chunk.start
            last = s == steps - 1
            for k, piece in enumerate(chunk.pieces):
                buf = await recv_piece(PH_DATA, s, k, len(chunk.pieces), piece)
                a = acc[piece.start - base : piece.stop - base]
                a[...] = x[piece.start : piece.stop]
                if spec.raw:
                    xp.add(a, buf.view(dtype) if piece.numel else buf[:0].view(dtype), out=a)
                else:
                    await comm._codec.run(
                        piece.numel, decode_add_piece, buf, piece, acc, base, dtype
                    )
                if last:
                    continue
                if spec.raw and spec.acc_dtype != dtype:
                    tmp = call.take(piece.numel * dtype.itemsize, x)
                    tv = tmp.view(dtype) if piece.numel else xp.empty(0, dtype)
                    tv[...] = a
                    send(PH_DATA, s + 1, k, byte_view(tv), len(chunk.pieces))
                else:
                    send(PH_DATA, s + 1, k, await encode_from(acc, base, piece), len(chunk.pieces))
        # The complete chunk (r + 1): finalize, write into our buffer, start the allgather.
        own = plan.chunks[(r + 1) % n_world]
        for k, piece in enumerate(own.pieces):
            a = acc[piece.start - base : piece.stop - base]
            if spec.avg:
                xp.divide(a, n_world, out=a)
            if spec.raw:
                x[piece.start : piece.stop] = a
                payload = byte_view(x[piece.start : piece.stop])
            else:
                for seg in piece.segments:
                    if seg.bits == 32:
                        x[seg.start : seg.stop] = acc[seg.start - base : seg.stop - base]
                buf = call.take(piece.wire_nbytes(dtype), x)
                payload = await comm._codec.run(
                    piece.numel, _requantize, acc, base, piece, buf, x, dtype, spec, call.seq, r
                )
            synchronize(payload)
            send(PH_GATHER, 0, k, payload, len(own.pieces))
        # Allgather: step s receives chunk (r - s), owned by rank (r - s - 1), and forwards it.
        for s in range(steps):
            chunk = plan.chunks[(r - s) % n_world]
            for k, piece in enumerate(chunk.pieces):
                frame = await call.recv_header(left, PH_GATHER, s * P + k)
                if spec.raw:
                    dst = x[piece.start : piece.stop]
                    await call.recv_payload(left, frame, dst)
                    payload = byte_view(dst)
                else:
                    payload = call.take(piece.wire_nbytes(dtype), x)
                    await call.recv_payload(left, frame, payload)
                    await comm._codec.run(piece.numel, decode_piece, payload, piece, x, 0, dtype)
                if s < steps - 1:
                    send(PH_GATHER, s + 1, k, payload, len(chunk.pieces))
        await gather_or_cancel(sends)
    finally:
        pending = [t for t in sends if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    synchronize(x)
