"""A collective stage over some of the ranks: the transport seen through a rank subset.

The two-level allreduce (:mod:`.hierarchical`) runs the existing algorithms (:mod:`.sra`,
:mod:`.ring`) among the ranks of one node or of one cross-node group. They address peers
as ``0..n-1`` of their own world; :class:`GroupView` renumbers those onto the real ranks
of the group and passes everything else through, and :class:`StageCall` is the
collective's :class:`~.call.Call` on that view: same sequence number, signature, abort
future and staging as the whole call, so a failure anywhere ends every stage and a
signature that differs between nodes is seen as a mismatch by the stage that meets it.

Frames keep the sender's real rank (``src``) and travel on the real pair's tags, so the
mesh validates them as usual; stages that share a phase number must therefore talk to
disjoint sets of peers (the node, the cross-node group), which they do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import CGXError, ConfigError
from ..transport.frames import AbortCode, Frame
from ..transport.stats import TransportStats
from .call import Call, describe
from .transport import Transport

__all__ = ["GroupView", "StageCall"]


class GroupView:
    """``transport`` restricted to ``ranks`` (real rank numbers), renumbered 0..len-1 in
    the order given. Implements :class:`~.transport.Transport`; it owns nothing (closing
    it does nothing: the underlying transport belongs to the communicator)."""

    def __init__(self, transport: Transport, ranks: Sequence[int]) -> None:
        self.base = transport
        self.ranks = tuple(ranks)
        index = {r: i for i, r in enumerate(self.ranks)}
        if len(index) != len(self.ranks) or transport.rank not in index:
            raise ConfigError(f"rank {transport.rank} cannot view the group {list(self.ranks)}")
        self._rank = index[transport.rank]
        self.on_abort: Callable[[Frame, str], None] | None = None

    def real(self, rank: int) -> int:
        """The real rank of the group's ``rank``."""
        return self.ranks[rank]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def peers(self) -> list[int]:
        return [i for i in range(len(self.ranks)) if i != self._rank]

    @property
    def job(self) -> int:
        return self.base.job

    @property
    def closed(self) -> bool:
        return self.base.closed

    @property
    def stats(self) -> TransportStats:
        return self.base.stats

    def check(self) -> None:
        self.base.check()

    def lose(self, rank: int, exc: CGXError) -> None:
        self.base.lose(self.ranks[rank], exc)

    async def send_frame(
        self, rank: int, frame: Frame, payload: Any = None, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        await self.base.send_frame(self.ranks[rank], frame, payload, extra)

    async def recv_frame(
        self, rank: int, seq: int, phase: int, slot: int, extra: Iterable[asyncio.Future] = ()
    ) -> Frame:
        return await self.base.recv_frame(self.ranks[rank], seq, phase, slot, extra)

    async def recv_payload(
        self, rank: int, frame: Frame, buf: Any, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        await self.base.recv_payload(self.ranks[rank], frame, buf, extra)

    async def recv_frame_into(
        self,
        rank: int,
        seq: int,
        phase: int,
        slot: int,
        buf: Any,
        extra: Iterable[asyncio.Future] = (),
    ) -> Frame:
        return await self.base.recv_frame_into(self.ranks[rank], seq, phase, slot, buf, extra)

    async def exchange_frames(
        self, frame: Frame, payload: Any, peers: Iterable[int], extra: Iterable[asyncio.Future] = ()
    ) -> list[Frame]:
        real = [self.ranks[r] for r in peers]
        return await self.base.exchange_frames(frame, payload, real, extra)

    async def broadcast_abort(self, seq: int, code: AbortCode, peer: int, reason: str) -> None:
        # An abort concerns the whole collective: every rank of the job hears it.
        await self.base.broadcast_abort(seq, code, self.ranks[peer], reason)

    async def close(self) -> None:
        return None


class StageCall(Call):
    """``parent``'s collective, run on ``view``: shares its sequence number, signature,
    abort future and staging (given back by the parent, after the whole call)."""

    def __init__(self, parent: Call, view: GroupView) -> None:
        super().__init__(view, parent.pool, parent.codec, parent.seq, parent.name)
        self.parent = parent
        self.view = view
        self.abort = parent.abort
        self.extra = parent.extra
        self.template = parent.template

    def take(self, nbytes: int, like: Any) -> Any:
        return self.parent.take(nbytes, like)

    def give(self, buf: Any) -> None:
        self.parent.give(buf)

    def take_segment(self, nbytes: int) -> Any:
        return self.parent.take_segment(nbytes)

    def give_back_all(self) -> None:
        """Nothing: the staging is the parent call's."""

    def fail(self, exc: CGXError) -> None:
        self.parent.fail(exc)

    def mismatch(self, peer: int, frame: Frame) -> str:
        """Names the real ranks, not the stage's numbers."""
        assert self.template is not None
        return (
            f"rank {self.view.real(peer)} called {describe(frame)} while rank "
            f"{self.parent.rank} called {describe(self.template)}"
        )
