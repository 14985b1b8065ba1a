"""A closed progress driver leaves nothing on its event loop that refers to it: no
pending ``call_soon`` of its run, no timer, no reader. Otherwise the driver, and with it
the UCX worker it drives, lives until that loop runs again, which a loop kept only for
later communicators may never do."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref

import pytest

from cgx_ucx.transport import progress


class _Worker:
    """Stands in for a UCXX worker: an event descriptor, progress() and arm()."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        self.epoll_file_descriptor = self._r
        self.progressed = 0

    def progress(self) -> None:
        self.progressed += 1

    def arm(self) -> bool:
        return True

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


@pytest.fixture
def loop_and_worker():
    loop = asyncio.new_event_loop()
    worker = _Worker()
    gc_was = gc.isenabled()
    gc.disable()  # freed by reference counts alone, as the driver's worker must be
    try:
        yield loop, worker
    finally:
        if gc_was:
            gc.enable()
        loop.close()
        worker.close()


def _refers_to(handle: asyncio.Handle, drv: progress.Progress) -> bool:
    callback = getattr(handle, "_callback", None)
    return getattr(callback, "__self__", None) is drv


def test_close_with_a_run_pending_frees_the_driver(loop_and_worker) -> None:
    loop, worker = loop_and_worker
    drv = progress.Progress(worker, loop)  # its constructor queues a run (kick)
    assert drv._scheduled
    drv.close()
    assert not drv._scheduled
    pending = list(loop._ready) + list(loop._scheduled)
    assert not any(_refers_to(h, drv) for h in pending)
    ref = weakref.ref(drv)
    del drv
    assert ref() is None, gc.get_referrers(ref())
    assert worker.progressed == 0  # the loop never ran


def test_close_with_a_run_and_a_timer_pending_frees_the_driver(loop_and_worker) -> None:
    loop, worker = loop_and_worker
    drv = progress.Progress(worker, loop)
    # One iteration: the queued run progresses the worker and arms the safety timer.
    loop.run_until_complete(asyncio.sleep(0))
    assert worker.progressed == 1 and drv._timer is not None
    drv.kick()  # a run queued again (a request posted), then closed before it runs
    drv.close()
    ref = weakref.ref(drv)
    del drv
    assert ref() is None
    assert worker.progressed == 1


def test_kick_after_close_queues_nothing(loop_and_worker) -> None:
    loop, worker = loop_and_worker
    drv = progress.Progress(worker, loop)
    drv.close()
    before = len(loop._ready)
    drv.kick()
    assert len(loop._ready) == before and not drv._scheduled


def test_close_cancels_a_run_queued_before_the_reader_ran_the_driver(loop_and_worker) -> None:
    loop, worker = loop_and_worker
    drv = progress.Progress(worker, loop)  # a run queued
    drv._run()  # the worker's descriptor became readable first: the reader ran it
    drv.kick()  # a request posted: a second run queued behind the first
    assert sum(_refers_to(h, drv) for h in loop._ready) == 2
    drv.close()
    assert not any(_refers_to(h, drv) for h in list(loop._ready) + list(loop._scheduled))
    ref = weakref.ref(drv)
    del drv
    assert ref() is None


def test_queued_runs_still_run_in_order(loop_and_worker) -> None:
    loop, worker = loop_and_worker
    drv = progress.Progress(worker, loop)
    drv._run()
    drv.kick()
    loop.run_until_complete(asyncio.sleep(0))
    assert worker.progressed == 3 and not drv._soon
    drv.close()
