"""The progress driver on a slow network link: a large message that arrives a few
segments per wake-up leaves the worker's descriptor unwatched between runs, so one run
moves many segments; the message's completion is still seen within COALESCE_MAX_S, and
transfers with a node-local peer are never held back."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from test_progress_spin_misses import _Request

from cgx_ucx.transport import progress


class _LinkWorker:
    """A worker whose descriptor turns readable at every "segment" a thread writes;
    progress() takes in whatever arrived."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self.epoll_file_descriptor = self._r

    def progress(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def arm(self) -> bool:
        return True

    def segment(self) -> None:
        os.write(self._w, b"x")

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


@pytest.fixture
def link(monkeypatch):
    monkeypatch.setattr(progress, "host_oversubscribed", lambda: False)
    monkeypatch.setattr(progress, "_crowded", [True])  # no spin: events alone drive it
    loop = asyncio.new_event_loop()
    worker = _LinkWorker()
    drv = progress.Progress(worker, loop)
    drv._spin_mode = "auto"
    try:
        yield loop, worker, drv
    finally:
        drv.close()
        loop.close()
        worker.close()


def _stream(loop, worker, drv, remote: bool, seconds: float = 0.3, gap: float = 1e-4):
    """A message arriving in segments every ``gap`` for ``seconds``; returns the driver's
    runs meanwhile and how late its completion was seen."""
    req = _Request()
    fut = drv.submit(req, None, remote=remote)
    done_at = [0.0]

    def sender() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            worker.segment()
            time.sleep(gap)
        done_at[0] = time.monotonic()
        req.completed = True
        worker.segment()

    runs = drv.wakeups
    t = threading.Thread(target=sender)
    t.start()
    loop.run_until_complete(asyncio.wait_for(fut, 5))
    seen = time.monotonic()
    t.join()
    return drv.wakeups - runs, seen - done_at[0]


def test_a_slow_links_segments_are_taken_in_by_few_runs(link):
    loop, worker, drv = link
    loop.run_until_complete(asyncio.sleep(0))
    runs, late = _stream(loop, worker, drv, remote=True)
    print(f"runs {runs}, completion seen {late * 1e3:.2f} ms late")
    # ~3000 segments in 0.3 s; unwatched for up to COALESCE_MAX_S after each fruitless
    # readable run, the driver runs a few hundred times at most (twice per hold).
    assert runs < 2 * 0.3 / progress.COALESCE_MIN_S, runs
    assert late < progress.COALESCE_MAX_S + 0.05, late
    assert drv._resume is None and drv._hold == 0.0  # the completion ended the hold


def test_node_local_transfers_are_never_held_back(link):
    loop, worker, drv = link
    loop.run_until_complete(asyncio.sleep(0))
    holds = []
    unwatch = drv._unwatch
    drv._unwatch = lambda period: (holds.append(period), unwatch(period))[1]
    _stream(loop, worker, drv, remote=False, seconds=0.1)
    assert holds == [] and drv._resume is None


def test_a_node_local_header_due_beside_the_link_does_not_end_the_hold(link):
    """The two-level allreduce keeps its node's frame headers due while its pieces cross
    the network: those raise events of their own, so the link's segments are still
    taken in by few runs; a node-local header due alone is never held back."""
    loop, worker, drv = link
    loop.run_until_complete(asyncio.sleep(0))
    header = _Request()
    header_fut = drv.submit(header, None, signaled=True)
    runs, late = _stream(loop, worker, drv, remote=True)
    assert runs < 2 * 0.3 / progress.COALESCE_MIN_S, runs
    assert late < progress.COALESCE_MAX_S + 0.05, late
    holds = []
    unwatch = drv._unwatch
    drv._unwatch = lambda period: (holds.append(period), unwatch(period))[1]
    for _ in range(20):
        worker.segment()
        loop.run_until_complete(asyncio.sleep(1e-3))
    assert holds == [] and drv._resume is None
    header.completed = True
    worker.segment()
    loop.run_until_complete(asyncio.wait_for(header_fut, 5))


def test_a_silent_node_local_transfer_beside_the_link_ends_the_hold(link):
    """A node-local transfer that raises no event (larger than a frame header) is never
    held back, network transfers due beside it or not."""
    loop, worker, drv = link
    loop.run_until_complete(asyncio.sleep(0))
    payload = _Request()
    drv.submit(payload, None)
    holds = []
    unwatch = drv._unwatch
    drv._unwatch = lambda period: (holds.append(period), unwatch(period))[1]
    _stream(loop, worker, drv, remote=True, seconds=0.1)
    assert holds == [] and drv._resume is None
    payload.completed = True
    drv._run()
    assert drv._due == 0
