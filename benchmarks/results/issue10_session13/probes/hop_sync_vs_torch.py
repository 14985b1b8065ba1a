# ruff: noqa: SLF001
"""Probe (not a command), issue 10 session 13: see ../README.md. Run as
``python PROBE 0 & python PROBE 1`` from the repository root (2 ranks, TCPStore on loopback)."""

import datetime
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from cgx_ucx.config import CompressionConfig
from cgx_ucx.torch import ops

rank, world = int(sys.argv[1]), 2
store = dist.TCPStore(
    "127.0.0.1", 29611, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
)
dist.init_process_group(
    "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
)
pg = dist.group.WORLD
sync = pg.communicator
bits = int(os.environ.get("BITS", "32"))
cfg = CompressionConfig(bits=bits, minimal_size=16)
pg.compression = cfg
x = torch.randn(1024)
arr = x.numpy()
AVG = dist.ReduceOp.AVG
opts = dist.AllreduceOptions()
opts.reduceOp = AVG
lay = ops._one_layer(1024, cfg if bits < 32 else None)
cases = [
    ("sync bits", lambda: sync.allreduce(arr, "avg", bits=bits).result()),
    (
        "sync layout",
        lambda: sync.allreduce(
            arr, "avg", layout=lay, stochastic=cfg.stochastic, seed=cfg.seed
        ).result(),
    ),
    ("pg.allreduce.wait", lambda: pg.allreduce([x], opts).wait()),
    ("dist.all_reduce", lambda: dist.all_reduce(x, op=AVG)),
]
for _rep in range(2):
    for name, fn in cases:
        for _ in range(50):
            fn()
        s = []
        for _ in range(400):
            t0 = time.perf_counter()
            fn()
            s.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"{name:20s} median {np.median(s) * 1e6:7.1f} us")
dist.destroy_process_group()
