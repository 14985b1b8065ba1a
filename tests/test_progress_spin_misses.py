"""The progress driver's spin after a completion: kept while completions come densely
(shared-memory fragments), given up once spins keep finding nothing (a slow link's
pieces), and taken up again when completions come densely again."""

from __future__ import annotations

import asyncio

import pytest
from test_progress_close import _Worker

from cgx_ucx.transport import progress


class _Request:
    def __init__(self) -> None:
        self.completed = False

    def check_error(self) -> None:
        pass


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.setattr(progress, "host_oversubscribed", lambda: False)
    loop = asyncio.new_event_loop()
    worker = _Worker()
    drv = progress.Progress(worker, loop)
    drv._spin_mode = "auto"
    try:
        yield loop, drv
    finally:
        drv.close()
        loop.close()
        worker.close()


def _spin_windows_opened(loop, drv, gaps_s: list[float]) -> list[bool]:
    """Keep one request due; complete another after each gap. For each completion:
    whether a spin window opened right after it."""
    loop.run_until_complete(asyncio.sleep(0))
    drv.submit(_Request(), None)  # stays due: the driver has something to wait for
    opened = []
    for gap in gaps_s:
        req = _Request()
        drv.submit(req, None)
        loop.run_until_complete(asyncio.sleep(gap))
        req.completed = True
        drv._run()
        opened.append(drv._active_until > loop.time())
    return opened


def test_sparse_completions_stop_spinning_after_spin_misses(driver):
    loop, drv = driver
    gaps = [4 * progress.SPIN_S] * (progress.SPIN_MISSES + 3)
    opened = _spin_windows_opened(loop, drv, gaps)
    # Each post opens a window that ends fruitless before its request completes; after
    # SPIN_MISSES of them, a sparse completion no longer opens one.
    assert opened[-2:] == [False, False], opened
    assert opened[0] is True


def test_dense_completions_keep_spinning(driver):
    loop, drv = driver
    sparse = [4 * progress.SPIN_S] * (progress.SPIN_MISSES + 2)
    dense = [progress.SPIN_S / 10] * 4
    opened = _spin_windows_opened(loop, drv, sparse + dense)
    assert opened[len(sparse) - 1] is False
    assert all(opened[len(sparse) + 1 :]), opened


def test_where_no_core_is_spare_only_node_local_transfers_make_it_spin(driver, monkeypatch):
    """With more ranks than cores here, a transfer with a peer on another node waits for
    the network's events instead of spinning; one with a node-local peer (shared memory
    signals no event for a rendezvous step) still spins."""
    loop, drv = driver
    loop.run_until_complete(asyncio.sleep(0))
    monkeypatch.setattr(progress, "_crowded", [True])
    remote = _Request()
    drv.submit(remote, None, remote=True)
    assert drv._due == 1 and not drv._may_spin()
    local = _Request()
    drv.submit(local, None)
    assert drv._may_spin()
    local.completed = True
    drv._run()
    assert drv._due == 1 and not drv._may_spin()
    monkeypatch.setattr(progress, "_crowded", [False])
    assert drv._may_spin()  # a spare core: spin for the network too
    remote.completed = True
    drv._run()
    assert drv._due == 0 and drv._due_local == 0


def test_a_signaled_node_local_request_waits_for_events_where_no_core_is_spare(driver, monkeypatch):
    """A node-local receive small enough to arrive in eager fragments (a frame header,
    inline payload included) raises an event on arrival: with more ranks than cores it
    does not make the driver spin, and it still ends a hold of the descriptor (it counts
    as node-local); a larger node-local transfer spins as before."""
    loop, drv = driver
    loop.run_until_complete(asyncio.sleep(0))
    monkeypatch.setattr(progress, "_crowded", [True])
    header = _Request()
    drv.submit(header, None, signaled=True)
    assert drv._due == 1 and drv._due_local == 1 and not drv._may_spin()
    payload = _Request()
    drv.submit(payload, None)
    assert drv._may_spin()
    payload.completed = True
    drv._run()
    assert drv._due == 1 and not drv._may_spin()
    header.completed = True
    drv._run()
    assert drv._due == drv._due_local == drv._due_silent == 0


def test_header_receives_count_as_signaled():
    from cgx_ucx.transport import frames

    assert frames.RECV_NBYTES <= progress.SIGNALED_RECV_NBYTES
