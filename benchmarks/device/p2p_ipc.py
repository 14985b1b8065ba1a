"""Point-to-point bandwidth of the communicator between two processes of one GPU.

    python benchmarks/device/p2p_ipc.py [--sizes MiB ...] [--device auto|cuda|cpu] --out-dir DIR

Two spawned processes join one communicator (TCPStore on 127.0.0.1). Rank 0 streams a
buffer to rank 1 with :meth:`Communicator.send`, ``WINDOW`` sends in flight, as
``ucx_perftest -t tag_bw`` does; rank 1 receives them and answers once. On CUDA the
buffers are CuPy arrays on GPU 0 of both processes, so UCX moves them with cuda_ipc; the
transport UCX chose is recorded from the communicator's stats. Next to it, in the same
run: a device-to-device copy of the same bytes (CUDA events; ``np.copyto`` on the CPU),
and ``ucx_perftest`` of the libucx wheel between two processes with the same memory type
(``-m cuda`` on CUDA), when the wheel ships it.

Writes ``p2p_ipc.json`` (with the provenance block of every benchmark result) and prints
one line: the largest size's bandwidth against the copy and ucx_perftest. Exit status 1
when the processes failed, or on CUDA when UCX did not pick cuda_ipc.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from cgx_ucx.bench.report import format_table, write_json  # noqa: E402

MIB = 1 << 20
#: Sends in flight (ucx_perftest's tag_bw keeps a window too).
WINDOW = 16
#: Bytes moved per size and measurement, about: enough to average, bounded in time.
BYTES_PER_SIZE = 2 << 30


def _iters(nbytes: int, cap: int) -> int:
    return int(min(max(BYTES_PER_SIZE // max(nbytes, 1), 4), cap))


def _xp(device: str) -> Any:
    if device == "cuda":
        import cupy

        cupy.cuda.Device(0).use()
        return cupy
    import numpy

    return numpy


async def _stream(rank: int, port: int, opts: dict[str, Any]) -> dict[str, Any]:
    import datetime

    import torch.distributed as dist

    from cgx_ucx.collectives import connect

    xp = _xp(opts["device"])
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    comm = await connect(store, rank, 2)
    rows = []
    try:
        ack = xp.zeros(1, xp.uint8)
        for size in opts["sizes"]:
            nbytes = int(size * MIB)
            buf = xp.ones(nbytes, xp.uint8)
            iters = _iters(nbytes, opts["max_iters"])
            if rank == 0:  # warm-up: first-touch, registration
                await comm.send(buf, 1)
            else:
                await comm.recv(buf, 0)
            await comm.barrier()
            start = time.perf_counter()
            if rank == 0:
                window: list[asyncio.Future] = []
                for _ in range(iters):
                    window.append(asyncio.ensure_future(comm.send(buf, 1)))
                    if len(window) >= WINDOW:
                        await window.pop(0)
                await asyncio.gather(*window)
                await comm.recv(ack, 1, tag=1)
            else:
                window = []
                for _ in range(iters):
                    window.append(asyncio.ensure_future(comm.recv(buf, 0)))
                    if len(window) >= WINDOW:
                        await window.pop(0)
                await asyncio.gather(*window)
                await comm.send(ack, 0, tag=1)
            elapsed = time.perf_counter() - start
            rows.append({"MiB": size, "iters": iters, "GBps": nbytes * iters / elapsed / 1e9})
        transports = dict(comm.transport.stats.transports)
        await comm.barrier()  # neither closes while the other still reads
    finally:
        await comm.close()
    return {"rows": rows, "transports": {str(k): v for k, v in transports.items()}}


def _child(rank: int, port: int, opts: dict[str, Any], q: Any) -> None:
    try:
        q.put((rank, "ok", asyncio.run(_stream(rank, port, opts))))
    except BaseException as exc:  # reported by the parent
        import traceback

        q.put((rank, "error", f"{exc!r}\n{traceback.format_exc()}"))


def _run_pair(opts: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, master.port, opts, q)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < 2:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the two processes did not finish within {timeout:g} s")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a process died") from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return [results[0], results[1]]


def _copy_gbps(device: str, nbytes: int, repeat: int = 10) -> float:
    """Bytes per second of a copy of ``nbytes`` within the device (median of ``repeat``)."""
    xp = _xp(device)
    src, dst = xp.ones(nbytes, xp.uint8), xp.empty(nbytes, xp.uint8)
    times = []
    for i in range(repeat + 2):
        if device == "cuda":
            start, end = xp.cuda.Event(), xp.cuda.Event()
            start.record()
            dst[...] = src
            end.record()
            end.synchronize()
            t = xp.cuda.get_elapsed_time(start, end) / 1e3
        else:
            t0 = time.perf_counter()
            xp.copyto(dst, src)
            t = time.perf_counter() - t0
        if i >= 2:
            times.append(t)
    return nbytes / statistics.median(times) / 1e9


def perftest_gbps(nbytes: int, iters: int, device: str, timeout: float) -> float | str:
    """``ucx_perftest -t tag_bw`` between two processes of this host (GB/s), with the
    buffers in ``device`` memory; else why there is no figure."""
    try:
        import libucx
    except ImportError:
        return "no libucx wheel"
    root = Path(libucx.__file__).parent
    exe = root / "bin" / "ucx_perftest"
    if not exe.exists():
        return "not in the libucx wheel"
    env = dict(os.environ, LD_LIBRARY_PATH=str(root / "lib"))
    port = str(20000 + os.getpid() % 20000)
    args = ["-t", "tag_bw", "-s", str(nbytes), "-n", str(iters), "-p", port]
    if device == "cuda":
        args += ["-m", "cuda"]
    server = subprocess.Popen(
        [str(exe), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        done = subprocess.run(
            [str(exe), "127.0.0.1", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out = done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        out = f"ran past {timeout:g} s"
    finally:
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
    m = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)", out)
    return (
        float(m.group(2)) * MIB / 1e9
        if m
        else "no result (" + (out.strip()[-200:] or "no output") + ")"
    )


def _shown(perf: float | str) -> str:
    return f"{perf:.1f} GB/s" if isinstance(perf, float) else perf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64, 256], help="MiB")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--max-iters", type=int, default=200, help="transfers per size at most")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for the pair")
    ap.add_argument("--no-perftest", action="store_true")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        try:
            import cupy

            device = "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
        except Exception:  # no CuPy, no driver, no device: the host path
            device = "cpu"
    if device == "cuda":
        try:
            _xp("cuda")
        except Exception as exc:  # say so at once instead of from both children
            print(f"p2p failed: no usable CUDA device ({exc!r})", file=sys.stderr)
            return 1
    opts = {"sizes": args.sizes, "device": device, "max_iters": args.max_iters}
    try:
        ranks = _run_pair(opts, args.timeout)
    except (RuntimeError, TimeoutError) as exc:
        print(f"p2p failed: {exc}", file=sys.stderr)
        return 1
    rows = []
    for r in ranks[1]["rows"]:
        nbytes = int(r["MiB"] * MIB)
        copy = _copy_gbps(device, nbytes)
        perf: float | str = "not run"
        if not args.no_perftest:
            perf = perftest_gbps(nbytes, r["iters"], device, timeout=60.0)
        rows.append({**r, "copy_GBps": copy, "vs_copy": r["GBps"] / copy, "perftest_GBps": perf})
    transports = ranks[0]["transports"]
    print(f"device {device}; UCX data transports of rank 0: {transports}")
    table = [
        [r["MiB"], r["iters"], r["GBps"], r["copy_GBps"], r["vs_copy"], _shown(r["perftest_GBps"])]
        for r in rows
    ]
    print(
        format_table(["MiB", "iters", "p2p GB/s", "copy GB/s", "p2p/copy", "perftest GB/s"], table)
    )
    over_ipc = any("cuda_ipc" in v for v in transports.values())
    ok = device != "cuda" or over_ipc
    last = rows[-1]
    perf = _shown(last["perftest_GBps"])
    text = (
        f"{last['MiB']:g} MiB {last['GBps']:.1f} GB/s = {last['vs_copy']:.3f}x the device copy "
        f"({last['copy_GBps']:.1f} GB/s), ucx_perftest {perf}, over "
        + ", ".join(sorted(set(transports.values())))
        + ("" if ok else ": UCX did not pick cuda_ipc")
    )
    path = write_json(
        "p2p_ipc",
        {
            "device": device,
            "window": WINDOW,
            "units": "GB/s of payload; copy = one copy of the same bytes within the device",
            "transports": transports,
            "rows": rows,
            "headline": [
                {"case": f"point-to-point, 2 processes, {device}", "met": ok, "text": text}
            ],
        },
        args.out_dir,
    )
    print(text)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
