"""The Work object the `cgx` backend returns for every collective.

Why a subclass of torch's Work and not ``_create_work_from_future``: in torch 2.13 a
Work made from a future whose result is an exception still reports success
(``is_success()`` is True) and its ``wait()`` returns normally, which would turn a
lost peer into silently stale tensors. This class raises the engine's own exception
(a :class:`~cgx_ucx.errors.CGXError` subclass) from ``wait()``, bounds every wait by
the group's timeout, and hands out the torch future that DDP and ``get_future()``
users chain on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CGXTimeoutError
from .futures import Finished, TorchBridge, outcome

__all__ = ["CGXWork", "wait_seconds"]

# The one place that names a torch internal. A Work written in Python must subclass
# torch's C++ Work class (as torch's own Python ProcessGroup tests do): recent torch
# exports it as ``torch.distributed.Work``, but not every release this package
# supports (torch >= 2.4) does, and there it exists only as ``_Work``.
_TorchWork: type = getattr(dist, "Work", None) or dist._Work  # noqa: SLF001


def wait_seconds(timeout: Any) -> float | None:
    """Seconds of a wait timeout; None when it means "no timeout" (torch's 0 or < 0)."""
    if timeout is None:
        return None
    secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return secs if secs > 0 else None


class CGXWork(_TorchWork):
    """Handle of one collective in flight.

    ``wait(timeout)`` blocks until the collective completes, at most ``timeout`` (or
    the group's timeout when none is given), then re-raises the collective's error.
    ``get_future()`` returns a ``torch.futures.Future`` whose value is the list of
    output tensors, as gloo's.
    """

    def __init__(self, what: str, timeout: float, *, latch: bool = True) -> None:
        super().__init__()
        self._what = what
        self._timeout = timeout
        # The torch future: made at once for a pending work (its bridge completes it);
        # for one done at construction, only when get_future() asks (most synchronous
        # calls never do: a torch future costs a few us of a ~100 us call).
        self._future: torch.futures.Future[Any] | None = None
        self._value: Any = None
        # Done-ness: a flag and a latch (a lock held until done; a waiter acquires and
        # releases it). A threading.Event costs ~6 us to make, on every collective; a
        # work completed at construction needs neither wait nor latch: ``latch=False``
        # is for that only (from_future, which marks it done before handing it out).
        self._finished = False
        self._latch: threading.Lock | None = None
        if latch:
            self._latch = threading.Lock()
            self._latch.acquire()
        self._exception: BaseException | None = None
        self._bridge: TorchBridge | None = None

    @classmethod
    def from_future(
        cls,
        what: str,
        timeout: float,
        source: concurrent.futures.Future[Any] | Finished,
        finish: Callable[[Any], Any],
    ) -> CGXWork:
        """The work of ``what`` completed by the engine future ``source`` (or its
        :class:`~.futures.Finished` result).

        ``finish(result)`` runs on a completion thread, or on the thread blocked in
        :meth:`wait`, and returns the work's result (the output tensors); ``wait()``
        waits at most ``timeout`` seconds by default.
        """
        done = type(source) is Finished or source.done()
        work = cls(what, timeout, latch=not done)
        if done:
            # Done already (a mailbox collective ran on the caller's thread): completed
            # here, with neither a bridge nor a torch future (both cost ~10 us per call).
            work._value, exc = outcome(source, finish)
            work.mark_done(exc)
        else:
            work._future = torch.futures.Future()
            work._bridge = TorchBridge(source, finish, done=work.mark_done, future=work._future)
        return work

    def attach(self, future: torch.futures.Future[Any]) -> None:
        """Set the torch future that :meth:`get_future` hands out (right after
        construction, before anyone waits)."""
        self._future = future

    def mark_done(self, exc: BaseException | None) -> None:
        """Complete this work with the collective's error or None (called from a
        completion thread, after the future is completed)."""
        if self._finished:
            return
        self._exception = exc
        self._finished = True
        self._bridge = None  # the bridge refers back to this work (see TorchBridge)
        latch = self._latch
        if latch is not None:
            with contextlib.suppress(RuntimeError):  # two racing calls: released once
                latch.release()

    def _wait_latch(self, seconds: float) -> bool:
        latch = self._latch
        if self._finished or latch is None:  # no latch: done at construction
            return True
        if not latch.acquire(timeout=seconds):
            return False
        latch.release()  # the next waiter passes too
        return True

    def wait(self, timeout: Any = None) -> bool:
        """Block until done; raise the collective's error or CGXTimeoutError."""
        if self._finished:
            if self._exception is not None:
                raise self._exception
            return True
        limit = wait_seconds(timeout) or self._timeout
        end = time.monotonic() + limit
        bridge = self._bridge
        if bridge is not None and not self._finished:
            bridge.wait(limit)  # completes here: no completion-thread hop
        if not self._wait_latch(max(end - time.monotonic(), 0.0)):
            raise CGXTimeoutError(
                f"cgx {self._what} did not complete within {limit:.3g} s (the process "
                "group's timeout, or the wait's): timeout of a peer that is dead or silent"
            )
        if self._exception is not None:
            raise self._exception
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        future = self._future
        if future is None:  # made on demand (completed, for a work done at construction)
            future = torch.futures.Future()
            if self._finished and self._exception is not None:
                future.set_exception(self._exception)
            elif self._finished:
                future.set_result(self._value)
            self._future = future
        return future

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._exception is None

    def exception(self) -> BaseException | None:
        return self._exception

    def result(self) -> Any:
        self.wait()
        return self.get_future().value()

    def synchronize(self) -> None:
        # Results are written by the engine before the future completes (CPU), or on
        # a stream it has synchronized (CUDA): nothing to order here.
        return None

    def __repr__(self) -> str:
        state = "done" if self._finished else "pending"
        return f"CGXWork({self._what}, {state})"
