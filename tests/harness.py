"""Spawned multi-process test harness: run one function in N real processes.

    results = run_ranks(fn, world_size=3, timeout=30, args=(...))

``fn(ctx, *args, **kwargs)`` may be a plain or an ``async`` function defined at module
level (children are started with the "spawn" method and import it by name). ``ctx`` is a
:class:`RankContext`: rank, world_size, a shared store (``ctx.store``, a small file-based
torch.distributed-Store look-alike: set/get/wait/add/check, no torch import needed),
a shared scratch directory and the common deadline.

All ranks share ONE deadline: when it passes, every child still running is killed and
:class:`RanksTimedOut` lists which ranks hung (with the tracebacks of the others). A
child that raises sends its formatted traceback back; by default the harness re-raises
it in the parent as :class:`RankFailed` (all child tracebacks in the message). With
``check=False`` it returns one :class:`RankResult` per rank instead, for tests that
expect failures (``.ok``, ``.value``, ``.error_type``, ``.error``, ``.peer``,
``.exitcode``; a killed rank has ``exitcode == -9`` and no result).

``env`` sets variables in every child (a dict) or per rank (a callable ``rank -> dict``)
before anything is imported there (UCX reads its variables once, at start-up).
"""

from __future__ import annotations

import asyncio
import fcntl
import inspect
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DirStore",
    "RankContext",
    "RankFailed",
    "RankResult",
    "RanksTimedOut",
    "run_ranks",
]


class DirStore:
    """A torch.distributed-Store look-alike over files in a directory (set/get/wait/add/check).

    Enough for rendezvous between processes of one machine, without importing torch.
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout

    def _file(self, key: str) -> Path:
        return self.path / key.replace("/", "%2F")

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        tmp = self.path / f".{os.getpid()}.{time.monotonic_ns()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self._file(key))

    def check(self, keys: list[str]) -> bool:
        return all(self._file(k).exists() for k in keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if timeout is None:
            limit = self.timeout
        elif hasattr(timeout, "total_seconds"):
            limit = timeout.total_seconds()
        else:
            limit = float(timeout)
        end = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > end:
                raise TimeoutError(f"keys {keys} not set within {limit:g} s")
            time.sleep(0.005)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._file(key).read_bytes()

    def add(self, key: str, amount: int) -> int:
        with open(self.path / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            f = self._file(key)
            value = int(f.read_bytes() or b"0") if f.exists() else 0
            value += amount
            self.set(key, str(value))
            return value


@dataclass
class RankContext:
    rank: int
    world_size: int
    store: DirStore
    shared_dir: str
    deadline: float  # time.time() value shared by all ranks

    @property
    def remaining(self) -> float:
        return max(self.deadline - time.time(), 0.0)


@dataclass
class RankResult:
    rank: int
    ok: bool = False
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    peer: int | None = None
    traceback: str | None = None
    exitcode: int | None = None
    elapsed: float | None = None
    extra: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        if self.ok:
            return f"<rank {self.rank} ok>"
        if self.error_type:
            return f"<rank {self.rank} {self.error_type}: {self.error}>"
        return f"<rank {self.rank} exitcode {self.exitcode}>"


class RankFailed(AssertionError):
    """A child rank raised; the message holds every failing rank's traceback."""

    def __init__(self, results: list[RankResult]) -> None:
        self.results = results
        parts = []
        for r in results:
            if r.traceback:
                parts.append(f"--- rank {r.rank} ---\n{r.traceback}")
            elif not r.ok:
                parts.append(f"--- rank {r.rank} --- exit code {r.exitcode}, no result")
        super().__init__("child rank(s) failed:\n" + "\n".join(parts))


class RanksTimedOut(AssertionError):
    """The shared deadline passed; the hung ranks were killed."""

    def __init__(self, hung: list[int], results: list[RankResult], timeout: float) -> None:
        self.hung, self.results = hung, results
        tbs = "\n".join(f"--- rank {r.rank} ---\n{r.traceback}" for r in results if r.traceback)
        super().__init__(f"ranks {hung} still running after the {timeout:g} s deadline\n{tbs}")


def _child(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    env: dict[str, str],
    shared_dir: str,
    deadline: float,
    conn: mp.connection.Connection,
) -> None:
    os.environ.update(env)
    start = time.perf_counter()
    ctx = RankContext(
        rank, world_size, DirStore(os.path.join(shared_dir, "store")), shared_dir, deadline
    )
    res = RankResult(rank)
    try:
        if inspect.iscoroutinefunction(fn):

            async def main() -> Any:
                return await asyncio.wait_for(fn(ctx, *args, **kwargs), max(ctx.remaining, 0.1))

            res.value = asyncio.run(main())
        else:
            res.value = fn(ctx, *args, **kwargs)
        res.ok = True
    except BaseException as exc:
        res.error_type = type(exc).__name__
        res.error = str(exc)
        res.peer = getattr(exc, "peer", None)
        res.traceback = traceback.format_exc()
    res.elapsed = time.perf_counter() - start
    try:
        conn.send_bytes(pickle.dumps(res))
    except Exception:
        res.value = repr(res.value)
        conn.send_bytes(pickle.dumps(res))
    conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
    check: bool = True,
) -> list[Any] | list[RankResult]:
    """Run ``fn`` in ``world_size`` spawned processes under one shared deadline.

    Returns the per-rank return values (``check=True``, raising :class:`RankFailed` if
    any rank failed) or the :class:`RankResult` list (``check=False``). Raises
    :class:`RanksTimedOut` when ranks are still running at the deadline (they are killed).
    """
    ctx = mp.get_context("spawn")
    deadline = time.time() + timeout
    results: list[RankResult | None] = [None] * world_size
    with tempfile.TemporaryDirectory(prefix="cgx-ranks-") as shared:
        procs, conns = [], {}
        for rank in range(world_size):
            child_env = dict(env(rank) if callable(env) else (env or {}))
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(
                    rank,
                    world_size,
                    fn,
                    args,
                    dict(kwargs or {}),
                    child_env,
                    shared,
                    deadline,
                    send_end,
                ),
                name=f"rank{rank}",
                daemon=True,
            )
            p.start()
            send_end.close()
            procs.append(p)
            conns[recv_end] = rank
        pending = dict(conns)
        try:
            while pending:
                left = deadline - time.time()
                if left <= 0:
                    break
                ready = mp.connection.wait(list(pending), timeout=min(left, 0.5))
                for conn in ready:
                    rank = pending.pop(conn)
                    try:
                        results[rank] = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        results[rank] = None  # died without a result
                    conn.close()
            hung = [conns[c] for c in pending]
            for p in procs:
                p.join(timeout=max(min(deadline - time.time(), 5.0), 0.5) if not hung else 0.1)
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(5)
            for c in conns:
                c.close()
        final = []
        for rank, p in enumerate(procs):
            r = results[rank] or RankResult(rank)
            r.exitcode = p.exitcode
            final.append(r)
    if hung:
        raise RanksTimedOut(hung, final, timeout)
    if not check:
        return final
    if not all(r.ok for r in final):
        raise RankFailed(final)
    return [r.value for r in final]
