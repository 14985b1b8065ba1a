"""Parallel runs of the host codec kernels: the calling thread and helper threads share
the chunks of one large call (:func:`run_chunks`); :func:`set_num_threads` bounds them.

The caller and up to threads-1 helper threads take batches of chunks from a shared cursor
and run the GIL-free kernels on them. Not Numba's prange: a prange region ends in a
barrier that waits for every OpenMP thread, and on a host shared with busy processes a
thread that is not scheduled stalls each call by scheduler time slices (small encodes
became orders of magnitude slower on a loaded host). Here a helper that has not started
yet finds the work done and touches nothing, so the caller waits at most for batches
already running. GNU OpenMP is also not fork-safe; plain threads are.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable

from ..arrays import check_positive_int

__all__ = [
    "BATCH_VALUES",
    "PARALLEL_MIN_NUMEL",
    "num_threads",
    "run_chunks",
    "set_num_threads",
    "share_threads",
    "threads_chosen",
]

#: Below this many values a call stays on the calling thread: handing batches to a helper
#: thread (submit, wake-up, GIL hand-off) costs about as much as encoding this many values
#: on one core, so smaller calls gain nothing from helpers (measured, not guessed).
PARALLEL_MIN_NUMEL = 1 << 18

#: Values per batch: enough work on one core that the cursor (a lock and a Numba call per
#: batch) costs a few percent of it, while batches stay small enough to share evenly.
BATCH_VALUES = 1 << 17

_threads: int | None = None  # None: every core this process may use
_chosen = False  # the count is set_num_threads()'s, not share_threads()'s
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def set_num_threads(n: int | None) -> None:
    """Threads a large encode/decode may use (the caller's included); None: all cores.

    On a host shared with other busy processes (several ranks per host, or torch's own
    threads during backward) give each rank ``cores // local_ranks``; 1 keeps every call
    on the calling thread.
    """
    global _threads, _chosen
    _threads = None if n is None else check_positive_int(n, "codec threads")
    _chosen = _threads is not None


def share_threads(n: int) -> None:
    """The count the engine shares out to each rank of a host where the user chose none
    (:func:`threads_chosen` stays False, so the next job's connect shares again: a rank
    whose process group is re-formed with more or fewer ranks on its host follows them)."""
    global _threads
    if not _chosen:
        _threads = check_positive_int(n, "codec threads")


def threads_chosen() -> bool:
    """Whether :func:`set_num_threads` chose a thread count (else: every core, or the
    engine's share of them, :func:`share_threads`)."""
    return _chosen


def num_threads() -> int:
    """Threads a large call uses: set_num_threads(), else the cores this process may use."""
    return _threads if _threads is not None else _available_cores()


def _helpers(count: int) -> concurrent.futures.ThreadPoolExecutor:
    """The helper threads (created on first use, grown when more are asked for)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < count:
            old = _pool
            _pool = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="cgx-codec")
            _pool_size = count
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _forget_pool_in_child() -> None:  # its threads do not exist after fork
    global _pool, _pool_size
    _pool, _pool_size = None, 0


os.register_at_fork(after_in_child=_forget_pool_in_child)


class _Batches:
    """A shared cursor over chunks [0, nchunks), taken ``batch`` chunks at a time."""

    def __init__(self, run: Callable[[int, int], None], nchunks: int, batch: int) -> None:
        self.run, self.nchunks, self.batch = run, nchunks, batch
        self.cursor = 0
        self.active = 0
        self.closed = False
        self.error: BaseException | None = None
        self.cv = threading.Condition()

    def work(self) -> None:
        while True:
            with self.cv:
                if self.closed or self.cursor >= self.nchunks:
                    return
                c0 = self.cursor
                self.cursor = c1 = min(c0 + self.batch, self.nchunks)
                self.active += 1
            try:
                self.run(c0, c1)
            except BaseException as exc:  # re-raised on the caller's thread
                self.error = self.error or exc
            finally:
                with self.cv:
                    self.active -= 1
                    self.cv.notify_all()

    def finish(self) -> None:
        """Close the cursor and wait only for the batches that are running.

        The wait is bounded by one batch of kernel work (no I/O, no other dependency).
        """
        with self.cv:
            self.closed = True
            while self.active:
                self.cv.wait()
        if self.error is not None:
            raise self.error


def run_chunks(run: Callable[[int, int], None], n: int, nchunks: int, chunk_values: int) -> None:
    """``run(c0, c1)`` over all chunks: on this thread, or shared with helper threads."""
    threads = min(num_threads(), nchunks)
    if threads <= 1 or n < PARALLEL_MIN_NUMEL:
        run(0, nchunks)
        return
    batches = _Batches(run, nchunks, max(1, BATCH_VALUES // chunk_values))
    pool = _helpers(threads - 1)
    for _ in range(threads - 1):
        pool.submit(batches.work)
    batches.work()
    batches.finish()
