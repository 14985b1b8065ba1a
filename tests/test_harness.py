"""The spawned multi-process harness itself (``harness.run_ranks``) and its torch layer
(``torch_helpers.run_torch_ranks``): values come back, child tracebacks reach the parent,
one deadline kills the whole job, expected deaths are told apart from crashes."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
from harness import DEAD_EXIT, RankFailed, RanksTimedOut, run_ranks


def _echo(ctx: Any, tag: str) -> tuple[int, int, str, str | None]:
    ctx.store.set(f"k{ctx.rank}", str(ctx.rank))
    ctx.store.wait([f"k{r}" for r in range(ctx.world_size)])
    return ctx.rank, ctx.world_size, tag, os.environ.get("CGX_TEST_RANK_ENV")


async def _async_sum(ctx: Any) -> int:
    total = ctx.store.add("sum", ctx.rank + 1)
    await asyncio.sleep(0)
    ctx.store.wait(["sum"])
    return total


def _raise_on_one(ctx: Any) -> None:
    if ctx.rank == 1:
        raise ValueError("boom from rank one")


def _sleep(ctx: Any) -> None:
    time.sleep(60)


def _die_on_one(ctx: Any, code: int) -> str:
    if ctx.rank == 1:
        os._exit(code)
    return "alive"


def _unpicklable(ctx: Any) -> Any:
    return threading.Lock()


@pytest.mark.timeout(60)
def test_runner_returns_values_with_env_per_rank() -> None:
    got = run_ranks(
        _echo, 2, args=("t",), timeout=50, env=lambda r: {"CGX_TEST_RANK_ENV": f"env{r}"}
    )
    assert got == [(0, 2, "t", "env0"), (1, 2, "t", "env1")]


@pytest.mark.timeout(60)
def test_runner_runs_coroutines() -> None:
    assert sorted(run_ranks(_async_sum, 2, timeout=50)) in ([1, 3], [2, 3])


@pytest.mark.timeout(60)
def test_runner_forwards_child_tracebacks() -> None:
    with pytest.raises(RankFailed, match="boom from rank one") as info:
        run_ranks(_raise_on_one, 2, timeout=50)
    assert "Traceback" in str(info.value)
    results = run_ranks(_raise_on_one, 2, timeout=50, check=False)
    assert results[0].ok and results[0].exitcode == 0
    assert not results[1].ok and results[1].error_type == "ValueError"


@pytest.mark.timeout(60)
def test_runner_deadline_kills_the_job() -> None:
    t0 = time.monotonic()
    with pytest.raises(RanksTimedOut, match="still running after the 3 s deadline") as info:
        run_ranks(_sleep, 2, timeout=3)
    assert time.monotonic() - t0 < 30
    assert info.value.hung == [0, 1]


@pytest.mark.timeout(60)
def test_runner_expected_deaths() -> None:
    assert run_ranks(_die_on_one, 2, args=(DEAD_EXIT,), timeout=50, expect_dead=[1]) == [
        "alive",
        None,
    ]
    with pytest.raises(RankFailed, match=f"should have exited with {DEAD_EXIT}, got 3"):
        run_ranks(_die_on_one, 2, args=(3,), timeout=50, expect_dead=[1])
    with pytest.raises(RankFailed, match="exit code 17, no result"):
        run_ranks(_die_on_one, 2, args=(DEAD_EXIT,), timeout=50)  # not expected


@pytest.mark.timeout(60)
def test_runner_unpicklable_value_fails_in_the_child() -> None:
    with pytest.raises(RankFailed, match="cannot send the value back"):
        run_ranks(_unpicklable, 1, timeout=50)


# -- the torch layer -----------------------------------------------------------------------
def _torch_echo(rank: int, world: int, store: Any, tag: str) -> tuple[int, int, str]:
    import torch.distributed as dist

    assert isinstance(store, dist.FileStore)
    store.set(f"k{rank}", str(rank))
    store.wait([f"k{r}" for r in range(world)])
    return rank, world, tag


def _torch_raise_on_one(rank: int, world: int, store: Any) -> None:
    if rank == 1:
        raise ValueError("boom from torch rank one")


@pytest.mark.timeout(120)
def test_torch_runner_hands_a_torch_store_and_forwards_tracebacks() -> None:
    pytest.importorskip("torch")
    from torch_helpers import run_torch_ranks

    assert run_torch_ranks(_torch_echo, 2, args=("x",), timeout=50) == [(0, 2, "x"), (1, 2, "x")]
    with pytest.raises(RankFailed, match="boom from torch rank one"):
        run_torch_ranks(_torch_raise_on_one, 2, timeout=50)
