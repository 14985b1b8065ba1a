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
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from ..compression import kernels
from ..config import CommConfig, log_configuration, resolve_comm
from ..errors import CGXError, ConfigError, TransportError
from ..layout import Layout
from ..transport import progress
from ..transport.frames import Frame
from ..transport.mailbox import Mailbox
from ..transport.mesh import Mesh
from ..transport.rendezvous import env_store
from .allgather import prepare_allgather, run_allgather
from .allreduce import prepare_allreduce, run_allreduce
from .alltoall import prepare_alltoall, run_alltoall
from .barrier import prepare_barrier, run_barrier
from .bootstrap import compile_codec_in_background, share_codec_threads
from .broadcast import prepare_broadcast, run_broadcast
from .call import Call, what
from .failure import explained, tell_peers
from .local import AllgatherOp, AllreduceOp, BarrierOp, BroadcastOp, LocalOp, signature_words
from .mailbox_path import FROM_OP, MailboxPath
from .p2p import PointToPoint
from .piece_codec import CodecRunner
from .reduce_scatter import prepare_reduce_scatter, run_reduce_scatter
from .registry import CallRegistry
from .staging import BufferPool
from .transport import Transport

__all__ = ["FROM_OP", "CommStats", "Communicator", "connect"]

log = logging.getLogger("cgx_ucx")

S = TypeVar("S")
R = TypeVar("R")

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
    compile_codec_in_background()
    share_codec_threads(len(mesh.local_ranks))
    progress.share_cores(len(mesh.local_ranks))
    log_configuration(config, None, rank=mesh.rank, world_size=mesh.world_size)
    # The env:// store lives as long as the communicator: on rank 0 it is the TCPStore
    # server, which peers may still poll (the mailbox counter) after this rank's
    # connect returned.
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
        self._registry = CallRegistry(transport)
        #: prepare_allreduce results by argument set (see its ``cache``).
        self._prepared: dict = {}
        self._pool = BufferPool(config.staging_bytes)
        self._codec = CodecRunner()
        self._closed = False
        self._warm = False  # warm_up() ran (or is running)
        self._loop = asyncio.get_running_loop()
        transport.on_abort = self._registry.on_abort
        self._p2p = PointToPoint(transport, config)  # send/recv, outside the numbering
        self._local = MailboxPath(transport, self._registry, config, self._loop)

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
    def mailbox(self) -> Mailbox | None:
        """The group's node-local mailboxes, None where it has none (ranks on several
        hosts or nodes, node-local shared memory off, a world of one)."""
        return self._local.box

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

    @property
    def _seq(self) -> int:
        """The number the next collective gets."""
        return self._registry.next_seq

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Communicator rank {self.rank}/{self.world_size} {state}>"

    # -- lifecycle ----------------------------------------------------------------------
    async def close(self) -> None:
        """Release endpoints, the listener, threads and staging memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._registry.fail_all(TransportError("the communicator was closed during the collective"))
        self._local.close()  # a round still running on a caller's thread raises
        await self._mesh.close()
        self._codec.close()
        self._pool.clear()
        self._keep_alive = None

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- machinery ----------------------------------------------------------------------
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
        seq, call, early = self._registry.begin(
            lambda n: Call(self._mesh, self._pool, self._codec, n, name), seq
        )
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
            # Peers that time out waiting for us are told which call we are in.
            self._mesh.collective_started(seq, what(name, template))
            box = self._local.box
            if box is not None:
                op = local(state) if local is not None else None
                if op is None:  # peers waiting in their mailboxes see where this one went
                    box.announce(seq, signature_words(call.template))
            if op is None:
                result: R | None = await body(call, state)
            else:
                result = await self._local.run_async(call, op)
        except BaseException as exc:
            told = explained(self._local.box, seq, self.rank, exc)
            await tell_peers(self._mesh, self._local.box, seq, told)
            if told is not exc:
                raise told from exc
            raise
        finally:
            self._registry.end(seq)
            self._mesh.collective_finished(seq)
        call.give_back_all()
        if counted:
            self._registry.count(name)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s #%d done in %.3f ms", name, seq, (time.perf_counter() - started) * 1e3)
        return result

    # -- node-local mailboxes (.mailbox_path) -------------------------------------------
    async def attach_mailbox(self, store: Any, prefix: str) -> None:
        """Give this group mailboxes if every rank runs on this host (run by
        :func:`connect` on every rank; all ranks or none end with them). Ranks of one host
        that disagree on ``CGX_UCX_INTRA_SHM`` raise ConfigError, every one of them."""
        if await self._local.attach(store, prefix):
            # The warm-up once more, through the mailboxes: their first call's costs (a
            # kernel loaded for a peer's read-only bytes, first runs of the path) move into
            # connect too.
            await self._warm_up_allreduce()

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
        if self._closed:
            return False, None, None
        return self._local.run(name, prepare, local, result)

    # -- warm-up ------------------------------------------------------------------------
    async def warm_up(self) -> None:
        """One small compressed allreduce at sequence number 0, which :func:`connect`
        runs on every rank before returning (later calls do nothing).

        It pays the first-call costs of the path (Python code, pool buffers, UCX's first
        messages on each data endpoint) inside connect, so that the callers' first
        compressed collective starts as fast as later ones. Like any collective it is
        bounded by the communicator's timeout and fails with a typed error if a peer is
        lost; the callers' first collective stays collective #1 (the handshake uses 0 on a
        phase of its own), and neither its messages nor its bytes count in :attr:`stats`."""
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
        with kernels.uncounted():  # every group repeats it: not a sign the job compresses
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
                oneshot_limit=self._local.oneshot_limit,
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
