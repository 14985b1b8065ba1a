"""The one spawned multi-process test harness: run one function in N real processes.

    results = run_ranks(fn, world_size=3, timeout=30, args=(...))

``fn(ctx, *args, **kwargs)`` may be a plain or an ``async`` function defined at module
level (children start from a fork server, see ``_context``, and import it by name). ``ctx`` is a
:class:`RankContext`: rank, world_size, a shared store (``ctx.store``, a small file-based
torch.distributed-Store look-alike: set/get/wait/add/check, no torch import needed),
a shared scratch directory and the common deadline. Torch jobs go through
``torch_helpers.run_torch_ranks``, a thin layer over this runner that hands each rank a
torch FileStore instead.

All ranks share ONE deadline: when it passes, every child still running is killed and
:class:`RanksTimedOut` lists which ranks hung (with the tracebacks of the others). A
child that raises sends its formatted traceback back; by default the harness re-raises
it in the parent as :class:`RankFailed` (all child tracebacks in the message). With
``check=False`` it returns one :class:`RankResult` per rank instead, for tests that
expect failures (``.ok``, ``.value``, ``.error_type``, ``.error``, ``.peer``,
``.exitcode``; a killed rank has ``exitcode == -9`` and no result). A value that cannot
be pickled fails its rank in the child, with a traceback, rather than in the parent.

``expect_dead`` names ranks that end on purpose with ``os._exit(DEAD_EXIT)``: they count
as successful with the value None, and as failed if they end any other way.

``env`` sets variables in every child (a dict) or per rank (a callable ``rank -> dict``)
before anything is imported there, ``fn``'s module included (UCX reads its variables once,
at start-up): ``fn`` and its arguments travel pickled and are loaded after ``env`` is set.

``ctx.after_report(callback)`` registers clean-up that runs once the rank's result has
been sent (closing a process group, say), so a clean-up that hangs cannot lose the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEAD_EXIT",
    "MESSAGES_ONLY",
    "DirStore",
    "RankContext",
    "RankFailed",
    "RankResult",
    "RanksTimedOut",
    "run_ranks",
]

#: Exit code of a rank that a test kills on purpose (see ``expect_dead``).
DEAD_EXIT = 17
#: ``env`` for tests about messages: without it, a one-host group's small collectives go
#: through node-local mailboxes instead (tests/test_mailbox.py covers those).
MESSAGES_ONLY = {"CGX_UCX_INTRA_SHM": "0"}


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
    cleanups: list[Callable[[], Any]] = field(default_factory=list, repr=False)

    @property
    def remaining(self) -> float:
        return max(self.deadline - time.time(), 0.0)

    def after_report(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` after this rank's result is sent (errors there are ignored)."""
        self.cleanups.append(callback)


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
                why = r.error or "no result"
                parts.append(f"--- rank {r.rank} --- exit code {r.exitcode}, {why}")
        super().__init__("child rank(s) failed:\n" + "\n".join(parts))


class RanksTimedOut(AssertionError):
    """The shared deadline passed; the hung ranks were killed."""

    def __init__(self, hung: list[int], results: list[RankResult], timeout: float) -> None:
        self.hung, self.results = hung, results
        tbs = "\n".join(f"--- rank {r.rank} ---\n{r.traceback}" for r in results if r.traceback)
        super().__init__(f"ranks {hung} still running after the {timeout:g} s deadline\n{tbs}")


def _call(ctx: RankContext, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    if inspect.iscoroutinefunction(fn):

        async def main() -> Any:
            return await asyncio.wait_for(fn(ctx, *args, **kwargs), max(ctx.remaining, 0.1))

        return asyncio.run(main())
    return fn(ctx, *args, **kwargs)


def _child(
    rank: int,
    world_size: int,
    job: bytes,
    env: dict[str, str],
    shared_dir: str,
    deadline: float,
    conn: mp.connection.Connection,
) -> None:
    os.environ.update(env)
    # A crash in native code (UCX) prints every thread's Python stack to stderr.
    faulthandler.enable(all_threads=True)
    start = time.perf_counter()
    ctx = RankContext(
        rank, world_size, DirStore(os.path.join(shared_dir, "store")), shared_dir, deadline
    )
    res = RankResult(rank)
    try:
        fn, args, kwargs = pickle.loads(job)  # imports fn's module: only now, under env
        res.value = _call(ctx, fn, args, kwargs)
        res.ok = True
    except BaseException as exc:
        res.error_type = type(exc).__name__
        res.error = str(exc)
        res.peer = getattr(exc, "peer", None)
        res.traceback = traceback.format_exc()
    res.elapsed = time.perf_counter() - start
    try:
        try:
            data = pickle.dumps(res)
        except Exception as exc:  # an unpicklable value fails here, with its traceback
            res = RankResult(
                rank,
                error_type=type(exc).__name__,
                error=f"cannot send the value back: {exc}",
                traceback=f"cannot send the value back: {res.value!r:.200}\n"
                f"{traceback.format_exc()}",
                elapsed=res.elapsed,
            )
            data = pickle.dumps(res)
        conn.send_bytes(data)
        conn.close()
    finally:
        for callback in ctx.cleanups:
            # The result is already reported; a failed job may leave debris behind.
            with contextlib.suppress(Exception):
                callback()


def _settle_expected_deaths(final: list[RankResult], dead: set[int]) -> None:
    for r in final:
        if r.rank not in dead:
            continue
        if r.exitcode == DEAD_EXIT and not r.traceback:
            r.ok, r.value = True, None
        else:
            r.ok = False
            r.error = r.error or f"should have exited with {DEAD_EXIT}, got {r.exitcode}"


def _context() -> Any:
    """Ranks start from a fork server that preloaded torch (``tests/_preload.py``): the
    same fresh interpreter state as "spawn" for everything a rank configures through
    its environment, about 3 s less start-up per rank. ``CGX_TEST_START=spawn`` (or
    ``fork``) chooses another start method."""
    method = os.environ.get("CGX_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["_preload"])
        _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the fork server with this directory importable, so that it finds
    ``_preload``: Python 3.11's fork server ignores the sys.path it is handed and
    silently skips a preload module it cannot import (every rank then paid for
    ``import torch`` itself)."""
    from multiprocessing import forkserver

    here = str(Path(__file__).resolve().parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, old) if p)
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
    check: bool = True,
    expect_dead: Iterable[int] = (),
) -> list[Any] | list[RankResult]:
    """Run ``fn`` in ``world_size`` spawned processes under one shared deadline.

    Returns the per-rank return values (``check=True``, raising :class:`RankFailed` if
    any rank failed) or the :class:`RankResult` list (``check=False``). Raises
    :class:`RanksTimedOut` when ranks are still running at the deadline (they are killed).
    """
    ctx = _context()
    job = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    deadline = time.time() + timeout
    results: list[RankResult | None] = [None] * world_size
    with tempfile.TemporaryDirectory(prefix="cgx-ranks-") as shared:
        procs, conns = [], {}
        for rank in range(world_size):
            child_env = dict(env(rank) if callable(env) else (env or {}))
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, job, child_env, shared, deadline, send_end),
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
    _settle_expected_deaths(final, set(expect_dead))
    if hung:
        raise RanksTimedOut(hung, final, timeout)
    if not check:
        return final
    if not all(r.ok for r in final):
        raise RankFailed(final)
    return [r.value for r in final]
