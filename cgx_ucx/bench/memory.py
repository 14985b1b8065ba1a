"""Memory benchmark: what an allreduce costs in resident memory, cgx_ucx next to gloo.

    python -m cgx_ucx.bench memory [--sizes 16 64 256 1024] [--bits 32 4] [--world 2]
                                   [--calls 3] [--link-rate 1gbit]

For every buffer size (MiB of float32) and method (gloo, then cgx at each bit width), a
fresh set of ranks is started as torchrun would start them (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``... and ``init_process_group`` through ``env://``), so that no method
inherits another's memory. Each rank:

1. joins the group (``init_process_group("gloo")`` or ``("cgx")`` with
   ``CGX_COMPRESSION_QUANTIZATION_BITS``) and records its RSS after one barrier;
2. makes one random tensor of the size and a clone of it (the clone is reduced);
3. runs ``--calls`` ``all_reduce`` calls of the clone, recording RSS after each;
4. frees the clone, waits :data:`HELD_AFTER_S` (past the staging pool's release delay,
   :data:`cgx_ucx.collectives.staging.RELEASE_AFTER_S`, which calls made back to back
   do not lengthen; every method waits alike) and
   records the RSS it still holds (in parts too: private, pages of mapped files such as
   shared libraries, which the processes mapping them share, and shared memory), and
   its peak (``VmHWM``) from
   the end of step 1 on (``peak_init_mib``: the peak of step 1 itself, which holds
   one-off costs such as compiling kernels).

For cgx the communicator's own staging accounting is recorded too (bytes kept idle for
the next calls, and the peak of held and idle bytes). Rank 0's figures are reported;
``peak_mib_max`` is the largest peak over all ranks.

``--link-rate 1gbit`` runs the ranks in network namespaces joined by a shaped link
(:mod:`cgx_ucx.bench.netns`, needs root and iproute2) instead of on loopback.

Shows progress (one step per size and method), prints a table and writes ``memory.json``
(``memory_<rate>.json`` with a link rate) to ``--out-dir`` (default: a new
``./cgx_bench_results/<timestamp>/``; ``--refresh-tracked``: the checkout's
``benchmarks/results/``). The load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from .link_args import rate_arg
from .netns import missing_prerequisites
from .report import (
    HelpFormatter,
    Progress,
    add_output_args,
    arg_error,
    bits_arg,
    check_rank_buffers,
    count_arg,
    format_table,
    positive_number,
    ranks_arg,
    results_dir,
    write_json,
)
from .shaping import format_rate

MiB = 1 << 20
#: Buffers of a size each rank holds at once: the tensor, its clone, and the backend's
#: staging (about 2 more at most).
BUFFERS_PER_RANK = 4
#: The line a worker prints its result on (rank 0's is read).
RESULT_TAG = "CGX_MEMORY_RESULT "
#: Targets of a cgx row against gloo's row of the same size, for sizes of at least
#: TARGET_MIN_MIB: RSS held after the calls at most gloo's plus HELD_SLACK x the buffer,
#: peak at most gloo's peak plus PEAK_SLACK x the buffer; RSS after init at most gloo's plus
#: INIT_SLACK_MIB.
HELD_SLACK = 0.25
PEAK_SLACK = 0.5
#: Seconds between freeing the clone and reading the RSS held: the staging pool's
#: release delay and a margin.
HELD_AFTER_S = 2.0
INIT_SLACK_MIB = 100
TARGET_MIN_MIB = 256


def _status_mib(field: str) -> float:
    """A ``/proc/self/status`` figure (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Start ``VmHWM`` again from the current RSS (Linux ``clear_refs``); False where the
    kernel refuses (the peak then counts from the process's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _staging(comm: Any) -> dict[str, float] | None:
    """The cgx communicator's staging accounting in MiB (None for gloo)."""
    if comm is None:
        return None
    pool = comm._pool  # noqa: SLF001 (the benchmark reads the pool's own accounting)
    return {k: v / MiB for k, v in pool.usage().items()}


def _worker(method: str, size_mib: float, calls: int) -> int:
    """One rank of one (method, size) run; prints its figures on a RESULT_TAG line."""
    import datetime

    import torch
    import torch.distributed as dist

    backend = "gloo"
    if method != "gloo":
        import cgx_ucx  # noqa: F401  (registers the backend)

        backend = "cgx"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    dist.barrier()
    gc.collect()
    rec: dict[str, Any] = {"rank": rank, "rss_init_mib": _status_mib("VmRSS")}
    rec["peak_init_mib"] = _status_mib("VmHWM")
    rec["peak_since"] = "init" if _reset_peak() else "start"
    comm = dist.group.WORLD.communicator.comm if backend == "cgx" else None
    n = int(size_mib * MiB) // 4
    t = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    clone = t.clone()
    rec["rss_tensor_mib"] = _status_mib("VmRSS")
    after, seconds = [], []
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(clone)
        seconds.append(time.perf_counter() - start)
        after.append(_status_mib("VmRSS"))
    rec["rss_after_calls_mib"] = after
    rec["call_s"] = seconds
    del clone
    gc.collect()
    # Held between calls: after the pool's release delay (idle staging over the cap goes
    # back once no call used it for that long), the same wait for every method.
    time.sleep(HELD_AFTER_S)
    staging = _staging(comm)
    rec["rss_held_mib"] = _status_mib("VmRSS")
    # RSS in parts: private memory, and pages of mapped files (shared libraries: what
    # every process that maps them shares, resident once per host).
    rec["rss_held_anon_mib"] = _status_mib("RssAnon")
    rec["rss_held_file_mib"] = _status_mib("RssFile")
    rec["rss_held_shmem_mib"] = _status_mib("RssShmem")
    rec["peak_mib"] = _status_mib("VmHWM")
    rec["staging_mib"] = staging
    dist.barrier()
    print(RESULT_TAG + json.dumps(rec), flush=True)
    del t
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _method_env(method: str) -> dict[str, str]:
    if method == "gloo":
        return {}
    return {"CGX_COMPRESSION_QUANTIZATION_BITS": method[3:]}


def _run_one(
    method: str, size_mib: float, args: argparse.Namespace, emulator: Any
) -> list[dict[str, Any]]:
    """Every rank's record of one (method, size) run."""
    from .ranks import raise_for_results, run_processes

    argv = [
        sys.executable, "-m", "cgx_ucx.bench.memory", "--worker", "--method", method,
        "--size-mib", repr(size_mib), "--calls", str(args.calls),
    ]  # fmt: skip
    extra = {**_method_env(method), "OMP_NUM_THREADS": "1"}
    if emulator is not None:
        results = emulator.run_ranks(argv, timeout=args.timeout, env=extra)
    else:
        port = _free_port()

        def start(rank: int, out: IO[str]) -> subprocess.Popen[Any]:
            env = dict(os.environ, **extra)
            env.update(
                RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(args.world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.PIPE, text=True)

        _, results, timed_out = run_processes(
            start, args.world, timeout=args.timeout, grace=10.0, progress=None
        )
        raise_for_results(results, timed_out, args.timeout)
    recs = []
    for r in results:
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        if not lines:
            raise RuntimeError(f"rank {r.rank} printed no result")
        recs.append(json.loads(lines[-1][len(RESULT_TAG) :]))
    return sorted(recs, key=lambda rec: rec["rank"])


def _row(method: str, size_mib: float, recs: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = recs[0]
    return {
        "size_mib": size_mib,
        "method": method,
        **{k: v for k, v in r0.items() if k != "rank"},
        "held_over_init_mib": r0["rss_held_mib"] - r0["rss_init_mib"],
        "peak_mib_max": max(r["peak_mib"] for r in recs),
    }


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cgx row against gloo's of its size: the three memory targets (HELD_SLACK,
    PEAK_SLACK, INIT_SLACK_MIB), evaluated."""
    gloo = {r["size_mib"]: r for r in rows if r["method"] == "gloo"}
    out = []
    for r in rows:
        g = gloo.get(r["size_mib"])
        if r["method"] == "gloo" or g is None:
            continue
        held = r["rss_held_mib"] - g["rss_held_mib"]
        peak = r["peak_mib"] - g["peak_mib"]
        init = r["rss_init_mib"] - g["rss_init_mib"]
        parts = {
            f"held_{part}_over_gloo_mib": r[f"rss_held_{part}_mib"] - g[f"rss_held_{part}_mib"]
            for part in ("anon", "file", "shmem")
        }
        checked = r["size_mib"] >= TARGET_MIN_MIB
        out.append(
            {
                "size_mib": r["size_mib"],
                "method": r["method"],
                "held_over_gloo_mib": held,
                "peak_over_gloo_mib": peak,
                "init_over_gloo_mib": init,
                **parts,
                "held_ok": held <= HELD_SLACK * r["size_mib"] if checked else None,
                "peak_ok": peak <= PEAK_SLACK * r["size_mib"] if checked else None,
                "init_ok": init <= INIT_SLACK_MIB,
            }
        )
    return out


def _link_rate_arg(text: str) -> str:
    """An argparse ``type``: a link rate as ``bench link --rates`` takes it, written in
    tc's units (``1000mbit`` -> ``1gbit``: the name of the result file)."""
    return format_rate(rate_arg(text))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench memory", description=__doc__, formatter_class=HelpFormatter
    )
    ap.add_argument("--world", type=ranks_arg(2), default=2, help="ranks on this host")
    ap.add_argument(
        "--sizes", type=positive_number, nargs="+", default=[16, 64, 256, 1024], help="MiB"
    )
    ap.add_argument("--bits", type=bits_arg, nargs="+", default=[32, 4], help="cgx bit widths")
    ap.add_argument("--calls", type=count_arg(1), default=3, help="all_reduce calls per run")
    ap.add_argument(
        "--link-rate",
        type=_link_rate_arg,
        default=None,
        help="emulated link rate, e.g. 1gbit (root; default: loopback)",
    )
    ap.add_argument("--timeout", type=positive_number, default=900.0, help="seconds per run")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_output_args(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="gloo", help=argparse.SUPPRESS)
    ap.add_argument("--size-mib", type=positive_number, default=1.0, help=argparse.SUPPRESS)
    return ap


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.timeout != args.timeout or args.timeout == float("inf"):
        arg_error(ap, "--timeout", f"must be a finite number of seconds, got {args.timeout}")
    largest = max(args.sizes)
    check_rank_buffers(
        ap, "--sizes", args.world, BUFFERS_PER_RANK, largest * MiB, f"{largest:g} MiB"
    )
    if args.link_rate is not None:
        missing = missing_prerequisites()
        if missing:
            arg_error(ap, "--link-rate", f"link emulation needs {', '.join(missing)}")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        return _worker(args.method, args.size_mib, args.calls)
    _check_args(ap, args)
    out_dir = results_dir(args)
    methods = ["gloo", *(f"cgx{b}" for b in args.bits)]
    load_before = os.getloadavg()
    bar = Progress(len(args.sizes) * len(methods), "memory", disable=args.quiet)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        stack.callback(bar.close)
        emulator = None
        if args.link_rate is not None:
            from .netns import LinkEmulator

            emulator = stack.enter_context(LinkEmulator(args.world, args.link_rate))
        for size_mib in args.sizes:
            for method in methods:
                rows.append(_row(method, size_mib, _run_one(method, size_mib, args, emulator)))
                bar.update(note=f"{size_mib:g} MiB {method}")
    load_after = os.getloadavg()
    table = [
        [
            r["size_mib"], r["method"], r["rss_init_mib"], r["held_over_init_mib"],
            r["peak_mib"], r["rss_held_file_mib"],
            (r["staging_mib"] or {}).get("idle", float("nan")),
            (r["staging_mib"] or {}).get("peak", float("nan")), 1e3 * min(r["call_s"]),
        ]
        for r in rows
    ]  # fmt: skip
    print(
        format_table(
            ["MiB", "method", "RSS init", "held - init", "peak (HWM)", "held file-backed",
             "staging idle", "staging peak", "best ms/call"],
            table,
        )
    )  # fmt: skip
    checks = targets(rows)
    for c in checks:
        if c["held_ok"] is not None:
            print(
                f"{c['size_mib']:g} MiB {c['method']}: held {c['held_over_gloo_mib']:+.0f} MiB, "
                f"peak {c['peak_over_gloo_mib']:+.0f} MiB, init {c['init_over_gloo_mib']:+.0f} "
                f"MiB over gloo (targets +{HELD_SLACK:g}x, +{PEAK_SLACK:g}x the buffer, "
                f"+{INIT_SLACK_MIB} MiB)"
            )
            print(
                f"    of the held: {c['held_anon_over_gloo_mib']:+.0f} MiB private, "
                f"{c['held_file_over_gloo_mib']:+.0f} MiB pages of mapped files, "
                f"{c['held_shmem_over_gloo_mib']:+.0f} MiB shared memory"
            )
    cpus = os.cpu_count()
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({cpus} CPUs)")
    name = "memory" if args.link_rate is None else f"memory_{args.link_rate}"
    path = write_json(
        name,
        {
            "args": {
                k: v
                for k, v in vars(args).items()
                if k not in ("refresh_tracked", "worker", "method", "size_mib")
            },
            "link_rate": args.link_rate or "loopback",
            "world": args.world,
            "calls": args.calls,
            "memory": rows,
            "targets": checks,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        out_dir,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
