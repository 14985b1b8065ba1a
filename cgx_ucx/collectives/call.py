"""One collective call in flight: its sequence number, signature, abort future, staging.

Every collective starts the same way (so ranks that disagree on *which* collective or
algorithm still meet): each rank sends every peer a frame tagged (seq, phase 1, slot 0)
carrying its signature. For SRA allreduce that frame heads the first scatter piece; for
everything else it is a bare SIG frame (all-to-all's differs per peer: it carries the
pair's block sizes in ``numel`` and ``digest``, checked by :mod:`.alltoall`). A
receiver compares the signature with its own before it posts any receive into caller
memory; a different signature is a
:class:`~cgx_ucx.errors.CollectiveMismatchError` on every rank (each rank sees every
peer's signature), after draining what the peer announced, so no send is left hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

import numpy as np

from ..arrays import is_cupy
from ..errors import (
    CGXError,
    CollectiveMismatchError,
    ConfigError,
    PeerLostError,
    ProtocolError,
)
from ..transport.frames import (
    MIXED_BITS,
    AbortCode,
    Algo,
    Coll,
    Frame,
    Kind,
    Op,
    dtype_code,
    dtype_from_code,
)
from ..transport.handshake import MAX_SLOTS
from .piece_codec import CodecRunner
from .staging import BufferPool, byte_view, owner
from .transport import Transport

__all__ = [
    "PH_DATA",
    "PH_GATHER",
    "PH_SIG",
    "Call",
    "abort_error",
    "cancel_pending",
    "describe",
    "gather_or_cancel",
    "make_template",
    "mismatch_error",
    "what",
]

#: Phase 1: signatures (and, for SRA, the scatter pieces).
PH_SIG = 1
#: Phase 2: SRA allgather of reduced chunks, ring reduce-scatter, broadcast/allgather data.
PH_DATA = 2
#: Phase 3: ring allgather.
PH_GATHER = 3


async def gather_or_cancel(aws: Iterable[Awaitable[Any]]) -> list[Any]:
    """Like asyncio.gather, but the first failure cancels (and awaits) the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if failed:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed[0].exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


#: Bits of a reduce's signature digest that carry its root (the layout digest keeps the
#: other 40: still far beyond chance agreement of two different layouts).
ROOT_BITS = 24


def signed_root(digest: int, root: int) -> int:
    """The signature digest of a reduce to ``root`` of a layout with ``digest``."""
    return (digest & ~((1 << ROOT_BITS) - 1)) | root


def root_of(digest: int) -> int:
    """The root a reduce's signature digest carries (:func:`signed_root`)."""
    return digest & ((1 << ROOT_BITS) - 1)


def describe(frame: Frame) -> str:
    """Human-readable signature, for mismatch messages."""
    coll = (
        Coll(frame.collective).name.lower()
        if frame.collective in Coll._value2member_map_
        else frame.collective
    )
    if frame.collective == Coll.BARRIER:
        return "barrier()"
    dt = dtype_from_code(frame.dtype)
    # an alltoall's template signs no numel (its blocks differ per pair: the per-peer SIG
    # frames carry them in numel and digest, and .alltoall words their differences)
    parts = [] if frame.collective == Coll.ALLTOALL else [f"numel={frame.numel}"]
    parts.append(f"dtype={dt if dt is not None else frame.dtype}")
    op = (
        Op(frame.reduce_op).name.lower()
        if frame.reduce_op in Op._value2member_map_
        else frame.reduce_op
    )
    if frame.collective == Coll.REDUCE:
        parts.append(f"root={root_of(frame.digest)}")
    if frame.collective in (Coll.ALLREDUCE, Coll.REDUCE_SCATTER, Coll.REDUCE):
        algo = (
            Algo(frame.algorithm).name.lower()
            if frame.algorithm in Algo._value2member_map_
            else frame.algorithm
        )
        bits = "mixed" if frame.bits == 255 else frame.bits
        parts += [f"op={op}", f"bits={bits}", f"algorithm={algo}", f"layout={frame.digest:#018x}"]
        if frame.flags & 1:
            parts.append("stochastic")
    elif frame.collective == Coll.BROADCAST:
        parts.append(f"root={frame.digest}")
    elif frame.collective == Coll.ALLGATHER and frame.digest:
        parts.append(f"root={frame.digest - 1}")
    if frame.collective == Coll.ALLGATHER and frame.reduce_op:
        parts.append(f"reduced by {op}")
    return f"{coll}({', '.join(parts)})"


def what(name: str, template: Frame) -> str:
    """A collective as a peer's timeout message names it: "allreduce, numel 4096, bits 4"
    (an alltoall's template carries no numel: its blocks differ per peer)."""
    text = name if template.collective == Coll.ALLTOALL else f"{name}, numel {template.numel}"
    if template.bits and template.bits != 32:
        text += ", bits mixed" if template.bits == MIXED_BITS else f", bits {template.bits}"
    return text


def abort_error(src: int, seq: int, code: int, culprit: int, reason: str, rank: int) -> CGXError:
    """Rank ``src``'s abort of collective ``seq`` (an ABORT frame, or a mailbox's abort
    record) as the error it means on ``rank``: ``code`` an AbortCode, ``culprit`` the rank
    it blames for a lost peer."""
    text = f"rank {src} aborted collective #{seq}: {reason}"
    if code == AbortCode.PEER_LOST:
        return PeerLostError(text, peer=culprit if culprit != rank else src)
    if code == AbortCode.PROTOCOL:
        return ProtocolError(text)
    return CollectiveMismatchError(text)


def mismatch_error(seq: int, name: str, problems: list[str]) -> CollectiveMismatchError:
    """The error of collective ``seq`` whose ranks disagree (``problems``: one line each)."""
    # Every rank numbers its collectives in call order, so a rank that issued them in
    # another order (PowerSGD with several DDP buckets) meets a different call
    # under the same number: say so, not only "disagree".
    return CollectiveMismatchError(
        f"collective #{seq} ({name}): ranks disagree: ranks issued collectives in a "
        "different order, or the same one with different arguments: " + "; ".join(problems)
    )


def make_template(coll: Coll, x: Any, **fields: Any) -> Frame:
    """The signature frame of a collective on the flat array ``x`` (job, seq and src are
    filled in by the communicator); ConfigError for a dtype the wire cannot name."""
    try:
        dt = dtype_code(x.dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return Frame(kind=Kind.DATA, job=0, collective=coll, dtype=dt, numel=int(x.size), **fields)


async def cancel_pending(tasks: Iterable[asyncio.Future]) -> None:
    """Cancel the tasks not done yet and wait until they are; the failures of those done
    already are retrieved (asyncio would log them as never retrieved)."""
    pending = []
    for t in tasks:
        if not t.done():
            t.cancel()
            pending.append(t)
        elif not t.cancelled():
            t.exception()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


class Call:
    """State of one collective on this rank, and the collaborators it runs with.

    ``transport`` moves the frames, ``pool`` lends staging memory (given back only after
    success: UCX may still own it otherwise), ``codec`` runs piece encoding/decoding;
    ``seq`` numbers the collective, ``name`` names it in errors and statistics.
    """

    def __init__(
        self,
        transport: Transport,
        pool: BufferPool,
        codec: CodecRunner,
        seq: int,
        name: str,
    ) -> None:
        self.transport = transport
        self.pool = pool
        self.codec = codec
        self.seq = seq
        self.name = name
        self.rank = transport.rank
        self.world_size = transport.world_size
        loop = asyncio.get_running_loop()
        self.abort: asyncio.Future = loop.create_future()
        self.abort.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.extra = (self.abort,)
        self.template: Frame | None = None
        #: Added to every slot this call sends and receives on (stages of one collective
        #: that run at once on the same peers use disjoint slot ranges).
        self.slot_base = 0
        #: Staging this call holds, by the id of the pool's buffer (:meth:`give` returns
        #: one early, given any view of it).
        self._taken: dict[int, Any] = {}
        self._segments: list[Any] = []

    # -- staging ----------------------------------------------------------------------
    def take(self, nbytes: int, like: Any) -> Any:
        """``nbytes`` of staging on ``like``'s device, held until :meth:`give_back_all`."""
        buf = self.pool.take(nbytes, like)
        self._taken[id(owner(buf))] = buf
        return buf

    def give(self, buf: Any) -> None:
        """Return host staging from :meth:`take` before the call ends, once nothing uses
        it any more (a receive into it completed and its bytes were consumed, or every
        send of it completed), so the next piece reuses it: what a call holds is bounded
        by the pieces in flight, not by the whole buffer. GPU staging stays held until
        :meth:`give_back_all` (queued kernels may still read it)."""
        if is_cupy(buf):
            return
        taken = self._taken.pop(id(owner(buf)), None)
        if taken is not None:
            self.pool.give(taken)

    def give_after(self, sends: list[asyncio.Future], buf: Any) -> None:
        """:meth:`give` ``buf`` once every one of ``sends`` (the sends of its bytes) has
        completed; never if one of them failed (UCX may still own it)."""
        if not sends:
            self.give(buf)
            return
        left = [len(sends)]

        def done(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                left[0] = -1
                return
            left[0] -= 1
            if left[0] == 0:
                self.give(buf)

        for f in sends:
            f.add_done_callback(done)

    def take_segment(self, nbytes: int) -> Any:
        """A node-local shared segment (:mod:`cgx_ucx.transport.shm`) of at least
        ``nbytes``, held until :meth:`give_back_all` (the collective's peers read it)."""
        seg = self.pool.take_segment(nbytes)
        self._segments.append(seg)
        return seg

    def give_back_all(self) -> None:
        """Return staging to the pool (only after success: UCX may still own it otherwise,
        and a peer may still read a shared segment)."""
        for buf in self._taken.values():
            self.pool.give(buf)
        self._taken.clear()
        for seg in self._segments:
            self.pool.give_segment(seg)
        self._segments.clear()

    # -- frames -----------------------------------------------------------------------
    def frame(
        self, phase: int, slot: int, payload: int, count: int, kind: Kind = Kind.DATA
    ) -> Frame:
        assert self.template is not None
        return self.template.with_(
            kind=kind, phase=phase, slot=slot + self.slot_base, payload=payload, count=count
        )

    def fail(self, exc: CGXError) -> None:
        if not self.abort.done():
            self.abort.set_exception(exc)

    async def send(self, peer: int, phase: int, slot: int, payload: Any, count: int) -> None:
        nbytes = 0 if payload is None else int(payload.nbytes)
        await self.transport.send_frame(
            peer, self.frame(phase, slot, nbytes, count), payload if nbytes else None, self.extra
        )

    async def exchange(
        self,
        peers: list[int],
        phase: int,
        slot: int,
        payload: Any,
        count: int,
        kind: Kind = Kind.DATA,
    ) -> list[Frame]:
        """Send (phase, slot) with ``payload`` to every peer and receive theirs, in one round
        (:meth:`~.transport.Transport.exchange_frames`); the headers come back unchecked
        against our signature (:meth:`check_first` does that), in ``peers`` order."""
        nbytes = 0 if payload is None else int(payload.nbytes)
        frame = self.frame(phase, slot, nbytes, count, kind)
        return await self.transport.exchange_frames(
            frame, payload if nbytes else None, peers, self.extra
        )

    async def recv_header(self, peer: int, phase: int, slot: int, first: bool = False) -> Frame:
        """Receive the header of (phase, slot) from ``peer``; later ones must match exactly."""
        frame = await self.transport.recv_frame(
            peer, self.seq, phase, slot + self.slot_base, self.extra
        )
        if not first:
            self.check_signature(peer, frame)
        return frame

    async def recv_piece(self, peer: int, phase: int, slot: int, buf: Any) -> Frame:
        """The header of (phase, slot) from ``peer`` and its payload into ``buf``, whose size
        is known beforehand (:meth:`~.transport.Transport.recv_frame_into`: the payload's
        receive is posted with the header's). Not for a collective's first frame from a
        peer: a mismatched collective is drained by its header, never received into
        ``buf``."""
        frame = await self.transport.recv_frame_into(
            peer, self.seq, phase, slot + self.slot_base, byte_view(buf), self.extra
        )
        self.check_signature(peer, frame)
        return frame

    def check_signature(self, peer: int, frame: Frame) -> None:
        """A frame after ``peer``'s first of this collective carries the same signature."""
        assert self.template is not None
        if frame.signature != self.template.signature:
            err = ProtocolError(
                f"rank {peer} changed the signature of collective #{self.seq} mid-way"
            )
            self.transport.lose(peer, err)
            raise err

    async def recv_payload(self, peer: int, frame: Frame, buf: Any) -> None:
        await self.transport.recv_payload(peer, frame, byte_view(buf), self.extra)

    def mismatch(self, peer: int, frame: Frame) -> str:
        assert self.template is not None
        return (
            f"rank {peer} called {describe(frame)} while rank {self.rank} called "
            f"{describe(self.template)}"
        )

    async def drain(self, peer: int, first: Frame, phase: int) -> None:
        """Receive and discard everything ``peer`` announced for ``phase`` (after a mismatch)."""
        if first.count > MAX_SLOTS:
            raise ProtocolError(f"rank {peer} announced {first.count} pieces")
        frame = first
        for slot in range(max(first.count, 1)):
            if slot:
                frame = await self.transport.recv_frame(
                    peer, self.seq, phase, slot + self.slot_base, self.extra
                )
            if frame.payload:
                sink = np.empty(frame.payload, np.uint8)
                await self.transport.recv_payload(peer, frame, sink, self.extra)

    async def check_first(self, peer: int, frame: Frame) -> str | None:
        """None when ``frame`` matches our signature; else drain the peer and describe it."""
        assert self.template is not None
        if frame.signature == self.template.signature:
            return None
        await self.drain(peer, frame, PH_SIG)
        return self.mismatch(peer, frame)

    def raise_mismatches(self, problems: list[str]) -> None:
        if problems:
            raise mismatch_error(self.seq, self.name, problems)

    async def exchange_signatures(self) -> None:
        """Phase 1 for every collective but SRA allreduce: SIG frames all-to-all."""
        peers = list(self.transport.peers)
        problems: list[str] = []
        frames = await self.exchange(peers, PH_SIG, 0, None, 1, Kind.SIG)
        for p, frame in zip(peers, frames, strict=True):
            problem = await self.check_first(p, frame)
            if problem:
                problems.append(problem)
        self.raise_mismatches(sorted(problems))
