# ruff: noqa
"""Probe (not a command), issue 11 session 15: one rank of the 2 x 2 emulation (started by
cpu_probe.py through LinkEmulator.run_ranks, env as torchrun would set it): 70 calls of
the 64 MiB 4-bit allreduce with ``algorithm`` = argv[1] (the buffer reset every 10 calls,
outside the timing), each between two gloo barriers; prints the median wall time of the
call and the median process CPU time (all threads, time.process_time) from before the
call to after the barrier that follows it, over the last 60 calls."""

import asyncio, os, sys, time, json, datetime
import numpy as np
from cgx_ucx.bench.link_worker import _store, _env_int


async def main():
    import torch, torch.distributed as dist
    from cgx_ucx.collectives import connect

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    store = _store(rank, world, 120.0)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("gloo", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    comm = await asyncio.wait_for(connect(store, rank, world), 120)
    alg = sys.argv[1]
    x0 = np.random.default_rng(rank).standard_normal((64 << 20) // 4, dtype=np.float32)
    buf = x0.copy()
    walls, cpus = [], []
    for it in range(70):
        if it % 10 == 0:
            buf[:] = x0
        await asyncio.to_thread(dist.barrier)
        c0, t0 = time.process_time(), time.perf_counter()
        await comm.allreduce(buf, op="sum", bits=4, bucket_size=1024, algorithm=alg)
        t1, c1 = time.perf_counter(), time.process_time()
        await asyncio.to_thread(dist.barrier)
        c2 = time.process_time()  # the call's tail work (sends finishing) lands here too
        if it >= 10:
            walls.append(t1 - t0)
            cpus.append(c2 - c0)
    print(
        json.dumps(
            {
                "rank": rank,
                "wall_ms": float(np.median(walls) * 1e3),
                "cpu_ms": float(np.median(cpus) * 1e3),
            }
        ),
        flush=True,
    )
    await comm.close() if asyncio.iscoroutinefunction(getattr(comm, "close", None)) else None


asyncio.run(main())
