"""The full mesh of one communicator: two channels per peer, failure detection, deadlines.

Why two channels (issue 3, ucxx 0.52 / UCX 1.21):

- **data**: endpoints made from exchanged UCX worker addresses. Endpoints made through
  the listener only ever get TCP on one host; worker-address endpoints get shared
  memory. Without endpoint error handling UCX adds CMA zero-copy (``process_vm_readv``)
  for large messages, but then treats a failed transfer as fatal: a peer SIGKILLed while
  a rendezvous from it was pending aborted the *survivor* (SIGABRT in ``cma_ep.c``). So
  by default the data endpoints keep error handling on and UCX_MM_ERROR_HANDLING=y (see
  :mod:`.ucx`) lets them use shared memory (copy-in/copy-out with keepalive), which with
  the progress driver spinning during transfers is as fast as CMA was.
  ``data_error_handling=False`` restores CMA for those who accept the risk; cuda_ipc and
  IB are used either way where present.
- **control**: one error-handling endpoint per peer pair, made through the listener
  (TCP). UCX reports a killed peer on it within milliseconds; it carries the membership
  handshake (:mod:`.handshake`), ABORT, BYE and STATUS frames.

Liveness comes from the control channel (a peer lost there fails every pending operation
with :class:`~cgx_ucx.errors.PeerLostError` naming it), from errors on the data
endpoints, and from a deadline on every single wait (UCX never reports a silently cut
link). A wait past ``CommConfig.timeout`` asks the peer for its status on the control
channel and raises :class:`~cgx_ucx.errors.CGXTimeoutError` saying whether the peer is
alive and which collective it is in, or that it is gone (issue 13).

Trust (:mod:`.handshake`): data messages travel on tags derived from per-pair secrets
exchanged on the control channel, and every header carries a check keyed with the pair
key; a header that fails it is a :class:`~cgx_ucx.errors.ProtocolError` for the whole
communicator, without blaming the peer it claimed to come from.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import CommConfig
from ..errors import (
    CGXError,
    CGXTimeoutError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from . import handshake as _hs
from . import stuck as _stuck
from . import ucx as _ucx
from .connection import MAX_WORLD_SIZE, MeshSetup
from .frames import (
    FLAG_INLINE,
    FRAME_NBYTES,
    RECV_NBYTES,
    AbortCode,
    Frame,
    Kind,
    copy_inline,
    describe_slot,
    inlinable,
    inline_message,
    inline_payload,
)
from .handshake import MAX_SLOTS, PHASE_HELLO, Auth, PairKeys, structured_tag
from .progress import await_or_wake, post_recv, post_send
from .rendezvous import default_host as _default_host  # noqa: F401 (tests import it here)
from .rendezvous import store_host as store_host
from .status import STATUS_WAIT_S, Activity, PeerStatus
from .topology import Topology, resolve_hierarchy

__all__ = [
    "MAX_SLOTS",
    "MAX_WORLD_SIZE",
    "PHASE_HELLO",
    "Mesh",
    "PeerStatus",
    "TransportStats",
    "store_host",
]

log = logging.getLogger("cgx_ucx.transport")

#: Largest reason text an ABORT frame carries.
MAX_REASON_NBYTES = 1024
#: How long close() waits for the peers' BYE (they send it when they close, i.e. after
#: they received everything we sent): bounded so one rank that never closes costs little.
CLOSE_WAIT_S = 10.0
#: The same after the communicator failed or a collective was aborted: the peers were
#: told (ABORT) or are gone, and a teardown after a failure must stay short (issue 13).
FAILED_CLOSE_WAIT_S = 1.0
ABORT_PERIOD_NS = _ucx.ABORT_PERIOD_NS
#: ABORT frames kept while no communicator listens yet (one per peer and call at most).
MAX_EARLY_ABORT_FRAMES = 64
#: How long abort() waits for connection handshakes in flight inside ucxx's listener to
#: end (a dialer that gave up makes them fail at once) before giving up on them.
LISTENER_SETTLE_S = 2.0
#: How long the listener of a communicator that gave up connecting stays open after
#: its connect timeout, for peers still dialing it (see transport.ucx.park_listener).
LISTENER_PARK_MARGIN_S = 5.0


@dataclass
class TransportStats:
    """Traffic of one communicator (payload and header bytes, as posted to UCX), and the
    connections refused because they could not prove membership."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    collectives: int = 0
    by_collective: dict[str, int] = field(default_factory=dict)
    refused_connections: int = 0
    #: The transports UCX gave the data endpoint to each peer (``"tcp/eth0"``), and per
    #: level (``{"node-local": "sysv/memory+posix/memory", "cross-node": "tcp/eth0"}``).
    transports: dict[int, str] = field(default_factory=dict)
    levels: dict[str, str] = field(default_factory=dict)


class _Peer:
    __slots__ = (
        "aborted",
        "answers",
        "asks",
        "bye",
        "bye_seq",
        "ctrl",
        "ctrl_task",
        "data",
        "hosts",
        "keys",
        "lost",
        "rank",
        "status",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ctrl: Any = None  # error-handling endpoint (listener / create_endpoint)
        self.data: Any = None  # worker-address endpoint
        #: The IP addresses of the host it published (its listener's): where our
        #: connections to it go (resolved at connect, for .stuck).
        self.hosts: frozenset[str] = frozenset()
        self.keys: PairKeys | None = None
        self.ctrl_task: asyncio.Task | None = None
        self.lost: CGXError | None = None
        self.bye = False
        #: The last collective the peer started before it said BYE (the BYE's seq).
        self.bye_seq = 0
        self.status: asyncio.Future | None = None  # a STATUS answer being waited for
        #: What the peer's last ABORT said ("collective #n: reason"): a peer that gives
        #: up a call we had already finished, then closes, is reported with its reason.
        self.aborted = ""
        #: STATUS_REQUESTs sent to the peer and its STATUS answers: it answers in order,
        #: so answer n says that it read every control frame sent before request n.
        self.asks = 0
        self.answers = 0


def _copy_error(exc: CGXError) -> CGXError:
    """A fresh instance of the same error (one raise site per waiter keeps tracebacks clean)."""
    if isinstance(exc, CGXTimeoutError):
        return type(exc)(str(exc), peer=exc.peer, alive=exc.alive)
    if isinstance(exc, PeerLostError):
        return type(exc)(str(exc), peer=exc.peer)
    return type(exc)(str(exc))


class Mesh(MeshSetup):
    """Connected endpoints to every peer of one communicator. Use :meth:`connect`."""

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
        self.peers: dict[int, _Peer] = {r: _Peer(r) for r in range(world_size) if r != rank}
        self.stats = TransportStats()
        self.activity = Activity()
        self._on_abort: Any = None  # callable(frame, reason) set by the communicator
        #: ABORTs that came before the communicator took the mesh: connect still waits
        #: for the other ranks' codecs after the mesh is up, and a rank that got through
        #: first may already have failed its first collective (issue 13: dropping them
        #: made the peers report "rank 0 closed its communicator" instead of the cause).
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

    # -- tags ---------------------------------------------------------------------------
    def tag(self, seq: int, src: int, phase: int, slot: int, payload: bool) -> int:
        """The tag of (seq, phase, slot) between this rank and a peer, without the pair's
        secret prefix (:meth:`send` and :meth:`recv` add the one of the peer they talk to).
        ``src`` is implied by that peer and kept for callers that name it."""
        return structured_tag(seq, phase, slot, payload)

    # -- failure --------------------------------------------------------------------------
    def _on_ctrl_closed(self, rank: int) -> None:
        # Called from UCX progress (the loop thread in blocking/polling mode, the progress
        # thread in thread mode).
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # Two hops: UCX calls this inside worker.progress(), before the progress driver
        # resolves the receives completed in the same call; a BYE that arrived just
        # before the connection closed must be seen first (then the close is quiet).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.call_soon, self._peer_closed, rank, "connection closed")

    def _peer_closed(self, rank: int, how: str) -> None:
        p = self.peers[rank]
        if self._closing or p.lost is not None:
            return
        if p.bye or self._bye_fut is not None:
            # A clean close: later collectives report it, nothing to warn about now.
            text = f"rank {rank} closed its communicator"
            if p.aborted:
                text += f" after aborting {p.aborted}"
            self.lose(rank, PeerLostError(text, peer=rank), quiet=True)
        else:
            self.lose(rank, PeerLostError(f"rank {rank} is gone ({how})", peer=rank))

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
            if self.data_error_handling:  # see _release_stuck: for a mesh nobody closes
                _stuck.release_at_exit(self._peer_hosts())
        if self._failed is not None and not self._failed.done():
            (log.info if quiet else log.warning)("rank %d: communicator failed: %s", self.rank, exc)
            self._failed.set_exception(exc)

    def check(self) -> None:
        """Raise the mesh's failure (a fresh copy), or TransportError when closed."""
        if self._closed or self._closing:
            raise TransportError("the communicator is closed")
        exc = self.failure
        if exc is not None:
            raise _copy_error(exc)

    async def _control_loop(self, p: _Peer) -> None:
        buf = np.empty(FRAME_NBYTES, np.uint8)
        errors = _ucx.errors()
        assert p.keys is not None
        while True:
            try:
                await post_recv(p.ctrl, buf, None)
                frame = Frame.unpack(buf, job=self.job, key=p.keys.key)
                if frame.src != p.rank:
                    raise ProtocolError(f"control frame from rank {p.rank} claims rank {frame.src}")
                reason = ""
                if frame.payload:
                    if frame.payload > MAX_REASON_NBYTES:
                        raise ProtocolError(f"control payload of {frame.payload} bytes")
                    text = np.empty(frame.payload, np.uint8)
                    await post_recv(p.ctrl, text, None)
                    reason = text.tobytes().decode("utf-8", errors="replace")
            except asyncio.CancelledError:
                return
            except ProtocolError as exc:
                if not self._closing:
                    self.lose(p.rank, ProtocolError(f"rank {p.rank}: {exc}"))
                return
            except errors:
                if not self._closing:
                    self._peer_closed(p.rank, "connection reset")
                return
            if not self._on_control(p, frame, reason):
                return

    def _on_control(self, p: _Peer, frame: Frame, reason: str) -> bool:
        """Act on one control frame; False ends the control loop."""
        if frame.kind == Kind.BYE:
            p.bye, p.bye_seq = True, frame.seq
            self._bye_seen()
            self._check_bye(p)
        elif frame.kind == Kind.ABORT:
            self._aborts += 1
            p.aborted = f"collective #{frame.seq}: {reason or f'abort code {frame.phase}'}"
            if self._on_abort is not None:
                self._on_abort(frame, reason)
            elif len(self._early_aborts) < MAX_EARLY_ABORT_FRAMES:
                self._early_aborts.append((frame, reason))
        elif frame.kind == Kind.STATUS_REQUEST:
            head, what = self.activity.frame(self.job, self.rank)
            self._spawn(self.send_control(p.rank, head, what))
        elif frame.kind == Kind.STATUS:
            p.answers += 1
            self._bye_seen()
            if p.status is not None and not p.status.done():
                p.status.set_result(PeerStatus.from_frame(frame, reason))
        else:
            if not self._closing:
                self.lose(p.rank, ProtocolError(f"unexpected control frame kind {frame.kind}"))
            return False
        return True

    @property
    def on_abort(self) -> Any:
        """Called with (frame, reason) for every ABORT; ABORTs received before it was
        set are delivered when it is."""
        return self._on_abort

    @on_abort.setter
    def on_abort(self, callback: Any) -> None:
        self._on_abort = callback
        early, self._early_aborts = self._early_aborts, []
        if callback is not None:
            for frame, reason in early:
                callback(frame, reason)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _bye_seen(self) -> None:
        """Resolve what :meth:`close` waits for: every peer said BYE or is lost
        (``_bye_fut``), or answered the STATUS_REQUEST sent after our ABORTs
        (``_read_fut``)."""
        peers = self.peers.values()
        fut = self._bye_fut
        if fut is not None and not fut.done() and all(q.bye or q.lost is not None for q in peers):
            fut.set_result(None)
        fut, marks = self._read_fut, self._read_marks
        if (
            fut is not None
            and not fut.done()
            and all(q.bye or q.lost is not None or q.answers >= marks[q.rank] for q in peers)
        ):
            fut.set_result(None)

    # -- status (issue 13: alive but late, or gone?) --------------------------------------
    def collective_started(self, seq: int, what: str) -> None:
        """Record that collective ``seq`` started here (``what``: e.g. "allreduce, numel
        4096"); peers that time out waiting for us are told."""
        self.activity.started(seq, what)
        for p in self.peers.values():
            if p.bye:
                self._check_bye(p)

    def _check_bye(self, p: _Peer) -> None:
        """A peer that said BYE after collective #n will not take part in a later one: a
        collective of ours past n that is running now fails at once, naming the close,
        rather than when the peer's endpoints go (the peer waits up to CLOSE_WAIT_S for
        our BYE first). Collectives up to n are left alone: the BYE travels on the control
        channel and may overtake the peer's last data frames."""
        if self._closing or p.lost is not None or not p.bye:
            return
        act = self.activity
        if act.started_seq > max(p.bye_seq, act.finished_seq):
            text = (
                f"rank {p.rank} closed its communicator after collective #{p.bye_seq}; "
                f"collective #{act.started_seq} ({act.what}) here needs it"
            )
            self.lose(p.rank, PeerLostError(text, peer=p.rank), quiet=True)

    def collective_finished(self, seq: int) -> None:
        self.activity.finished(seq)

    async def peer_status(self, rank: int, timeout: float = STATUS_WAIT_S) -> PeerStatus:
        """Ask ``rank`` on the control channel where it is; ``PeerStatus.gone`` when its
        control channel is down, ``answered`` False when it did not answer in time."""
        p = self.peers[rank]
        if p.lost is not None or p.ctrl is None:
            return PeerStatus(rank, gone=True)
        if p.status is None or p.status.done():
            assert self._loop is not None
            p.status = self._loop.create_future()
            await self._ask(rank)
        with contextlib.suppress(TimeoutError):
            got = await asyncio.wait_for(asyncio.shield(p.status), timeout)
            if got is not None:
                got.rank = rank
                return got
        return PeerStatus(rank, gone=p.lost is not None)

    async def _ask(self, rank: int) -> int:
        """Send ``rank`` a STATUS_REQUEST; returns the number of the answer to it."""
        p = self.peers[rank]
        p.asks += 1
        req = Frame(kind=Kind.STATUS_REQUEST, job=self.job, comm=self.comm_id, src=self.rank)
        await self.send_control(rank, req)
        return p.asks

    async def _timed_out(self, rank: int, what: str) -> CGXError:
        status = await self.peer_status(rank, min(STATUS_WAIT_S, self.config.timeout))
        exc = CGXTimeoutError(
            f"rank {self.rank}: rank {rank} did not complete {what} within "
            f"{self.config.timeout:g} s: {status.describe()}",
            peer=rank,
            alive=status.alive,
        )
        if status.gone:
            self.lose(rank, exc)
        else:
            self.fail(exc)  # never tear down a peer that is still there
        return exc

    # -- operations -----------------------------------------------------------------------
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
        _raise_done(extra)
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
                # collective was aborted meanwhile, that says why (issue 13).
                _raise_done(extra)
                return self._op_failed(rank, what, exc)
        _raise_done(extra)
        if self.failed_future.done():
            self.check()
        raise _copy_error(await self._timed_out(rank, what))

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
        await self._guard(rank, lambda: post_send(p.data, buf, full), what, extra)
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
        await self._guard(rank, lambda: post_recv(p.data, buf, full), what, extra, deadline)
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
            raise _copy_error(err) from exc
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
            raise _copy_error(err) from exc
        if inline is None:
            self.stats.bytes_received += FRAME_NBYTES
            return frame
        self.stats.bytes_received += FRAME_NBYTES + inline.nbytes + 1
        return frame.with_(flags=frame.flags & ~FLAG_INLINE, inline=inline)

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
        _raise_done(extra)
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
                ops.append((rank, sending, _as_future(post_send(p.data, msg, keys.tx ^ tag))))
                sent += msg.nbytes
                buf = np.zeros(RECV_NBYTES, np.uint8)
                recv = _as_future(post_recv(p.data, buf, keys.rx ^ tag))
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
                raise _copy_error(got) if isinstance(got, CGXError) else got
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
                _raise_done(extra)
                if self.failed_future.done():
                    self.check()
                raise _copy_error(await self._timed_out(*late))
        errors = _ucx.errors()
        for rank, op_what, fut in ops:
            if not fut.done():  # woken by another operation's failure, found below
                continue
            if fut.cancelled():  # by the driver closing under us
                self._cancel_ops(ops)
                _raise_done(extra)
                self.check()
                raise TransportError(f"{op_what} with rank {rank} was cancelled")
            exc = fut.exception()
            if exc is not None:
                self._cancel_ops(ops)
                _raise_done(extra)
                if isinstance(exc, errors):
                    self._op_failed(rank, op_what, exc)
                raise exc

    async def recv_payload(
        self, rank: int, frame: Frame, buf: Any, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        """Receive the payload announced by ``frame`` into ``buf`` (exactly its size)."""
        if _nbytes(buf) != frame.payload:
            err = ProtocolError(
                f"rank {self.rank}: rank {rank} announced {frame.payload} payload bytes, "
                f"{_nbytes(buf)} expected"
            )
            self.lose(rank, err)
            raise _copy_error(err)
        if frame.payload == 0:
            return
        if frame.inline is not None:
            # What a separate payload receive would check first (_guard): the call's
            # abort, then a failure seen since the header, win over the copy.
            _raise_done(extra)
            self.check()
            copy_inline(buf, frame.inline)
            return
        tag = structured_tag(frame.seq, frame.phase, frame.slot, True)
        what = "payload of " + describe_slot(frame.seq, frame.phase, frame.slot)
        await self.recv(rank, tag, buf, what, extra)

    async def send_control(self, rank: int, frame: Frame, reason: str = "") -> None:
        """Best-effort control frame (ABORT/BYE/STATUS) with a short bounded wait."""
        p = self.peers[rank]
        if p.lost is not None or p.ctrl is None or p.keys is None:
            return
        text = reason.encode()[:MAX_REASON_NBYTES]
        frame = frame.with_(payload=len(text), comm=self.comm_id)
        try:
            head = np.frombuffer(frame.pack(p.keys.key), np.uint8).copy()
            sends = [post_send(p.ctrl, head, None)]
            if text:
                sends.append(post_send(p.ctrl, np.frombuffer(text, np.uint8).copy(), None))
            await asyncio.wait_for(asyncio.gather(*sends), min(self.config.timeout, 5.0))
        except (TimeoutError, *_ucx.errors()) as exc:
            log.debug("rank %d: control frame to rank %d not sent: %s", self.rank, rank, exc)

    async def broadcast_abort(self, seq: int, code: AbortCode, peer: int, reason: str) -> None:
        self._aborts += 1
        self._told = True
        frame = Frame(
            kind=Kind.ABORT, job=self.job, seq=seq, src=self.rank, phase=int(code), count=peer
        )
        await asyncio.gather(*(self.send_control(r, frame, reason) for r in self.peers))

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
            # A peer told of an abort may not have read it yet: a starved process (its
            # loop blocked, by a forward pass say) that reads it after our endpoints
            # went loses it with the connection, and blamed this rank ("gone
            # (connection reset)") instead of the cause (CI, session 16). Its answer to
            # a STATUS_REQUEST sent now (in order, after the ABORT) says it read it.
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
            # silent or forged peer, issue 13): its teardown stays FAILED_CLOSE_WAIT_S.
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
        blocking send, which on such a connection waited for the kernel to give the
        connection up (minutes), at interpreter exit. A live peer acknowledges, so its
        connections are left alone. Not with data endpoints without error handling
        (``data_error_handling=False``): there a failed send is fatal to the process."""
        if self._troubled and self.data_error_handling:
            with contextlib.suppress(Exception):  # teardown goes on whatever happens here
                _stuck.release_stuck(self._peer_hosts())

    def _peer_hosts(self) -> set[str]:
        """The IP addresses our connections to the peers go to (resolved at connect)."""
        return {h for p in self.peers.values() for h in p.hosts}

    async def _settle_listener(self, park: bool = False) -> bool:
        """Close the listener once no connection handshake is in flight inside ucxx
        (bounded by LISTENER_SETTLE_S); False when one still is (UCX must not be reset:
        resetting under a half-made endpoint crashed the process). ``park``: peers may
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


def _raise_done(futures: Iterable[asyncio.Future]) -> None:
    for f in futures:
        if f.done():
            exc = f.exception()
            raise _copy_error(exc) if isinstance(exc, CGXError) else TransportError(str(exc))


def _as_future(op: Any) -> asyncio.Future:
    """A posted operation as a future (ucxx's own coroutine when no driver is installed)."""
    return op if asyncio.isfuture(op) else asyncio.ensure_future(op)


def _consume(fut: asyncio.Future) -> None:
    # Failures are re-raised to callers as copies; silence "exception never retrieved".
    if not fut.cancelled():
        fut.exception()


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else memoryview(buf).nbytes
