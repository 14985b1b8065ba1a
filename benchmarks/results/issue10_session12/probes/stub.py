"""Probe (not a command): the cgx backend's own per-call cost, the engine stubbed out.

A 1-rank ``cgx`` group whose communicator's allreduce returns a finished future at once:
what ``dist.all_reduce`` then takes is torch's dispatch plus this package's torch layer
(session 12: 48-83 us on the 2-vCPU VM). Run from the repository root:
``.venv/bin/python benchmarks/results/issue10_session12/probes/stub.py``.
"""

import concurrent.futures
import time

import torch
import torch.distributed as dist

import cgx_ucx  # noqa: F401  (registers the backend)

dist.init_process_group("cgx", rank=0, world_size=1, store=dist.HashStore())
pg = dist.group.WORLD
done = concurrent.futures.Future()
done.set_result(None)
pg.communicator.allreduce = lambda x, op="sum", **kw: done
t = torch.randn(1024)
opts = dist.AllreduceOptions()
N = 20000
cases = [
    ("dist.all_reduce", lambda: dist.all_reduce(t)),
    ("pg.allreduce", lambda: pg.allreduce([t], opts)),
    ("pg.allreduce.wait", lambda: pg.allreduce([t], opts).wait()),
]
for _ in range(2):
    for name, fn in cases:
        for _ in range(1000):
            fn()
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        print(f"{name:20s} {(time.perf_counter() - t0) / N * 1e6:7.1f} us (engine stubbed)")
dist.destroy_process_group()
