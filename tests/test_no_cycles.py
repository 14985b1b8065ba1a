"""No reference cycle holds a user's tensor, or anything sized like it, after its work
completes.

Python's cyclic collector runs on counts of objects, not bytes: a tensor kept alive by a
cycle stays in memory until the collector happens to run, so a loop that all-reduces
fresh tensors would hold gigabytes. Each rank runs with the collector disabled and checks
that (a) a tensor is freed by reference counting as soon as the caller drops it, and
(b) the operation left nothing behind that only the collector could free: no tensor, no
array, no future, no task and no object of cgx_ucx in the unreachable set.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from torch_helpers import run_torch_ranks

#: Sizes: a mailbox-path call (4 KiB) and one that goes through the engine loop (4 MiB).
NUMELS = (1024, 1 << 20)
#: Seconds a completion thread gets to drop its frame's references to a finished work.
SETTLE_S = 2.0


def _garbage_kinds() -> list[str]:
    """Type names of what the cyclic collector finds unreachable now and that a
    collective must never leave there (tensors, arrays, futures, tasks, cgx_ucx objects)."""
    import asyncio
    import concurrent.futures
    import gc

    import numpy as np
    import torch

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    kept_kinds = (
        torch.Tensor,
        np.ndarray,
        concurrent.futures.Future,
        asyncio.Future,
        torch.futures.Future,
    )
    kinds = []
    for obj in found:
        typ = type(obj)
        if isinstance(obj, kept_kinds) or typ.__module__.startswith("cgx_ucx"):
            kinds.append(f"{typ.__module__}.{typ.__qualname__}")
    return sorted(set(kinds))


def _check(name: str, make: Any, failures: dict[str, Any]) -> None:
    """Run ``make()`` (which returns the user's tensors after the op completed), drop
    them, and record what survived: a live weakref or cyclic garbage."""
    import gc
    import time
    import weakref

    gc.collect()
    tensors = make()
    refs = [weakref.ref(t) for t in tensors]
    del tensors
    # A completion thread may still be returning from the callback that completed the
    # work: its frame's references go by reference counting within moments.
    end = time.monotonic() + SETTLE_S
    while any(r() is not None for r in refs) and time.monotonic() < end:
        time.sleep(0.001)
    alive = sum(r() is not None for r in refs)
    kinds = _garbage_kinds()
    if alive or kinds:
        failures[name] = {"alive": alive, "garbage": kinds}


def _ops_job(rank: int, world: int, store: Any) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist

    import cgx_ucx.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("cgx", store=store, rank=rank, world_size=world)
    peer = 1 - rank
    failures: dict[str, Any] = {}

    def all_reduce(numel: int, async_op: bool, future: bool) -> list[Any]:
        t = torch.randn(numel)
        work = dist.all_reduce(t, async_op=async_op)
        if future:
            work.get_future().wait()
        elif work is not None:
            work.wait()
        return [t]

    def reduce_scatter(numel: int) -> list[Any]:
        src = torch.randn(numel * world)
        out = torch.empty(numel)
        dist.reduce_scatter_tensor(out, src)
        return [src, out]

    def all_gather(numel: int) -> list[Any]:
        src = torch.randn(numel)
        out = torch.empty(numel * world)
        dist.all_gather_into_tensor(out, src)
        rows = [torch.empty(numel) for _ in range(world)]
        dist.all_gather(rows, src)
        return [src, out, *rows]

    def broadcast(numel: int) -> list[Any]:
        t = torch.randn(numel)
        dist.broadcast(t, src=0)
        return [t]

    def p2p(numel: int) -> list[Any]:
        out, inp = torch.randn(numel), torch.empty(numel)
        works = [dist.isend(out, peer), dist.irecv(inp, peer)]
        for w in works:
            w.wait()
        return [out, inp]

    # Warm up every path (kernel compiles, first-call caches) before counting garbage.
    for numel in NUMELS:
        all_reduce(numel, True, True)
        reduce_scatter(numel)
        all_gather(numel)
        broadcast(numel)
        p2p(numel)
    gc.collect()
    gc.disable()
    try:
        for numel in NUMELS:
            _check(f"all_reduce {numel}", lambda n=numel: all_reduce(n, False, False), failures)
            _check(
                f"all_reduce async {numel}", lambda n=numel: all_reduce(n, True, False), failures
            )
            _check(
                f"all_reduce future {numel}", lambda n=numel: all_reduce(n, True, True), failures
            )
            _check(f"reduce_scatter {numel}", lambda n=numel: reduce_scatter(n), failures)
        for numel in NUMELS:
            _check(f"all_gather {numel}", lambda n=numel: all_gather(n), failures)
            _check(f"broadcast {numel}", lambda n=numel: broadcast(n), failures)
            _check(f"p2p {numel}", lambda n=numel: p2p(n), failures)
    finally:
        gc.enable()
    return failures


def _training_job(rank: int, world: int, store: Any) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx_ucx.torch import CGXState, GradientSync, cgx_hook

    dist.init_process_group("cgx", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    failures: dict[str, Any] = {}

    def model() -> Any:
        return torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
        )

    def ddp_steps() -> list[Any]:
        net = DDP(model())
        net.register_comm_hook(CGXState(None, compression_params={"bits": 4}), cgx_hook)
        for _ in range(2):
            net(torch.randn(8, 256)).sum().backward()
        return [p.grad for p in net.parameters()]

    def grad_sync_steps() -> list[Any]:
        net = model()
        sync = GradientSync(net, compression_params={"bits": 4})
        for _ in range(2):
            net(torch.randn(8, 256)).sum().backward()
            sync.synchronize()
        grads = [p.grad for p in net.parameters()]
        sync.remove()
        return grads

    ddp_steps()
    grad_sync_steps()
    gc.collect()
    gc.disable()
    try:
        _check("GradientSync", grad_sync_steps, failures)
        # DDP's reducer is torch's own; what must not survive is ours (futures, buffers).
        _check("DDP cgx_hook", ddp_steps, failures)
    finally:
        gc.enable()
    return failures


@pytest.mark.parametrize("bits", [32, 4])
def test_ops_leave_no_cycles(bits: int) -> None:
    env = {"CGX_COMPRESSION_QUANTIZATION_BITS": str(bits)}
    results = run_torch_ranks(_ops_job, 2, timeout=180, env=env)
    assert results == [{}, {}]


def test_training_hooks_leave_no_cycles() -> None:
    results = run_torch_ranks(_training_job, 2, timeout=180)
    assert results == [{}, {}]
