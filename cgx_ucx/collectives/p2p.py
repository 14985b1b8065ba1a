"""Point-to-point messages beside the collectives: send, recv, and recv from any source.

Pipeline parallelism (and torch's ``send``/``recv``/``batch_isend_irecv``) needs messages
that only two ranks take part in, so they cannot use the collectives' numbering (every
rank must take every sequence number). Each message is one header frame, checked with
the pair key like every frame (:mod:`cgx_ucx.transport.frames`), then its payload, on
the data channel under the pair's secret tag prefix, in phase :data:`PH_P2P`, which no
collective uses:

1. The frame's ``slot`` is the user's tag and its ``seq`` the message's number in the
   stream (source, destination, tag): the sender numbers its sends to (dst, tag) in call
   order, the receiver its receives from (src, tag). Message n of a stream can only match
   receive n of that stream, so messages of one pair and tag arrive in the order they
   were sent (torch's promise) however the engine interleaves them, and streams of other
   tags or pairs never mix.
2. The header names dtype, numel and payload size; a receive whose buffer differs drains
   the payload and raises :class:`~cgx_ucx.errors.CollectiveMismatchError`.
3. Any source: the header of each peer's next message on that tag is received ahead of
   need (one outstanding receive per peer, without the per-wait deadline); the first to
   arrive wins and takes its stream's number. The others stay posted and are claimed by
   later receives from those peers (never cancelled: cancelling a UCX receive can race
   with its match and lose the message), so nothing is lost or reordered. The wait of the
   any-source receive itself is bounded by the communicator's timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..config import CommConfig
from ..errors import CGXTimeoutError, CollectiveMismatchError, ConfigError, ProtocolError
from ..transport.frames import PH_P2P, Coll, Frame
from ..transport.handshake import MAX_SLOTS
from .call import describe, make_template
from .staging import as_flat, byte_view, synchronize
from .transport import Transport

__all__ = ["MAX_TAG", "PH_P2P", "PointToPoint"]

#: Largest user tag: the tag travels in the frame's slot bits.
MAX_TAG = MAX_SLOTS - 1
#: Largest payload a mismatched receive drains into a scratch buffer; beyond it the
#: peer is dropped (a receive that small cannot take it, and allocating it is not ours).
MAX_DRAIN_NBYTES = 1 << 28


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class PointToPoint:
    """The point-to-point streams of one communicator (see the module docstring)."""

    def __init__(self, transport: Transport, config: CommConfig) -> None:
        self._t = transport
        self._config = config
        self._tx: dict[tuple[int, int], int] = {}  # (dst, tag) -> number of the next send
        self._rx: dict[tuple[int, int], int] = {}  # (src, tag) -> number of the next receive
        #: Headers received (or being received) ahead of need, not claimed yet.
        self._ahead: dict[tuple[int, int, int], asyncio.Task] = {}
        #: Streams whose header never came in time: their numbering is lost.
        self._broken: dict[tuple[int, int], CGXTimeoutError] = {}

    # -- checks -----------------------------------------------------------------------
    def _peer(self, peer: Any, what: str) -> int:
        size, rank = self._t.world_size, self._t.rank
        if not isinstance(peer, (int, np.integer)) or not 0 <= int(peer) < size:
            raise ConfigError(f"{what}: peer must be a rank in 0..{size - 1}, got {peer!r}")
        if int(peer) == rank:
            raise ConfigError(f"{what}: rank {rank} cannot send to or receive from itself")
        return int(peer)

    @staticmethod
    def _tag(tag: Any, what: str) -> int:
        if not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) <= MAX_TAG:
            raise ConfigError(f"{what}: tag must be an int in 0..{MAX_TAG}, got {tag!r}")
        return int(tag)

    def _template(self, flat: Any) -> Frame:
        return make_template(Coll.P2P, flat).with_(
            job=self._t.job, src=self._t.rank, phase=PH_P2P, count=1
        )

    def _count(self, name: str) -> None:
        stats = self._t.stats
        stats.by_collective[name] = stats.by_collective.get(name, 0) + 1

    # -- send -------------------------------------------------------------------------
    async def send(self, x: Any, dst: int, tag: int = 0) -> None:
        """Send ``x`` (a C-contiguous NumPy/CuPy array) to rank ``dst`` on ``tag``."""
        flat = as_flat(x)
        dst, tag = self._peer(dst, "send"), self._tag(tag, "send")
        template = self._template(flat)  # before numbering: a bad dtype takes no number
        self._t.check()
        key = (dst, tag)
        n = self._tx.get(key, 0)
        self._tx[key] = n + 1  # numbered in call order, before any await
        data = byte_view(flat)
        frame = template.with_(seq=n, slot=tag, payload=int(data.nbytes))
        synchronize(flat)
        await self._t.send_frame(dst, frame, data if data.nbytes else None)
        self._count("send")

    # -- receive ----------------------------------------------------------------------
    def _posted(self, src: int, tag: int, n: int) -> asyncio.Task:
        """The header receive of message ``n`` of (src, tag), posted ahead of need."""
        key = (src, tag, n)
        task = self._ahead.get(key)
        if task is None:
            task = asyncio.ensure_future(self._t.recv_frame(src, n, PH_P2P, tag, deadline=False))
            task.add_done_callback(_consume)
            self._ahead[key] = task
        return task

    def _claim(self, src: int, tag: int) -> int:
        broken = self._broken.get((src, tag))
        if broken is not None:
            raise CGXTimeoutError(str(broken), peer=src, alive=broken.alive)
        n = self._rx.get((src, tag), 0)
        self._rx[(src, tag)] = n + 1
        return n

    async def recv(self, x: Any, src: int, tag: int = 0) -> int:
        """Receive the next message of rank ``src`` on ``tag`` into ``x``; returns ``src``."""
        flat = as_flat(x, writable=True)
        src, tag = self._peer(src, "recv"), self._tag(tag, "recv")
        expected = self._template(flat)
        self._t.check()
        n = self._claim(src, tag)
        try:
            ahead = self._ahead.pop((src, tag, n), None)
            if ahead is None:
                frame = await self._t.recv_frame(src, n, PH_P2P, tag)
            else:
                frame = await self._wait_ahead(ahead, src, tag)
            await self._take(src, tag, frame, flat, expected)
        except asyncio.CancelledError:
            self._abandoned(src, tag)
            raise
        self._count("recv")
        return src

    def _abandoned(self, src: int, tag: int) -> None:
        """A numbered receive was cancelled before its message was in: the stream's
        numbering is lost (its message would be the next receive's), so it fails."""
        self._broken.setdefault(
            (src, tag),
            CGXTimeoutError(
                f"rank {self._t.rank}: an earlier receive of tag {tag} from rank {src} was "
                "abandoned before its message came (its wait timed out or it was "
                "cancelled); later receives of this stream would take the wrong messages",
                peer=src,
            ),
        )

    async def _wait_ahead(self, task: asyncio.Task, src: int, tag: int) -> Frame:
        """A header posted ahead of need (no deadline), awaited with the deadline."""
        limit = self._config.timeout
        try:
            return await asyncio.wait_for(asyncio.shield(task), limit)
        except TimeoutError:
            exc = CGXTimeoutError(
                f"rank {self._t.rank}: rank {src} sent no message with tag {tag} within "
                f"{limit:g} s",
                peer=src,
            )
            self._broken[(src, tag)] = exc
            raise exc from None

    async def recv_any(self, x: Any, tag: int = 0) -> int:
        """Receive the first message on ``tag`` from any peer into ``x``; returns its rank."""
        flat = as_flat(x, writable=True)
        tag = self._tag(tag, "recv from any source")
        expected = self._template(flat)
        self._t.check()
        peers = sorted(self._t.peers)
        if not peers:
            raise ConfigError("recv from any source needs a peer (the group has one rank)")
        loop = asyncio.get_running_loop()
        end = loop.time() + self._config.timeout
        while True:
            posted = {p: self._posted(p, tag, self._rx.get((p, tag), 0)) for p in peers}
            ready = [p for p, t in posted.items() if t.done()]
            if ready:
                # Claimed without an await in between: a concurrent receive of the same
                # stream either took it before (then it is not in ``posted``) or after.
                src = ready[0]
                n = self._claim(src, tag)
                frame = self._ahead.pop((src, tag, n)).result()
                try:
                    await self._take(src, tag, frame, flat, expected)
                except asyncio.CancelledError:
                    self._abandoned(src, tag)
                    raise
                self._count("recv")
                return src
            left = end - loop.time()
            if left <= 0:
                raise CGXTimeoutError(
                    f"rank {self._t.rank}: no message with tag {tag} from any rank within "
                    f"{self._config.timeout:g} s"
                )
            await asyncio.wait(posted.values(), timeout=left, return_when=asyncio.FIRST_COMPLETED)

    async def _take(self, src: int, tag: int, frame: Frame, flat: Any, expected: Frame) -> None:
        """Check the header against our buffer, then receive the payload into it."""
        data = byte_view(flat)
        if (frame.collective, frame.dtype, frame.numel, frame.payload) == (
            Coll.P2P,
            expected.dtype,
            expected.numel,
            int(data.nbytes),
        ):
            await self._t.recv_payload(src, frame, data)
            return
        if frame.payload > MAX_DRAIN_NBYTES:
            err = ProtocolError(
                f"rank {src} sent a {frame.payload}-byte message with tag {tag}, too large "
                f"for the {data.nbytes}-byte receive of rank {self._t.rank}"
            )
            self._t.lose(src, err)
            raise err
        if frame.payload:
            await self._t.recv_payload(src, frame, np.empty(frame.payload, np.uint8))
        raise CollectiveMismatchError(
            f"tag {tag}: rank {src} sent {describe(frame)} while rank {self._t.rank} "
            f"receives {describe(expected)}"
        )
