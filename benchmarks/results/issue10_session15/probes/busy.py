# ruff: noqa
"""Probe (not a command), issue 10 session 15: does the mailbox protocol amplify work done
between calls? 2 ranks, 4 KiB float32 on the engine face, with 0, 15 or 30 us of busy
Python before (b) or after (a) each call, in turns of 20 calls; medians per rank. Run
from the repository root: ``python PROBE 0 & python PROBE 1`` (port 29661)."""

import datetime, sys, time

rank, world = int(sys.argv[1]), 2
import numpy as np, torch, torch.distributed as dist
import cgx_ucx

store = dist.TCPStore(
    "127.0.0.1", 29661, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
)
dist.init_process_group(
    "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
)
pg = dist.group.WORLD
sync = pg.communicator
a = np.random.rand(1024).astype(np.float32)
P = time.perf_counter


def busy(us):
    end = P() + us * 1e-6
    while P() < end:
        pass


def mk(us, after):
    if us == 0:
        return lambda: sync.allreduce(a, "avg", bits=32, bucket_size=512).result()
    if after:
        return lambda: (sync.allreduce(a, "avg", bits=32, bucket_size=512).result(), busy(us))
    return lambda: (busy(us), sync.allreduce(a, "avg", bits=32, bucket_size=512).result())


cases = {
    f"{us}{'a' if af else 'b'}": mk(us, af)
    for us in (0, 15, 30)
    for af in (False, True)
    if not (us == 0 and af)
}
res = {k: [] for k in cases}
for rep in range(60):
    for k, f in cases.items():
        for _ in range(3):
            f()
        for _ in range(20):
            t0 = P()
            f()
            res[k].append(P() - t0)
print(rank, " ".join(f"{k}:{np.median(v) * 1e6:.0f}" for k, v in res.items()), flush=True)
dist.destroy_process_group()
