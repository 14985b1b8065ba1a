"""The full mesh of one communicator: two channels per peer, failure detection, deadlines.

Why two channels (ucxx 0.52 / UCX 1.21):

- **data**: endpoints made from exchanged UCX worker addresses. Endpoints made through
  the listener only ever get TCP on one host; worker-address endpoints get shared
  memory. Without endpoint error handling UCX adds CMA zero-copy (``process_vm_readv``)
  for large messages, but then treats a failed transfer as fatal: a peer SIGKILLed while
  a rendezvous from it is pending aborts the *survivor* (SIGABRT in ``cma_ep.c``). So
  by default the data endpoints keep error handling on and UCX_MM_ERROR_HANDLING=y (see
  :mod:`.ucx`) lets them use shared memory (copy-in/copy-out with keepalive), which with
  the progress driver spinning during transfers is as fast as CMA.
  ``data_error_handling=False`` restores CMA for those who accept the risk, on the
  endpoints to peers of this host only (CMA goes no further; the endpoints to other
  nodes keep error handling, else a cut link leaves them impossible to close); cuda_ipc
  and IB are used either way where present.
- **control**: one error-handling endpoint per peer pair, made through the listener
  (TCP). UCX reports a killed peer on it within milliseconds; it carries the membership
  handshake (:mod:`.handshake`), ABORT, BYE and STATUS frames.

Liveness comes from the control channel (a peer lost there fails every pending operation
with :class:`~cgx_ucx.errors.PeerLostError` naming it), from errors on the data
endpoints, and from a deadline on every single wait (UCX never reports a silently cut
link). A wait past ``CommConfig.timeout`` asks the peer for its status on the control
channel and raises :class:`~cgx_ucx.errors.CGXTimeoutError` saying whether the peer is
alive and which collective it is in, or that it is gone.

Trust (:mod:`.handshake`): data messages travel on tags derived from per-pair secrets
exchanged on the control channel, and every header carries a check keyed with the pair
key; a header that fails it is a :class:`~cgx_ucx.errors.ProtocolError` for the whole
communicator, without blaming the peer it claimed to come from.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from ..config import CommConfig
from ..errors import CGXError, RendezvousError, TransportError
from . import progress as _progress
from . import stuck as _stuck
from . import ucx as _ucx
from .connection import MeshSetup
from .exchange import MeshExchange
from .frames import Frame, Kind
from .rendezvous import PeerFailedError, Rendezvous, default_host, with_rank
from .ucx import ABORT_PERIOD_NS

__all__ = ["CLOSE_WAIT_S", "FAILED_CLOSE_WAIT_S", "MAX_WORLD_SIZE", "Mesh"]

#: Ranks a frame header can name.
MAX_WORLD_SIZE = 1 << 12
#: How long close() waits for the peers' BYE (they send it when they close, i.e. after
#: they received everything we sent): bounded so one rank that never closes costs little.
CLOSE_WAIT_S = 10.0
#: The same after the communicator failed or a collective was aborted: the peers were
#: told (ABORT) or are gone, and a teardown after a failure must stay short.
FAILED_CLOSE_WAIT_S = 1.0
#: How long abort() waits for connection handshakes in flight inside ucxx's listener to
#: end (a dialer that gave up makes them fail at once) before giving up on them.
LISTENER_SETTLE_S = 2.0
#: How long the listener of a communicator that gave up connecting stays open after
#: its connect timeout, for peers still dialing it (see transport.ucx.park_listener).
LISTENER_PARK_MARGIN_S = 5.0


class Mesh(MeshSetup, MeshExchange):
    """Connected endpoints to every peer of one communicator. Use :meth:`connect`."""

    @classmethod
    async def connect(
        cls,
        store: Any,
        rank: int,
        world_size: int,
        config: CommConfig,
        prefix: str = "cgx",
        host: str | None = None,
        data_error_handling: bool = True,
    ) -> Mesh:
        """Rendezvous through ``store``, connect both channels to every peer, prove membership.

        ``data_error_handling=False`` lets UCX use CMA zero-copy between processes of one
        host, but UCX then treats a failed transfer as fatal: a peer killed while a
        transfer from it is pending aborts this process (see the module docstring). It
        applies to the data endpoints to peers on this host; those to other nodes keep
        error handling."""
        if not 0 < world_size <= MAX_WORLD_SIZE:
            raise RendezvousError(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
        if not 0 <= rank < world_size:
            raise RendezvousError(f"rank {rank} outside 0..{world_size - 1}")
        _progress.spin_mode()  # a bad CGX_UCX_SPIN fails here, before the rendezvous
        deadline = time.monotonic() + config.connect_timeout
        rdzv = Rendezvous(store, rank, world_size, prefix, deadline)
        mesh: Mesh | None = None
        try:
            await rdzv.join()
            # A rank that fails publishes why; the watch ends every other rank's waits
            # (store keys, dials, accepts, data hello) within ~0.1 s of it.
            rdzv.start_watch()
            token, comm = await rdzv.credentials()
            mesh = cls(rank, world_size, config, token, data_error_handling, comm)
            await mesh._start(rdzv, host or default_host(store))
        except BaseException as exc:
            first = None
            if isinstance(exc, Exception) and not isinstance(exc, PeerFailedError):
                first = await rdzv.failed_elsewhere()
                if first is None:
                    await rdzv.publish_failure(with_rank(rank, str(exc)))
            await rdzv.stop_watch()
            rdzv.close(wait=False)
            if mesh is not None:
                await mesh.abort()
            if first is not None:
                raise first from exc
            if isinstance(exc, CGXError) and not str(exc).startswith(f"rank {rank}: "):
                raise type(exc)(with_rank(rank, str(exc))) from exc
            raise
        await rdzv.stop_watch()
        rdzv.close()
        return mesh

    # -- shutdown -------------------------------------------------------------------------
    async def close(self) -> None:
        """Say BYE, wait (bounded) for the peers' BYE, then release everything."""
        if self._closed or self._closing:
            return
        loop = asyncio.get_running_loop()
        self._bye_fut = loop.create_future()
        live = [r for r, p in self.peers.items() if p.lost is None]
        # seq: the last collective this rank started (peers fail their later ones at once).
        bye = Frame(kind=Kind.BYE, job=self.job, src=self.rank, seq=self.activity.started_seq)
        await asyncio.gather(*(self.send_control(r, bye) for r in live))
        if self._told and not self._troubled:
            # Peers must read our ABORTs before our endpoints go (one whose loop is
            # blocked would lose them with the connection and report this rank gone).
            # Control frames are read in order, so an answer to a STATUS_REQUEST sent
            # now proves the ABORTs were read.
            marks = await asyncio.gather(*(self._ask(r) for r in live))
            self._read_marks = {r: 0 for r in self.peers} | dict(zip(live, marks, strict=True))
            self._read_fut = loop.create_future()
        self._bye_seen()
        failed = self.failure is not None or self._aborts > 0
        wait = min(FAILED_CLOSE_WAIT_S if failed else CLOSE_WAIT_S, self.config.timeout)
        start = loop.time()
        if live:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._bye_fut), wait)
        if self._read_fut is not None:
            # Up to CLOSE_WAIT_S in all for peers that neither said BYE nor answered
            # (lost peers count as done). Not after a failure of the mesh itself (a lost,
            # silent or forged peer): its teardown stays FAILED_CLOSE_WAIT_S.
            left = min(CLOSE_WAIT_S, self.config.timeout) - (loop.time() - start)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._read_fut), max(0.0, left))
        await self.abort()

    async def abort(self) -> None:
        """Release endpoints, the listener and the UCX context without telling anyone."""
        if self._closed:
            return
        self._closing = True
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(TransportError("the communicator is closed"))
        ctrl = [p.ctrl_task for p in self.peers.values() if p.ctrl_task is not None]
        for t in ctrl:
            t.cancel()
        # Handshakes still running end on their own deadlines (see _setup); accepts and
        # status answers are cancelled. Then nothing of ours touches UCX any more.
        for t in list(self._tasks):
            t.cancel()
        for t in [*ctrl, *self._tasks, *self._setup_tasks]:
            with contextlib.suppress(BaseException):
                await t
        self._release_stuck()
        for p in self.peers.values():
            for ep in (p.data, p.ctrl):
                if ep is not None:
                    with contextlib.suppress(Exception):
                        ep.abort(period=ABORT_PERIOD_NS)
            p.data = p.ctrl = None
        # Peers that published their address but never reached us may be dialing us.
        dialers = any(not f.done() and r in self._published for r, f in self._accepted.items())
        for fut in self._accepted.values():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                with contextlib.suppress(Exception):
                    fut.result()[0].abort(period=ABORT_PERIOD_NS)
            fut.cancel()
        # An aborted ucxx endpoint keeps its UCX endpoint, and through it the listener
        # it came from, until the Python object goes: hold none past the close.
        self._accepted = {}
        settled = await self._settle_listener(park=dialers)
        # Let UCX run the callbacks of what was just cancelled before the context goes.
        await asyncio.sleep(0)
        self._closed = True
        if self._ucxx is not None:
            self._ucxx = None
            _ucx.release(reset=settled)

    def _release_stuck(self) -> None:
        """Before the endpoints go, after a failure of the mesh itself (a lost, silent
        or forged peer): shut the write side of our TCP connections to the peers that
        hold data nobody acknowledges (:mod:`.stuck`; a cut link leaves the peer behind
        it silent and, on the far side, every peer). UCX destroys a TCP endpoint with a
        blocking send, which on such a connection waits for the kernel to give the
        connection up (minutes), at interpreter exit. A live peer acknowledges, so its
        connections are left alone. Whatever ``data_error_handling`` says: data endpoints
        without error handling only go to peers on this host (.connection), whose
        connections never stop acknowledging."""
        if self._troubled:
            with contextlib.suppress(Exception):  # teardown goes on whatever happens here
                _stuck.release_stuck(self._peer_hosts())

    async def _settle_listener(self, park: bool = False) -> bool:
        """Close the listener once no connection handshake is in flight inside ucxx
        (bounded by LISTENER_SETTLE_S); False when one still is (UCX must not be reset:
        resetting under a half-made endpoint crashes the process). ``park``: peers may
        still dial it, so it stays open for a while (transport.ucx.park_listener)."""
        listener, self._listener = self._listener, None
        if listener is None:
            return True
        if park:
            _ucx.park_listener(listener, self.config.connect_timeout + LISTENER_PARK_MARGIN_S)
            return True
        end = time.monotonic() + LISTENER_SETTLE_S
        while listener.active_clients and time.monotonic() < end:
            await asyncio.sleep(0.01)
        settled = not listener.active_clients
        listener.close()
        return settled
