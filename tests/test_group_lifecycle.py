"""Process groups made and destroyed on the ``cgx`` backend: creation order checked
across ranks, nothing left behind by a destroyed group."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import pytest

pytest.importorskip("torch")

from torch_helpers import run_torch_ranks

#: The orders each rank calls new_group in (rank 2 agrees with rank 0).
_ORDERS = {0: ([0, 1], [1, 2]), 1: ([1, 2], [0, 1]), 2: ([0, 1], [1, 2])}


def _groups_in_another_order(rank: int, world: int, store: Any) -> dict[str, Any]:
    import datetime

    import torch.distributed as dist

    import cgx_ucx.torch  # noqa: F401  (registers the backend)
    from cgx_ucx.errors import CollectiveMismatchError

    # A connect timeout far above the bound the test sets on the error.
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("cgx", store=store, rank=rank, world_size=world, timeout=timeout)
    start = time.monotonic()
    for ranks in _ORDERS[rank]:
        try:
            dist.new_group(ranks)
        except CollectiveMismatchError as exc:
            return {"seconds": time.monotonic() - start, "error": str(exc), "ranks": ranks}
    return {"seconds": time.monotonic() - start, "error": None, "ranks": None}


@pytest.mark.timeout(60)
def test_new_group_in_different_orders_raises_a_mismatch_on_every_rank() -> None:
    """Rank 0 makes groups [0, 1] then [1, 2], rank 1 [1, 2] then [0, 1]: every rank
    raises CollectiveMismatchError within 5 s, on the first group it is a member of,
    naming the ranks each side gave the group."""
    results = run_torch_ranks(_groups_in_another_order, 3, timeout=55)
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} made its groups without an error"
        assert res["seconds"] < 5.0, (rank, res)
        assert "different orders" in res["error"], res["error"]
    assert results[0]["ranks"] == [0, 1]
    assert "ranks [0, 1] on global rank 0 and ranks [1, 2] on global rank 1" in results[0]["error"]
    assert results[1]["ranks"] == [1, 2]
    assert results[2]["ranks"] == [1, 2]
    # Whichever of ranks 1 and 2 reads the other's entry first names the pair.
    either = (
        "group 1 on global rank 1 and group 2 on global rank 2",
        "group 2 on global rank 2 and group 1 on global rank 1",
    )
    text = results[1]["error"] + results[2]["error"]
    assert any(pair in text for pair in either), text


def _compile_threads() -> int:
    """Threads no group leaves behind: the host codec's compile thread (one per process,
    started the first time a kernel is due, compression.kernels) and the staging release
    thread (one per process, started by the first call that stages memory)."""
    import threading

    return sum(t.name in ("cgx-compile", "cgx-staging-release") for t in threading.enumerate())


def _usage() -> tuple[int, int, int, int]:
    """This process's open descriptors, sockets among them, threads (but the codec's
    compile thread), and RSS in KiB."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):  # the descriptor listdir used, closed since
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    threads = len(os.listdir("/proc/self/task")) - _compile_threads()
    return len(fds), sockets, threads, rss


def _groups_made_and_destroyed(rank: int, world: int, store: Any, rounds: int) -> Any:
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    import cgx_ucx.torch  # noqa: F401  (registers the backend)

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("cgx", store=store, rank=rank, world_size=world, timeout=timeout)

    def one_round() -> None:
        group = dist.new_group([0, 1])
        t = torch.ones(4)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [2.0] * 4
        dist.destroy_process_group(group)

    warm = 10  # first-use costs (UCX, codec, caches) land before the baseline
    for _ in range(warm):
        one_round()
    gc.collect()
    before = _usage()
    for _ in range(rounds - warm):
        one_round()
    gc.collect()
    return before, _usage()


@pytest.mark.timeout(150)
def test_groups_made_and_destroyed_leave_nothing_behind() -> None:
    """200 groups made, used once and destroyed on 2 ranks: open descriptors (sockets:
    each group's listener) and threads stay flat, RSS within a small bound."""
    rounds = 200
    for rank, (before, after) in enumerate(
        run_torch_ranks(_groups_made_and_destroyed, 2, args=(rounds,), timeout=140)
    ):
        fds, sockets, threads, rss = before
        fds_after, sockets_after, threads_after, rss_after = after
        assert fds_after <= fds + 2, f"rank {rank}: descriptors {before} -> {after}"
        assert sockets_after <= sockets, f"rank {rank}: sockets {before} -> {after}"
        assert threads_after <= threads, f"rank {rank}: threads {before} -> {after}"
        assert rss_after - rss < 32 * 1024, f"rank {rank}: RSS {rss} -> {rss_after} KiB"
