"""A torchft job on this host: a Lighthouse and replica groups (one process each, started
from :mod:`.ft_worker`), killed and restarted on demand, their reports read back.

Used by ``python -m cgx_ucx.bench ft``, examples/torchft_train.py and the torchft tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FtJob", "Lighthouse", "read_reports"]


class Lighthouse:
    """torchft's Lighthouse server in this process.

    ``heartbeat_timeout_ms`` is how long a silent replica group stays in the quorum;
    ``join_timeout_ms`` how long a quorum waits for groups of the previous one.
    """

    def __init__(
        self,
        min_replicas: int = 1,
        join_timeout_ms: int = 1000,
        heartbeat_timeout_ms: int = 1000,
        quorum_tick_ms: int = 50,
        bind: str = "[::]:0",
    ) -> None:
        from torchft._torchft import LighthouseServer

        self._server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )

    @property
    def address(self) -> str:
        return self._server.address()

    def shutdown(self) -> None:
        self._server.shutdown()


def serve_lighthouse(argv: Sequence[str] | None = None) -> int:
    """``python -m cgx_ucx.bench.ft_jobs --port P``: a Lighthouse in its own process (in a
    network namespace of the benchmark); prints ``ready`` and serves until killed."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m cgx_ucx.bench.ft_jobs")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--join-timeout-ms", type=int, default=1000)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    args = p.parse_args(argv)
    server = Lighthouse(
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        bind=f"[::]:{args.port}",
    )
    print("ready", server.address, flush=True)
    while True:  # the server lives as long as this reference
        time.sleep(3600)


def read_reports(out: Path | str, replica: int) -> list[dict[str, Any]]:
    """The JSON lines replica group ``replica`` wrote (all its incarnations), in order."""
    path = Path(out) / f"replica{replica}.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by SIGKILL
            continue
    return rows


@dataclass
class FtJob:
    """Replica groups of one job; each is ``python -m cgx_ucx.bench.ft_worker`` with
    ``args`` plus its replica id (``prefix(replica)`` may run it inside a network
    namespace, ``host(replica)`` names the address its store listens on)."""

    lighthouse: str
    out: Path
    args: Sequence[str]
    env: Callable[[int], dict[str, str]] = lambda replica: {}
    prefix: Callable[[int], list[str]] = lambda replica: []
    host: Callable[[int], str] = lambda replica: "127.0.0.1"
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    #: Replica groups told to SIGKILL themselves (their death is not a failure).
    dying: set[int] = field(default_factory=set)

    def start(self, replica: int, extra: Sequence[str] = ()) -> None:
        """Start replica group ``replica`` (``extra``: more worker arguments)."""
        cmd = [
            *self.prefix(replica),
            sys.executable,
            "-m",
            "cgx_ucx.bench.ft_worker",
            *self.args,
            "--replica-id",
            str(replica),
            "--lighthouse",
            self.lighthouse,
            "--host",
            self.host(replica),
            "--hostname",
            self.host(replica),
            "--out",
            str(self.out),
            *extra,
        ]
        log = open(Path(self.out) / f"replica{replica}.log", "a")  # noqa: SIM115
        with log:
            self.procs[replica] = subprocess.Popen(
                cmd, env={**os.environ, **self.env(replica)}, stdout=log, stderr=subprocess.STDOUT
            )

    def start_together(self, replicas: Sequence[int], timeout: float, die: dict[int, int]) -> None:
        """Start ``replicas`` and let them train once every one is ready (imports done,
        model built), so the first quorum holds them all. ``die``: replica -> the step at
        which it SIGKILLs itself."""
        go = Path(self.out) / "go"
        go.unlink(missing_ok=True)
        self.dying |= set(die)
        for r in replicas:
            extra = ["--wait-go", "--start-with", str(len(replicas))]
            extra += ["--die-at", str(die[r])] if r in die else []
            self.start(r, extra)

        def ready() -> bool:
            return all(
                any(row.get("event") == "ready" for row in read_reports(self.out, r))
                for r in replicas
            )

        self.wait_for(ready, timeout, "every replica group ready")
        go.touch()

    def died(self, replica: int) -> float | None:
        """When replica group ``replica`` was killed (its last report; None: it runs)."""
        proc = self.procs[replica]
        if proc.poll() is None:
            return None
        if proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"replica group {replica} exited with {proc.returncode}")
        rows = read_reports(self.out, replica)
        self.procs.pop(replica)
        self.dying.discard(replica)
        return rows[-1]["t"] if rows else time.time()

    def kill(self, replica: int) -> float:
        """SIGKILL replica group ``replica``; returns the time of the kill."""
        proc = self.procs.pop(replica)
        t = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return t

    def steps(self, replica: int) -> int:
        """The last manager step replica group ``replica`` reported (-1: none yet)."""
        rows = [r for r in read_reports(self.out, replica) if "step" in r]
        return rows[-1]["step"] if rows else -1

    def wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > end:
                raise TimeoutError(f"torchft job: {what} within {timeout:g} s")
            dead = [
                r
                for r, p in self.procs.items()
                if p.poll() not in (None, 0)
                and not (r in self.dying and p.returncode == -signal.SIGKILL)
            ]
            if dead:
                codes = {r: self.procs[r].returncode for r in dead}
                raise RuntimeError(
                    f"replica group(s) failed (exit codes {codes}): {self.tail(dead[0])}"
                )
            time.sleep(0.05)

    def wait(self, timeout: float) -> dict[int, int]:
        """Wait for every replica group to exit; their exit codes."""
        end = time.monotonic() + timeout
        codes = {}
        for replica, proc in self.procs.items():
            try:
                codes[replica] = proc.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                codes[replica] = None  # type: ignore[assignment]
        return codes

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def tail(self, replica: int, lines: int = 30) -> str:
        path = Path(self.out) / f"replica{replica}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    raise SystemExit(serve_lighthouse())
