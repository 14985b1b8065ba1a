"""The state of one mesh and its failure bookkeeping: losing a peer, failing the mesh."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Iterable
from typing import Any

from ..config import CommConfig
from ..errors import CGXError, CGXTimeoutError, PeerLostError, TransportError
from . import handshake as _hs
from . import stuck as _stuck
from .frames import Frame
from .handshake import Auth
from .peer import Peer
from .stats import TransportStats
from .status import Activity
from .topology import Topology, resolve_hierarchy
from .ucx import ABORT_PERIOD_NS

__all__ = ["MeshState", "copy_error", "raise_done"]

log = logging.getLogger("cgx_ucx.transport")


def copy_error(exc: CGXError) -> CGXError:
    """A fresh instance of the same error (one raise site per waiter keeps tracebacks clean)."""
    if isinstance(exc, CGXTimeoutError):
        return type(exc)(str(exc), peer=exc.peer, alive=exc.alive)
    if isinstance(exc, PeerLostError):
        return type(exc)(str(exc), peer=exc.peer)
    return type(exc)(str(exc))


def raise_done(futures: Iterable[asyncio.Future]) -> None:
    """Raise the failure of the first of ``futures`` that is done (a fresh copy)."""
    for f in futures:
        if f.done():
            exc = f.exception()
            raise copy_error(exc) if isinstance(exc, CGXError) else TransportError(str(exc))


class MeshState:
    """The state of a :class:`~cgx_ucx.transport.mesh.Mesh` (its fields are declared
    here) and how it fails: a lost peer, or a failure of the whole mesh."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: CommConfig,
        token: bytes,
        data_error_handling: bool = True,
        comm_id: int | None = None,
    ) -> None:
        self.rank, self.world_size, self.config = rank, world_size, config
        self.data_error_handling = data_error_handling
        self.token = token
        self.job: int = struct.unpack_from("<Q", token, 0)[0]
        #: Communicator id, unique in the job (agreed through the store, see .rendezvous).
        self.comm_id: int = comm_id if comm_id is not None else 0
        secret = getattr(config, "secret", None)
        self.auth = Auth(token, self.job, self.comm_id, _hs.hash_bytes(secret) if secret else None)
        self.peers: dict[int, Peer] = {r: Peer(r) for r in range(world_size) if r != rank}
        self.stats = TransportStats()
        self.activity = Activity()
        self._on_abort: Any = None  # callable(frame, reason) set by the communicator
        #: ABORTs that arrive before on_abort is set are kept and delivered when it is
        #: set, so a peer's abort reason is never lost (connect still waits for the other
        #: ranks' codecs after the mesh is up, and a rank that got through first may
        #: already have failed its first collective).
        self._early_aborts: list[tuple[Frame, str]] = []
        self._ucxx: Any = None
        self._listener: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Future | None = None
        self._accepted: dict[int, asyncio.Future] = {}
        #: Peers whose address we read at connect: only they can be dialing our listener.
        self._published: set[int] = set()
        self._closing = False
        self._closed = False
        self._bye_fut: asyncio.Future | None = None
        #: close(): resolved once every peer read our ABORTs (``_read_marks``), see there.
        self._read_fut: asyncio.Future | None = None
        self._read_marks: dict[int, int] = {}
        self._aborts = 0  # ABORT frames sent or received: a collective failed
        self._told = False  # this rank sent an ABORT
        #: A failure other than a clean close of a peer (see :meth:`fail`): a lost or
        #: silent peer, a forged frame. close() then keeps its teardown short.
        self._troubled = False
        self._tasks: set[asyncio.Task] = set()  # accepts and status answers in flight
        self._setup_tasks: set[asyncio.Future] = set()  # dials, data hellos (see _setup)
        #: Ranks on this machine (same kernel), this one included.
        self.local_ranks: list[int] = [rank]
        #: Which ranks share a node (from every rank's hints at connect) and how the
        #: allreduce uses the two levels (torch_cgx's variables, see .topology).
        self.topology = Topology.single_node(world_size)
        self.hierarchy = resolve_hierarchy()

    # -- properties ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failure(self) -> CGXError | None:
        """The error that broke this mesh (a lost peer, a protocol violation), if any."""
        if self._failed is not None and self._failed.done() and not self._failed.cancelled():
            return self._failed.exception()  # type: ignore[return-value]
        return None

    @property
    def failed_future(self) -> asyncio.Future:
        assert self._failed is not None
        return self._failed

    # -- failure --------------------------------------------------------------------------
    def lose(self, rank: int, exc: CGXError, quiet: bool = False) -> None:
        """Mark ``rank`` lost: abort its endpoints, fail every pending operation with ``exc``."""
        p = self.peers.get(rank)
        if p is None or p.lost is not None:
            return
        p.lost = exc
        (log.info if quiet else log.warning)("rank %d: %s", self.rank, exc)
        for ep in (p.data, p.ctrl):
            if ep is not None:
                with contextlib.suppress(Exception):
                    ep.abort(period=ABORT_PERIOD_NS)
        if p.ctrl_task is not None and p.ctrl_task is not asyncio.current_task():
            p.ctrl_task.cancel()
        if p.status is not None and not p.status.done():
            p.status.set_result(None)
        self.fail(exc, quiet)
        self._bye_seen()  # a close waiting for this peer's BYE need not wait any more

    def fail(self, exc: CGXError, quiet: bool = False) -> None:
        """Fail every pending and later operation with ``exc``, dropping no peer: for a
        failure no peer is proven guilty of (a forged frame, a late but live peer).
        ``quiet``: log at INFO (a peer that said BYE: a clean end of the job, which the
        next collective, if any, still reports as an error)."""
        if not quiet:
            self._troubled = True
            # See Mesh._release_stuck: for a mesh nobody closes.
            _stuck.release_at_exit(self._peer_hosts())
        if self._failed is not None and not self._failed.done():
            (log.info if quiet else log.warning)("rank %d: communicator failed: %s", self.rank, exc)
            self._failed.set_exception(exc)

    def told_silent(self, src: int, ranks: Iterable[int]) -> None:
        """Rank ``src`` reported a failure (an ABORT) naming ``ranks`` as not answering
        its status request: stopped, blocked or cut off, as if they had not answered
        ours. A rank that learns of the failure this way never asked them, yet they will
        not say BYE either: close() does not wait for them, and keeps the teardown of a
        troubled mesh (a cut link leaves connections that cannot drain, see :meth:`fail`)."""
        named = [self.peers[r] for r in ranks if r != src and r in self.peers]
        named = [q for q in named if q.lost is None and not q.bye]
        if not named:
            return
        for q in named:
            q.silent = True
        self._troubled = True
        _stuck.release_at_exit(self._peer_hosts())
        self._bye_seen()

    def check(self) -> None:
        """Raise the mesh's failure (a fresh copy), or TransportError when closed."""
        if self._closed or self._closing:
            raise TransportError("the communicator is closed")
        exc = self.failure
        if exc is not None:
            raise copy_error(exc)

    def _bye_seen(self) -> None:
        """Resolve what :meth:`close` waits for: every peer said BYE, is lost or went
        silent (``_bye_fut``), or answered the STATUS_REQUEST sent after our ABORTs
        (``_read_fut``)."""
        peers = self.peers.values()
        fut = self._bye_fut
        done = all(q.bye or q.lost is not None or q.silent for q in peers)
        if fut is not None and not fut.done() and done:
            fut.set_result(None)
        fut, marks = self._read_fut, self._read_marks
        if (
            fut is not None
            and not fut.done()
            and all(
                q.bye or q.lost is not None or q.silent or q.answers >= marks[q.rank] for q in peers
            )
        ):
            fut.set_result(None)

    def _peer_hosts(self) -> set[str]:
        """The IP addresses our connections to the peers go to (resolved at connect)."""
        return {h for p in self.peers.values() for h in p.hosts}
