"""Allreduce benchmark: cgx_ucx at several bit widths next to torch.distributed gloo.

    python -m cgx_ucx.bench allreduce [--world 2 4] [--sizes 1 4 16 64 256] [--bits 2 4 8 32]
                                      [--iters N] [--algorithm auto|sra|ring] [--no-p2p]

For every world size, ranks are spawned on this host; they rendezvous through one
TCPStore and build both a cgx_ucx communicator and a gloo process group. For each buffer
size (MiB of float32) every method runs on the same buffer in the same processes, one
after the other: a warm-up call, a barrier, then ``iters`` back-to-back calls; a rank's
time per op is its loop time / iters, and the op's time is the maximum over ranks.
Algorithm bandwidth = bytes of the float32 buffer / time per op (what the caller sees:
a 2x compression that costs more than it saves shows up as a loss).

Point-to-point (world 2): cgx_ucx's data channel (rank 0 streams a buffer to rank 1 with
a window of outstanding sends, as ``ucx_perftest`` does) next to ``ucx_perftest -t
tag_bw`` between two processes of this host, run from the libucx wheel.

``--cma`` runs with ``data_error_handling=False`` (CMA zero-copy on one host, at the
risk described in :mod:`cgx_ucx.transport.mesh`), for comparison.

Shows progress (one step per size and method, from rank 0), prints a table and writes
``allreduce.json`` to ``--out-dir`` (default: a new ``./cgx_bench_results/<timestamp>/``;
``--refresh-tracked``: the checkout's ``benchmarks/results/``).
The load average before and after is recorded: on a shared machine, compare rows of one
run with each other, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..compression.kernels import settle as settle_kernels
from .report import (
    HelpFormatter,
    Progress,
    add_output_args,
    bits_arg,
    check_rank_buffers,
    count_arg,
    format_table,
    positive_number,
    ranks_arg,
    results_dir,
    write_json,
)

MiB = 1 << 20
#: Buffers of a size each rank holds at once: the input, the buffer reduced in place, the
#: float64 draw that makes the input and the communicator's staging (about 4 in all).
BUFFERS_PER_RANK = 4
#: Buffers of a point-to-point size each of the two ranks holds: its own and staging.
P2P_BUFFERS_PER_RANK = 2
#: Sends kept in flight by the point-to-point test (ucx_perftest's tag_bw also keeps a
#: window of outstanding sends, so per-message latency does not hide the bandwidth).
P2P_WINDOW = 16


def _iters(nbytes: int, requested: int | None) -> int:
    if requested:
        return requested
    # About 0.5-1 GB moved per method and size: enough to average, bounded in time.
    return int(min(max((512 * MiB) // max(nbytes, 1), 3), 50))


async def _rank_main(
    rank: int, world: int, port: int, opts: dict[str, Any], q: Any = None
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ..collectives import connect
    from ..config import CommConfig

    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world
    )
    comm = await connect(
        store,
        rank,
        world,
        config=CommConfig(timeout=300.0, connect_timeout=120.0),
        data_error_handling=not opts["cma"],
    )
    rows: list[dict[str, Any]] = []
    try:
        for size_mib in opts["sizes"]:
            n = int(size_mib * MiB) // 4
            x0 = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
            x = x0.copy()
            iters = _iters(n * 4, opts["iters"])
            for method in ["gloo", *(f"cgx{b}" for b in opts["bits"])]:
                if method == "gloo":
                    t = torch.from_numpy(x)

                    async def op(t: Any = t) -> None:
                        dist.all_reduce(t)
                else:
                    bits = int(method[3:])

                    async def op(bits: int = bits, x: np.ndarray = x) -> None:
                        await comm.allreduce(x, bits=bits, algorithm=opts["algorithm"])

                for _ in range(2):
                    x[:] = x0
                    await op()  # warm-up (first-touch of staging buffers)
                    # ...and the kernels it asked for imported and compiled (the first
                    # round's call may only start the import): timed calls run them, not
                    # the NumPy reference (first calls are what ``bench latency --cold``
                    # times).
                    await asyncio.to_thread(settle_kernels, 600)
                x[:] = x0
                await comm.barrier()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    await op()
                elapsed = (time.perf_counter() - start) / iters
                rows.append({"size_mib": size_mib, "method": method, "iters": iters, "s": elapsed})
                if rank == 0 and q is not None:
                    q.put((rank, "progress", f"{size_mib:g} MiB {method} {elapsed * 1e3:.1f} ms"))
        p2p = []
        if world == 2 and opts["p2p"]:
            p2p = await _p2p(comm, rank, opts["p2p_sizes"])
        stats = comm.stats.as_dict()
    finally:
        await comm.close()
        dist.destroy_process_group()
    return {"rows": rows, "p2p": p2p, "stats": stats}


async def _p2p(comm: Any, rank: int, sizes: list[float]) -> list[dict[str, Any]]:
    """Rank 0 streams to rank 1 over the data channel, P2P_WINDOW sends in flight."""
    # the transport itself, below the collective protocol: what ucx_perftest measures
    mesh = comm._mesh  # noqa: SLF001
    out = []
    ack = np.zeros(1, np.uint8)
    for size_mib in sizes:
        nbytes = int(size_mib * MiB)
        buf = np.ones(nbytes, np.uint8)
        iters = _iters(nbytes, None) * 2
        await comm.barrier()
        tag = mesh.tag(0, 0, 14, 1, True)
        start = time.perf_counter()
        if rank == 0:
            await _windowed(functools.partial(mesh.send, 1, tag, buf, "p2p"), iters)
            await mesh.recv(1, mesh.tag(0, 1, 14, 2, True), ack, "p2p ack")
        else:
            await _windowed(functools.partial(mesh.recv, 0, tag, buf, "p2p"), iters)
            await mesh.send(0, mesh.tag(0, 1, 14, 2, True), ack, "p2p ack")
        elapsed = time.perf_counter() - start
        out.append({"size_mib": size_mib, "iters": iters, "GBps": nbytes * iters / elapsed / 1e9})
    return out


async def _windowed(start: Callable[[], Awaitable[Any]], iters: int) -> None:
    """Start ``iters`` transfers with at most P2P_WINDOW in flight (the oldest is awaited
    before the next starts), then wait for the rest."""
    window: list[asyncio.Future] = []
    for _ in range(iters):
        window.append(asyncio.ensure_future(start()))
        if len(window) >= P2P_WINDOW:
            await window.pop(0)
    await asyncio.gather(*window)


def _child(rank: int, world: int, port: int, opts: dict[str, Any], q: Any) -> None:
    try:
        q.put((rank, "ok", asyncio.run(_rank_main(rank, world, port, opts, q))))
    except BaseException as exc:  # reported by the parent
        import traceback

        q.put((rank, "error", f"{exc!r}\n{traceback.format_exc()}"))


def _run_world(
    world: int, opts: dict[str, Any], timeout: float, bar: Progress | None = None
) -> list[dict[str, Any]]:
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, world, master.port, opts, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"world {world}: ranks did not finish within {timeout:g} s")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a benchmark rank died") from None
                continue
            if status == "progress":
                if bar is not None:
                    bar.update(note=f"world {world}: {value}")
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _perftest(nbytes: int, iters: int) -> float | None:
    """ucx_perftest tag_bw between two processes of this host (GB/s), or None if absent."""
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    exe = root / "bin" / "ucx_perftest"
    if not exe.exists():
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=str(root / "lib"))
    port = str(20000 + os.getpid() % 20000)
    args = ["-t", "tag_bw", "-s", str(nbytes), "-n", str(iters), "-p", port]
    server = subprocess.Popen(
        [str(exe), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        out = subprocess.run(
            [str(exe), "127.0.0.1", *args], env=env, capture_output=True, text=True, timeout=120
        ).stdout
    finally:
        server.wait(30) if server.poll() is None else None
        if server.poll() is None:
            server.kill()
    m = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)", out)
    return float(m.group(2)) * MiB / 1e9 if m else None


def _check_memory(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for sizes whose buffers cannot fit in this machine's memory."""
    world, largest = max(args.world), max(args.sizes)
    check_rank_buffers(ap, "--sizes", world, BUFFERS_PER_RANK, largest * MiB, f"{largest:g} MiB")
    if not args.no_p2p and 2 in args.world:
        largest = max(args.p2p_sizes)
        check_rank_buffers(
            ap, "--p2p-sizes", 2, P2P_BUFFERS_PER_RANK, largest * MiB, f"{largest:g} MiB"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench allreduce", description=__doc__, formatter_class=HelpFormatter
    )
    ap.add_argument("--world", type=ranks_arg(2), nargs="+", default=[2, 4], help="world sizes")
    ap.add_argument(
        "--sizes", type=positive_number, nargs="+", default=[1, 4, 16, 64, 256], help="MiB"
    )
    ap.add_argument(
        "--bits", type=bits_arg, nargs="+", default=[2, 4, 8, 32], help="cgx bit widths"
    )
    ap.add_argument(
        "--iters", type=count_arg(1), default=None, help="timed calls (unset: ~0.5-1 GB)"
    )
    ap.add_argument("--algorithm", default="auto", choices=["auto", "sra", "ring"], help="cgx")
    ap.add_argument("--p2p-sizes", type=positive_number, nargs="+", default=[1, 16, 64], help="MiB")
    ap.add_argument("--no-p2p", action="store_true", help="skip the point-to-point test")
    ap.add_argument(
        "--cma",
        action="store_true",
        help="data endpoints without error handling (CMA zero-copy; a dying peer can abort)",
    )
    ap.add_argument(
        "--timeout", type=positive_number, default=1800.0, help="seconds per world size"
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_output_args(ap)
    args = ap.parse_args(argv)
    _check_memory(ap, args)
    out_dir = results_dir(args)
    opts = {
        "sizes": args.sizes,
        "bits": args.bits,
        "iters": args.iters,
        "algorithm": args.algorithm,
        "p2p": not args.no_p2p,
        "p2p_sizes": args.p2p_sizes,
        "cma": args.cma,
    }
    load_before = os.getloadavg()
    table, records, p2p_rows = [], [], []
    steps = len(args.world) * len(args.sizes) * (1 + len(args.bits))
    bar = Progress(steps, "allreduce", disable=args.quiet)
    for world in args.world:
        per_rank = _run_world(world, opts, args.timeout, bar)
        for i, row in enumerate(per_rank[0]["rows"]):
            s = max(r["rows"][i]["s"] for r in per_rank)
            records.append(
                {**row, "world": world, "s": s, "algbw_GBps": row["size_mib"] * MiB / s / 1e9}
            )
        gloo = {(r["world"], r["size_mib"]): r["s"] for r in records if r["method"] == "gloo"}
        for r in records:
            if r["world"] == world:
                r["speedup_vs_gloo"] = gloo[(world, r["size_mib"])] / r["s"]
                table.append(
                    [
                        world,
                        r["size_mib"],
                        r["method"],
                        r["s"] * 1e3,
                        r["algbw_GBps"],
                        r["speedup_vs_gloo"],
                    ]
                )
        if per_rank[0]["p2p"]:
            for row in per_rank[1]["p2p"]:  # the receiver's clock
                nbytes = int(row["size_mib"] * MiB)
                perf = _perftest(nbytes, row["iters"])
                ratio = row["GBps"] / perf if perf else None
                p2p_rows.append({**row, "perftest_GBps": perf, "ratio": ratio})
    bar.close()
    load_after = os.getloadavg()
    print(format_table(["world", "MiB", "method", "ms/op", "algbw GB/s", "x gloo"], table))
    if p2p_rows:
        print()
        print(
            format_table(
                ["p2p MiB", "cgx_ucx GB/s", "ucx_perftest GB/s", "ratio"],
                [
                    [
                        r["size_mib"],
                        r["GBps"],
                        r["perftest_GBps"] or float("nan"),
                        r["ratio"] or float("nan"),
                    ]
                    for r in p2p_rows
                ],
            )
        )
    cpus = os.cpu_count()
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({cpus} CPUs)")
    path = write_json(
        "allreduce",
        {
            "args": {k: v for k, v in vars(args).items() if k != "refresh_tracked"},
            "allreduce": records,
            "p2p": p2p_rows,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        out_dir,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
