# ruff: noqa  (a throw-away probe kept as it ran; see ../README.md)
# PROBE: what the first compressed all_reduce of a process spends (2 ranks, rank 0 profiled)
import sys, time, tempfile, cProfile, pstats, os
import torch, torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, path):
    os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = "4"
    import cgx_ucx

    store = dist.FileStore(path, world)
    dist.init_process_group("cgx", store=store, rank=rank, world_size=world)
    t = torch.ones(1024)
    dist.barrier()
    dist.barrier()
    if rank == 0:
        pr = cProfile.Profile()
        pr.enable()
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    dt = time.perf_counter() - t0
    if rank == 0:
        pr.disable()
        print("first call ms", dt * 1e3)
        pstats.Stats(pr).sort_stats("cumtime").print_stats(25)
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    if rank == 0:
        print("second call ms", (time.perf_counter() - t0) * 1e3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2, tempfile.mktemp()), nprocs=2)
