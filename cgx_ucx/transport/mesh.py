"""The full mesh of one communicator: two channels per peer, failure detection, deadlines.

Why two channels (measured here with ucxx 0.52 / UCX 1.21, issue 3):

- **data**: endpoints made from exchanged UCX worker addresses. Endpoints made through
  the listener only ever get TCP on one host (0.6-2 GB/s at 64 MiB); worker-address
  endpoints get shared memory. Without endpoint error handling UCX adds CMA zero-copy
  (``process_vm_readv``) for large messages, but then treats a failed transfer as
  fatal: a peer SIGKILLed while a rendezvous from it was pending aborted the *survivor*
  (SIGABRT in ``cma_ep.c``) in 2 of 4 runs of the kill test. So by default the data
  endpoints keep error handling on and UCX_MM_ERROR_HANDLING=y (see :mod:`.ucx`) lets
  them use shared memory (copy-in/copy-out through SysV segments, with keepalive): with
  the progress driver spinning while transfers are active, a 64 MiB 2-rank allreduce ran
  at 3.1 GB/s against 2.5 GB/s with CMA in the same session (2 loaded cores; noisy).
  ``data_error_handling=False`` restores CMA for those who accept the risk; cuda_ipc and
  IB are used either way where present.
- **control**: one error-handling endpoint per peer pair, made through the listener
  (TCP). UCX reports a killed peer on it within milliseconds (12 ms measured after a
  SIGKILL); it carries the membership handshake, ABORT and BYE frames.

Liveness therefore comes from the control channel (a peer lost there fails every
pending operation of the communicator with :class:`~cgx_ucx.errors.PeerLostError`
naming it), from errors on the data endpoints, and from a deadline on every single wait
(a silently cut link is never reported by UCX: a recv was seen waiting > 90 s): a wait
past ``CommConfig.timeout`` raises :class:`~cgx_ucx.errors.CGXTimeoutError` naming the
peer and aborts its endpoints.

Membership: rank 0 draws a random token and publishes it in the store; every endpoint
proves it (HELLO frame + token) before it is used: control endpoints when they connect,
data channels with a tagged HELLO. An accepted connection that does not present the
token within ``connect_timeout`` is closed and logged, never used.

Matching: UCX tags are worker-wide, so a tag carries the communicator, the collective's
sequence number, the sender, the phase and the slot (piece or step): several
collectives may be in flight and messages may arrive in any order (UCX queues the
unexpected ones until the matching receive is posted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
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
    RendezvousError,
    TransportError,
)
from . import progress as _progress
from . import ucx as _ucx
from .frames import FRAME_NBYTES, AbortCode, Frame, Kind
from .progress import post_recv, post_send
from .rendezvous import (
    TOKEN_NBYTES,
    PeerAddress,
    PeerFailedError,
    Rendezvous,
    local_address_towards,
    node_id,
)

__all__ = ["MAX_WORLD_SIZE", "Mesh", "TransportStats", "store_host"]

log = logging.getLogger("cgx_ucx.transport")

# Tag layout (64 bits): communicator 12 | seq 20 | src 12 | phase 4 | slot 15 | payload 1.
_COMM_BITS, _SEQ_BITS, _SRC_BITS, _PHASE_BITS, _SLOT_BITS = 12, 20, 12, 4, 15
MAX_WORLD_SIZE = 1 << _SRC_BITS
#: Pieces/steps per phase a tag can number.
MAX_SLOTS = 1 << _SLOT_BITS
#: Phase number reserved for the data-channel membership HELLO.
PHASE_HELLO = (1 << _PHASE_BITS) - 1
#: Largest reason text an ABORT frame carries.
MAX_REASON_NBYTES = 1024
#: How long close() waits for the peers' BYE (they send it when they close, i.e. after
#: they received everything we sent): bounded so one rank that never closes costs little.
CLOSE_WAIT_S = 10.0
#: Period handed to UCXX's endpoint abort (ns): the default of 10 s would stall close()
#: on an endpoint whose peer is gone.
ABORT_PERIOD_NS = 100_000_000


_UCX_ERRORS: tuple[type[BaseException], ...] = ()


def _ucx_errors() -> tuple[type[BaseException], ...]:
    global _UCX_ERRORS
    if not _UCX_ERRORS:
        from ucxx._lib.libucxx import UCXError

        _UCX_ERRORS = (UCXError,)
    return _UCX_ERRORS


@dataclass
class TransportStats:
    """Traffic of one communicator (payload and header bytes, as posted to UCX)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    collectives: int = 0
    by_collective: dict[str, int] = field(default_factory=dict)


class _Peer:
    __slots__ = ("bye", "ctrl", "ctrl_task", "data", "lost", "rank")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ctrl: Any = None  # error-handling endpoint (listener / create_endpoint)
        self.data: Any = None  # worker-address endpoint, error handling off
        self.ctrl_task: asyncio.Task | None = None
        self.lost: CGXError | None = None
        self.bye = False


def _copy_error(exc: CGXError) -> CGXError:
    """A fresh instance of the same error (one raise site per waiter keeps tracebacks clean)."""
    if isinstance(exc, PeerLostError):
        return type(exc)(str(exc), peer=exc.peer)
    return type(exc)(str(exc))


class Mesh:
    """Connected endpoints to every peer of one communicator. Use :meth:`connect`."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: CommConfig,
        token: bytes,
        data_error_handling: bool = True,
    ) -> None:
        self.rank, self.world_size, self.config = rank, world_size, config
        self.data_error_handling = data_error_handling
        self.token = token
        self.job: int = struct.unpack_from("<Q", token, 0)[0]
        self.comm_id: int = struct.unpack_from("<H", token, 8)[0] & ((1 << _COMM_BITS) - 1)
        self.peers: dict[int, _Peer] = {r: _Peer(r) for r in range(world_size) if r != rank}
        self.stats = TransportStats()
        self.on_abort: Any = None  # callable(frame, reason) set by the communicator
        self._ucxx: Any = None
        self._listener: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Future | None = None
        self._accepted: dict[int, asyncio.Future] = {}
        self._closing = False
        self._closed = False
        self._accept_tasks: set[asyncio.Task] = set()
        #: Ranks on this machine (same kernel), this one included.
        self.local_ranks: list[int] = [rank]

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
        if not 0 <= slot < MAX_SLOTS:
            raise TransportError(f"slot {slot} out of range (max {MAX_SLOTS - 1})")
        t = self.comm_id
        t = (t << _SEQ_BITS) | (seq & ((1 << _SEQ_BITS) - 1))
        t = (t << _SRC_BITS) | src
        t = (t << _PHASE_BITS) | phase
        t = (t << _SLOT_BITS) | slot
        return (t << 1) | int(payload)

    # -- set-up -------------------------------------------------------------------------
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
        transfer from it is pending aborts this process (see the module docstring).
        """
        if not 0 < world_size <= MAX_WORLD_SIZE:
            raise RendezvousError(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
        if not 0 <= rank < world_size:
            raise RendezvousError(f"rank {rank} outside 0..{world_size - 1}")
        deadline = time.monotonic() + config.connect_timeout
        rdzv = Rendezvous(store, rank, world_size, prefix, deadline)
        mesh: Mesh | None = None
        try:
            await rdzv.join()
            # A rank that fails publishes why; the watch ends every other rank's waits
            # then, instead of letting them wait out connect_timeout for a peer that is
            # gone. Waits end at their own await points: cancelling set-up mid-dial
            # left UCX endpoints half made, and UCX's reset then crashed (SIGSEGV seen).
            rdzv.start_watch()
            token = await rdzv.token()
            mesh = cls(rank, world_size, config, token, data_error_handling)
            await mesh._start(rdzv, host or _default_host(store))
        except BaseException as exc:
            if isinstance(exc, Exception) and not isinstance(exc, PeerFailedError):
                await rdzv.publish_failure(f"rank {rank}: {exc}")
            await rdzv.stop_watch()
            rdzv.close(wait=False)
            if mesh is not None:
                await mesh.abort()
            raise
        await rdzv.stop_watch()
        rdzv.close()
        return mesh

    async def _start(self, rdzv: Rendezvous, host: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._failed = self._loop.create_future()
        self._failed.add_done_callback(_consume)
        self._ucxx = _ucx.acquire(self.config.progress_mode, self.config.ucx_env)
        drv = _progress.driver(self._loop)
        if drv is not None:
            drv.boost(True)
        try:
            await self._connect_all(rdzv, host)
        finally:
            if drv is not None:
                drv.boost(False)

    async def _connect_all(self, rdzv: Rendezvous, host: str) -> None:
        ucxx = self._ucxx
        assert self._loop is not None
        self._accepted = {r: self._loop.create_future() for r in self.peers if r > self.rank}
        for f in self._accepted.values():
            f.add_done_callback(_consume)
        if self.world_size > 1:
            self._listener = ucxx.create_listener(
                self._on_accept, port=0, connect_timeout=self.config.connect_timeout
            )
            port = self._listener.port
        else:
            port = 0
        addr = PeerAddress(host, port, bytes(ucxx.get_worker_address().tobytes()), node_id())
        await rdzv.publish(addr)
        if self.world_size == 1:
            return
        peers = {r: await rdzv.peer(r) for r in self.peers}
        self.local_ranks = sorted(
            [self.rank, *(r for r, a in peers.items() if a.node == addr.node)]
        )
        # Control channel: each rank dials the lower ranks and accepts the higher ones.
        dials = [
            asyncio.ensure_future(self._dial(r, peers[r], rdzv))
            for r in self.peers
            if r < self.rank
        ]
        try:
            await asyncio.gather(*dials)
        except BaseException:
            # One dial failed: end the others before abort() resets UCX under them.
            for d in dials:
                d.cancel()
            await asyncio.gather(*dials, return_exceptions=True)
            raise
        for r, fut in self._accepted.items():
            left = rdzv.deadline - time.monotonic()
            try:
                self.peers[r].ctrl = await rdzv.race(fut, max(left, 0.001))
            except TimeoutError:
                raise RendezvousError(
                    f"rank {self.rank}: rank {r} did not connect within the connect timeout"
                ) from None
        # Data channel: worker-address endpoints (shared memory / CMA / cuda_ipc).
        for r, p in self.peers.items():
            address = ucxx.get_ucx_address_from_buffer(peers[r].worker_address)
            p.data = await ucxx.create_endpoint_from_worker_address(
                address, endpoint_error_handling=self.data_error_handling
            )
        await self._data_hello(rdzv, rdzv.deadline)
        for p in self.peers.values():
            p.ctrl.set_close_callback(self._on_ctrl_closed, cb_args=(p.rank,))
            p.ctrl_task = self._loop.create_task(self._control_loop(p))
        log.info(
            "rank %d/%d connected (control via listener %s:%d, data via worker addresses)",
            self.rank,
            self.world_size,
            host,
            port,
        )

    def _hello(self, kind: Kind) -> Frame:
        return Frame(kind=kind, job=self.job, src=self.rank, payload=TOKEN_NBYTES)

    async def _dial(self, r: int, addr: PeerAddress, rdzv: Rendezvous) -> None:
        deadline = rdzv.deadline
        ucxx = self._ucxx
        left = max(deadline - time.monotonic(), 0.001)
        try:
            # Resolve first: UCX's own failure on a bad name left a half-made endpoint
            # whose collection at UCX reset crashed the process (SIGSEGV, 1 run in 3).
            if not _numeric_ip(addr.host):
                # On the store thread: the loop's default executor would leave a thread.
                await asyncio.wait_for(
                    rdzv.run_blocking(socket.getaddrinfo, addr.host, addr.port), left
                )
        except (TimeoutError, OSError) as exc:
            raise RendezvousError(
                f"rank {self.rank}: cannot connect to rank {r} at {addr.host}:{addr.port}: "
                f"cannot resolve the address: {exc}"
            ) from exc
        try:
            ep = await asyncio.wait_for(
                ucxx.create_endpoint(addr.host, addr.port, connect_timeout=left), left
            )
        except (TimeoutError, *_ucx_errors()) as exc:
            raise RendezvousError(
                f"rank {self.rank}: cannot connect to rank {r} at {addr.host}:{addr.port}: {exc}"
            ) from exc
        try:
            await asyncio.wait_for(self._send_hello(ep, Kind.HELLO), left)
            frame = await asyncio.wait_for(self._recv_hello(ep, Kind.HELLO_ACK), left)
            if frame.src != r:
                raise ProtocolError(f"rank {r}'s address answered as rank {frame.src}")
        except (TimeoutError, ProtocolError, *_ucx_errors()) as exc:
            ep.abort(period=ABORT_PERIOD_NS)
            raise RendezvousError(
                f"rank {self.rank}: rank {r} did not complete the membership handshake: {exc}"
            ) from exc
        except BaseException:
            with contextlib.suppress(Exception):
                ep.abort(period=ABORT_PERIOD_NS)
            raise
        self.peers[r].ctrl = ep

    async def _send_hello(self, ep: Any, kind: Kind) -> None:
        await post_send(ep, np.frombuffer(self._hello(kind).pack(), np.uint8).copy(), None)
        await post_send(ep, np.frombuffer(self.token, np.uint8).copy(), None)

    async def _recv_hello(self, ep: Any, kind: Kind) -> Frame:
        buf = np.empty(FRAME_NBYTES, np.uint8)
        await post_recv(ep, buf, None)
        frame = Frame.unpack(buf, job=self.job)
        if frame.kind != kind or frame.payload != TOKEN_NBYTES:
            raise ProtocolError(f"expected a {kind.name} frame, got kind {frame.kind}")
        tok = np.empty(TOKEN_NBYTES, np.uint8)
        await post_recv(ep, tok, None)
        if not hmac.compare_digest(tok.tobytes(), self.token):
            raise ProtocolError("wrong membership token")
        return frame

    async def _on_accept(self, ep: Any) -> None:
        """Listener callback: the connection must prove membership before it is used."""
        task = asyncio.current_task()
        if task is not None:
            self._accept_tasks.add(task)
        try:
            frame = await asyncio.wait_for(
                self._recv_hello(ep, Kind.HELLO), self.config.connect_timeout
            )
            fut = self._accepted.get(frame.src)
            if fut is None or fut.done():
                raise ProtocolError(f"unexpected HELLO from rank {frame.src}")
            await asyncio.wait_for(
                self._send_hello(ep, Kind.HELLO_ACK), self.config.connect_timeout
            )
            fut.set_result(ep)
        except (TimeoutError, ProtocolError, *_ucx_errors()) as exc:
            log.warning(
                "rank %d: closing a connection that did not prove membership: %s",
                self.rank,
                exc or type(exc).__name__,
            )
            ep.abort(period=ABORT_PERIOD_NS)
        except BaseException:
            # Cancelled by abort() mid-handshake: an endpoint left open here crashed the
            # UCX reset that follows (SIGSEGV in gc at ucxx.reset()).
            with contextlib.suppress(Exception):
                ep.abort(period=ABORT_PERIOD_NS)
            raise
        finally:
            if task is not None:
                self._accept_tasks.discard(task)

    async def _data_hello(self, rdzv: Rendezvous, deadline: float) -> None:
        """Prove membership on the data channel: a tagged HELLO + token to every peer."""
        sends, recvs = [], []
        hello = np.frombuffer(self._hello(Kind.HELLO).pack(), np.uint8).copy()
        token = np.frombuffer(self.token, np.uint8).copy()
        for r, p in self.peers.items():
            sends.append(post_send(p.data, hello, self.tag(0, self.rank, PHASE_HELLO, 0, False)))
            sends.append(post_send(p.data, token, self.tag(0, self.rank, PHASE_HELLO, 0, True)))
            recvs.append(self._recv_data_hello(r, p))
        left = max(deadline - time.monotonic(), 0.001)
        try:
            await rdzv.race(asyncio.gather(*sends, *recvs), left)
        except TimeoutError:
            raise RendezvousError(
                f"rank {self.rank}: data-channel membership handshake timed out"
            ) from None

    async def _recv_data_hello(self, r: int, p: _Peer) -> None:
        buf = np.empty(FRAME_NBYTES, np.uint8)
        await post_recv(p.data, buf, self.tag(0, r, PHASE_HELLO, 0, False))
        frame = Frame.unpack(buf, job=self.job)
        tok = np.empty(TOKEN_NBYTES, np.uint8)
        await post_recv(p.data, tok, self.tag(0, r, PHASE_HELLO, 0, True))
        if (
            frame.kind != Kind.HELLO
            or frame.src != r
            or not hmac.compare_digest(tok.tobytes(), self.token)
        ):
            raise RendezvousError(f"rank {r} failed the data-channel membership check")

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
        if p.bye or getattr(self, "_bye_fut", None) is not None:
            # A clean close: later collectives report it, nothing to warn about now.
            self.lose(
                rank, PeerLostError(f"rank {rank} closed its communicator", peer=rank), quiet=True
            )
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
        if self._failed is not None and not self._failed.done():
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
        errors = _ucx_errors()
        while True:
            try:
                await post_recv(p.ctrl, buf, None)
                frame = Frame.unpack(buf, job=self.job)
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
            if frame.kind == Kind.BYE:
                p.bye = True
                self._bye_seen()
            elif frame.kind == Kind.ABORT:
                if self.on_abort is not None:
                    self.on_abort(frame, reason)
            else:
                if not self._closing:
                    self.lose(p.rank, ProtocolError(f"unexpected control frame kind {frame.kind}"))
                return

    def _bye_seen(self) -> None:
        fut = getattr(self, "_bye_fut", None)
        if (
            fut is not None
            and not fut.done()
            and all(q.bye or q.lost is not None for q in self.peers.values())
        ):
            fut.set_result(None)

    # -- operations -----------------------------------------------------------------------
    async def _guard(
        self, rank: int, post: Any, what: str, extra: Iterable[asyncio.Future] = ()
    ) -> Any:
        """Post a UCX operation with ``rank`` (``post()``) and await it against the
        deadline, the loss of any peer and the collective's own abort (``extra``)."""
        self.check()
        for f in extra:
            if f.done():
                exc = f.exception()
                raise _copy_error(exc) if isinstance(exc, CGXError) else TransportError(str(exc))
        errors = _ucx_errors()
        try:
            task = asyncio.ensure_future(post())
        except errors as exc:
            return self._op_failed(rank, what, exc)
        if not task.done():
            waiters = {task, self.failed_future, *extra}
            try:
                await asyncio.wait(
                    waiters, timeout=self.config.timeout, return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:
                task.cancel()
                raise
        if task.done():
            try:
                return task.result()
            except errors as exc:
                return self._op_failed(rank, what, exc)
        task.cancel()
        for f in extra:
            if f.done():
                exc = f.exception()
                raise _copy_error(exc) if isinstance(exc, CGXError) else TransportError(str(exc))
        if self.failed_future.done():
            self.check()
        exc = CGXTimeoutError(
            f"rank {self.rank}: rank {rank} did not complete {what} within "
            f"{self.config.timeout:g} s",
            peer=rank,
        )
        self.lose(rank, exc)
        raise _copy_error(exc)

    def _op_failed(self, rank: int, what: str, exc: BaseException) -> Any:
        """A UCX error on a data operation: the peer is lost (data endpoints only fail so)."""
        if self.peers[rank].lost is None and not self._closing:
            if "truncated" in type(exc).__name__.lower():
                # More bytes than the frame protocol allows for this (seq, phase, slot).
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
        ep = self.peers[rank].data
        nbytes = _nbytes(buf)
        await self._guard(rank, lambda: post_send(ep, buf, tag), what, extra)
        self.stats.bytes_sent += nbytes
        self.stats.messages_sent += 1

    async def recv(
        self, rank: int, tag: int, buf: Any, what: str, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        ep = self.peers[rank].data
        await self._guard(rank, lambda: post_recv(ep, buf, tag), what, extra)
        self.stats.bytes_received += _nbytes(buf)
        self.stats.messages_received += 1

    async def send_frame(
        self,
        rank: int,
        frame: Frame,
        payload: Any = None,
        extra: Iterable[asyncio.Future] = (),
    ) -> None:
        """Send a header (and its payload, if any) tagged by the frame's seq/phase/slot."""
        head = np.frombuffer(frame.pack(), np.uint8)
        what = f"sending phase {frame.phase} piece {frame.slot} of collective #{frame.seq}"
        tag = self.tag(frame.seq, self.rank, frame.phase, frame.slot, False)
        if payload is None or frame.payload == 0:
            await self.send(rank, tag, head, what, extra)
            return
        await asyncio.gather(
            self.send(rank, tag, head, what, extra),
            self.send(rank, tag | 1, payload, what, extra),
        )

    async def recv_frame(
        self, rank: int, seq: int, phase: int, slot: int, extra: Iterable[asyncio.Future] = ()
    ) -> Frame:
        """Receive and validate the header ``rank`` sent for (seq, phase, slot)."""
        buf = np.empty(FRAME_NBYTES, np.uint8)
        what = f"phase {phase} piece {slot} of collective #{seq}"
        await self.recv(rank, self.tag(seq, rank, phase, slot, False), buf, what, extra)
        try:
            frame = Frame.unpack(buf, job=self.job)
            if (frame.src, frame.seq, frame.phase, frame.slot) != (
                rank,
                seq & 0xFFFFFFFF,
                phase,
                slot,
            ):
                raise ProtocolError(
                    f"frame (src {frame.src}, seq {frame.seq}, phase {frame.phase}, slot "
                    f"{frame.slot}) arrived for (src {rank}, seq {seq}, phase {phase}, slot {slot})"
                )
            if frame.kind not in (Kind.DATA, Kind.SIG):
                raise ProtocolError(f"unexpected frame kind {frame.kind} on the data channel")
        except ProtocolError as exc:
            err = ProtocolError(f"rank {self.rank}: malformed frame from rank {rank}: {exc}")
            self.lose(rank, err)
            raise _copy_error(err) from exc
        return frame

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
        tag = self.tag(frame.seq, rank, frame.phase, frame.slot, True)
        what = f"payload of phase {frame.phase} piece {frame.slot} of collective #{frame.seq}"
        await self.recv(rank, tag, buf, what, extra)

    async def send_control(self, rank: int, frame: Frame, reason: str = "") -> None:
        """Best-effort control frame (ABORT/BYE) with a short bounded wait."""
        p = self.peers[rank]
        if p.lost is not None or p.ctrl is None:
            return
        text = reason.encode()[:MAX_REASON_NBYTES]
        frame = frame.with_(payload=len(text))
        try:
            sends = [post_send(p.ctrl, np.frombuffer(frame.pack(), np.uint8).copy(), None)]
            if text:
                sends.append(post_send(p.ctrl, np.frombuffer(text, np.uint8).copy(), None))
            await asyncio.wait_for(asyncio.gather(*sends), min(self.config.timeout, 5.0))
        except (TimeoutError, *_ucx_errors()) as exc:
            log.debug("rank %d: control frame to rank %d not sent: %s", self.rank, rank, exc)

    async def broadcast_abort(self, seq: int, code: AbortCode, peer: int, reason: str) -> None:
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
        bye = Frame(kind=Kind.BYE, job=self.job, src=self.rank)
        await asyncio.gather(*(self.send_control(r, bye) for r in live))
        self._bye_seen()
        if live:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(self._bye_fut), min(CLOSE_WAIT_S, self.config.timeout)
                )
        await self.abort()

    async def abort(self) -> None:
        """Release endpoints, the listener and the UCX context without telling anyone."""
        if self._closed:
            return
        self._closing = True
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(TransportError("the communicator is closed"))
        tasks = [p.ctrl_task for p in self.peers.values() if p.ctrl_task is not None]
        tasks += list(self._accept_tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        for p in self.peers.values():
            for ep in (p.data, p.ctrl):
                if ep is not None:
                    with contextlib.suppress(Exception):
                        ep.abort(period=ABORT_PERIOD_NS)
            p.data = p.ctrl = None
        for fut in self._accepted.values():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                with contextlib.suppress(Exception):
                    fut.result().abort(period=ABORT_PERIOD_NS)
            fut.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        # Let UCX run the callbacks of what was just cancelled before the context goes.
        await asyncio.sleep(0)
        self._closed = True
        if self._ucxx is not None:
            self._ucxx = None
            _ucx.release()


def _consume(fut: asyncio.Future) -> None:
    # Failures are re-raised to callers as copies; silence "exception never retrieved".
    if not fut.cancelled():
        fut.exception()


def _numeric_ip(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return True
    return False


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else memoryview(buf).nbytes


#: How many PrefixStore layers :func:`store_host` unwraps (torch nests one per process
#: group / backend; a loop bound keeps a self-referencing duck-typed store from hanging us).
MAX_STORE_NESTING = 32


def store_host(store: Any) -> str | None:
    """The host of the TCPStore under ``store``, unwrapping PrefixStores.

    torch hands a backend a ``PrefixStore`` (often several nested) around the job's
    TCPStore; only the innermost store knows the host. None for stores without a host
    (FileStore, HashStore).
    """
    for _ in range(MAX_STORE_NESTING):
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        inner = getattr(store, "underlying_store", None)
        if inner is None or inner is store:
            return None
        store = inner
    return None


def _default_host(store: Any) -> str:
    """The address peers should dial: the local interface that routes to the store's host
    (found through PrefixStores), else to MASTER_ADDR, else the hostname's address.

    Falling back to loopback or the hostname when the store is wrapped left ranks in other
    network namespaces or on other hosts unable to dial (issue 3 follow-up).
    """
    for target in (store_host(store), os.environ.get("MASTER_ADDR")):
        if target:
            addr = local_address_towards(target)
            if addr:
                return addr
    with contextlib.suppress(OSError):
        return local_address_towards(socket.gethostname()) or "127.0.0.1"
    return "127.0.0.1"
