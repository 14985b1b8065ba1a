"""Session 17 probe: the first compressed all_reduce of a process against later ones.

``torchrun --nproc-per-node 2 first_call.py``: a 4 KiB 4-bit AVG all_reduce on the
``cgx`` backend after two gloo barriers, first in the process and then 9 more started
the same way (median); rank 0 prints both. ``PROF=1 PROFRANK=r``: a cProfile of rank r's
first call (microseconds, cumulative and own, the 45 largest).
"""

import cProfile
import datetime
import os
import pstats
import time

import torch
import torch.distributed as dist

import cgx_ucx  # noqa: F401 (registers the backend)
from cgx_ucx import CompressionConfig


def main() -> None:
    dist.init_process_group("cgx", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    pg = dist.group.WORLD
    pg.compression = CompressionConfig(bits=4, minimal_size=16)
    t = torch.ones(1024)

    def one(prof: cProfile.Profile | None = None) -> float:
        dist.barrier(group=gloo)
        dist.barrier(group=gloo)
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        dt = time.perf_counter() - t0
        if prof:
            prof.disable()
        return dt

    profiling = os.environ.get("PROF") == "1"
    mine = rank == int(os.environ.get("PROFRANK", "0"))
    prof = cProfile.Profile() if profiling and mine else None
    first = one(prof)
    later = sorted(one() for _ in range(9))[4]
    if prof is not None or (rank == 0 and not profiling):
        print(f"first {first * 1e3:.3f} ms later {later * 1e3:.3f} ms")
    if prof is not None:
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        rows = sorted(((v[3], v[2], k) for k, v in stats.items()), reverse=True)[:45]
        for cum, own, k in rows:
            print(f"{cum * 1e6:9.0f} {own * 1e6:9.0f}  {k[0].split('/')[-1]}:{k[1]}({k[2]})")
    dist.destroy_process_group()


main()
