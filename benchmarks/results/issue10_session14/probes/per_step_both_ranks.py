# ruff: noqa
"""Probe (not a command), issue 10 session 14: timestamps at each step of the torch
all_reduce path (backend, allreduce_into, as_array, the sync face, run_local, prepare,
Round, the two waits, post, finish, the Work), medians of 350 calls on each rank.
Run from the repository root: ``python PROBE 0 & python PROBE 1`` (port 29623).
See ../README.md."""

import datetime, sys, time, os
import numpy as np
import torch
import torch.distributed as dist
import cgx_ucx
from cgx_ucx.config import CompressionConfig
from cgx_ucx.collectives import local as L
from cgx_ucx.collectives import communicator as C
from cgx_ucx.collectives import allreduce as A
from cgx_ucx import engine as E
from cgx_ucx.torch import ops as O
from cgx_ucx.torch import backend as B
from cgx_ucx.torch.work import CGXWork

rank, world = int(sys.argv[1]), 2
bits = int(sys.argv[2]) if len(sys.argv) > 2 else 32
store = dist.TCPStore(
    "127.0.0.1", 29623, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
)
dist.init_process_group(
    "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
)
pg = dist.group.WORLD
pg.compression = CompressionConfig(bits=bits, minimal_size=16)
P = time.perf_counter
ev = []


def wrap(obj, name, key, exit=False):
    orig = getattr(obj, name)

    def f(*a, **k):
        ev.append((key, P()))
        r = orig(*a, **k)
        if exit:
            ev.append((key + "/", P()))
        return r

    setattr(obj, name, f)


wrap(B.ProcessGroupCGX, "allreduce", "backend", True)
wrap(O, "allreduce_into", "into", True)
wrap(E.SyncCommunicator, "allreduce", "sync", True)
wrap(E.SyncCommunicator, "_local", "_local", True)
wrap(C.Communicator, "run_local", "run_local", True)
wrap(C, "prepare_allreduce", "prepare", True)
wrap(C, "Round", "Round", True)
wrap(C, "wait_blocking", "wb", True)
wrap(L.Round, "post", "post", True)
wrap(C.Communicator, "_local_done", "done", True)
wrap(L.AllreduceOp, "finish", "finish", True)
wrap(CGXWork, "wait", "wait", True)
wrap(B.ProcessGroupCGX, "_work", "work", True)
wrap(O, "as_array", "as_array", True)
wrap(O, "_one_layer", "_one_layer", True)
x = torch.randn(1024)
AVG = dist.ReduceOp.AVG
gl = dist.new_group(backend="gloo")
for rep in range(2):
    dist.barrier(group=gl)
    recs = []
    for i in range(400):
        ev.clear()
        t0 = P()
        dist.all_reduce(x, op=AVG)
        t1 = P()
        if i >= 50:
            recs.append([("start", t0)] + list(ev) + [("end", t1)])
    names = [k for k, _ in recs[0]]
    ok = [r for r in recs if [k for k, _ in r] == names]
    arr = np.array([[t for _, t in r] for r in ok])
    d = np.median(np.diff(arr, axis=1), axis=0) * 1e6
    if True:
        print(
            "rank",
            rank,
            "total",
            round(float(np.median(arr[:, -1] - arr[:, 0]) * 1e6), 1),
            "n",
            len(ok),
        )
        print("  ".join(f"{a}->{b}:{v:.1f}" for a, b, v in zip(names, names[1:], d)))
dist.barrier(group=gl)
dist.destroy_process_group()
