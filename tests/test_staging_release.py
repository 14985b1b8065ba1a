"""The idle-staging release runs on one thread per process, whatever the number of pools
and for as long as calls keep coming (a thread per release would start one a second per
communicator in use), still releases once a pool goes unused, and ends once no pool is
due (a closed communicator leaves no thread behind)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cgx_ucx.collectives import staging
from cgx_ucx.collectives.staging import RELEASE_THREAD_NAME, BufferPool, size_class

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def _release_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == RELEASE_THREAD_NAME]


@pytest.fixture
def quick_release(monkeypatch):
    """A release delay of 0.1 s instead of the default's second."""
    monkeypatch.setattr(staging, "RELEASE_AFTER_S", 0.1)
    return 0.1


def _no_release_thread_within(limit_s: float) -> bool:
    end = time.monotonic() + limit_s
    while _release_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return not _release_threads()


def _idle_within(pool: BufferPool, limit_s: float) -> int:
    end = time.monotonic() + limit_s
    while pool.usage()["idle"] and time.monotonic() < end:
        time.sleep(0.01)
    return pool.usage()["idle"]


def test_calls_spanning_many_release_delays_use_one_thread(quick_release):
    """Two pools used every 20 ms for 30 release delays, then left alone: one release
    thread in all (the same one before, during and after), and both pools released."""
    pools = [BufferPool(0), BufferPool(0)]
    like = np.empty(0, np.uint8)
    seen: set[threading.Thread] = set()
    end = time.monotonic() + 30 * quick_release
    while time.monotonic() < end:
        for pool in pools:
            pool.give(pool.take(MiB, like))
        seen.update(_release_threads())
        time.sleep(quick_release / 5)
    assert all(p.usage()["idle"] == size_class(MiB) for p in pools)  # kept while in use
    for pool in pools:
        assert _idle_within(pool, 20 * quick_release) == 0
    assert len(seen) == 1, seen
    assert all(t.daemon for t in seen)
    assert _no_release_thread_within(5.0)  # nothing due: it ended


def test_a_pool_used_again_after_its_release_is_released_again(quick_release):
    pool = BufferPool(0)
    like = np.empty(0, np.uint8)
    for _ in range(3):
        pool.give(pool.take(MiB, like))
        assert len(_release_threads()) == 1
        assert _idle_within(pool, 20 * quick_release) == 0
        assert _no_release_thread_within(5.0)


def test_a_dropped_pool_is_not_kept_by_its_release(quick_release):
    import gc
    import weakref

    pool = BufferPool(0)
    pool.give(pool.take(MiB, np.empty(0, np.uint8)))  # a release is due
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None
    time.sleep(3 * quick_release)  # its deadline passes without it
    assert _no_release_thread_within(5.0)


def test_clearing_the_last_due_pool_ends_the_thread_at_once():
    """What a communicator's close does: nothing left due, no thread left when it returns."""
    pool = BufferPool(0)
    pool.give(pool.take(MiB, np.empty(0, np.uint8)))  # a release due in a second
    assert len(_release_threads()) == 1
    pool.clear()
    assert _release_threads() == []


def test_the_releaser_stops_after_a_release_in_progress():
    releaser = staging._Releaser()
    started, done = threading.Event(), threading.Event()

    class SlowPool:
        def release_if_idle(self) -> None:
            started.set()
            time.sleep(0.2)
            done.set()

    pool = SlowPool()
    releaser.schedule(pool, time.monotonic())  # type: ignore[arg-type]
    assert started.wait(5)
    releaser.stop()
    assert done.is_set() and not releaser._thread.is_alive()
    releaser.schedule(pool, time.monotonic())  # type: ignore[arg-type] - ignored once stopped
    assert not releaser._due


def test_the_release_thread_is_stopped_at_interpreter_exit():
    """A pool with a release due at exit: the thread is stopped by the exit handler
    (handlers run last registered first, so the check registered before runs after it)."""
    code = (
        "import atexit, threading\n"
        "def check():\n"
        "    alive = [t for t in threading.enumerate() if t.name == 'cgx-staging-release']\n"
        "    print('alive' if alive and alive[0].is_alive() else 'stopped')\n"
        "atexit.register(check)\n"
        "import numpy as np\n"
        "from cgx_ucx.collectives.staging import BufferPool\n"
        "pool = BufferPool(0)\n"
        "pool.give(pool.take(1 << 20, np.empty(0, np.uint8)))\n"
        "assert [t for t in threading.enumerate() if t.name == 'cgx-staging-release']\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "stopped", (out.stdout, out.stderr)


def _burst(pool: BufferPool) -> None:
    pool.give(pool.take(MiB, np.empty(0, np.uint8)))


def _paced(pauses: int, pause_s: float) -> BufferPool:
    """A pool used in bursts ``pause_s`` apart, ``pauses`` times, then once more."""
    pool = BufferPool(0)
    for _ in range(pauses):
        _burst(pool)
        time.sleep(pause_s)
    _burst(pool)
    return pool


def _idle_after(pool: BufferPool, seconds: float) -> int:
    time.sleep(seconds)
    return pool.usage()["idle"]


def test_a_loop_pausing_longer_than_the_delay_keeps_its_working_set(quick_release, monkeypatch):
    """Bursts 0.3 s apart (three times the 0.1 s delay): from the third burst on, the
    pool waits twice the pause before releasing, and still releases once calls stop."""
    monkeypatch.setattr(staging, "GAP_MIN_S", 0.05)
    pool = _paced(3, pause_s=0.3)
    assert pool.release_delay() == pytest.approx(2 * 0.3, rel=0.3)
    assert _idle_after(pool, 0.3) == size_class(MiB)  # kept across a pause like the last
    assert _idle_within(pool, 20 * quick_release) == 0


def test_a_one_off_pause_does_not_lengthen_the_delay(quick_release, monkeypatch):
    """Setting up, or an evaluation: one long pause among back-to-back calls."""
    monkeypatch.setattr(staging, "GAP_MIN_S", 0.05)
    pool = BufferPool(0)
    _burst(pool)
    time.sleep(0.4)
    for _ in range(5):
        _burst(pool)
    assert pool.release_delay() == quick_release
    assert _idle_within(pool, 20 * quick_release) == 0


def test_the_delay_is_capped(quick_release, monkeypatch):
    monkeypatch.setattr(staging, "GAP_MIN_S", 0.05)
    monkeypatch.setattr(staging, "RELEASE_MAX_S", 0.2)
    pool = _paced(3, pause_s=0.3)
    assert pool.release_delay() == 0.2
    assert _idle_within(pool, 20 * quick_release) == 0
