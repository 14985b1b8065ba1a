# ruff: noqa
"""Probe (not a command), issue 10 session 15: 2 ranks, 4 KiB float32, the engine face
(sync.allreduce().result()), the group's Python method called directly, and
dist.all_reduce, in turns of 20 calls (3 untimed first), medians per rank. Run from the
repository root: ``python PROBE 0 & python PROBE 1`` (port 29651); for the code before a
change, the same with PYTHONPATH set to a worktree of it. See ../README.md."""

import datetime, sys, time, threading, os

rank, world = int(sys.argv[1]), 2
import numpy as np, torch, torch.distributed as dist
import cgx_ucx
from cgx_ucx.config import CompressionConfig

store = dist.TCPStore(
    "127.0.0.1", 29651, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
)
dist.init_process_group(
    "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
)
pg = dist.group.WORLD
pg.compression = CompressionConfig(bits=32, bucket_size=512, minimal_size=16)
sync = pg.communicator
t = torch.randn(1024)
a = t.numpy()
opts = dist.AllreduceOptions()
opts.reduceOp = dist.ReduceOp.AVG
AVG = dist.ReduceOp.AVG
cases = {
    "sync": lambda: sync.allreduce(a, "avg", bits=32, bucket_size=512).result(),
    "pg.py": lambda: type(pg).allreduce(pg, [t], opts).wait(),
    "dist": lambda: dist.all_reduce(t, op=AVG),
}
res = {k: [] for k in cases}
P = time.perf_counter
for rep in range(60):
    for k, f in cases.items():
        for _ in range(3):
            f()
        for _ in range(20):
            t0 = P()
            f()
            res[k].append(P() - t0)
if rank == 0:
    print("threads:", [th.name for th in threading.enumerate()])
print(rank, " ".join(f"{k} {np.median(v) * 1e6:.0f}us" for k, v in res.items()), flush=True)
dist.destroy_process_group()
