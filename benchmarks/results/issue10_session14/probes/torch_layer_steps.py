# ruff: noqa
"""Probe (not a command), issue 10 session 14: one 4 KiB float32 all_reduce on 2 ranks
through each layer in turns of 40 calls (15 turns): ``dist.all_reduce``, the group's
``allreduce().wait()`` through torch's C++ dispatch, the same Python method called
directly, ``allreduce_into`` alone, and the synchronous engine face with and without the
torch layer's layout. Run from the repository root:
``python PROBE 0 & python PROBE 1`` (TCPStore on 127.0.0.1:29626). See ../README.md."""

import datetime, sys, time, os
import numpy as np
import torch
import torch.distributed as dist
import cgx_ucx
from cgx_ucx.config import CompressionConfig
from cgx_ucx.torch.backend import ProcessGroupCGX

rank, world = int(sys.argv[1]), 2
store = dist.TCPStore(
    "127.0.0.1", 29626, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
)
dist.init_process_group(
    "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
)
pg = dist.group.WORLD
pg.compression = CompressionConfig(bits=32, minimal_size=16)
x = torch.randn(1024)
arr = x.numpy()
AVG = dist.ReduceOp.AVG
opts = dist.AllreduceOptions()
opts.reduceOp = AVG
sync = pg.communicator
gl = dist.new_group(backend="gloo")
P = time.perf_counter
cases = [
    ("dist.all_reduce", lambda: dist.all_reduce(x, op=AVG)),
    ("pg.allreduce.wait", lambda: pg.allreduce([x], opts).wait()),
    ("py direct", lambda: ProcessGroupCGX.allreduce(pg, [x], opts).wait()),
    ("sync", lambda: sync.allreduce(arr, "avg").result()),
    (
        "sync+layout",
        lambda: sync.allreduce(arr, "avg", layout=lay, stochastic=False, seed=0).result(),
    ),
    ("into only", lambda: into(pg._view, x, AVG, pg.compression)[0].result()),
]
from cgx_ucx.torch.ops import _one_layer, allreduce_into as into

lay = _one_layer(1024, None)
res = {n: [] for n, _ in cases}
for rep in range(15):
    for n, fn in cases:
        for _ in range(3):
            fn()
        for _ in range(40):
            t0 = P()
            fn()
            res[n].append(P() - t0)
if rank == 0:
    for n, _ in cases:
        print(f"{n:20s} {np.median(res[n]) * 1e6:7.1f}")
dist.destroy_process_group()
