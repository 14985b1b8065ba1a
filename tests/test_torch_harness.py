"""Spawned multi-process runner for the torch tests, and the tests of the runner itself.

``run_ranks(fn, world, ...)`` starts ``world`` processes (multiprocessing "spawn"), each
running ``fn(rank, world, store, *args)`` with a FileStore shared by the job, under one
deadline for the whole job. A child's exception comes back as its formatted traceback
and fails the parent with every child's traceback; a job past its deadline is killed
and fails naming the ranks that did not report.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest

#: Exit code of a rank that a test kills on purpose (see ``expect_dead``).
DEAD_EXIT = 17


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    store_path: str,
    args: tuple[Any, ...],
    env: Mapping[str, str],
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # several ranks share two cores
        store = dist.FileStore(store_path, world)
        value = fn(rank, world, store, *args)
        pickle.dumps(value)  # an unpicklable value fails here, with a traceback, not in the parent
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # a failed job may leave a broken group behind
            pass


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    expect_dead: Iterable[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world, store, *args)`` on ``world`` spawned ranks; return their values.

    ``expect_dead``: ranks that end with ``os._exit(DEAD_EXIT)`` on purpose (their value
    is None). Fails with every child's traceback if any rank raises, and kills the job
    when ``timeout`` (seconds, for the whole job) runs out.
    """
    ctx = mp.get_context("spawn")
    dead = set(expect_dead)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="cgx_torch_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world, store_path, args, dict(env or {}), results),
                name=f"rank{r}",
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world - len(dead):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, ok, value = results.get(timeout=min(left, 0.5))
                    got[rank] = (ok, value)
                except queue.Empty:
                    # A rank that died without reporting (segfault, os._exit) is a failure
                    # unless expected; its peers' reports still come in until the deadline.
                    lost = [
                        r
                        for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in got and r not in dead
                    ]
                    if lost and all(p.exitcode is not None for p in procs):
                        break
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        failures = [f"--- rank {r} raised:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
        missing = [r for r in range(world) if r not in got and r not in dead]
        for r in dead:
            if procs[r].exitcode != DEAD_EXIT:
                failures.append(
                    f"--- rank {r} should have exited with {DEAD_EXIT}, got {procs[r].exitcode}"
                )
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            failures.append(f"--- ranks {missing} did not report within {timeout} s: {codes}")
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)
        return [got[r][1] if r in got else None for r in range(world)]


def join_cgx_with_gloo(rank: int, world: int, store: Any) -> Any:
    """In a rank of :func:`run_ranks`: join the default "cgx" process group (60 s
    timeout) and return a gloo group over the same ranks for reference results.

    The bits knob is dropped from the environment first so that each test's own
    configuration applies, and torch is seeded with 0 so every rank builds the same model.
    """
    import datetime

    import torch
    import torch.distributed as dist

    import cgx_ucx.torch  # noqa: F401  (registers the backend)

    os.environ.pop("CGX_COMPRESSION_QUANTIZATION_BITS", None)
    dist.init_process_group(
        "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    return gloo


# -- the runner's own tests ----------------------------------------------------------------
def _echo(rank: int, world: int, store: Any) -> tuple[int, int]:
    store.set(f"k{rank}", str(rank))
    store.wait([f"k{r}" for r in range(world)])
    return rank, world


def _raise_on_one(rank: int, world: int, store: Any) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")


def _sleep(rank: int, world: int, store: Any) -> None:
    time.sleep(60)


@pytest.mark.timeout(60)
def test_runner_returns_values() -> None:
    assert run_ranks(_echo, 2, timeout=50) == [(0, 2), (1, 2)]


@pytest.mark.timeout(60)
def test_runner_forwards_child_tracebacks() -> None:
    with pytest.raises(pytest.fail.Exception, match="boom from rank one"):
        run_ranks(_raise_on_one, 2, timeout=50)


@pytest.mark.timeout(60)
def test_runner_deadline_kills_the_job() -> None:
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not report within 3"):
        run_ranks(_sleep, 2, timeout=3)
    assert time.monotonic() - t0 < 30
