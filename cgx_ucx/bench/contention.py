"""DDP step time under CPU contention: cgx 4-bit against gloo, with and without a CPU hog.

    python -m cgx_ucx.bench contention [--world 2] [--hogs 8] [--steps 150] [--repeats 2]

A user's machine is rarely idle: data loaders, other jobs and the ranks themselves
compete for cores. A communication library that spins (busy progress loops, helper
threads) degrades faster than one that sleeps while it waits. This benchmark trains the
same DDP model on ``--world`` ranks (loopback, this host) with plain gloo and with the
``cgx`` backend plus ``cgx_hook`` at 4 bits, first on a quiet machine and then beside
``--hogs`` busy-looping processes, in rotating order, ``--repeats`` times each.

Reported per run: the median step time (after 20 warm-up steps) and the slowdown under the
hog (hog / quiet). The figure of merit is cgx's slowdown divided by gloo's (the target: at
most 1.5). Prints a table and writes ``contention.json`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .report import (
    MAX_LOCAL_RANKS,
    HelpFormatter,
    add_output_args,
    count_arg,
    format_table,
    positive_number,
    ranks_arg,
    results_dir,
    write_json,
)

__all__ = ["main"]

#: Steps not counted at the start of every run (JIT, first-touch, DDP's bucket rebuild).
WARMUP_STEPS = 20


def _hog(stop: Any) -> None:  # pragma: no cover - a busy loop in a child process
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _usage() -> tuple[float, int]:
    """This process's CPU seconds (every thread) and voluntary context switches (a thread
    went to sleep: each is a wake-up the scheduler must grant again)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_nvcsw


def _train(
    method: str, pg: Any, steps: int, hidden: int, seed: int
) -> tuple[list[float], tuple[float, int]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..torch import CGXState, cgx_hook

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )
    ddp = DDP(model, process_group=pg)
    if method == "cgx4":
        state = CGXState(pg, compression_params={"bits": 4, "bucket_size": 1024})
        ddp.register_comm_hook(state, cgx_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed + pg.rank())
    x = torch.randn(32, 64, generator=gen)
    y = torch.randint(0, 10, (32,), generator=gen)
    times: list[float] = []
    usage = _usage()
    for i in range(steps):
        if i == WARMUP_STEPS:
            usage = _usage()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    cpu, switches = _usage()
    counted = max(steps - WARMUP_STEPS, 1)
    return times, ((cpu - usage[0]) / counted, round((switches - usage[1]) / counted))


def _rank(rank: int, world: int, port: int, opts: dict[str, Any], q: Any, go: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        import cgx_ucx  # noqa: F401  (registers the backend)

        torch.set_num_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=300)
        )
        dist.init_process_group(
            "cgx", store=dist.PrefixStore("cgx", store), rank=rank, world_size=world
        )
        gloo = dist.new_group(backend="gloo")
        groups = {"gloo": gloo, "cgx4": dist.group.WORLD}
        for run in opts["schedule"]:
            dist.barrier(group=gloo)
            if rank == 0:
                q.put(("ready", run))
                go.wait()
                go.clear()
            dist.barrier(group=gloo)
            times, per_step = _train(
                run["method"], groups[run["method"]], opts["steps"], opts["hidden"], 0
            )
            q.put(("run", rank, run, float(np.median(times[WARMUP_STEPS:])), per_step))
        dist.barrier(group=gloo)
        dist.destroy_process_group()
        q.put(("done", rank))
    except BaseException as exc:
        import traceback

        q.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _schedule(repeats: int) -> list[dict[str, Any]]:
    """Quiet and hogged runs of both methods, in rotating order."""
    out = []
    for r in range(repeats):
        methods = ["gloo", "cgx4"] if r % 2 == 0 else ["cgx4", "gloo"]
        for hog in (False, True):
            for m in methods:
                out.append({"method": m, "hog": hog, "repeat": r})
    return out


def _drive(args: argparse.Namespace, schedule: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    master = dist.TCPStore("127.0.0.1", port, args.world + 1, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    opts = {"schedule": schedule, "steps": args.steps, "hidden": args.hidden}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = [
        ctx.Process(target=_rank, args=(r, args.world, port, opts, q, go))
        for r in range(args.world)
    ]
    for p in ranks:
        p.start()
    hogs: list[Any] = []
    results: list[dict[str, Any]] = []
    done = 0
    deadline = time.monotonic() + args.timeout
    try:
        while done < args.world:
            if time.monotonic() > deadline:
                raise TimeoutError("the contention benchmark did not finish in time")
            try:
                msg = q.get(timeout=1.0)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in ranks):
                    raise RuntimeError("a rank died") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"rank {msg[1]}: {msg[2]}")
            if msg[0] == "ready":
                stop.set()
                for h in hogs:
                    h.join(5)
                hogs, stop = [], ctx.Event()
                if msg[1]["hog"]:
                    hogs = [ctx.Process(target=_hog, args=(stop,)) for _ in range(args.hogs)]
                    for h in hogs:
                        h.start()
                    time.sleep(0.5)
                print(f"run {msg[1]}", file=sys.stderr, flush=True)
                go.set()
            elif msg[0] == "run":
                _, rank, run, med, (cpu, switches) = msg
                results.append(
                    {**run, "rank": rank, "median_s": med, "cpu_s": cpu, "switches": switches}
                )
            elif msg[0] == "done":
                done += 1
    finally:
        stop.set()
        for h in hogs:
            h.join(5)
        for p in ranks:
            p.join(10)
            if p.is_alive():
                p.kill()
        del master
    return results


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeats of the slowest rank's median step time, per method and hog."""
    by: dict[tuple[str, bool, int], float] = {}
    for r in results:
        key = (r["method"], r["hog"], r["repeat"])
        by[key] = max(by.get(key, 0.0), r["median_s"])
    out: dict[str, Any] = {}
    for method in ("gloo", "cgx4"):
        quiet = float(np.median([v for (m, h, _), v in by.items() if m == method and not h]))
        hog = float(np.median([v for (m, h, _), v in by.items() if m == method and h]))
        out[method] = {"quiet_ms": quiet * 1e3, "hog_ms": hog * 1e3, "slowdown": hog / quiet}
        for hogged, name in ((False, "quiet"), (True, "hog")):
            runs = [r for r in results if r["method"] == method and r["hog"] == hogged]
            if runs and "cpu_s" in runs[0]:
                cpu = float(np.median([r["cpu_s"] for r in runs]))
                out[method][f"{name}_cpu_ms"] = cpu * 1e3
                out[method][f"{name}_switches"] = float(np.median([r["switches"] for r in runs]))
    out["cgx_vs_gloo_slowdown"] = out["cgx4"]["slowdown"] / out["gloo"]["slowdown"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench contention",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--world", type=ranks_arg(2), default=2, help="ranks")
    ap.add_argument(
        "--hogs",
        type=count_arg(0, MAX_LOCAL_RANKS, "processes started on this one machine"),
        default=8,
        help="busy-looping processes beside the job",
    )
    ap.add_argument(
        "--steps", type=count_arg(WARMUP_STEPS + 1), default=150, help="training steps per run"
    )
    ap.add_argument("--hidden", type=count_arg(1), default=512, help="MLP width")
    ap.add_argument("--repeats", type=count_arg(1), default=2, help="runs per method and condition")
    ap.add_argument(
        "--timeout", type=positive_number, default=1200.0, help="seconds for everything"
    )
    add_output_args(ap)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    results = _drive(args, _schedule(args.repeats))
    summary = summarize(results)
    rows = [
        [m, round(s["quiet_ms"], 2), round(s["hog_ms"], 2), round(s["slowdown"], 2),
         round(s.get("quiet_cpu_ms", 0), 2), round(s.get("hog_cpu_ms", 0), 2),
         s.get("quiet_switches"), s.get("hog_switches")]
        for m, s in summary.items()
        if isinstance(s, dict)
    ]  # fmt: skip
    headers = ["method", "quiet ms/step", f"{args.hogs} hogs ms/step", "slowdown"]
    headers += ["quiet CPU ms/step", "hogs CPU ms/step", "quiet sleeps/step", "hogs sleeps/step"]
    print(format_table(headers, rows))
    print("CPU: a rank's, every thread; sleeps: its threads' voluntary context switches")
    print(f"cgx slowdown / gloo slowdown: {summary['cgx_vs_gloo_slowdown']:.2f} (target <= 1.5)")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    record = {
        "args": vars(args),
        "summary": summary,
        "runs": results,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    path = write_json("contention", record, results_dir(args))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
