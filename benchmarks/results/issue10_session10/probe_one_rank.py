"""Probe (session 10): one rank of a real ``cgx`` group, per-call time at 4 KiB for
dist.all_reduce (torch), the engine's sync face, the asyncio core, and a no-op hop."""

import asyncio
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import cgx_ucx  # noqa: F401  (registers the backend)
from cgx_ucx.config import CompressionConfig


def median_us(fn, n=2000):
    for _ in range(50):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


dist.init_process_group("cgx", store=dist.FileStore(f"/tmp/probe_fs{os.getpid()}", 1), rank=0,
                        world_size=1)  # fmt: skip
pg = dist.group.WORLD
sync = pg.communicator
comm, engine = sync.comm, sync.engine
pg.compression = CompressionConfig(bits=32, minimal_size=16)
x = torch.randn(1024)
arr = x.numpy()


async def noop():
    return None


async def core(n=2000):
    ts = []
    for _ in range(n + 50):
        t0 = time.perf_counter()
        await comm.allreduce(arr, "avg", bits=32)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts[50:])) * 1e6


print(f"torch {median_us(lambda: dist.all_reduce(x, op=dist.ReduceOp.AVG)):.1f} us")
print(f"sync  {median_us(lambda: sync.allreduce(arr, 'avg', bits=32).result()):.1f} us")
print(f"core  {engine.run(core()):.1f} us")
hop = median_us(lambda: asyncio.run_coroutine_threadsafe(noop(), engine.loop).result())
print(f"no-op hop {hop:.1f} us")
dist.destroy_process_group()
