"""The synchronous face: one daemon thread runs an asyncio loop; calls return futures.

Autograd hooks and other synchronous code cannot ``await``. :class:`Engine` runs the
asyncio core on a loop in one daemon thread (process-wide, started lazily, stopped when
the last :class:`SyncCommunicator` closes, so nothing of ours outlives the last
communicator); :func:`connect_sync` returns a :class:`SyncCommunicator` whose collectives
return :class:`concurrent.futures.Future` at once. There is one implementation of every
collective: these methods submit the asyncio ones (DESIGN.md, "Threads and loops").

Submission order is call order: each collective takes its sequence number in the first
synchronous step of its coroutine, and the loop starts submitted coroutines in FIFO
order, so two hooks firing ``allreduce`` back to back keep their order on every rank.

Future callbacks run on the engine thread: they must not block (wrap the future, e.g.
into a ``torch.futures.Future``, and do the work elsewhere). This module never imports
torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Coroutine
from typing import Any

from .collectives.barrier import prepare_barrier
from .collectives.communicator import FROM_OP, CommStats, Communicator, connect
from .collectives.local import AllgatherOp, AllreduceOp, BarrierOp, BroadcastOp
from .config import CommConfig
from .errors import CGXTimeoutError, TransportError

__all__ = ["Engine", "SyncCommunicator", "connect_sync"]

log = logging.getLogger("cgx_ucx")

#: Seconds to wait for the engine thread to finish its loop on shutdown.
STOP_TIMEOUT_S = 30.0


class Engine:
    """An asyncio loop on a daemon thread. Use :meth:`get` for the process-wide one."""

    _instance: Engine | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._users = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="cgx-engine", daemon=True)
        self._thread.start()
        self._ready.wait()

    @classmethod
    def get(cls, retain: bool = False) -> Engine:
        """The process-wide engine, started on first use (again after it was stopped).

        ``retain=True`` also counts the caller as a user (atomically with the lookup,
        so a concurrent last :meth:`release` cannot stop it in between).
        """
        with cls._instance_lock:
            if cls._instance is None or not cls._instance.running:
                cls._instance = cls()
            if retain:
                cls._instance.retain()
            return cls._instance

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
            finally:
                self._loop.close()

    # -- properties ---------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._loop.is_closed()

    # -- use ------------------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Schedule ``coro`` on the engine loop; returns at once."""
        if not self.running:
            coro.close()
            raise TransportError("the cgx_ucx engine is stopped")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(_start, self._loop, coro, fut)
        return fut

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine loop and wait for its result (not from the loop thread)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise TransportError("Engine.run() would deadlock on the engine thread; use submit()")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            if fut.done():  # the coroutine itself raised TimeoutError (Python >= 3.11)
                if isinstance(exc, CGXTimeoutError):
                    raise
                raise CGXTimeoutError(f"engine call timed out inside: {exc}") from exc
            fut.cancel()
            raise CGXTimeoutError(f"engine call did not finish within {timeout:g} s") from None

    def retain(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """Drop a user; the last one stops the loop and joins the thread."""
        with self._lock:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.stop()

    def stop(self) -> None:
        if not self.running:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("cgx_ucx engine thread did not stop within %g s", STOP_TIMEOUT_S)


def _start(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], fut: concurrent.futures.Future
) -> None:
    """On the loop: run ``coro`` as a task whose outcome completes ``fut``; cancelling
    ``fut`` cancels the task.

    This is :func:`asyncio.run_coroutine_threadsafe` without its reference cycle: that
    one's callbacks close over both futures, and a finished ``concurrent.futures.Future``
    keeps its callbacks, so the returned future, its task and the task's result (a view
    of the caller's buffer) would stay alive until the cyclic collector runs. Here the
    future refers to the task, and the finished task to nothing of the future's.
    """
    if fut.cancelled():
        coro.close()
        return
    task = loop.create_task(coro)
    task.add_done_callback(functools.partial(_settle, fut))
    fut.add_done_callback(functools.partial(_cancel_task, loop, task))


def _settle(fut: concurrent.futures.Future, task: asyncio.Task) -> None:
    if task.cancelled():
        fut.cancel()
    if not fut.set_running_or_notify_cancel():  # cancelled, here or by its caller
        return
    exc = task.exception()
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(task.result())


def _cancel_task(loop: asyncio.AbstractEventLoop, task: asyncio.Task, fut: Any) -> None:
    if fut.cancelled() and not task.done() and not loop.is_closed():
        loop.call_soon_threadsafe(task.cancel)


def _finished(value: Any) -> concurrent.futures.Future:
    """A future holding ``value``: a call that completed on the caller's thread."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class SyncCommunicator:
    """A :class:`~cgx_ucx.collectives.Communicator` driven from synchronous code.

    Collectives return ``concurrent.futures.Future`` immediately; their result is what
    the asyncio method returns (the buffer, in place). Buffers must stay untouched
    until the future completes.
    """

    def __init__(self, engine: Engine, comm: Communicator) -> None:
        self._engine = engine
        self._comm = comm
        self._closed = False
        self._submitted = 0
        self._here = threading.local()  # ``count``: calls this thread submitted
        #: Calls submitted to the engine and not done yet; a mailbox collective runs on
        #: the caller's thread only while there are none (DESIGN.md, "Threads and loops").
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> CommStats:
        return self._comm.stats

    @property
    def comm(self) -> Communicator:
        """The asyncio communicator underneath (lives on the engine loop)."""
        return self._comm

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def submitted(self) -> int:
        """Calls submitted so far, by every thread."""
        return self._submitted

    @property
    def submitted_here(self) -> int:
        """Calls this thread submitted so far: a caller can tell whether a call of its
        went out, whatever other threads submit meanwhile."""
        return getattr(self._here, "count", 0)

    def _count(self) -> None:
        """One more call submitted, by this thread (caller holds the lock)."""
        self._submitted += 1
        self._here.count = getattr(self._here, "count", 0) + 1

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        if self._closed:
            coro.close()
            raise TransportError("the communicator is closed")
        with self._lock:
            fut = self._engine.submit(coro)
            self._count()
            self._in_flight += 1
        fut.add_done_callback(self._landed)
        return fut

    def _landed(self, _: Any) -> None:
        with self._lock:
            self._in_flight -= 1

    def _local_now(
        self, name: str, prepare: Any, local: Any, result: Any
    ) -> tuple[Any, concurrent.futures.Future | None] | None:
        """Run a mailbox collective on this thread (:meth:`Communicator.run_local`): no
        hop to the engine loop and back. None where it does not apply (then submit);
        (its result, None) when it completed here; (None, a future) when a peer was late
        (the engine loop finishes the call) or it failed (the future holds the error)."""
        if self._closed or self._comm.mailbox is None:
            return None
        with self._lock:
            if self._in_flight:
                return None  # queued behind the engine's calls, to keep call order
            try:
                ran, value, rest = self._comm.run_local(name, prepare, local, result)
            except BaseException as exc:
                self._count()
                failed: concurrent.futures.Future = concurrent.futures.Future()
                failed.set_exception(exc)
                return None, failed
            if not ran:
                return None
            self._count()
            if rest is None:
                return value, None
            fut = self._engine.submit(rest)  # a peer is late: the engine loop waits for it
            self._in_flight += 1
        fut.add_done_callback(self._landed)
        return None, fut

    def _local(
        self, name: str, prepare: Any, local: Any, result: Any
    ) -> concurrent.futures.Future | None:
        """:meth:`_local_now` with its result in a finished future."""
        now = self._local_now(name, prepare, local, result)
        if now is None:
            return None
        value, fut = now
        return fut if fut is not None else _finished(value)

    def allreduce_now(
        self, x: Any, op: str = "sum", **kwargs: Any
    ) -> tuple[Any, concurrent.futures.Future | None]:
        """:meth:`allreduce`, but a call that completed on this thread (a mailbox call
        whose peers were there) comes back as (its result, None), with no future made:
        a future's set-up, completion and two looks at it cost a few us of a call of
        ~50 (the torch backend takes this path). Else (None, the future)."""
        if self._comm.mailbox is not None:
            name, prepare = self._comm.allreduce_call(x, op, **kwargs)
            now = self._local_now(name, prepare, AllreduceOp.of, x)
            if now is not None:
                return now
        return None, self._submit(self._comm.allreduce(x, op, **kwargs))

    def allreduce(self, x: Any, op: str = "sum", **kwargs: Any) -> concurrent.futures.Future:
        """Submit :meth:`Communicator.allreduce`; same keywords (layout, bits, ...)."""
        value, fut = self.allreduce_now(x, op, **kwargs)
        return fut if fut is not None else _finished(value)

    # The name of the method that does what this allreduce does without a future for a
    # call done here: a caller that finds it on the class's own allreduce (not on an
    # override, not through a wrapper's __getattr__) may take that path.
    allreduce.without_future = "allreduce_now"  # type: ignore[attr-defined]

    def broadcast(self, x: Any, root: int = 0) -> concurrent.futures.Future:
        if self._comm.mailbox is not None:
            prepare = self._comm.broadcast_call(x, root)
            fut = self._local("broadcast", prepare, BroadcastOp.of, x)
            if fut is not None:
                return fut
        return self._submit(self._comm.broadcast(x, root))

    def allgather(
        self, x: Any, out: Any = None, reduce_op: str | None = None, root: int | None = None
    ) -> concurrent.futures.Future:
        if self._comm.mailbox is not None:
            prepare = self._comm.allgather_call(x, out, reduce_op, root)
            fut = self._local("allgather", prepare, AllgatherOp.of, FROM_OP)
            if fut is not None:
                return fut
        return self._submit(self._comm.allgather(x, out, reduce_op, root))

    def barrier(self) -> concurrent.futures.Future:
        fut = self._local("barrier", prepare_barrier, BarrierOp.of, None)
        return fut if fut is not None else self._submit(self._comm.barrier())

    def late_peers(self) -> concurrent.futures.Future:
        """Submit :meth:`Communicator.late_peers`."""
        return self._submit(self._comm.late_peers())

    def refuse(self, name: str, exc: Any) -> concurrent.futures.Future:
        """Submit :meth:`Communicator.refuse` (its future fails with ``exc``)."""
        return self._submit(self._comm.refuse(name, exc))

    def alltoall(
        self, x: Any, out: Any, send_counts: Any = None, recv_counts: Any = None
    ) -> concurrent.futures.Future:
        return self._submit(self._comm.alltoall(x, out, send_counts, recv_counts))

    def reduce_scatter(
        self, x: Any, out: Any, op: str = "sum", **kwargs: Any
    ) -> concurrent.futures.Future:
        return self._submit(self._comm.reduce_scatter(x, out, op, **kwargs))

    def send(self, x: Any, dst: int, tag: int = 0) -> concurrent.futures.Future:
        return self._submit(self._comm.send(x, dst, tag))

    def recv(self, x: Any, src: int | None = None, tag: int = 0) -> concurrent.futures.Future:
        """Its result is the sender's rank (``src=None``: from any rank)."""
        return self._submit(self._comm.recv(x, src, tag))

    def close(self, timeout: float | None = None) -> None:
        """Close the communicator (blocking); the last one also stops the engine thread."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._engine.running:
                limit = timeout if timeout is not None else self._comm.config.timeout + 15.0
                self._engine.run(self._comm.close(), limit)
        finally:
            self._engine.release()

    def __enter__(self) -> SyncCommunicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<SyncCommunicator rank {self.rank}/{self.world_size}{state}>"


def connect_sync(
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    config: CommConfig | None = None,
    prefix: str = "cgx",
    host: str | None = None,
    data_error_handling: bool = True,
) -> SyncCommunicator:
    """Blocking :func:`~cgx_ucx.collectives.connect` on the engine thread."""
    engine = Engine.get(retain=True)
    try:
        coro = connect(
            store,
            rank,
            world_size,
            config=config,
            prefix=prefix,
            host=host,
            data_error_handling=data_error_handling,
        )
        comm = engine.run(coro)
    except BaseException:
        engine.release()
        raise
    return SyncCommunicator(engine, comm)
