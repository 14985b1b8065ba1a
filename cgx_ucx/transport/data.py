"""The data channel of a mesh: tagged sends and receives, each bounded by a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import CGXError, PeerLostError, ProtocolError, TransportError
from . import ucx as _ucx
from .control import MeshControl
from .frames import (
    FLAG_INLINE,
    FRAME_NBYTES,
    MAX_INLINE_NBYTES,
    RECV_NBYTES,
    Frame,
    Kind,
    copy_inline,
    describe_slot,
    inlinable,
    inline_message,
    inline_payload,
)
from .handshake import structured_tag
from .progress import await_or_wake, post_recv, post_send
from .state import copy_error, raise_done

__all__ = ["MeshData"]


class MeshData(MeshControl):
    """The data channel of a :class:`~cgx_ucx.transport.mesh.Mesh`: every operation waits
    against the deadline, the loss of any peer and the collective's own abort."""

    def tag(self, seq: int, src: int, phase: int, slot: int, payload: bool) -> int:
        """The tag of (seq, phase, slot) between this rank and a peer, without the pair's
        secret prefix (:meth:`send` and :meth:`recv` add the one of the peer they talk to).
        ``src`` is implied by that peer and kept for callers that name it."""
        return structured_tag(seq, phase, slot, payload)

    async def _guard(
        self,
        rank: int,
        post: Any,
        what: str,
        extra: Iterable[asyncio.Future] = (),
        deadline: bool = True,
    ) -> Any:
        """Post a UCX operation with ``rank`` (``post()``) and await it against the
        deadline, the loss of any peer and the collective's own abort (``extra``).
        ``deadline=False``: no deadline (a receive posted ahead of need, which its
        caller bounds itself: cgx_ucx.collectives.p2p's any-source receive)."""
        # The collective's own abort first: a peer that gave up this call and then closed
        # sent ABORT before BYE, and the ABORT says why.
        raise_done(extra)
        self.check()
        errors = _ucx.errors()
        try:
            task = post()
            if not asyncio.isfuture(task):
                task = asyncio.ensure_future(task)  # ucxx's own coroutine (no driver)
        except errors as exc:
            return self._op_failed(rank, what, exc)
        if not task.done():
            timeout = self.config.timeout if deadline else None
            self.activity.wait_begins(rank)  # told to peers that ask (status.py)
            try:
                if not await await_or_wake(task, (self.failed_future, *extra), timeout):
                    task = None
            finally:
                self.activity.wait_ends(rank)
        if task is not None:
            try:
                return task.result()
            except errors as exc:
                # The operation failed because a peer closed or was aborted; if this
                # collective was aborted meanwhile, that says why.
                raise_done(extra)
                return self._op_failed(rank, what, exc)
        raise_done(extra)
        if self.failed_future.done():
            self.check()
        raise copy_error(await self._timed_out(rank, what))

    def _op_failed(self, rank: int, what: str, exc: BaseException) -> Any:
        """A UCX error on a data operation: the peer is lost (data endpoints only fail so)."""
        if self.peers[rank].lost is None and not self._closing:
            if "truncated" in type(exc).__name__.lower():
                # More bytes than the frame protocol allows for this (seq, phase, slot):
                # on a secret tag only the peer can have sent them.
                err: CGXError = ProtocolError(
                    f"rank {self.rank}: oversized message from rank {rank} ({what})"
                )
            else:
                err = PeerLostError(f"rank {rank}: {what} failed: {exc}", peer=rank)
            self.lose(rank, err)
        self.check()
        raise TransportError(f"{what} with rank {rank} failed: {exc}") from exc

    async def send(
        self, rank: int, tag: int, buf: Any, what: str, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        """Send ``buf`` to ``rank`` on ``tag`` (from :meth:`tag`) under the pair's prefix."""
        p = self.peers[rank]
        nbytes = _nbytes(buf)
        full = p.keys.tx ^ tag  # type: ignore[union-attr]
        await self._guard(
            rank, lambda: post_send(p.data, buf, full, p.remote, self._loop), what, extra
        )
        self.stats.bytes_sent += nbytes
        self.stats.messages_sent += 1

    async def recv(
        self,
        rank: int,
        tag: int,
        buf: Any,
        what: str,
        extra: Iterable[asyncio.Future] = (),
        deadline: bool = True,
    ) -> None:
        """Receive into ``buf`` from ``rank`` on ``tag`` under the pair's prefix."""
        await self._recv_message(rank, tag, buf, what, extra, deadline)
        self.stats.bytes_received += _nbytes(buf)

    async def _recv_message(
        self,
        rank: int,
        tag: int,
        buf: Any,
        what: str,
        extra: Iterable[asyncio.Future],
        deadline: bool,
    ) -> None:
        """One message into ``buf`` (counted; its bytes are the caller's to count: a
        header receive has room for more than arrives)."""
        p = self.peers[rank]
        full = p.keys.rx ^ tag  # type: ignore[union-attr]
        await self._guard(
            rank, lambda: post_recv(p.data, buf, full, p.remote, self._loop), what, extra, deadline
        )
        self.stats.messages_received += 1

    async def send_frame(
        self,
        rank: int,
        frame: Frame,
        payload: Any = None,
        extra: Iterable[asyncio.Future] = (),
    ) -> None:
        """Send a header (and its payload, if any) tagged by the frame's seq/phase/slot.

        A small contiguous host payload travels in the header's message (FLAG_INLINE, see
        :mod:`.frames`); device payloads and larger ones follow as a second message."""
        if frame.flags & FLAG_INLINE:
            raise ValueError(f"flags {frame.flags:#x}: bit {FLAG_INLINE:#x} is the transport's")
        if frame.comm != self.comm_id:
            frame = frame.with_(comm=self.comm_id)
        self.activity.sending(frame)
        key = self.peers[rank].keys.key  # type: ignore[union-attr]
        what = "sending " + describe_slot(frame.seq, frame.phase, frame.slot)
        tag = structured_tag(frame.seq, frame.phase, frame.slot, False)
        if payload is None or frame.payload == 0:
            await self.send(rank, tag, np.frombuffer(frame.pack(key), np.uint8), what, extra)
            return
        if inlinable(payload, frame.payload):
            await self.send(rank, tag, inline_message(frame, payload, key), what, extra)
            return
        head = np.frombuffer(frame.pack(key), np.uint8)
        await asyncio.gather(
            self.send(rank, tag, head, what, extra),
            self.send(rank, tag | 1, payload, what, extra),
        )

    async def recv_frame(
        self,
        rank: int,
        seq: int,
        phase: int,
        slot: int,
        extra: Iterable[asyncio.Future] = (),
        deadline: bool = True,
    ) -> Frame:
        """Receive and validate the header ``rank`` sent for (seq, phase, slot)
        (``deadline=False``: wait without the per-wait deadline, see :meth:`_guard`).

        The receive has room for an inline payload (the sender decides, the header says,
        see :mod:`.frames`); it is zeroed, so a message that ends early is seen. The
        header is checked first, then the inline bound and end; the returned frame
        carries the payload bytes in ``inline`` and no longer has FLAG_INLINE."""
        buf = np.zeros(RECV_NBYTES, np.uint8)
        what = describe_slot(seq, phase, slot)
        tag = structured_tag(seq, phase, slot, False)
        await self._recv_message(rank, tag, buf, what, extra, deadline)
        return self._parse_frame(rank, buf, seq, phase, slot)

    def _parse_frame(self, rank: int, buf: np.ndarray, seq: int, phase: int, slot: int) -> Frame:
        """The header received from ``rank`` in ``buf``, checked (see :meth:`recv_frame`)."""
        key = self.peers[rank].keys.key  # type: ignore[union-attr]
        try:
            frame = Frame.unpack(buf, job=self.job, key=key)
        except ProtocolError as exc:
            # Not keyed by the pair: nobody is proven guilty (it may be forged), so the
            # communicator fails without dropping rank ``rank``.
            err = ProtocolError(
                f"rank {self.rank}: a frame on rank {rank}'s channel (collective #{seq}) "
                f"was rejected: {exc}"
            )
            self.fail(err)
            raise copy_error(err) from exc
        try:
            if (frame.src, frame.seq, frame.phase, frame.slot, frame.comm) != (
                rank,
                seq & 0xFFFFFFFF,
                phase,
                slot,
                self.comm_id,
            ):
                raise ProtocolError(
                    f"frame (src {frame.src}, seq {frame.seq}, phase {frame.phase}, slot "
                    f"{frame.slot}) arrived for (src {rank}, seq {seq}, phase {phase}, slot {slot})"
                )
            if frame.kind not in (Kind.DATA, Kind.SIG):
                raise ProtocolError(f"unexpected frame kind {frame.kind} on the data channel")
            inline = inline_payload(frame, buf)
        except ProtocolError as exc:
            err = ProtocolError(f"rank {self.rank}: malformed frame from rank {rank}: {exc}")
            self.lose(rank, err)
            raise copy_error(err) from exc
        if inline is None:
            self.stats.bytes_received += FRAME_NBYTES
            return frame
        self.stats.bytes_received += FRAME_NBYTES + inline.nbytes + 1
        return frame.with_(flags=frame.flags & ~FLAG_INLINE, inline=inline)

    async def recv_frame_into(
        self,
        rank: int,
        seq: int,
        phase: int,
        slot: int,
        buf: Any,
        extra: Iterable[asyncio.Future] = (),
    ) -> Frame:
        """:meth:`recv_frame`, then :meth:`recv_payload` into ``buf``, for a receiver that
        knows the payload's size beforehand (a collective's pieces after the first).

        A payload too large to travel inline has its receive posted together with the
        header's, so that its bytes land in ``buf`` as they arrive: UCX copies a message
        that arrives before its receive is posted into a descriptor of its own, and again
        into ``buf`` once it is (over TCP, one copy of every payload byte more; a header
        takes a loop hop to be handled, by which time much of a large payload is in).
        The header is still validated, and its announced size checked, before the call
        returns; the payload cannot be longer than ``buf`` (UCX refuses it)."""
        nbytes = _nbytes(buf)
        if nbytes <= MAX_INLINE_NBYTES:
            frame = await self.recv_frame(rank, seq, phase, slot, extra)
            await self.recv_payload(rank, frame, buf, extra)
            return frame
        tag = structured_tag(seq, phase, slot, True)
        what = "payload of " + describe_slot(seq, phase, slot)
        payload = asyncio.ensure_future(self.recv(rank, tag, buf, what, extra))
        try:
            frame = await self.recv_frame(rank, seq, phase, slot, extra)
            # Larger than any inline payload: a header with the right size has none.
            self._check_payload_size(rank, frame, nbytes)
            await payload
        finally:
            if not payload.done():
                payload.cancel()
            elif not payload.cancelled():
                payload.exception()  # retrieved: the header's error is the one raised
        return frame

    def _check_payload_size(self, rank: int, frame: Frame, nbytes: int) -> None:
        if nbytes != frame.payload:
            err = ProtocolError(
                f"rank {self.rank}: rank {rank} announced {frame.payload} payload bytes, "
                f"{nbytes} expected"
            )
            self.lose(rank, err)
            raise copy_error(err)

    async def recv_payload(
        self, rank: int, frame: Frame, buf: Any, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        """Receive the payload announced by ``frame`` into ``buf`` (exactly its size)."""
        self._check_payload_size(rank, frame, _nbytes(buf))
        if frame.payload == 0:
            return
        if frame.inline is not None:
            # What a separate payload receive would check first (_guard): the call's
            # abort, then a failure seen since the header, win over the copy.
            raise_done(extra)
            self.check()
            copy_inline(buf, frame.inline)
            return
        tag = structured_tag(frame.seq, frame.phase, frame.slot, True)
        what = "payload of " + describe_slot(frame.seq, frame.phase, frame.slot)
        await self.recv(rank, tag, buf, what, extra)


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else memoryview(buf).nbytes
