"""Bridge the engine's ``concurrent.futures.Future`` to ``torch.futures.Future``.

The engine resolves its futures on its event-loop thread. Completing a torch future
runs the callbacks chained on it with ``then()`` in the completing thread, and those
callbacks are user code: a DDP hook may wait inside one for another collective
(PyTorch's PowerSGD hook does). Run there, such a callback would block the event loop
that has to finish the collective it waits for. So completions are handed to a small
pool of "cgx-complete" threads; the loop thread only enqueues.

The pool has several threads so that a callback that blocks on a second collective
does not stop that collective's own completion (gloo runs callbacks on its worker
pool for the same reason). Threads start lazily and are daemons; a process never
waits for them at exit.

A thread blocked in ``Work.wait()`` (every synchronous ``dist.all_reduce``) needs no
completion thread: :meth:`TorchBridge.wait` waits on the engine future itself and
completes the torch future on the waiting thread, which is off the loop as well. That
saves one thread hand-off on the latency path of every synchronous call; the loop
then does not even enqueue the completion.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import TransportError

__all__ = [
    "Finished",
    "TorchBridge",
    "complete_from",
    "completion_executor",
    "outcome",
    "to_torch_future",
]

T = TypeVar("T")

#: Nested blocking waits inside then-callbacks that can be served at once. PowerSGD
#: nests one level; four leaves room for user hooks composed on top of it.
_COMPLETION_THREADS = 4

_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def completion_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The shared pool that completes torch futures off the engine's loop thread."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=_COMPLETION_THREADS, thread_name_prefix="cgx-complete"
            )
        return _executor


class Finished:
    """The result of a collective that completed on the calling thread (the engine's
    ``allreduce_now``), standing in for its engine future: none was made."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def outcome(
    src: concurrent.futures.Future[Any] | Finished, finish: Callable[[Any], T]
) -> tuple[T | None, BaseException | None]:
    """(``finish(result)``, None) of the finished ``src``, or (None, its error): a
    cancellation as a typed error, a failing ``finish`` as its own."""
    try:
        # One look at the future (it is done).
        result = src.value if type(src) is Finished else src.result(0)
    except concurrent.futures.CancelledError:
        # The engine cancels the calls still running when their communicator closes
        # (destroy_process_group with async work pending): a typed error, not a bare
        # concurrent.futures.CancelledError.
        return None, TransportError(
            "the collective was cancelled before it completed: its process group was "
            "shut down (destroy_process_group) while it was still running, or (a "
            "receive) its wait timed out"
        )
    except BaseException as err:  # the collective's error
        return None, err
    try:
        return finish(result), None
    except BaseException as err:  # a failing finish()
        return None, err


def complete_from(
    src: concurrent.futures.Future[Any],
    dst: torch.futures.Future[T],
    finish: Callable[[Any], T],
    done: Callable[[BaseException | None], None] | None,
) -> None:
    """Complete ``dst`` from the finished ``src`` (:func:`outcome`); then
    ``done(error or None)``."""
    value, exc = outcome(src, finish)
    try:
        if exc is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(value)
    finally:
        if done is not None:
            done(exc)


class TorchBridge:
    """One engine future bridged to one torch future (:attr:`future`), completed exactly
    once: by a completion thread, or by the thread that waits in :meth:`wait`.

    Once complete it drops the engine future and the callables: the engine future keeps
    its done-callbacks (this bridge's) after it finishes, and ``finish`` and ``done``
    hold the caller's tensors and work, so keeping them would tie all of these into a
    reference cycle that only the cyclic collector frees.
    """

    def __init__(
        self,
        src: concurrent.futures.Future[Any],
        finish: Callable[[Any], Any],
        done: Callable[[BaseException | None], None] | None = None,
        future: torch.futures.Future[Any] | None = None,
    ) -> None:
        self.src: concurrent.futures.Future[Any] | None = src
        self.future: torch.futures.Future[Any] = (
            future if future is not None else torch.futures.Future()
        )
        self._finish: Callable[[Any], Any] | None = finish
        self._done: Callable[[BaseException | None], None] | None = done
        self._lock = threading.Lock()
        self._claimed = False
        self._waiters = 0
        if src.done():
            # Done already (a mailbox collective runs on the caller's thread): complete
            # here, not on a completion thread (a hop of two wake-ups, 150 us per call).
            self.complete()
        else:
            src.add_done_callback(self._on_done)

    def _on_done(self, _: concurrent.futures.Future[Any]) -> None:
        # On the engine's loop thread: never run user code here.
        with self._lock:
            if self._claimed or self._waiters:
                return  # a waiter completes it (see wait)
        try:
            completion_executor().submit(self.complete)
        except RuntimeError:  # pool shut down at interpreter exit: complete inline
            self.complete()

    def complete(self) -> None:
        """Complete the torch future from the finished engine future (once)."""
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
            src, finish, done = self.src, self._finish, self._done
            self.src = self._finish = self._done = None
        assert src is not None and finish is not None
        complete_from(src, self.future, finish, done)

    def wait(self, timeout: float | None) -> None:
        """Wait at most ``timeout`` s for the engine future; when it finished, complete
        the torch future here unless another thread already does. Returns without
        saying: the caller checks its own completion signal."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            src = self.src
            if src is None:  # completed already
                return
            self._waiters += 1
        try:
            if end is None or end > time.monotonic():
                src.exception(None if end is None else max(end - time.monotonic(), 0.0))
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            pass
        finally:
            with self._lock:
                self._waiters -= 1
        # _on_done skipped the pool only while we were registered, and it runs after
        # src is done: so if src is done now, completing it is (at least) up to us.
        if src.done():
            self.complete()


def to_torch_future(
    src: concurrent.futures.Future[Any],
    finish: Callable[[Any], T],
    *,
    done: Callable[[BaseException | None], None] | None = None,
) -> torch.futures.Future[T]:
    """A torch future that completes when ``src`` does.

    ``finish(result)`` runs on a completion thread and returns the torch future's
    value (e.g. copies a staging buffer back and returns the output tensors); if it or
    ``src`` fails, the torch future carries that exception unchanged (a CGXError
    subclass from the engine stays one). ``done(exc)`` runs after the torch future is
    completed, with the exception or None.
    """
    return TorchBridge(src, finish, done).future
