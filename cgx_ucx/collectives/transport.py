"""What the collectives need from the layer below: a small structural interface.

:class:`cgx_ucx.transport.mesh.Mesh` (UCX endpoints to every peer) is the one real
implementation; the unit tests run SRA and ring over an in-memory one. Everything the
collectives send goes through :meth:`Transport.send_frame`: a 64-byte header tagged by
(sequence, phase, slot), optionally followed by a payload that the receiver takes only
after it validated the header (:meth:`Transport.recv_frame`, then
:meth:`Transport.recv_payload` into a buffer of exactly the announced size, or both at
once with :meth:`Transport.recv_frame_into` where that size is known beforehand).

Every wait takes ``extra`` futures (the collective's abort future): an operation fails
as soon as one of them holds an exception, so a peer's ABORT ends the wait at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol

from ..errors import CGXError
from ..transport.frames import AbortCode, Frame
from ..transport.stats import TransportStats

__all__ = ["Transport"]


class Transport(Protocol):
    """Connected, authenticated message channels to every other rank of one group."""

    #: Called with (frame, reason) when a peer sends ABORT for a collective.
    on_abort: Callable[[Frame, str], None] | None

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def peers(self) -> Collection[int]:
        """The other ranks (iteration yields rank numbers)."""
        ...

    @property
    def job(self) -> int:
        """The job id every frame carries (from the membership token)."""
        ...

    @property
    def closed(self) -> bool: ...

    @property
    def stats(self) -> TransportStats:
        """Traffic counters; the communicator also counts its collectives there."""
        ...

    def check(self) -> None:
        """Raise the failure that broke the group (a lost peer...), or TransportError if closed."""
        ...

    @property
    def comm_id(self) -> int:
        """The communicator id every frame carries (unique in the job)."""
        ...

    def collective_started(self, seq: int, what: str) -> None:
        """Collective ``seq`` (described by ``what``) started here: for peers' timeouts."""
        ...

    def collective_finished(self, seq: int) -> None:
        """Collective ``seq`` ended here (success or failure)."""
        ...

    def lose(self, rank: int, exc: CGXError) -> None:
        """Drop ``rank`` (it broke the protocol): every pending operation fails with ``exc``."""
        ...

    async def send_frame(
        self,
        rank: int,
        frame: Frame,
        payload: Any = None,
        extra: Iterable[asyncio.Future] = (),
    ) -> None:
        """Send ``frame`` (and ``payload``, ``frame.payload`` bytes) to ``rank``."""
        ...

    async def recv_frame(
        self,
        rank: int,
        seq: int,
        phase: int,
        slot: int,
        extra: Iterable[asyncio.Future] = (),
        deadline: bool = True,
    ) -> Frame:
        """The validated header ``rank`` sent for (seq, phase, slot); ``deadline=False``
        waits without the per-wait deadline (a receive posted ahead of need)."""
        ...

    async def recv_payload(
        self, rank: int, frame: Frame, buf: Any, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        """Receive the payload ``frame`` announced into ``buf`` (uint8, exactly its size)."""
        ...

    async def recv_frame_into(
        self,
        rank: int,
        seq: int,
        phase: int,
        slot: int,
        buf: Any,
        extra: Iterable[asyncio.Future] = (),
    ) -> Frame:
        """:meth:`recv_frame`, then :meth:`recv_payload` into ``buf``, whose size the
        caller knows beforehand: the payload's receive may be posted with the header's
        (so that its bytes land in place), but ``buf`` is the caller's only once the header
        was validated and its size checked."""
        ...

    async def exchange_frames(
        self, frame: Frame, payload: Any, peers: Iterable[int], extra: Iterable[asyncio.Future] = ()
    ) -> list[Frame]:
        """Send ``frame`` (and ``payload``: None, or small enough to travel inline) to every
        rank of ``peers`` and return the header each of them sent for the same (seq,
        phase, slot), in ``peers`` order: one round, as :meth:`send_frame` to each and
        :meth:`recv_frame` from each would do."""
        ...

    async def broadcast_abort(self, seq: int, code: AbortCode, peer: int, reason: str) -> None:
        """Best effort: tell every peer that this rank gave up collective ``seq``."""
        ...

    async def close(self) -> None:
        """Say goodbye to the peers and release everything. Idempotent."""
        ...
