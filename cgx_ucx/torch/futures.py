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
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["completion_executor", "to_torch_future"]

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


def _complete(
    src: concurrent.futures.Future[Any],
    dst: torch.futures.Future[T],
    finish: Callable[[Any], T],
    done: Callable[[BaseException | None], None] | None,
) -> None:
    try:
        exc = src.exception()
        if exc is None:
            value = finish(src.result())
    except BaseException as err:  # cancellation, or a failing finish()
        exc = err
    try:
        if exc is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(value)
    finally:
        if done is not None:
            done(exc)


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
    dst: torch.futures.Future[T] = torch.futures.Future()
    pool = completion_executor()

    def _on_done(f: concurrent.futures.Future[Any]) -> None:
        try:
            pool.submit(_complete, f, dst, finish, done)
        except RuntimeError:  # pool shut down at interpreter exit: complete inline
            _complete(f, dst, finish, done)

    src.add_done_callback(_on_done)
    return dst
