"""Connecting a mesh: rendezvous, the control channel (dial the lower ranks, accept the
higher ones, each connection proving membership, :mod:`.handshake`), the data channel
(worker-address endpoints and a keyed HELLO on each), all bounded by the connect deadline.

A rank whose connect fails publishes why in the store, and every other rank's set-up
steps race that news, so every rank names the culprit within ~0.1 s of the first failure
rather than waiting out its own dial and blaming a healthy rank; each step is bounded by
what is left of ``connect_timeout``. A wait that runs out, or a dial that fails, names the
rank at fault from the liveness marks every connecting rank keeps in the store
(:mod:`.liveness`): one that died or stopped after publishing, or the pair whose dial got
no answer, with the address dialed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

from ..errors import ConfigError, ProtocolError, RendezvousError
from . import handshake as _hs
from . import levels as _levels
from . import liveness as _live
from . import progress as _progress
from . import stuck as _stuck
from . import ucx as _ucx
from .control import MeshControl
from .liveness import Phase
from .rendezvous import PeerAddress, Rendezvous, node_id
from .topology import NodeHints, Topology
from .ucx import ABORT_PERIOD_NS

__all__ = ["MeshSetup"]

log = logging.getLogger("cgx_ucx.transport")


def _consume(fut: asyncio.Future) -> None:
    # Failures are re-raised to callers as copies; silence "exception never retrieved".
    if not fut.cancelled():
        fut.exception()


class MeshSetup(MeshControl):
    """How a :class:`~cgx_ucx.transport.mesh.Mesh` connects to its peers (after the
    rendezvous of :meth:`~cgx_ucx.transport.mesh.Mesh.connect`): both channels to every
    peer, each bounded by the connect deadline."""

    async def _start(self, rdzv: Rendezvous, host: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._failed = self._loop.create_future()
        self._failed.add_done_callback(_consume)
        self._ucxx = _ucx.acquire(self.config.progress_mode, self.config.ucx_env)
        _boost(self._loop, True)
        try:
            await self._connect_all(rdzv, host)
        finally:
            _boost(self._loop, False)

    async def _connect_all(self, rdzv: Rendezvous, host: str) -> None:
        ucxx = self._ucxx
        assert self._loop is not None
        self._accepted = {r: self._loop.create_future() for r in self.peers if r > self.rank}
        for f in self._accepted.values():
            f.add_done_callback(_consume)
        # What this rank's liveness mark says (.liveness): the phase, the ranks waited for.
        self._phase, self._waiting = Phase.ADDRESSES, frozenset(self.peers)
        self._dialing: frozenset[int] = frozenset()
        rdzv.state = self._connect_state
        if self.world_size > 1:
            self._listener = ucxx.create_listener(
                self._on_accept, port=0, connect_timeout=self.config.connect_timeout
            )
            port = self._listener.port
        else:
            port = 0
        # Both worker addresses: peers on this node dial the full one (shared memory, CMA,
        # cuda_ipc), peers on other nodes the network-only one (see .levels).
        addresses = _levels.worker_addresses(_levels.ucp_worker_handle(ucxx))
        hints = NodeHints.from_env(node_id=self.config.node_id)
        addr = PeerAddress(
            host,
            port,
            addresses[_levels.ADDRESS_FULL],
            node_id(),
            self.world_size,
            addresses[_levels.ADDRESS_NET_ONLY],
            hints.pack(),
        )
        self._addresses = {self.rank: addr}
        await rdzv.publish(addr)
        if self.world_size == 1:
            return
        peers = {}
        resolved: dict[str, frozenset[str]] = {}
        for r in self.peers:
            peers[r] = await rdzv.peer(r)
            self._addresses[r] = peers[r]
            self._waiting -= {r}
            self._published.add(r)
            host = peers[r].host
            if host not in resolved:
                resolved[host] = await _host_addresses(rdzv, host)
            self.peers[r].hosts = resolved[host]
        # Ranks on this kernel (codec threads share its cores), not the topology's node.
        self.local_ranks = sorted(
            [self.rank, *(r for r, a in peers.items() if a.node == addr.node)]
        )
        self.topology = _topology_of(self.rank, hints, peers)
        node_of = self.topology.node_of
        for r, peer in self.peers.items():
            peer.remote = node_of[r] != node_of[self.rank]
        await self._same_node_processes(rdzv, addr.node)
        # Control channel: each rank dials the lower ranks and accepts the higher ones.
        self._dialing = self._waiting = frozenset(r for r in self.peers if r < self.rank)
        self._phase = Phase.DIALING
        await self._setup(
            rdzv, [self._dial(r, peers[r], rdzv) for r in self.peers if r < self.rank]
        )
        self._phase = Phase.ACCEPTING
        for r, fut in self._accepted.items():
            try:
                self.peers[r].ctrl, self.peers[r].keys = await rdzv.race(
                    asyncio.shield(fut), _hs.remaining(rdzv.deadline)
                )
            except TimeoutError:
                waiting = [q for q, f in self._accepted.items() if not f.done()]
                raise RendezvousError(
                    await self._blame(rdzv, waiting)
                    or f"rank {self.rank}: rank {r} did not connect within the connect "
                    f"timeout ({self.config.connect_timeout:g} s)"
                ) from None
        # Data channel: worker-address endpoints, per level (.levels): node-local peers on
        # the full address, the others on the network-only one.
        for r, p in self.peers.items():
            kind = _levels.address_kind(self.topology, self.rank, r, self.hierarchy)
            raw = peers[r].worker_address if kind == _levels.ADDRESS_FULL else peers[r].net_address
            if not raw:
                raise RendezvousError(f"rank {r} published no {kind} worker address")
            try:
                p.data = await ucxx.create_endpoint_from_worker_address(
                    ucxx.get_ucx_address_from_buffer(raw),
                    endpoint_error_handling=_data_error_handling(self.data_error_handling, kind),
                )
            except _ucx.errors() as exc:
                raise ConfigError(
                    f"rank {self.rank} cannot reach rank {r} (node {self.topology.node_of[r]}) "
                    f"on its {kind} worker address: {exc}; across nodes UCX needs a network "
                    "device both hosts share (check UCX_NET_DEVICES / UCX_TLS)"
                ) from exc
        self._phase, self._waiting = Phase.DATA, frozenset(self.peers)
        hellos = [self._data_hello(r) for r in self.peers]
        await self._setup(rdzv, hellos, "data-channel membership handshake", cancellable=True)
        self._phase, self._waiting = Phase.DONE, frozenset()
        self._record_transports()
        for p in self.peers.values():
            p.ctrl.set_close_callback(self._on_ctrl_closed, cb_args=(p.rank,))
            p.ctrl_task = self._loop.create_task(self._control_loop(p))
        log.info(
            "rank %d/%d connected (communicator %d; control via listener %s:%d, data via "
            "worker addresses)",
            self.rank,
            self.world_size,
            self.comm_id,
            host,
            port,
        )

    async def _data_hello(self, r: int) -> None:
        p = self.peers[r]
        await _hs.data_hello(p.data, self.auth, self.rank, r, p.keys)  # type: ignore[arg-type]
        self._waiting -= {r}

    def _connect_state(self) -> tuple[int, tuple[int, ...]]:
        """The phase of this connect and the ranks still waited for there (the liveness
        mark's; read on the store thread, so only immutable snapshots are read)."""
        phase, waiting = self._phase, self._waiting
        if phase == Phase.DIALING and not self._dialing:
            phase = Phase.HANDSHAKE
        elif phase == Phase.ACCEPTING:
            waiting = frozenset(r for r, f in list(self._accepted.items()) if not f.done())
        return phase, tuple(sorted(self._dialing if phase == Phase.DIALING else waiting))

    async def _blame(self, rdzv: Rendezvous, waiting_on: list[int]) -> str | None:
        """Who holds this connect up, from the liveness marks in the store (.liveness):
        a sentence naming the rank at fault, or None when the marks do not tell."""
        where = {r: f"{a.host}:{a.port}" for r, a in self._addresses.items()}
        dialing = self._connect_state()[0] == Phase.DIALING
        timeout = self.config.connect_timeout
        return await _live.blame(
            rdzv.mark, self.rank, waiting_on, where, node_id(), timeout, dialing
        )

    async def _same_node_processes(self, rdzv: Rendezvous, node: str) -> None:
        """Keep the process of each peer on this machine (from its liveness mark): a peer
        that stops answering later is then told apart from one cut off (.liveness)."""
        for r, a in self._addresses.items():
            if r != self.rank and a.node == node:
                mark = await rdzv.mark(r)
                if mark is not None and mark.proc.local_to(node):
                    self.peers[r].process = mark.proc

    def _record_transports(self) -> None:
        """Name the lanes UCX gave each data endpoint (final after the data HELLO): in
        ``stats.transports`` per peer and ``stats.levels`` per level, one INFO line per
        level. A cross-node endpoint on a node-local transport would mean the ranks share
        memory across what the launcher calls nodes: refused."""
        by_level: dict[str, set[str]] = {}
        for r, p in self.peers.items():
            try:
                lanes = _levels.endpoint_transports(p.data.ucp_endpoint)
            except Exception as exc:  # diagnostics only: never fail the connect for it
                log.debug("rank %d: cannot query the transports to rank %d: %s", self.rank, r, exc)
                continue
            level = _levels.level_of(self.topology, self.rank, r)
            if level == _levels.LEVEL_CROSS_NODE and _levels.node_local_lanes(lanes):
                raise ConfigError(
                    f"rank {self.rank}: the endpoint to rank {r} on another node uses "
                    f"{_levels.format_transports(lanes)}: node-local transports across nodes"
                )
            name = _levels.format_transports(lanes)
            self.stats.transports[r] = name
            by_level.setdefault(level, set()).add(name)
        for level, names in sorted(by_level.items()):
            self.stats.levels[level] = ", ".join(sorted(names))
            log.info("rank %d: %s peers on %s", self.rank, level, self.stats.levels[level])

    async def _setup(
        self, rdzv: Rendezvous, steps: list[Any], what: str = "", cancellable: bool = False
    ) -> None:
        """Run set-up steps until all are done, one fails, the connect deadline passes
        or another rank publishes a failure, whichever comes first.

        Steps are never cancelled mid-way: a UCX handshake abandoned with a request
        pending crashes the UCX reset that follows (SIGSEGV). A step still running when
        this raises is left to end on its own deadline; :meth:`abort` waits for it.
        ``cancellable`` steps (ours alone, no ucxx-internal request) are cancelled there."""
        tasks = [asyncio.ensure_future(s) for s in steps]
        group: set[Any] = self._tasks if cancellable else self._setup_tasks
        group.update(tasks)
        for t in tasks:
            t.add_done_callback(group.discard)
            t.add_done_callback(_consume)
        if not tasks:
            return
        first_error = asyncio.ensure_future(_first_error(tasks))
        try:
            await rdzv.race(asyncio.shield(first_error), _hs.remaining(rdzv.deadline))
        except TimeoutError:
            raise RendezvousError(
                await self._blame(rdzv, list(self._connect_state()[1]))
                or f"rank {self.rank}: {what or 'connecting'} did not finish within the "
                f"connect timeout ({self.config.connect_timeout:g} s)"
            ) from None
        finally:
            first_error.cancel()

    async def _dial(self, r: int, addr: PeerAddress, rdzv: Rendezvous) -> None:
        deadline = rdzv.deadline
        where = f"rank {r} at {addr.host}:{addr.port} (published by rank {r})"
        try:
            # Resolve first: UCX's own failure on a bad name leaves a half-made endpoint
            # whose collection at UCX reset crashes the process (SIGSEGV).
            if not _numeric_ip(addr.host):
                # On the store thread: the loop's default executor would leave a thread.
                await asyncio.wait_for(
                    rdzv.run_blocking(socket.getaddrinfo, addr.host, addr.port),
                    _hs.remaining(deadline),
                )
        except (TimeoutError, OSError) as exc:
            raise RendezvousError(
                f"rank {self.rank}: cannot connect to {where}: cannot resolve the address: {exc}"
            ) from exc
        try:
            # No wait_for around it: ucxx bounds its own exchange by connect_timeout,
            # and cancelling it mid-way abandons a pending UCX request (see _setup).
            ep = await self._ucxx.create_endpoint(
                addr.host, addr.port, connect_timeout=_hs.remaining(deadline)
            )
        except TimeoutError as exc:
            _ucx.release_abandoned_endpoints(exc)
            raise RendezvousError(
                await self._peer_lost(rdzv, r, addr)
                or f"rank {self.rank} could not reach {where}: no answer within "
                f"{self.config.connect_timeout:g} s{_tls_hint()}"
            ) from exc
        except _ucx.errors() as exc:
            _ucx.release_abandoned_endpoints(exc)
            lost = await self._peer_lost(rdzv, r, addr)
            text = f"cannot connect to {where}: {exc or type(exc).__name__}{_tls_hint()}"
            raise RendezvousError(
                f"{lost} (rank {self.rank} {text})" if lost else f"rank {self.rank}: {text}"
            ) from exc
        self._dialing -= {r}
        try:
            keys = await asyncio.wait_for(
                _hs.dial(ep, self.auth, self.rank, r), _hs.remaining(deadline)
            )
        except (TimeoutError, ProtocolError, *_ucx.errors()) as exc:
            ep.abort(period=ABORT_PERIOD_NS)
            lost = await self._peer_lost(rdzv, r, addr)
            raise RendezvousError(
                lost
                or f"rank {self.rank}: rank {r} did not complete the membership handshake: "
                f"{exc or type(exc).__name__}"
            ) from exc
        except BaseException:
            with contextlib.suppress(Exception):
                ep.abort(period=ABORT_PERIOD_NS)
            raise
        self.peers[r].ctrl, self.peers[r].keys = ep, keys
        self._waiting -= {r}

    async def _peer_lost(self, rdzv: Rendezvous, r: int, addr: PeerAddress) -> str | None:
        """The sentence naming rank ``r`` as dead or stopped after it published ``addr``,
        or None when its liveness mark does not say so (.liveness)."""
        mark = await rdzv.mark(r)
        verdict = mark.verdict(node_id()) if mark is not None else None
        if mark is None or verdict is None:
            return None
        return _live.lost_text(r, mark, verdict, f"{addr.host}:{addr.port}")

    async def _on_accept(self, ep: Any) -> None:
        """Listener callback: the connection must prove membership before it is used."""
        if self._closing:  # arrived while we tear down: nothing to prove it for
            ep.abort(period=ABORT_PERIOD_NS)
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

        def expected(rank: int) -> bool:
            fut = self._accepted.get(rank)
            return fut is not None and not fut.done()

        try:
            r, keys = await asyncio.wait_for(
                _hs.accept(ep, self.auth, self.rank, expected), self.config.connect_timeout
            )
            if not expected(r):
                raise ProtocolError(f"rank {r} connected twice")
            self._accepted[r].set_result((ep, keys))
        except (TimeoutError, ProtocolError, *_ucx.errors()) as exc:
            self.stats.refused_connections += 1
            log.warning(
                "rank %d: closing a connection that did not prove membership: %s",
                self.rank,
                exc or type(exc).__name__,
            )
            ep.abort(period=ABORT_PERIOD_NS)
        except BaseException:
            # Cancelled by abort() mid-handshake: an endpoint left open here crashes the
            # UCX reset that follows (SIGSEGV in gc at ucxx.reset()).
            with contextlib.suppress(Exception):
                ep.abort(period=ABORT_PERIOD_NS)
            raise
        finally:
            if task is not None:
                self._tasks.discard(task)


def _boost(loop: asyncio.AbstractEventLoop, on: bool) -> None:
    """Boost the loop's progress driver while connecting (see Progress.boost). Looked up
    each time, never kept in a frame: a failed connect's traceback holds its frames until a
    garbage collection, and a driver there would hold the UCX worker as long."""
    drv = _progress.driver(loop)
    if drv is not None:
        drv.boost(on)


def _data_error_handling(wanted: bool, kind: str) -> bool:
    """Whether the data endpoint to a peer dialled on its ``kind`` of address handles
    errors: always on the network-only address. ``data_error_handling=False`` is for
    CMA, which exists only between processes of one host (the full address); across
    nodes it would only take the endpoint's error handling away, and with it the way
    out of a cut link: UCX closes an endpoint without error handling by flushing it,
    which across a cut link never completes (close() and interpreter exit hung)."""
    return wanted or kind != _levels.ADDRESS_FULL


def _topology_of(rank: int, own: NodeHints, peers: dict[int, PeerAddress]) -> Topology:
    """The job's topology from every rank's published hints (the same on every rank)."""
    hints = []
    for r in range(len(peers) + 1):
        if r == rank:
            hints.append(own)
            continue
        try:
            hints.append(NodeHints.unpack(peers[r].hints))
        except ConfigError as exc:
            raise RendezvousError(f"rank {r} published bad node hints: {exc}") from exc
    topology = Topology.from_hints(hints)
    log.info("rank %d: topology %s", rank, topology.describe())
    return topology


async def _first_error(tasks: list[asyncio.Future]) -> None:
    """Return when every task is done; raise the first failure as soon as it happens."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]


async def _host_addresses(rdzv: Rendezvous, host: str) -> frozenset[str]:
    """The IP addresses of a peer's published host, for :mod:`.stuck` (empty where they
    cannot be known by the connect deadline). A name is resolved as :meth:`_dial` does
    it, on the resolver thread: never a blocking lookup on the loop."""
    if _numeric_ip(host):
        return _stuck.addresses_of(host)
    with contextlib.suppress(TimeoutError, OSError):
        return await asyncio.wait_for(
            rdzv.run_blocking(_stuck.addresses_of, host), _hs.remaining(rdzv.deadline)
        )
    return frozenset()


def _numeric_ip(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return True
    return False


def _tls_hint() -> str:
    """What to add to a connect failure when UCX_TLS leaves out TCP (else nothing): UCX
    connects endpoints to an address through TCP's connection manager where no RDMA one
    is available, so the failure shows as an unreachable peer or as no answer."""
    if not _ucx.tcp_excluded():
        return ""
    return (
        f" (UCX_TLS={os.environ['UCX_TLS']} leaves out tcp: UCX connects endpoints to an "
        "address through TCP's connection manager where no RDMA one is available; add it, "
        "e.g. UCX_TLS=sm,self,tcp: shared memory still carries the data between processes "
        "of one host)"
    )
