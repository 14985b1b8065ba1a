# ruff: noqa: SLF001, E402
"""Probe (not a command), issue 10 session 13: see ../README.md. Run as
``python PROBE 0 & python PROBE 1`` from the repository root (2 ranks, TCPStore on loopback)."""

import datetime
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from cgx_ucx.config import CompressionConfig
from cgx_ucx.torch import ops
from cgx_ucx.torch.work import CGXWork

rank, world = int(sys.argv[1]), 2
store = dist.TCPStore(
    "127.0.0.1", 29613, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
)
dist.init_process_group(
    "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
)
pg = dist.group.WORLD
sync = pg.communicator
cfg = CompressionConfig(bits=32, minimal_size=16)
pg.compression = cfg
x = torch.randn(1024)
AVG = dist.ReduceOp.AVG
P = time.perf_counter
rec = []
done_count = [0]
lay = ops._one_layer(1024, None)
arr = x.numpy()
from cgx_ucx.torch._convert import as_array

for it in range(600):
    t0 = P()
    stage, back = ops.staged(x)
    t1 = P()
    cf, post = ops.allreduce_into(pg._view, stage, AVG, pg.compression)
    t2 = P()
    d = cf.done()
    w = CGXWork.from_future("allreduce", 60.0, cf, lambda _: [x])
    t3 = P()
    w.wait()
    t4 = P()
    t5 = P()
    a = as_array(stage.view(-1))
    t6 = P()
    sync.allreduce(a, "avg", layout=lay, stochastic=False, seed=0).result()
    t7 = P()
    if it >= 100:
        rec.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5, t7 - t6])
        done_count[0] += d
if rank == 0:
    print(
        "staged/allreduce_into/work/wait/as_array/direct median us",
        (np.median(rec, axis=0) * 1e6).round(1),
        "mean",
        (np.mean(rec, axis=0) * 1e6).round(1),
    )
dist.destroy_process_group()
