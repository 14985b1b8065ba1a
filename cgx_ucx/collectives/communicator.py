"""The asyncio face: ``comm = await connect(...)``, then collectives on NumPy/CuPy arrays.

Collectives are numbered in call order (every rank must issue them in the same order,
as with any MPI-style library); several may be in flight at once (``asyncio.gather``
of several ``allreduce`` calls), their messages never mix. Each call carries its
signature to every peer; a rank whose arguments differ makes the call fail with
:class:`~cgx_ucx.errors.CollectiveMismatchError` on every rank, before any output is
written. A rank that fails a call for a reason of its own (bad argument, lost peer,
timeout) sends the others an ABORT frame so they fail fast instead of waiting out the
timeout.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from ..config import CommConfig, log_configuration, resolve_comm
from ..errors import (
    CGXError,
    CGXTimeoutError,
    CollectiveMismatchError,
    ConfigError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from ..layout import Layout
from ..transport import shm
from ..transport.frames import AbortCode, Frame
from ..transport.mailbox import Mailbox, State, compile_kernels
from ..transport.mesh import Mesh
from ..transport.rendezvous import env_store
from .allgather import prepare_allgather, run_allgather
from .allreduce import prepare_allreduce, run_allreduce
from .alltoall import prepare_alltoall, run_alltoall
from .barrier import prepare_barrier, run_barrier
from .broadcast import prepare_broadcast, run_broadcast
from .call import Call, abort_error, what
from .local import (
    HAND_OVER_S,
    LOCAL_ONESHOT_BYTES,
    AllgatherOp,
    AllreduceOp,
    BarrierOp,
    BroadcastOp,
    LocalCall,
    LocalOp,
    Round,
    recorded_abort,
    signature_words,
    wait_async,
    wait_blocking,
)
from .p2p import PointToPoint
from .piece_codec import CodecRunner
from .reduce_scatter import prepare_reduce_scatter, run_reduce_scatter
from .staging import BufferPool
from .transport import Transport

__all__ = ["FROM_OP", "CommStats", "Communicator", "connect"]

log = logging.getLogger("cgx_ucx")

S = TypeVar("S")
R = TypeVar("R")

#: What a rank publishes instead of its mailbox when CGX_UCX_INTRA_SHM is off.
_SHM_OFF = b"off"
#: ``result`` of :meth:`Communicator.run_local`: the collective's own result.
FROM_OP = object()
#: Early ABORT frames (for collectives this rank has not started yet) kept at most.
MAX_EARLY_ABORTS = 1024
#: Values of the warm-up allreduce run by :func:`connect` (:meth:`Communicator.warm_up`):
#: 4 KiB of float32, the size of a small gradient or metric.
WARM_UP_NUMEL = 1024


@dataclass
class CommStats:
    """What a communicator moved: payload + header bytes and message counts, collectives."""

    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    collectives: int
    by_collective: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def connect(
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    config: CommConfig | None = None,
    prefix: str = "cgx",
    host: str | None = None,
    data_error_handling: bool = True,
) -> Communicator:
    """Join the job and return a connected :class:`Communicator`.

    ``store`` is a torch.distributed Store (anything with set/get/wait/add); ``None``
    means env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE as torchrun sets them; a
    TCPStore is created, importing torch only then). ``host`` is the address peers dial
    for this rank (default: the interface that routes to the store's host).
    ``data_error_handling=False`` allows CMA zero-copy between processes of one host at
    the risk that a peer dying mid-transfer aborts this process (UCX treats the failed
    copy as fatal; see :mod:`cgx_ucx.transport.mesh`).
    """
    config = config if config is not None else resolve_comm()
    owned_store = None
    if store is None:
        store, env_rank, env_world = env_store(config.connect_timeout)
        owned_store = store
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    if rank is None or world_size is None:
        raise ConfigError("rank and world_size are required with an explicit store")
    mesh = await Mesh.connect(
        store, int(rank), int(world_size), config, prefix, host, data_error_handling
    )
    # Only once connected: the compile holds the GIL for most of its time, and during
    # the rendezvous it delayed this rank's connect steps and failure detection past
    # their deadlines. Loading cached kernels takes a fraction of a second.
    warm = _start_codec_warm_up()
    try:
        await _codec_ready(warm, store, mesh, config, prefix)
    except BaseException:
        await mesh.abort()
        raise
    _share_codec_threads(len(mesh.local_ranks))
    log_configuration(config, None, rank=mesh.rank, world_size=mesh.world_size)
    # The env:// store lives as long as the communicator: on rank 0 it is the TCPStore
    # server, and dropping it when connect returned cut off a peer still polling the
    # codec-ready counter (that peer failed, then so did this rank).
    comm = Communicator(mesh, config, keep_alive=owned_store)
    try:
        await comm.warm_up()  # over the network: UCX's first messages on each endpoint
        await comm.attach_mailbox(store, prefix)
    except BaseException:
        with contextlib.suppress(Exception):  # the warm-up's error is the one to raise
            await comm.close()
        raise
    return comm


class Communicator:
    """A connected group of ranks. Create with :func:`connect`; close with :meth:`close`.

    ``transport`` is the connected :class:`~.transport.Transport` (a UCX
    :class:`~cgx_ucx.transport.mesh.Mesh` from :func:`connect`); the communicator owns it
    from here on and closes it in :meth:`close`.
    """

    def __init__(self, transport: Transport, config: CommConfig, keep_alive: Any = None) -> None:
        self._mesh = transport
        self._keep_alive = keep_alive  # e.g. the env:// TCPStore this rank may be serving
        self._config = config
        self._seq = 1  # 0 is the connection handshake
        self._calls: dict[int, Call | LocalCall] = {}
        self._early: collections.OrderedDict[int, CGXError] = collections.OrderedDict()
        #: prepare_allreduce results by argument set (see its ``cache``).
        self._prepared: dict = {}
        self._pool = BufferPool()
        self._codec = CodecRunner()
        self._closed = False
        self._warm = False  # warm_up() ran (or is running)
        self._loop = asyncio.get_running_loop()
        transport.on_abort = self._on_abort
        self._p2p = PointToPoint(transport, config)  # send/recv, outside the numbering
        #: Node-local mailboxes (.local), where every rank is on this host; None elsewhere.
        self._mailbox: Mailbox | None = None
        #: A mailbox has one slot per collective in flight (two, alternating): its
        #: collectives on the loop run one at a time, in number order (FIFO lock, taken
        #: before the first await after numbering).
        self._local_lock = asyncio.Lock()

    # -- properties ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._mesh.rank

    @property
    def world_size(self) -> int:
        return self._mesh.world_size

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def config(self) -> CommConfig:
        return self._config

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this communicator runs on (every call must come from it)."""
        return self._loop

    @property
    def transport(self) -> Transport:
        """The message layer underneath (for benchmarks and diagnostics)."""
        return self._mesh

    @property
    def stats(self) -> CommStats:
        s = self._mesh.stats
        return CommStats(
            s.bytes_sent,
            s.bytes_received,
            s.messages_sent,
            s.messages_received,
            s.collectives,
            dict(s.by_collective),
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Communicator rank {self.rank}/{self.world_size} {state}>"

    # -- lifecycle ----------------------------------------------------------------------
    async def close(self) -> None:
        """Release endpoints, the listener, threads and staging memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for call in list(self._calls.values()):
            call.fail(TransportError("the communicator was closed during the collective"))
        if self._mailbox is not None:
            self._mailbox.close()  # a round still running on a caller's thread raises
            self._mailbox = None
        await self._mesh.close()
        self._codec.close()
        self._pool.clear()
        self._keep_alive = None

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- machinery ----------------------------------------------------------------------
    def _on_abort(self, frame: Frame, reason: str) -> None:
        exc = abort_error(frame.src, frame.seq, frame.phase, frame.count, reason, self.rank)
        call = self._calls.get(frame.seq)
        if call is not None:
            call.fail(exc)
        elif frame.seq >= self._seq:
            self._early[frame.seq] = exc
            while len(self._early) > MAX_EARLY_ABORTS:
                self._early.popitem(last=False)

    async def _collective(
        self,
        name: str,
        prepare: Callable[[], tuple[Frame, S]],
        body: Callable[[Call, S], Awaitable[R]],
        seq: int | None = None,
        local: Callable[[S], LocalOp | None] | None = None,
    ) -> R | None:
        """Number the call, run ``prepare`` (argument checks: its errors abort the peers
        too) and then ``body``; on failure tell the peers, on success recycle staging.
        ``seq``: a number outside the callers' numbering (the warm-up's 0), not counted
        in the statistics. ``local``: the call's mailbox steps (.local) for a prepared
        state, None where it goes over the network; used where the group has mailboxes."""
        if asyncio.get_running_loop() is not self._loop:
            raise TransportError("a communicator must be used from the event loop that created it")
        if self._closed:
            raise TransportError("the communicator is closed")
        counted = seq is None
        if seq is None:
            seq = self._seq
            self._seq += 1
        call = Call(self._mesh, self._pool, self._codec, seq, name)
        self._calls[seq] = call
        early = self._early.pop(seq, None)
        if early is not None:
            call.fail(early)
        started = time.perf_counter()
        op: LocalOp | None = None
        try:
            if early is not None:
                # The peer's ABORT for this call came before the call: it says why (a
                # BYE that followed it would otherwise read as a lost peer).
                raise early
            self._mesh.check()
            template, state = prepare()
            call.template = template.with_(
                job=self._mesh.job, seq=seq, src=self.rank, comm=self._mesh.comm_id
            )
            # Peers that time out waiting for us are told which call we are in (issue 13).
            self._mesh.collective_started(seq, what(name, template))
            box = self._mailbox
            if box is not None:
                op = local(state) if local is not None else None
                if op is None:  # peers waiting in their mailboxes see where this one went
                    box.announce(seq, signature_words(call.template))
            if op is None:
                result: R | None = await body(call, state)
            else:
                result = await self._run_local_async(call, op)
        except BaseException as exc:
            told = self._explained(seq, exc)
            await self._after_failure(call, told)
            if told is not exc:
                raise told from exc
            raise
        finally:
            del self._calls[seq]
            self._mesh.collective_finished(seq)
        call.give_back_all()
        if counted:
            self._count(name)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s #%d done in %.3f ms", name, seq, (time.perf_counter() - started) * 1e3)
        return result

    def _count(self, name: str) -> None:
        stats = self._mesh.stats
        stats.collectives += 1
        stats.by_collective[name] = stats.by_collective.get(name, 0) + 1

    # -- node-local mailboxes (.local) --------------------------------------------------
    @property
    def mailbox(self) -> Mailbox | None:
        """The group's node-local mailboxes, None where it has none (ranks on several
        hosts or nodes, node-local shared memory off, a world of one)."""
        return self._mailbox

    async def attach_mailbox(self, store: Any, prefix: str) -> None:
        """Give this group mailboxes if every rank runs on this host (run by
        :func:`connect` on every rank; all ranks or none end with them). Ranks of one host
        that disagree on ``CGX_UCX_INTRA_SHM`` raise ConfigError, every one of them."""
        mesh = self._mesh
        n = self.world_size
        if (
            n == 1
            or len(getattr(mesh, "local_ranks", ())) != n
            or getattr(mesh, "topology", None) is None
            or mesh.topology.num_nodes != 1
            or not shm.available()
        ):
            return  # the same on every rank: the topology is shared
        box = None
        if mesh.hierarchy.intra_shm:
            compile_kernels()
            box = Mailbox(self.rank, n)
        try:
            await self._exchange_mailboxes(box, store, prefix)
        except BaseException:
            if box is not None:
                box.close()
            raise
        if box is None or not box.enabled:
            if box is not None:
                box.close()
            return
        self._mailbox = box
        # The warm-up once more, through the mailboxes: their first call's costs (a
        # kernel loaded for a peer's read-only bytes, first runs of the path) move into
        # connect too.
        await self._warm_up_allreduce()

    async def _exchange_mailboxes(self, box: Mailbox | None, store: Any, prefix: str) -> None:
        """Publish ``box`` in the store (or that this rank has node-local shared memory
        off), map every peer's, and agree (through the mailboxes' state words) whether
        every rank mapped every other."""
        mesh, n = self._mesh, self.world_size
        base = f"{prefix}/mailbox/{mesh.job:x}"
        store.set(f"{base}/{self.rank}", bytes(box.descriptor().pack()) if box else _SHM_OFF)
        end = time.monotonic() + self._config.connect_timeout
        if not await _all_counted(store, f"{base}/count", n, end):
            raise CGXTimeoutError("not every rank published its mailbox within connect_timeout")
        raw = {p: bytes(store.get(f"{base}/{p}")) for p in range(n) if p != self.rank}
        off = sorted(p for p, v in raw.items() if v == _SHM_OFF) + ([] if box else [self.rank])
        if off:
            if len(off) == n:
                return
            raise ConfigError(
                f"ranks of one host disagree on CGX_UCX_INTRA_SHM: ranks {off} have "
                "node-local shared memory off, the others on; set it the same on every rank"
            )
        assert box is not None
        descs = {p: shm.Descriptor.unpack(np.frombuffer(v, np.uint8)) for p, v in raw.items()}
        why = box.attach(descs)
        if why is not None:
            log.warning("rank %d: no node-local mailboxes (%s)", self.rank, why)
        states = {}
        for p in box.peer_words:
            while (state := box.peer_state(p)) == State.CONNECTING:
                if time.monotonic() > end:
                    raise CGXTimeoutError(
                        f"rank {p} did not map the node-local mailboxes within connect_timeout",
                        peer=p,
                    )
                await asyncio.sleep(0.001)
            states[p] = state
        box.enabled = why is None and all(v == State.ATTACHED for v in states.values())

    def _oneshot_limit(self) -> int | None:
        return LOCAL_ONESHOT_BYTES if self._mailbox is not None else None

    async def _run_local_async(self, call: Call, op: LocalOp) -> Any:
        """A mailbox collective on the engine loop (queued behind others, or the asyncio
        core's own call); its failure is recorded by :meth:`_after_failure`."""
        assert self._mailbox is not None and call.template is not None

        def check() -> None:
            if call.abort.done():
                raise call.abort.exception()  # type: ignore[misc]
            self._mesh.check()

        r = Round(self._mailbox, call.seq, call.name, call.template, self._config.timeout, check)
        async with self._local_lock:
            result = await self._local_steps(r, op, posted=False, first=check)
        self._count_bytes(r)
        return result

    async def _local_steps(
        self, r: Round, op: LocalOp, posted: bool, first: Callable[[], None] | None = None
    ) -> Any:
        """A mailbox round on the loop, under ``_local_lock``: ``first``, then claim the
        slot and post (unless ``posted`` already), wait for every peer, finish; the round
        ends whatever happens. Returns the collective's result."""
        try:
            if first is not None:
                first()
            if not posted:
                await wait_async(r, r.claim)
                op.post(r)
            await wait_async(r)
            return op.finish(r)
        finally:
            r.end()

    def run_local(
        self,
        name: str,
        prepare: Callable[[], tuple[Frame, S]],
        local: Callable[[S], LocalOp | None],
        result: Any = None,
    ) -> tuple[bool, Any, Coroutine[Any, Any, Any] | None]:
        """Run a collective through the mailboxes on the calling thread, if it goes there.

        For :class:`~cgx_ucx.engine.SyncCommunicator`, which calls this only while none
        of its calls is in flight on the engine loop (so the numbering is not shared) and
        one at a time. Returns (False, None, None), having done nothing, where the call
        does not go through the mailboxes (no mailboxes, a closed communicator, arguments
        the network path must refuse on every rank, a call that does not fit). Otherwise
        it posts this rank's part and waits a short while (:data:`.local.HAND_OVER_S`):
        done then, (True, its result, None); a peer still missing, (True, None, the rest
        of the call as a coroutine for the engine loop, returning the result), so that
        the caller's thread is not held (an ``async_op`` call, a ``monitored_barrier``'s
        own timeout). The result is ``result``, or what the collective returns when that
        is :data:`FROM_OP`. A failure raises its typed error here (the peers are told)."""
        box = self._mailbox
        if box is None or not box.enabled or self._closed:
            return False, None, None
        try:
            template, state = prepare()
        except Exception:  # the network path raises it on this rank and aborts the peers
            return False, None, None
        op = local(state)
        if op is None:
            return False, None, None
        seq = self._seq
        lc = LocalCall()
        self._calls[seq] = lc  # before the number moves on: an ABORT for it finds it
        self._seq = seq + 1
        early = self._early.pop(seq, None)
        mesh = self._mesh
        template = template.with_(job=mesh.job, seq=seq, src=self.rank, comm=mesh.comm_id)
        mesh.activity.started(seq, what(name, template))

        def check() -> None:
            if lc.error is not None:
                raise lc.error
            mesh.check()

        r = Round(box, seq, name, template, self._config.timeout, check)
        try:
            if early is not None:
                raise early
            mesh.check()
            if not wait_blocking(r, HAND_OVER_S, r.claim):  # a peer still reads our slot
                return True, None, self._finish_local(r, op, result, posted=False)
            op.post(r)
            if not wait_blocking(r, HAND_OVER_S):
                return True, None, self._finish_local(r, op, result, posted=True)
            value = op.finish(r)
        except BaseException as exc:
            r.end()
            told = self._local_failed(r, exc)
            if told is not exc:
                raise told from exc
            raise
        r.end()
        self._local_done(r)
        return True, (value if result is FROM_OP else result), None

    async def _finish_local(self, r: Round, op: LocalOp, result: Any, posted: bool) -> Any:
        """The rest of a mailbox collective that :meth:`run_local` started, on the loop
        (``posted``: this rank's part is posted already)."""
        try:
            async with self._local_lock:
                value = await self._local_steps(r, op, posted)
        except BaseException as exc:
            told = self._local_failed(r, exc)
            if told is not exc:
                raise told from exc
            raise
        self._local_done(r)
        return value if result is FROM_OP else result

    def _local_done(self, r: Round) -> None:
        del self._calls[r.seq]
        self._mesh.activity.finished(r.seq)
        self._count(r.name)
        self._count_bytes(r)

    def _count_bytes(self, r: Round) -> None:
        """A mailbox collective's payload in :attr:`stats`: what each peer read of this
        rank's post, and what this rank read of theirs (no message, no header)."""
        stats = self._mesh.stats
        stats.bytes_sent += r.sent * (self.world_size - 1)
        stats.bytes_received += r.received

    def _local_failed(self, r: Round, exc: BaseException) -> BaseException:
        """After a failed mailbox collective of :meth:`run_local`: the peers are told (in
        the mailbox now, over the network from the loop). Returns the error to raise
        (:meth:`_explained`)."""
        self._calls.pop(r.seq, None)
        self._mesh.activity.finished(r.seq)
        exc = self._explained(r.seq, exc)
        record = self._abort_record(r.seq, exc)
        if record is not None and not self._mesh.closed and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(self._broadcast_abort(r.seq, record), self._loop)
        return exc

    def _explained(self, seq: int, exc: BaseException) -> BaseException:
        """``exc``, or, for a lost peer where a peer recorded in its mailbox that it gave
        up collective ``seq``, what it recorded. A rank that aborted a call and closed
        drops its endpoints once every peer answered the ABORT or said BYE, or after
        CLOSE_WAIT_S; a peer whose loop did not run that long (a starved process) loses
        the ABORT still unread in its socket with the connection, and blamed the closed
        rank instead of the cause (CI, session 16, when the bound was one second). The
        mailbox keeps the record: it stays mapped here after its owner is gone."""
        box = self._mailbox
        if box is None or not isinstance(exc, PeerLostError):
            return exc
        return recorded_abort(box, seq, self.rank) or exc

    def _abort_record(self, seq: int, exc: BaseException) -> tuple[int, int, str] | None:
        """What the peers are told of this rank's failure of collective ``seq``: (code,
        culprit rank, reason), also written into the mailbox at once; None for a lost
        peer (every survivor sees the loss itself)."""
        if isinstance(exc, CGXTimeoutError):
            code, peer = AbortCode.PEER_LOST, exc.peer if exc.peer is not None else self.rank
        elif isinstance(exc, PeerLostError):
            return None
        elif isinstance(exc, ProtocolError):
            code, peer = AbortCode.PROTOCOL, self.rank
        elif isinstance(exc, CollectiveMismatchError):
            code, peer = AbortCode.MISMATCH, self.rank
        elif isinstance(exc, asyncio.CancelledError):
            code, peer = AbortCode.LOCAL, self.rank
            exc = TransportError("cancelled")
        else:
            code, peer = AbortCode.LOCAL, self.rank
        reason = f"{type(exc).__name__}: {exc}"
        box = self._mailbox
        if box is not None and box.enabled and seq:
            box.abort(seq, int(code), int(peer), reason)
        return int(code), int(peer), reason

    async def _after_failure(self, call: Call | Round, exc: BaseException) -> None:
        """Tell the peers, unless they saw it themselves (a lost peer).

        A failure that came as a peer's ABORT is relayed too: the ABORT from its origin
        may reach a third rank after this rank's BYE (different channels, no order between
        them), and that rank then blamed this one for closing mid-collective instead of
        reporting the cause; on one channel the relayed ABORT precedes our BYE."""
        if self._mesh.closed or self.world_size == 1:
            return
        record = self._abort_record(call.seq, exc)
        if record is not None:
            await self._broadcast_abort(call.seq, record)

    async def _broadcast_abort(self, seq: int, record: tuple[int, int, str]) -> None:
        try:
            await asyncio.shield(self._mesh.broadcast_abort(seq, *record))
        except Exception as err:
            log.debug("abort notification failed: %s", err)

    async def warm_up(self) -> None:
        """One small compressed allreduce at sequence number 0, which :func:`connect`
        runs on every rank before returning (later calls do nothing).

        After the codec warm-up (compiled or loaded kernels), the first compressed
        collective of a process still took about 2 ms more than later ones started the
        same way, 2.4-5.7x a back-to-back call on the asyncio core (issue 10 allows 3x):
        first runs somewhere on the path (Python code, pool buffers, UCX's first messages
        on each data endpoint; not told apart). Running one here moves that cost into
        connect. Like any collective it is bounded by the communicator's timeout and
        fails with a typed error if a peer is lost; the callers' first collective stays
        collective #1 (the handshake uses 0 on a phase of its own), and neither its
        messages nor its bytes count in :attr:`stats`."""
        if self.world_size == 1 or self._warm:
            return
        self._warm = True
        await self._warm_up_allreduce()

    async def _warm_up_allreduce(self) -> None:
        stats = self._mesh.stats
        before = (
            stats.bytes_sent,
            stats.bytes_received,
            stats.messages_sent,
            stats.messages_received,
        )
        x = np.zeros(WARM_UP_NUMEL, np.float32)
        await self._collective(
            "warm-up",
            lambda: prepare_allreduce(
                x, "avg", world_size=self.world_size, bits=4, algorithm="oneshot"
            ),
            run_allreduce,
            seq=0,
            local=AllreduceOp.of,
        )
        (stats.bytes_sent, stats.bytes_received, stats.messages_sent, stats.messages_received) = (
            before
        )

    # -- collectives --------------------------------------------------------------------
    async def allreduce(
        self,
        x: Any,
        op: str = "sum",
        *,
        layout: Layout | None = None,
        bits: int | None = None,
        bucket_size: int = 1024,
        algorithm: str = "auto",
        stochastic: bool = False,
        seed: int = 0,
        root: int | None = None,
    ) -> Any:
        """Sum (or average) ``x`` across ranks, in place; returns ``x``.

        ``layout`` gives per-layer bits / bucket sizes (bits=32: that layer travels
        uncompressed); without it the buffer is one layer of ``bits`` (default 32: exact
        uncompressed allreduce) and ``bucket_size``. Compression needs float32, float16
        or bfloat16 values; integer and float64 buffers reduce uncompressed only.
        ``algorithm``: "sra" (scatter-reduce-allgather), "ring", "oneshot" (one round:
        every rank sends its whole buffer to every peer), or "auto" (oneshot for small
        buffers, else SRA up to 8 ranks, else ring). Stochastic rounding is seeded by
        (seed, sequence number, rank, layer). ``root``: signed as the one rank that keeps
        the result (torch's reduce; every rank still computes it).
        """

        name, prepare = self.allreduce_call(
            x, op, layout=layout, bits=bits, bucket_size=bucket_size, algorithm=algorithm,
            stochastic=stochastic, seed=seed, root=root,
        )  # fmt: skip
        await self._collective(name, prepare, run_allreduce, local=AllreduceOp.of)
        return x

    def allreduce_call(
        self, x: Any, op: str = "sum", *, root: int | None = None, **kwargs: Any
    ) -> tuple[str, Callable[[], tuple[Frame, tuple[Any, Any]]]]:
        """The name and argument check of :meth:`allreduce` (keywords as there)."""

        def prepare() -> tuple[Frame, tuple[Any, Any]]:
            return prepare_allreduce(
                x,
                op,
                world_size=self.world_size,
                topology=getattr(self._mesh, "topology", None),
                hierarchy=getattr(self._mesh, "hierarchy", None),
                cache=self._prepared,
                root=root,
                oneshot_limit=self._oneshot_limit(),
                **kwargs,
            )

        return ("allreduce" if root is None else "reduce"), prepare

    async def broadcast(self, x: Any, root: int = 0) -> Any:
        """Copy ``root``'s ``x`` into every rank's ``x`` (same shape and dtype everywhere)."""
        await self._collective(
            "broadcast", self.broadcast_call(x, root), run_broadcast, local=BroadcastOp.of
        )
        return x

    def broadcast_call(self, x: Any, root: int = 0) -> Callable[[], tuple[Frame, Any]]:
        """The argument check of :meth:`broadcast`."""
        return lambda: prepare_broadcast(x, root, self.world_size, self.rank)

    async def allgather(
        self, x: Any, out: Any = None, reduce_op: str | None = None, root: int | None = None
    ) -> Any:
        """Every rank's ``x`` into ``out[rank]`` on every rank; ``out`` shape (world, *x.shape).
        ``reduce_op``: the local reduction the caller applies to ``out``; ``root``: the
        rank that keeps the result (see :func:`.allgather.prepare_allgather`); ranks that
        disagree on either raise a mismatch."""
        return await self._collective(
            "allgather",
            self.allgather_call(x, out, reduce_op, root),
            run_allgather,
            local=AllgatherOp.of,
        )

    def allgather_call(
        self, x: Any, out: Any = None, reduce_op: str | None = None, root: int | None = None
    ) -> Callable[[], tuple[Frame, Any]]:
        """The argument check of :meth:`allgather`."""
        return lambda: prepare_allgather(x, out, self.world_size, reduce_op, root)

    async def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        await self._collective("barrier", prepare_barrier, run_barrier, local=BarrierOp.of)

    async def late_peers(self) -> list[tuple[int, str]]:
        """The peers that have not started this rank's latest collective (or are gone,
        or did not answer), each with what its status answer says; asked on the control
        channels, at most ~1 s. For reports such as torch's ``monitored_barrier``."""
        mesh = self._mesh
        mine = mesh.activity.started_seq
        statuses = await asyncio.gather(*(mesh.peer_status(r) for r in sorted(mesh.peers)))
        return [
            (s.rank, s.describe())
            for s in statuses
            if s.gone or not s.answered or s.started_seq < mine
        ]

    async def refuse(self, name: str, exc: CGXError) -> None:
        """Take this rank's turn in the next collective only to refuse it: raises ``exc``
        here and aborts the peers' collective of the same number, as an argument error
        inside a collective does (they raise CollectiveMismatchError naming this rank and
        ``exc``). For callers that find a rank-local error before starting the call (the
        torch backend's argument checks), so that the peers do not wait out the timeout."""

        def prepare() -> tuple[Frame, None]:
            raise exc

        async def never(call: Call, state: None) -> None:  # pragma: no cover
            raise AssertionError("refuse() ran a collective")

        await self._collective(name, prepare, never)

    async def alltoall(
        self, x: Any, out: Any, send_counts: Any = None, recv_counts: Any = None
    ) -> Any:
        """Block i of flat ``x`` to rank i, block r of every rank into ``out`` (exact);
        blocks of ``send_counts`` / ``recv_counts`` values (None: even). See .alltoall."""
        return await self._collective(
            "alltoall",
            lambda: prepare_alltoall(x, out, self.rank, self.world_size, send_counts, recv_counts),
            run_alltoall,
        )

    async def reduce_scatter(self, x: Any, out: Any, op: str = "sum", **kwargs: Any) -> Any:
        """Shard ``rank`` of the sum (or average) of every rank's ``x`` (world x n values)
        into ``out`` (n values); ``bits``/``bucket_size``/``stochastic``/``seed`` as for
        :meth:`allreduce` (bits < 32: peers' shards travel quantized). See .reduce_scatter."""
        return await self._collective(
            "reduce_scatter",
            lambda: prepare_reduce_scatter(x, out, op, world_size=self.world_size, **kwargs),
            run_reduce_scatter,
        )

    # -- point to point (see .p2p: per-(pair, tag) streams, not numbered collectives) -----
    async def send(self, x: Any, dst: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dst``; messages of one (dst, tag) arrive in order."""
        await self._p2p.send(x, dst, tag)

    async def recv(self, x: Any, src: int | None = None, tag: int = 0) -> int:
        """Receive the next message of ``src`` (None: any rank) on ``tag`` into ``x``
        (same dtype and size as sent); returns the sender's rank."""
        if src is None:
            return await self._p2p.recv_any(x, tag)
        return await self._p2p.recv(x, src, tag)


def _start_codec_warm_up() -> concurrent.futures.Future | None:
    """Compile (or load) the CPU codec's kernels on a thread; None without Numba."""
    try:
        from ..compression import cpu
    except ImportError:  # pragma: no cover
        return None
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cgx-warm-up")
    fut = pool.submit(cpu.warm_up)
    pool.shutdown(wait=False)
    return fut


async def _codec_ready(
    warm: concurrent.futures.Future | None, store: Any, mesh: Mesh, config: CommConfig, prefix: str
) -> None:
    """Wait (bounded by ``connect_timeout``) until the codec is compiled on every rank.

    A cold compile (a fresh install: an empty Numba cache) takes seconds; if it ran in a
    first collective, a peer that was ready would time out waiting for this rank (issue
    10). So no rank returns from connect before every rank's kernels are loaded: a
    counter in the store, under the communicator's job-unique id. Past the bound the
    connect goes on (a warning): a slow compile must not fail the run.
    """
    end = time.monotonic() + config.connect_timeout
    if warm is not None:
        try:
            await asyncio.wait_for(asyncio.wrap_future(warm), config.connect_timeout)
        except TimeoutError:
            log.warning("codec kernels not compiled within connect_timeout; going on")
        except Exception as exc:  # the first compressed call reports it, typed
            log.warning("codec warm-up failed: %s", exc)
    if mesh.world_size == 1:
        return
    key = f"{prefix}/codec_ready/{mesh.job:x}"
    if not await _all_counted(store, key, mesh.world_size, end, pause=0.005):
        log.warning("not every rank compiled its codec within connect_timeout; going on")


async def _all_counted(store: Any, key: str, n: int, end: float, pause: float = 0.002) -> bool:
    """Count this rank in the store counter ``key`` and wait until all ``n`` ranks are,
    asking every ``pause`` seconds (False when the monotonic deadline ``end`` passes)."""
    count = int(store.add(key, 1))
    while count < n:
        if time.monotonic() > end:
            return False
        await asyncio.sleep(pause)
        count = int(store.add(key, 0))
    return True


def _share_codec_threads(local_ranks: int) -> None:
    """Give the CPU codec ``cores // local ranks`` threads, unless someone chose already.

    A parallel Numba kernel waits for its slowest thread; with several ranks per host
    each running all-core kernels, the threads oversubscribe the cores and wait for time
    slices: a large 4-bit allreduce then runs several times slower than with the cores
    shared out between the ranks.
    """
    try:
        from ..compression import cpu
    except ImportError:  # pragma: no cover
        return
    if cpu.threads_chosen():
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cpu.num_threads()
    threads = max(1, min(cores // max(local_ranks, 1), limit))
    cpu.set_num_threads(threads)
    log.info("codec threads per rank: %d (%d cores, %d ranks here)", threads, cores, local_ranks)
