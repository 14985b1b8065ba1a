"""Does a short cgx job that finishes exit 0, every time? Run one N times and count.

    python tests/clean_exit_loop.py --runs 100            # the issue-12 check
    python tests/clean_exit_loop.py --runs 5 --json r.json

Each run is ``torchrun --standalone --nproc-per-node 2 tests/clean_exit_loop.py --job``:
two ranks join the cgx backend, do a few all_reduces (exact and 4-bit compressed, sync
and async), a broadcast and a barrier, check the results, and call
``destroy_process_group()``. A run counts as failed when torchrun exits non-zero (a
rank crashed, hung past ``--run-timeout``, or died at interpreter exit); its stderr
tail is kept. Runs that exit 0 but print a traceback are counted apart ("noisy").
The command exits 1 when any run failed. ``tests/test_examples.py`` runs it 5 times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def job() -> int:
    """One rank of the short job (under torchrun)."""
    import datetime

    import torch
    import torch.distributed as dist

    import cgx_ucx

    torch.set_num_threads(1)
    dist.init_process_group("cgx", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2
    for _ in range(3):
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, expected)), t[:4]
    group = dist.new_group(
        backend="cgx",
        pg_options=cgx_ucx.CGXOptions(compression=cgx_ucx.CompressionConfig(bits=4)),
    )
    t = torch.linspace(-1, 1, 4096) * (rank + 1)
    work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()
    ref = torch.linspace(-1, 1, 4096) * expected
    assert (t - ref).abs().max() < 0.2 * expected, (t - ref).abs().max()
    b = torch.arange(10.0) if rank == 0 else torch.zeros(10)
    dist.broadcast(b, 0)
    assert torch.equal(b, torch.arange(10.0))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def loop(runs: int, run_timeout: float) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", str(Path(__file__).resolve()), "--job"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CGX_COMPRESSION_QUANTIZATION_BITS", None)
    failed, noisy, seconds = [], [], []
    for i in range(runs):
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=run_timeout
            )
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = "timeout"
            err = (exc.stderr or b"").decode(errors="replace") if exc.stderr else ""
        seconds.append(round(time.monotonic() - t0, 1))
        if rc != 0:
            failed.append({"run": i, "rc": rc, "stderr_tail": err[-3000:]})
        elif "Traceback" in err:
            noisy.append({"run": i, "stderr_tail": err[-3000:]})
        print(f"run {i + 1}/{runs}: rc {rc} ({seconds[-1]} s)", flush=True)
    return {"runs": runs, "failed": failed, "noisy": noisy, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help="be one rank (torchrun runs this)")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--run-timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--json", help="write the counts and failures here")
    args = parser.parse_args(argv)
    if args.job:
        return job()
    report = loop(args.runs, args.run_timeout)
    for f in report["failed"]:
        print(f"--- run {f['run']} exited {f['rc']} ---\n{f['stderr_tail']}", file=sys.stderr)
    print(
        f"{len(report['failed'])} of {args.runs} runs exited non-zero; "
        f"{len(report['noisy'])} exited 0 with a traceback on stderr"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
