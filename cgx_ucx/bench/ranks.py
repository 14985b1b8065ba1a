"""Rank processes on the emulated links: one per rank, one shared deadline, their outputs.

:meth:`cgx_ucx.bench.netns.LinkEmulator.run_ranks` starts each rank in its namespace through
:func:`run_processes` and reports failures with :func:`raise_for_results`.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import CGXTimeoutError, TransportError

__all__ = ["RankResult", "raise_for_results", "run_processes"]


@dataclass(frozen=True)
class RankResult:
    """What one rank process left behind."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


def run_processes(
    start: Callable[[int, IO[str]], subprocess.Popen[Any]],
    world_size: int,
    *,
    timeout: float,
    grace: float,
    progress: Callable[[int, str], None] | None,
) -> tuple[list[subprocess.Popen[Any]], list[RankResult], bool]:
    """Start rank ``r`` with ``start(r, stdout_file)`` (its stderr a pipe), wait, collect.

    Waits until every process ended, the deadline (``timeout`` from now) passed, or
    ``grace`` seconds after the first failure; kills what still runs. ``progress(rank,
    line)`` sees every stderr line as it arrives. Returns the processes, their results and
    whether the deadline passed with no failure.
    """
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="cgxlink-") as tmp:
        procs = []
        outs = []
        for rank in range(world_size):
            out = open(Path(tmp) / f"{rank}.out", "w+")  # noqa: SIM115 (closed below)
            outs.append(out)
            procs.append(start(rank, out))
        errs: list[list[str]] = [[] for _ in procs]
        readers = [
            threading.Thread(target=_pump, args=(p.stderr, errs[r], r, progress), daemon=True)
            for r, p in enumerate(procs)
        ]
        for t in readers:
            t.start()
        failed_at: float | None = None
        timed_out = False
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + grace):
                timed_out = failed_at is None
                break
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5.0)
        for t in readers:
            t.join(timeout=5.0)
        results = []
        for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
            out.seek(0)
            results.append(RankResult(rank, p.returncode, out.read(), "".join(errs[rank])))
            out.close()
    return procs, results, timed_out


def raise_for_results(results: Sequence[RankResult], timed_out: bool, timeout: float) -> None:
    """:class:`CGXTimeoutError` when the deadline passed, :class:`TransportError` with the
    stderr tails when a rank failed; nothing when every rank exited 0."""
    if timed_out:
        raise CGXTimeoutError(
            f"ranks did not finish within {timeout} s; stderr tails:\n" + _tails(results)
        )
    bad = [r for r in results if r.returncode != 0]
    if bad:
        raise TransportError(
            f"rank(s) {[r.rank for r in bad]} failed (exit "
            f"{[r.returncode for r in bad]}); stderr tails:\n" + _tails(bad)
        )


def _pump(
    stream: Any, sink: list[str], rank: int, progress: Callable[[int, str], None] | None
) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if progress is not None:
            progress(rank, line)
    stream.close()


def _tails(results: Sequence[RankResult], lines: int = 25) -> str:
    parts = []
    for r in results:
        tail = "".join(r.stderr.splitlines(keepends=True)[-lines:])
        parts.append(f"--- rank {r.rank} (exit {r.returncode}) ---\n{tail}")
    return "\n".join(parts)
