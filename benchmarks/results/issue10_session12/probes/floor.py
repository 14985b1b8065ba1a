"""Probe (not a command): what torch's own dispatch to a Python ProcessGroup costs.

A null backend whose allreduce returns a finished Work: ``dist.all_reduce`` on it is the
floor any Python backend pays (session 12: 9-13 us on the 2-vCPU VM). Run from the
repository root: ``.venv/bin/python benchmarks/results/issue10_session12/probes/floor.py``.
"""

import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future


class NullPG(dist.ProcessGroup):
    def getBackendName(self) -> str:
        return "null"

    def allreduce(self, tensors, opts=None):
        fut = torch.futures.Future()
        fut.set_result(tensors)
        return _create_work_from_future(fut)


def create(dist_opts, pg_options):
    return NullPG(dist_opts.group_rank, dist_opts.group_size)


dist.Backend.register_backend("null", create, extended_api=True, devices=["cpu"])
dist.init_process_group("null", rank=0, world_size=1, store=dist.HashStore())
t = torch.randn(1024)
for _ in range(1000):
    dist.all_reduce(t)
N = 20000
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(N):
        dist.all_reduce(t)
    print(
        f"dist.all_reduce on a null Python backend: {(time.perf_counter() - t0) / N * 1e6:.1f} us"
    )
