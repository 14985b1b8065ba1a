"""The progress driver's spin policy (``CGX_UCX_SPIN``): parsing, the host-load probe, and
collectives completing the same under each mode (the speed is the contention benchmark's)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from harness import run_ranks

from cgx_ucx.errors import ConfigError
from cgx_ucx.transport import progress


@pytest.mark.parametrize(
    ("raw", "mode"),
    [("", "auto"), ("auto", "auto"), (" AUTO ", "auto"), ("1", "1"), ("on", "1"), ("0", "0")],
)
def test_spin_mode_values(raw: str, mode: str) -> None:
    assert progress.spin_mode({progress.ENV_SPIN: raw}) == mode
    assert progress.spin_mode({}) == "auto"


def test_bad_spin_mode_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="CGX_UCX_SPIN='fast'"):
        progress.spin_mode({progress.ENV_SPIN: "fast"})


def test_runnable_threads_counts_at_least_this_one() -> None:
    n = progress.runnable_threads()
    assert n is not None and n >= 1


async def _allreduce_under_mode(ctx) -> tuple[float, int]:
    from cgx_ucx import connect

    comm = await connect(ctx.store, ctx.rank, ctx.world_size)
    try:
        worst = 0.0
        for n in (1000, 300_000):  # oneshot and SRA
            for _ in range(5):
                x = np.arange(n, dtype=np.float32) * (ctx.rank + 1)
                await comm.allreduce(x)
                want = np.arange(n, dtype=np.float32) * sum(range(1, ctx.world_size + 1))
                worst = max(worst, float(np.max(np.abs(x - want))))
        drv = progress.driver(asyncio.get_running_loop())
        return worst, drv.wakeups if drv is not None else -1
    finally:
        await comm.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["0", "1", "auto"])
def test_collectives_complete_under_every_spin_mode(mode: str) -> None:
    results = run_ranks(_allreduce_under_mode, 2, env={progress.ENV_SPIN: mode}, timeout=100)
    for worst, wakeups in results:
        assert worst == 0.0
        assert wakeups > 0


async def _connect_only(ctx) -> str:
    from cgx_ucx import connect

    try:
        comm = await connect(ctx.store, ctx.rank, ctx.world_size)
    except ConfigError as exc:
        return str(exc)
    await comm.close()
    return "connected"


@pytest.mark.timeout(60)
def test_bad_spin_mode_fails_connect_on_every_rank() -> None:
    results = run_ranks(_connect_only, 2, env={progress.ENV_SPIN: "sometimes"}, timeout=50)
    for text in results:
        assert "CGX_UCX_SPIN" in text, text


def test_host_oversubscribed_follows_the_runnable_count(monkeypatch) -> None:
    cores = progress._CORES
    for runnable, busy in [
        (1, False),
        (progress.RUNNABLE_PER_CORE * cores + 1, True),
        (None, False),
    ]:
        monkeypatch.setattr(progress, "runnable_threads", lambda n=runnable: n)
        monkeypatch.setattr(progress, "_load", [-1.0, not busy])  # force a re-read
        assert progress.host_oversubscribed() is busy
        assert progress.host_oversubscribed() is busy  # cached within LOAD_PERIOD_S


def test_no_spare_core_once_the_job_has_more_ranks_here_than_cores(monkeypatch) -> None:
    monkeypatch.setattr(progress, "runnable_threads", lambda: 1)
    monkeypatch.setattr(progress, "_load", [-1.0, False])
    monkeypatch.setattr(progress, "_crowded", [False])
    assert not progress.no_spare_core()
    cores = progress.usable_cores()
    progress.share_cores(cores)
    assert not progress.no_spare_core()
    progress.share_cores(cores + 1)
    assert progress.no_spare_core()
    assert not progress.host_oversubscribed()  # the progress driver still spins
    progress.share_cores(1)
    assert not progress.no_spare_core()


async def _crowded_after_connect(ctx) -> tuple[bool, float]:
    import os

    from cgx_ucx import connect

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this job's ranks: one core
    comm = await connect(ctx.store, ctx.rank, ctx.world_size)
    try:
        x = np.arange(300_000, dtype=np.float32)
        await comm.allreduce(x, bits=4)  # pieces encoded inline: no codec thread
        err = float(np.max(np.abs(x - 2 * np.arange(300_000, dtype=np.float32))))
        return progress.no_spare_core(), err / 300_000
    finally:
        await comm.close()


@pytest.mark.timeout(60)
def test_connect_notes_ranks_that_share_fewer_cores() -> None:
    for crowded, rel in run_ranks(_crowded_after_connect, 2, timeout=50):
        assert crowded
        assert rel < 0.01  # 4-bit max error, relative to the range
