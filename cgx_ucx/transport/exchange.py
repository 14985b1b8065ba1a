"""One round of headers with several peers at once: the latency path of small collectives."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import CGXError, TransportError
from . import ucx as _ucx
from .data import MeshData
from .frames import FLAG_INLINE, RECV_NBYTES, Frame, describe_slot, inlinable, inline_message
from .handshake import structured_tag
from .progress import await_or_wake, post_recv, post_send
from .state import copy_error, raise_done

__all__ = ["MeshExchange"]


class MeshExchange(MeshData):
    """:meth:`exchange_frames` of a :class:`~cgx_ucx.transport.mesh.Mesh`."""

    async def exchange_frames(
        self,
        frame: Frame,
        payload: Any,
        peers: Iterable[int],
        extra: Iterable[asyncio.Future] = (),
    ) -> list[Frame]:
        """Send ``frame`` (with ``payload``, if any) to every rank of ``peers`` and receive
        the header each of them sent for the same (seq, phase, slot), in one round: the
        latency path of small collectives. Every send and receive is posted at once and
        awaited under one guard (deadline, loss of a peer, the collective's abort), not
        one task and one guard per operation. Checks, errors and statistics are those of
        :meth:`send_frame` and :meth:`recv_frame`. Returns the headers in ``peers`` order.

        ``payload`` must be None or :func:`~.frames.inlinable`: a payload sent as a
        message of its own may wait for a rendezvous that its receiver only posts after
        this round returns (every rank would wait for the others until the deadline)."""
        peers = list(peers)
        if frame.flags & FLAG_INLINE:
            raise ValueError(f"flags {frame.flags:#x}: bit {FLAG_INLINE:#x} is the transport's")
        nbytes = 0 if payload is None else frame.payload
        if nbytes and not inlinable(payload, nbytes):
            raise ValueError(
                f"exchange_frames sends inline payloads only, not {nbytes} bytes of "
                f"{type(payload).__name__}: use send_frame / recv_frame"
            )
        if frame.comm != self.comm_id:
            frame = frame.with_(comm=self.comm_id)
        extra = tuple(extra)
        raise_done(extra)
        self.check()
        self.activity.sending(frame)
        tag = structured_tag(frame.seq, frame.phase, frame.slot, False)
        what = describe_slot(frame.seq, frame.phase, frame.slot)
        sending = "sending " + what
        ops: list[tuple[int, str, asyncio.Future]] = []
        headers: dict[int, Frame | CGXError] = {}
        bufs: list[np.ndarray] = []
        sent = 0
        errors = _ucx.errors()
        for rank in peers:
            p = self.peers[rank]
            keys = p.keys
            assert keys is not None
            try:
                if nbytes:
                    msg = inline_message(frame, payload, keys.key)
                else:
                    msg = np.frombuffer(frame.pack(keys.key), np.uint8)
                sent_fut = _as_future(post_send(p.data, msg, keys.tx ^ tag, p.remote, self._loop))
                ops.append((rank, sending, sent_fut))
                sent += msg.nbytes
                buf = np.zeros(RECV_NBYTES, np.uint8)
                recv = _as_future(post_recv(p.data, buf, keys.rx ^ tag, p.remote, self._loop))
                ops.append((rank, what, recv))
            except errors as exc:
                self._cancel_ops(ops)
                return self._op_failed(rank, what, exc)
            # Checked as soon as it arrives, as recv_frame does: a malformed or forged
            # header fails the call at once (waking the other operations), not after
            # the slowest peer has sent its own.
            recv.add_done_callback(functools.partial(self._parse_into, headers, rank, buf, frame))
            bufs.append(buf)
        await self._await_ops(ops, extra)
        stats = self.stats
        stats.messages_received += len(peers)
        stats.messages_sent += len(peers)
        stats.bytes_sent += sent
        out = []
        for rank, buf in zip(peers, bufs, strict=True):
            if rank not in headers:  # completed at once: its callback has not run yet
                self._parse_into(headers, rank, buf, frame, None)
            got = headers[rank]
            if isinstance(got, BaseException):
                raise copy_error(got) if isinstance(got, CGXError) else got
            out.append(got)
        return out

    def _parse_into(
        self,
        headers: dict,
        rank: int,
        buf: np.ndarray,
        sent: Frame,
        fut: asyncio.Future | None,
    ) -> None:
        """Done callback of a header receive of :meth:`exchange_frames`: the checked header
        (or the error its check raised, after it failed the mesh) into ``headers``."""
        if rank in headers or (fut is not None and (fut.cancelled() or fut.exception())):
            return  # checked already (see exchange_frames), or failed: _await_ops says why
        try:
            headers[rank] = self._parse_frame(rank, buf, sent.seq, sent.phase, sent.slot)
        except CGXError as exc:
            headers[rank] = exc

    @staticmethod
    def _cancel_ops(ops: list[tuple[int, str, Any]]) -> None:
        for _, _, fut in ops:
            if not fut.done():
                fut.cancel()

    async def _await_ops(self, ops: list[tuple[int, str, Any]], extra: tuple) -> None:
        """Wait for every posted operation of :meth:`exchange_frames`: one deadline for
        all, woken by the first failure, the mesh's failure or the collective's abort;
        errors as :meth:`_guard` raises them."""
        loop = self._loop
        assert loop is not None
        pending = [fut for _, _, fut in ops if not fut.done()]
        if pending:
            all_done = loop.create_future()
            left = len(pending)

            def one(fut: asyncio.Future) -> None:
                nonlocal left
                left -= 1
                failed = fut.cancelled() or fut.exception() is not None
                if (left == 0 or failed) and not all_done.done():
                    all_done.set_result(None)

            for fut in pending:
                fut.add_done_callback(one)
            awaited = {r for r, _, fut in ops if not fut.done()}
            for r in awaited:
                self.activity.wait_begins(r)  # told to peers that ask (status.py)
            try:
                ok = await await_or_wake(
                    all_done, (self.failed_future, *extra), self.config.timeout
                )
            except BaseException:  # cancelled from outside: nobody waits for them now
                self._cancel_ops(ops)
                raise
            finally:
                for r in awaited:
                    self.activity.wait_ends(r)
            if not ok:
                late = next(((r, w) for r, w, fut in ops if not fut.done()), ops[0][:2])
                self._cancel_ops(ops)
                raise_done(extra)
                if self.failed_future.done():
                    self.check()
                raise copy_error(await self._timed_out(*late))
        errors = _ucx.errors()
        for rank, op_what, fut in ops:
            if not fut.done():  # woken by another operation's failure, found below
                continue
            if fut.cancelled():  # by the driver closing under us
                self._cancel_ops(ops)
                raise_done(extra)
                self.check()
                raise TransportError(f"{op_what} with rank {rank} was cancelled")
            exc = fut.exception()
            if exc is not None:
                self._cancel_ops(ops)
                raise_done(extra)
                if isinstance(exc, errors):
                    self._op_failed(rank, op_what, exc)
                raise exc


def _as_future(op: Any) -> asyncio.Future:
    """A posted operation as a future (ucxx's own coroutine when no driver is installed)."""
    return op if asyncio.isfuture(op) else asyncio.ensure_future(op)
