"""Session 17 probe: where a 64 MiB 4-bit allreduce of 2 ranks on one host spends its time.

``torchrun --nproc-per-node 2 codec_in_run.py`` (the asyncio core, bucket 1024, 3 warm-up
and 40 timed calls; rank 0 prints the median and the fastest call). Knobs (environment):

- ``INLINE=1``: every piece's codec work runs inline on the event loop (no codec thread);
  ``INLINE=0``: the codec thread even where the host looks oversubscribed; unset: as
  shipped (:class:`cgx_ucx.collectives.piece_codec.CodecRunner`).
- ``TIMEIT=1`` (with ``INLINE=1``): the time rank 0 spends in each codec function, in ms
  per call (all 43 calls).
- ``PROF=1``: a cProfile of rank 0's event loop over the timed calls.
"""

import asyncio
import collections
import cProfile
import os
import pstats
import time

import numpy as np

import cgx_ucx
import cgx_ucx.collectives.piece_codec as pc

CALLS = 43
spent: dict[str, float] = collections.defaultdict(float)

if os.environ.get("INLINE") == "1":
    pc.CODEC_INLINE_NUMEL = 1 << 40
elif os.environ.get("INLINE") == "0":
    pc.host_oversubscribed = lambda: False


async def _timed_run(self, numel, fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    spent[fn.__name__] += time.perf_counter() - t
    return out


if os.environ.get("TIMEIT") == "1":
    pc.CodecRunner.run = _timed_run


async def main() -> None:
    comm = await cgx_ucx.connect()
    n = (64 << 20) // 4
    x0 = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    x = x0.copy()
    for _ in range(3):
        x[...] = x0
        await comm.allreduce(x, op="sum", bits=4, bucket_size=1024)
    await comm.barrier()
    times = []
    prof = cProfile.Profile() if (os.environ.get("PROF") == "1" and comm.rank == 0) else None
    for _ in range(CALLS - 3):
        x[...] = x0
        await comm.barrier()
        if prof:
            prof.enable()
        t = time.perf_counter()
        await comm.allreduce(x, op="sum", bits=4, bucket_size=1024)
        times.append(time.perf_counter() - t)
        if prof:
            prof.disable()
    if comm.rank == 0:
        per_call = {k: round(v * 1e3 / CALLS, 2) for k, v in spent.items()}
        print(per_call, "median ms", 1e3 * float(np.median(times)), "min", 1e3 * min(times))
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    await comm.close()


asyncio.run(main())
