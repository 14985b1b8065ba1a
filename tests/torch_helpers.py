"""Torch jobs on the one harness (``harness.run_ranks``): a torch Store per job and the
usual process-group set-up.

``run_torch_ranks(fn, world, args=(...))`` runs ``fn(rank, world, store, *args)`` on
``world`` spawned ranks, where ``store`` is a ``torch.distributed.FileStore`` shared by
the job; spawning, the shared deadline, tracebacks and ``expect_dead`` are the harness's.
A default process group left open by ``fn`` is destroyed after the rank has reported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from harness import DEAD_EXIT, RankContext, run_ranks

__all__ = ["DEAD_EXIT", "join_cgx_with_gloo", "run_torch_ranks"]


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _torch_rank(ctx: RankContext, fn: Callable[..., Any], args: tuple) -> Any:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share the machine's cores
    ctx.after_report(_destroy_default_group)
    store = dist.FileStore(os.path.join(ctx.shared_dir, "torch_store"), ctx.world_size)
    return fn(ctx.rank, ctx.world_size, store, *args)


def run_torch_ranks(
    fn: Callable[..., Any],
    world: int,
    *,
    args: tuple = (),
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    expect_dead: Iterable[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world, store, *args)`` on ``world`` spawned ranks; return their values.

    ``expect_dead``: ranks that end with ``os._exit(DEAD_EXIT)`` on purpose (their value
    is None). Raises ``harness.RankFailed`` with every child's traceback if any rank
    raises, and ``harness.RanksTimedOut`` (the job killed) when ``timeout`` (seconds, for
    the whole job) runs out.
    """
    return run_ranks(
        _torch_rank,
        world,
        args=(fn, tuple(args)),
        timeout=timeout,
        env=env,
        expect_dead=expect_dead,
    )


def join_cgx_with_gloo(rank: int, world: int, store: Any) -> Any:
    """In a rank of :func:`run_torch_ranks`: join the default "cgx" process group (60 s
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
