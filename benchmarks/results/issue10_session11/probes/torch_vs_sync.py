# ruff: noqa  (a throw-away probe kept as it ran; see ../README.md)
# PROBE: torch SUM / AVG vs the sync face at one size (2 ranks), interleaved
import sys, time, tempfile, statistics
import numpy as np, torch, torch.distributed as dist
import torch.multiprocessing as mp


def med(f, n=300):
    for _ in range(20):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def run(rank, world, path, numel):
    import cgx_ucx.torch
    from cgx_ucx.torch.backend import ProcessGroupCGX

    store = dist.FileStore(path, world)
    dist.init_process_group("cgx", store=store, rank=rank, world_size=world)
    t = torch.ones(numel)
    pg = dist.group.WORLD
    sync = pg.communicator
    arr = np.ones(numel, np.float32)
    res = {}
    for rep in range(2):
        res.setdefault("torch sum", []).append(med(lambda: dist.all_reduce(t)))
        res.setdefault("torch avg", []).append(
            med(lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG))
        )
        res.setdefault("backend avg", []).append(
            med(lambda: pg.allreduce([t], dist.AllreduceOptions()).wait())
        )
        if sync is not None:
            res.setdefault("sync avg", []).append(med(lambda: sync.allreduce(arr, "avg").result()))
            res.setdefault("sync avg torch-mem", []).append(
                med(lambda: sync.allreduce(t.numpy(), "avg").result())
            )
    if rank == 0:
        for k, v in res.items():
            print(f"{k:20s}", [round(x, 1) for x in v])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2, tempfile.mktemp(), int(sys.argv[1])), nprocs=2)
