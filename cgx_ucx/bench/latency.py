"""Latency of small collectives, hop by hop: torch backend, thread bridge, asyncio core.

    python -m cgx_ucx.bench latency [--world 2 4] [--sizes-kib 4 64 256 1024 4096]
                                    [--iters 200] [--bits 32 4] [--cold]

Every rank of a world joins one ``cgx`` process group (``init_process_group("cgx")``) and
one gloo group over the same TCPStore, so every row of a size is measured side by side
in the same processes. Per size and method, each call is timed on its own, the rows of
a size taking turns in blocks of 20 calls (2 untimed before each), so that every row
spans the same stretch of time; the table gives the median and the 99th percentile over
the calls, the slowest rank's median being the figure of the call:

- ``torch``: ``dist.all_reduce`` (gloo, or the cgx group at 32 / 4 bits): what users see;
- ``sync``: the engine's synchronous face (``SyncCommunicator.allreduce(...).result()``):
  the thread hop from the caller to the engine loop and back;
- ``core``: ``await comm.allreduce`` on the engine loop itself: the asyncio core.

``hop us`` = torch (or sync) - core: the cost of the synchronous call, the engine thread
and the torch future. ``wake/call`` counts the progress driver's runs per call (loop
wake-ups spent on UCX: events, polls and spins) and ``msgs/call`` the UCX messages one
rank sends per call: the per-call costs that load on a shared machine cannot blur.
Barriers are timed the same way. The compressed rows time a long job's steady state: the
host codec's Numba kernels are loaded by each size's untimed warm-up (a job's small
compressed calls run the NumPy reference, the same bytes, until they add up to about a
million values, then load the kernels on a thread of their own: its first thousand 4 KiB
calls at 4 bits cost about 0.2 ms of CPU each, later ones under 0.1). ``--cold`` also
times the first compressed call of a process (empty Numba cache), started after two gloo
barriers, against later calls started the same way (the median of 9) and against
back-to-back calls (each the slowest rank's): a call that follows an idle gap pays for
waking the engine thread, which back-to-back calls do not.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .report import (
    HelpFormatter,
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

KiB = 1 << 10
#: Calls per turn of a row (each row's calls are spread over the whole run in turns of
#: this many, see _measure), and untimed calls before each turn.
BLOCK = 20
BLOCK_WARMUP = 2
#: Values per quantization bucket on every path (the torch rows' CompressionConfig default).
BUCKET = 512
#: Buffers of a size each rank holds at once: the tensor reduced in place and the
#: backends' staging (about 3 in all).
BUFFERS_PER_RANK = 3


def _percentiles(samples: list[float]) -> tuple[float, float]:
    a = np.asarray(samples) * 1e6
    return float(np.median(a)), float(np.percentile(a, 99))


def _time_calls(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


async def _time_core(op: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        await op()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await op()
        out.append(time.perf_counter() - t0)
    return out


def _rows(sync: Any, comm: Any, x: Any, bits: int) -> tuple[Any, list[tuple[str, Any, Any]]]:
    """The configuration and the three paths (torch, sync, core) of the ``cgx{bits}`` row
    on ``x``, as ``(path, fn, loop_op)``: every path does the same work, the torch rows'
    configuration and its bucket too (CompressionConfig's 512, not the engine's 1024)."""
    import torch.distributed as dist

    from cgx_ucx.config import CompressionConfig

    arr = x.numpy()

    async def core_op() -> None:
        await comm.allreduce(arr, "avg", bits=bits, bucket_size=BUCKET)

    return CompressionConfig(bits=bits, bucket_size=BUCKET, minimal_size=16), [
        ("torch", lambda: dist.all_reduce(x, op=dist.ReduceOp.AVG), None),
        ("sync", lambda: sync.allreduce(arr, "avg", bits=bits, bucket_size=BUCKET).result(), None),
        ("core", None, core_op),
    ]


def _load_kernels(pg: Any, engine: Any, rows: dict[int, Any]) -> None:
    """One untimed call of every compressed row's paths, each compiling or loading the
    kernels it needs before it runs (see the module docstring)."""
    from cgx_ucx.compression import kernels

    kernels.compile_in_background(False)
    try:
        for bits, (config, paths) in rows.items():
            if bits >= 32:
                continue
            pg.compression = config
            for _, fn, loop_op in paths:
                if loop_op is None:
                    fn()
                else:
                    engine.run(loop_op())
    finally:
        kernels.compile_in_background(True)


def _rank_main(rank: int, world: int, port: int, opts: dict[str, Any], q: Any) -> None:
    try:
        q.put((rank, _measure(rank, world, port, opts)))
    except BaseException as exc:  # report, never hang the parent
        import traceback

        q.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def _measure(rank: int, world: int, port: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import cgx_ucx  # noqa: F401  (registers the backend)
    from cgx_ucx.config import CompressionConfig

    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    first: dict[str, float] = {}
    dist.init_process_group(
        "cgx",
        store=dist.PrefixStore("cgx", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    gloo = dist.new_group(backend="gloo")
    pg = dist.group.WORLD  # the cgx ProcessGroup (init_process_group's default group)
    sync = pg.communicator
    comm, engine = sync.comm, sync.engine
    iters = opts["iters"]
    from cgx_ucx.transport.progress import driver

    drv = driver(engine.loop)

    def counters() -> tuple[int, int]:
        return (drv.wakeups if drv is not None else 0, comm.stats.messages_sent)

    # cgx calls average (same cost as a sum) so that hundreds of in-place calls stay
    # finite; gloo has no AVG and sums (overflow does not change its time).
    AVG = dist.ReduceOp.AVG

    if opts["cold"]:
        # The first compressed call of the process (an empty Numba cache: the kernels
        # compiled while connecting). Started after two gloo barriers, so that no rank
        # waits for a peer still leaving init_process_group; later calls started the
        # same way (after the barriers, from an idle engine) are the like-for-like warm
        # reference, back-to-back calls the steady state.
        t = torch.ones(4096 // 4)
        pg.compression = CompressionConfig(bits=4, minimal_size=16)

        def after_barriers() -> float:
            dist.barrier(group=gloo)
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            dist.all_reduce(t, op=AVG)
            return time.perf_counter() - t0

        first["first_s"] = after_barriers()
        first["warm_after_barrier_s"] = float(np.median([after_barriers() for _ in range(9)]))
        warm = _time_calls(lambda: dist.all_reduce(t, op=AVG), 20, 2)
        first["warm_s"] = float(np.median(warm))

    # Every row of a size is measured in blocks of BLOCK calls, the rows taking turns
    # (gloo, then torch / sync / core per bit width, again and again), so that each
    # row's median spans the same stretch of time as the others': the machine's slow drifts
    # (a neighbour's load, a frequency change) shift every row alike instead of whichever
    # row they fall on, and the bridge (torch - core) compares like with like.
    samples: dict[tuple[float, str, str], list[float]] = {}
    counted: dict[tuple[float, str, str], list[float]] = {}
    turns = [min(BLOCK, iters - start) for start in range(0, iters, BLOCK)]

    def block(key: tuple[float, str, str], calls: int, fn: Any = None, loop_op: Any = None) -> None:
        """One turn of a row: ``calls`` timed calls of ``fn`` on this thread, or of the
        coroutine function ``loop_op`` on the engine loop; its counters (warm-up too)."""
        before = counters()
        if loop_op is not None:
            times = engine.run(_time_core(loop_op, calls, BLOCK_WARMUP))
        else:
            times = _time_calls(fn, calls, BLOCK_WARMUP)
        samples.setdefault(key, []).extend(times)
        total = counted.setdefault(key, [0.0, 0.0, 0.0])
        for k, (a, b) in enumerate(zip(counters(), before, strict=True)):
            total[k] += a - b
        total[2] += len(times) + BLOCK_WARMUP

    for kib in opts["sizes_kib"]:
        n = max(int(kib * KiB) // 4, 1)
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        rows = {bits: _rows(sync, comm, x, bits) for bits in opts["bits"]}
        dist.barrier(group=gloo)
        _load_kernels(pg, engine, rows)
        for calls in turns:
            block((kib, "torch", "gloo"), calls, lambda x=x: dist.all_reduce(x, group=gloo))
            for bits, (config, paths) in rows.items():
                pg.compression = config
                for path, fn, loop_op in paths:
                    block((kib, path, f"cgx{bits}"), calls, fn, loop_op=loop_op)
    dist.barrier(group=gloo)
    for calls in turns:
        block((0, "torch", "gloo barrier"), calls, lambda: dist.barrier(group=gloo))
        block((0, "torch", "cgx barrier"), calls, dist.barrier)
        block((0, "sync", "cgx barrier"), calls, lambda: sync.barrier().result())
        block((0, "core", "cgx barrier"), calls, loop_op=comm.barrier)
    rows: list[dict[str, Any]] = []
    for (kib, path, method), times in samples.items():
        med, p99 = _percentiles(times)
        wake, msgs, ncalls = counted[(kib, path, method)]
        plain = method.startswith("gloo")
        rows.append(
            {
                "kib": kib,
                "path": path,
                "method": method,
                "median_us": med,
                "p99_us": p99,
                "wakeups_per_call": 0.0 if plain else wake / ncalls,
                "messages_per_call": 0.0 if plain else msgs / ncalls,
            }
        )
    stats = comm.stats.as_dict()
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return {"rows": rows, "first": first, "stats": stats}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world: int, opts: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    import torch.distributed as dist

    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, world + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    env = dict(os.environ)
    if opts["cold"]:
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="cgx_numba_cold_")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, opts, q)) for r in range(world)]
    for p in procs:
        p.start()
    os.environ.clear()
    os.environ.update(env)
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"world {world}: ranks {sorted(set(range(world)) - set(results))} hung"
                )
            try:
                r, res = q.get(timeout=min(left, 1.0))
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if not set(dead) <= set(results):
                        raise RuntimeError(f"world {world}: ranks {dead} died") from None
                continue
            if "error" in res:
                raise RuntimeError(f"world {world} rank {r}: {res['error']}")
            results[r] = res
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        del master
    return [results[r] for r in range(world)]


def summarize(world: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: the slowest rank's median and p99 (a collective ends with its last rank)."""
    out = []
    for i, base in enumerate(per_rank[0]["rows"]):
        rows = [res["rows"][i] for res in per_rank]
        out.append(
            {
                "world": world,
                "kib": base["kib"],
                "path": base["path"],
                "method": base["method"],
                "median_us": max(r["median_us"] for r in rows),
                "p99_us": max(r["p99_us"] for r in rows),
                "wakeups_per_call": max(r.get("wakeups_per_call", 0.0) for r in rows),
                "messages_per_call": max(r.get("messages_per_call", 0.0) for r in rows),
            }
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    gloo = {(r["world"], r["kib"]): r["median_us"] for r in rows if r["method"] == "gloo"}
    core = {
        (r["world"], r["kib"], r["method"]): r["median_us"] for r in rows if r["path"] == "core"
    }
    gloo_barrier = {r["world"]: r["median_us"] for r in rows if r["method"] == "gloo barrier"}
    body = []
    for r in rows:
        key = (r["world"], r["kib"])
        ref = gloo_barrier.get(r["world"]) if "barrier" in r["method"] else gloo.get(key)
        ratio = r["median_us"] / ref if ref else float("nan")
        c = core.get((r["world"], r["kib"], r["method"]))
        bridge = r["median_us"] - c if (c is not None and r["path"] != "core") else float("nan")
        body.append(
            [
                r["world"],
                "barrier" if "barrier" in r["method"] else f"{r['kib']:g} KiB",
                r["path"],
                r["method"],
                round(r["median_us"], 1),
                round(r["p99_us"], 1),
                round(ratio, 2),
                round(bridge, 1),
                round(r.get("wakeups_per_call", 0.0), 1),
                round(r.get("messages_per_call", 0.0), 1),
            ]
        )
    headers = [
        "world",
        "size",
        "path",
        "method",
        "median us",
        "p99 us",
        "x gloo",
        "hop us",
        "wake/call",
        "msgs/call",
    ]
    return format_table(headers, body)


#: The targets for 2 ranks on one host: the torch backend at most this fraction
#: of gloo's median (4 KiB - 1 MiB, 32 and 4 bits); the asyncio core at 4 KiB and its
#: barrier at most this many microseconds; the bridge (torch - core) at most this many;
#: the first compressed call at most this multiple of a warm one.
TARGET_X_GLOO = 0.5
TARGET_CORE_US = 100.0
TARGET_BRIDGE_US = 50.0
TARGET_FIRST_X = 3.0


def targets(rows: list[dict[str, Any]], first: dict[str, Any]) -> list[dict[str, Any]]:
    """The checks on 2 ranks against the targets, one per (size, method): what was measured, the
    limit, and whether it held."""
    checks: list[dict[str, Any]] = []

    def check(what: str, value: float, limit: float) -> None:
        checks.append({"target": what, "value": value, "limit": limit, "ok": value <= limit})

    two = [r for r in rows if r["world"] == 2]
    med = {(r["kib"], r["path"], r["method"]): r["median_us"] for r in two}
    for (kib, path, method), us in med.items():
        if path != "torch" or not method.startswith("cgx") or "barrier" in method:
            continue
        if 4 <= kib <= 1024 and (kib, "torch", "gloo") in med:
            size = f"{kib:g} KiB"
            check(f"{size} {method} torch / gloo", us / med[(kib, "torch", "gloo")], TARGET_X_GLOO)
            core = med.get((kib, "core", method))
            if core is not None:
                check(f"{size} {method} bridge us", us - core, TARGET_BRIDGE_US)
    for method in ("cgx32", "cgx4"):
        if (4.0, "core", method) in med:
            check(f"4 KiB {method} core us", med[(4.0, "core", method)], TARGET_CORE_US)
    if (0, "core", "cgx barrier") in med:
        check("barrier core us", med[(0, "core", "cgx barrier")], TARGET_CORE_US)
    ranks = first.get("2")
    if ranks:
        worst = max(r["first_s"] for r in ranks)
        warm = max(r["warm_s"] for r in ranks)
        like = max(r["warm_after_barrier_s"] for r in ranks)
        check("first call / back-to-back", worst / warm, TARGET_FIRST_X)
        check("first call / later call after barriers", worst / like, TARGET_FIRST_X)
    return checks


def print_targets(checks: list[dict[str, Any]]) -> None:
    if not checks:
        return
    held = sum(c["ok"] for c in checks)
    print(f"Against the targets (2 ranks): {held} of {len(checks)} held")
    for c in checks:
        verdict = "ok" if c["ok"] else "MISSED"
        print(f"  {c['target']}: {c['value']:.2f} (at most {c['limit']:g}): {verdict}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench latency",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--world", type=ranks_arg(2), nargs="+", default=[2, 4], help="world sizes (ranks)"
    )
    ap.add_argument(
        "--sizes-kib",
        type=positive_number,
        nargs="+",
        default=[4, 64, 256, 1024, 4096],
        help="buffer sizes in KiB (float32)",
    )
    ap.add_argument("--bits", type=bits_arg, nargs="+", default=[32, 4], help="cgx bit widths")
    ap.add_argument("--iters", type=count_arg(1), default=200, help="timed calls per row")
    ap.add_argument("--cold", action="store_true", help="time the first compressed call")
    ap.add_argument("--timeout", type=positive_number, default=600.0, help="seconds per world size")
    add_output_args(ap)
    args = ap.parse_args(argv)
    world, largest = max(args.world), max(args.sizes_kib)
    check_rank_buffers(
        ap, "--sizes-kib", world, BUFFERS_PER_RANK, largest * KiB, f"{largest:g} KiB"
    )
    opts = {"sizes_kib": args.sizes_kib, "bits": args.bits, "iters": args.iters, "cold": args.cold}
    load_before = os.getloadavg()
    all_rows: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    for world in args.world:
        print(
            f"world {world}: {len(args.sizes_kib)} sizes x {1 + 3 * len(args.bits)} rows ...",
            file=sys.stderr,
            flush=True,
        )
        per_rank = run_world(world, opts, args.timeout)
        all_rows += summarize(world, per_rank)
        if args.cold:
            first[str(world)] = [res["first"] for res in per_rank]
    load_after = os.getloadavg()
    print(table(all_rows))
    if first:
        for world, fs in first.items():
            worst = max(f["first_s"] for f in fs)
            like = max(f["warm_after_barrier_s"] for f in fs)
            warm = max(f["warm_s"] for f in fs)
            print(
                f"world {world}: first compressed call {worst * 1e3:.2f} ms; later calls "
                f"started the same way {like * 1e3:.2f} ms ({worst / like:.1f}x), "
                f"back to back {warm * 1e3:.3f} ms ({worst / warm:.1f}x)"
            )
    checks = targets(all_rows, first)
    print_targets(checks)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    path = write_json(
        "latency",
        {
            "rows": all_rows,
            "first_call": first,
            "targets": checks,
            "load_before": load_before,
            "load_after": load_after,
            "iters": args.iters,
        },
        results_dir(args),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
