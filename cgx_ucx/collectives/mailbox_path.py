"""The mailbox path: a communicator's collectives through node-local mailboxes.

Where every rank of a group runs on one host (and node-local shared memory is on),
:func:`~.communicator.connect` gives the group mailboxes (:mod:`cgx_ucx.transport.mailbox`)
and the collectives that fit go through them (:mod:`.local`) instead of the network:
on the event loop, or on the calling thread for the synchronous face
(:meth:`MailboxPath.run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from ..config import CommConfig
from ..errors import CGXTimeoutError, ConfigError
from ..transport import shm
from ..transport.frames import Frame
from ..transport.mailbox import Mailbox, State, compile_kernels
from .bootstrap import all_counted
from .call import Call, what
from .failure import abort_record, broadcast_abort, explained
from .local import (
    HAND_OVER_S,
    LOCAL_ONESHOT_BYTES,
    LocalCall,
    LocalOp,
    Round,
    wait_async,
    wait_blocking,
)
from .registry import CallRegistry
from .transport import Transport

__all__ = ["FROM_OP", "MailboxPath"]

log = logging.getLogger("cgx_ucx")

S = TypeVar("S")

#: What a rank publishes instead of its mailbox when CGX_UCX_INTRA_SHM is off.
_SHM_OFF = b"off"
#: ``result`` of :meth:`MailboxPath.run`: the collective's own result.
FROM_OP = object()


class MailboxPath:
    """The node-local mailboxes of one communicator and the collectives run through them.

    ``box`` is None until :meth:`attach` gave the group mailboxes (all ranks or none end
    with them). A mailbox has one slot per collective in flight (two, alternating): its
    collectives on the loop run one at a time, in number order (a FIFO lock, taken before
    the first await after numbering).
    """

    def __init__(
        self,
        transport: Transport,
        registry: CallRegistry,
        config: CommConfig,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._mesh = transport
        self._registry = registry
        self._config = config
        self._loop = loop
        #: Node-local mailboxes (.local), where every rank is on this host; None elsewhere.
        self.box: Mailbox | None = None
        self._lock = asyncio.Lock()

    @property
    def oneshot_limit(self) -> int | None:
        """The one-round allreduce limit the mailboxes call for (None: the default)."""
        return LOCAL_ONESHOT_BYTES if self.box is not None else None

    def close(self) -> None:
        """Unmap the mailboxes; a round still running on a caller's thread raises."""
        if self.box is not None:
            self.box.close()
            self.box = None

    # -- set-up -------------------------------------------------------------------------
    async def attach(self, store: Any, prefix: str) -> bool:
        """Give the group mailboxes if every rank runs on this host; True if it has them.

        Run on every rank; all ranks or none end with them. Ranks of one host that
        disagree on ``CGX_UCX_INTRA_SHM`` raise ConfigError, every one of them."""
        mesh = self._mesh
        n = mesh.world_size
        if (
            n == 1
            or len(getattr(mesh, "local_ranks", ())) != n
            or getattr(mesh, "topology", None) is None
            or mesh.topology.num_nodes != 1
            or not shm.available()
        ):
            return False  # the same on every rank: the topology is shared
        box = None
        if mesh.hierarchy.intra_shm:
            compile_kernels()
            box = Mailbox(mesh.rank, n)
        try:
            await self._exchange(box, store, prefix)
        except BaseException:
            if box is not None:
                box.close()
            raise
        if box is None or not box.enabled:
            if box is not None:
                box.close()
            return False
        self.box = box
        return True

    async def _exchange(self, box: Mailbox | None, store: Any, prefix: str) -> None:
        """Publish ``box`` in the store (or that this rank has node-local shared memory
        off), map every peer's, and agree (through the mailboxes' state words) whether
        every rank mapped every other."""
        mesh = self._mesh
        rank, n = mesh.rank, mesh.world_size
        base = f"{prefix}/mailbox/{mesh.job:x}"
        store.set(f"{base}/{rank}", bytes(box.descriptor().pack()) if box else _SHM_OFF)
        end = time.monotonic() + self._config.connect_timeout
        if not await all_counted(store, f"{base}/count", n, end):
            raise CGXTimeoutError("not every rank published its mailbox within connect_timeout")
        raw = {p: bytes(store.get(f"{base}/{p}")) for p in range(n) if p != rank}
        off = sorted(p for p, v in raw.items() if v == _SHM_OFF) + ([] if box else [rank])
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
            log.warning("rank %d: no node-local mailboxes (%s)", rank, why)
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

    # -- on the event loop --------------------------------------------------------------
    async def run_async(self, call: Call, op: LocalOp) -> Any:
        """A mailbox collective on the event loop (queued behind others); the caller
        reports its failure to the peers."""
        assert self.box is not None and call.template is not None

        def check() -> None:
            if call.abort.done():
                raise call.abort.exception()  # type: ignore[misc]
            self._mesh.check()

        r = Round(self.box, call.seq, call.name, call.template, self._config.timeout, check)
        async with self._lock:
            result = await self._steps(r, op, posted=False, first=check)
        self._count_bytes(r)
        return result

    async def _steps(
        self, r: Round, op: LocalOp, posted: bool, first: Callable[[], None] | None = None
    ) -> Any:
        """A mailbox round on the loop, under the lock: ``first``, then claim the slot
        and post (unless ``posted`` already), wait for every peer, finish; the round ends
        whatever happens. Returns the collective's result."""
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

    # -- on the caller's thread ---------------------------------------------------------
    def run(
        self,
        name: str,
        prepare: Callable[[], tuple[Frame, S]],
        local: Callable[[S], LocalOp | None],
        result: Any = None,
    ) -> tuple[bool, Any, Coroutine[Any, Any, Any] | None]:
        """Run a collective through the mailboxes on the calling thread, if it goes there
        (see :meth:`~.communicator.Communicator.run_local`)."""
        box = self.box
        if box is None or not box.enabled:
            return False, None, None
        try:
            template, state = prepare()
        except Exception:  # the network path raises it on this rank and aborts the peers
            return False, None, None
        op = local(state)
        if op is None:
            return False, None, None
        seq, lc, early = self._registry.begin(lambda seq: LocalCall())
        mesh = self._mesh
        template = template.with_(job=mesh.job, seq=seq, src=mesh.rank, comm=mesh.comm_id)
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
                return True, None, self._finish(r, op, result, posted=False)
            op.post(r)
            if not wait_blocking(r, HAND_OVER_S):
                return True, None, self._finish(r, op, result, posted=True)
            value = op.finish(r)
        except BaseException as exc:
            r.end()
            told = self._failed(r, exc)
            if told is not exc:
                raise told from exc
            raise
        r.end()
        self._done(r)
        return True, (value if result is FROM_OP else result), None

    async def _finish(self, r: Round, op: LocalOp, result: Any, posted: bool) -> Any:
        """The rest of a mailbox collective that :meth:`run` started, on the loop
        (``posted``: this rank's part is posted already)."""
        try:
            async with self._lock:
                value = await self._steps(r, op, posted)
        except BaseException as exc:
            told = self._failed(r, exc)
            if told is not exc:
                raise told from exc
            raise
        self._done(r)
        return value if result is FROM_OP else result

    def _done(self, r: Round) -> None:
        self._registry.end(r.seq)
        self._mesh.activity.finished(r.seq)
        self._registry.count(r.name)
        self._count_bytes(r)

    def _count_bytes(self, r: Round) -> None:
        """A mailbox collective's payload in the statistics: what each peer read of this
        rank's post, and what this rank read of theirs (no message, no header)."""
        stats = self._mesh.stats
        stats.bytes_sent += r.sent * (self._mesh.world_size - 1)
        stats.bytes_received += r.received

    def _failed(self, r: Round, exc: BaseException) -> BaseException:
        """After a failed mailbox collective of :meth:`run`: the peers are told (in the
        mailbox at once, over the network from the loop). Returns the error to raise
        (:func:`.failure.explained`)."""
        self._registry.end(r.seq)
        self._mesh.activity.finished(r.seq)
        rank = self._mesh.rank
        exc = explained(self.box, r.seq, rank, exc)
        record = abort_record(self.box, r.seq, rank, exc)
        if not self._mesh.closed and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(
                    broadcast_abort(self._mesh, r.seq, record), self._loop
                )
        return exc
