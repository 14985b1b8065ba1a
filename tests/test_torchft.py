"""cgx_ucx.torchft.ProcessGroupCGX as torchft's Manager drives it: configure at every
quorum, abort, shrink and grow, and many reconfigurations in one process.

These tests call ``configure`` directly over a shared TCPStore (what the Manager does at
each quorum change); tests/test_torchft_train.py runs whole torchft jobs.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("torchft")

from harness import MESSAGES_ONLY, RankContext, run_ranks

pytestmark = pytest.mark.timeout(120)

#: The longest abort() may take to fail an operation in flight.
ABORT_BOUND_S = 1.0


def _store(ctx: RankContext) -> tuple[object, str]:
    """A TCPStore served by rank 0 (the replica group's store torchft would use) and
    its ``host:port`` for configure's store address."""
    import torch.distributed as dist

    if ctx.rank == 0:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ctx.store.set("port", str(server.port))
        return server, f"127.0.0.1:{server.port}"
    ctx.store.wait(["port"])
    return None, f"127.0.0.1:{int(ctx.store.get('port'))}"


def _allreduce(pg: object, value: float, n: int = 4096) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.full((n,), value)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce([t], opts).wait()  # type: ignore[attr-defined]
    return [float(t.min()), float(t.max())]


def _configure(pg: object, addr: str, quorum: int, rank: int, world: int) -> None:
    pg.configure(f"{addr}/torchft/{quorum}/0", "replica", rank, world, quorum)  # type: ignore[attr-defined]


# -- without peers ---------------------------------------------------------------------------
def test_unconfigured_group_and_refusals() -> None:
    import torch
    import torch.distributed as dist

    from cgx_ucx.config import CompressionConfig
    from cgx_ucx.errors import ConfigError
    from cgx_ucx.torchft import ProcessGroupAbortedError, ProcessGroupCGX

    pg = ProcessGroupCGX(bits=4)
    assert pg.getBackendName() == "torchft-cgx"
    assert pg.errored() is None and pg.group is None
    assert pg.compression == CompressionConfig(bits=4)
    with pytest.raises(ProcessGroupAbortedError, match="not configured"):
        pg.allreduce([torch.ones(2)], dist.AllreduceOptions())
    with pytest.raises(ConfigError, match="HSDP"):
        pg.register("hsdp")
    with pytest.raises(ConfigError, match="not both"):
        ProcessGroupCGX(bits=4, compression=CompressionConfig(bits=2))
    with pytest.raises(ConfigError, match="one of them"), pg.compressed():
        pass
    pg.abort()
    assert isinstance(pg.errored(), ProcessGroupAbortedError)
    pg.shutdown()


# -- shrink and grow ------------------------------------------------------------------------
def _shrink_grow(ctx: RankContext) -> list[list[float]]:
    from cgx_ucx.torchft import ProcessGroupCGX

    server, addr = _store(ctx)
    pg = ProcessGroupCGX(bits=4)
    out = []
    for quorum, members in enumerate([[0, 1, 2], [0, 2], [0, 1, 2]]):
        if ctx.rank in members:
            _configure(pg, addr, quorum, members.index(ctx.rank), len(members))
            out.append(_allreduce(pg, float(ctx.rank + 1)))
        ctx.store.add(f"done{quorum}", 1)
        ctx.store.wait([f"done{quorum}"])
        while int(ctx.store.add(f"done{quorum}", 0)) < ctx.world_size:
            time.sleep(0.01)
    pg.shutdown()
    del server
    return out


def test_shrink_then_grow() -> None:
    """A world of 3, then 2 (rank 1 left), then 3 again: each quorum's sum is right."""
    results = run_ranks(_shrink_grow, 3, timeout=90)
    assert results[0] == [[6.0, 6.0], [4.0, 4.0], [6.0, 6.0]]
    assert results[2] == results[0]
    assert results[1] == [[6.0, 6.0], [6.0, 6.0]]


# -- abort ------------------------------------------------------------------------------------
def _abort_in_flight(ctx: RankContext) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CGXError
    from cgx_ucx.torchft import ProcessGroupAbortedError, ProcessGroupCGX

    server, addr = _store(ctx)
    pg = ProcessGroupCGX(bits=4)
    _configure(pg, addr, 0, ctx.rank, 2)
    _allreduce(pg, 1.0)
    report: dict[str, object] = {}
    if ctx.rank == 0:
        # Rank 1 never joins this allreduce: it waits until rank 0 aborted.
        t = torch.ones(1 << 16)
        work = pg.allreduce([t], dist.AllreduceOptions())
        time.sleep(0.3)
        aborted_at = time.monotonic()
        threading.Thread(target=pg.abort).start()  # as torchft's timeout callback does
        try:
            work.wait()
            report["error"] = None
        except Exception as exc:
            report["error"] = type(exc).__name__
            report["typed"] = isinstance(exc, CGXError)
        report["failed_after_s"] = time.monotonic() - aborted_at
        report["errored"] = type(pg.errored()).__name__
        try:
            pg.allreduce([t], dist.AllreduceOptions())
        except ProcessGroupAbortedError:
            report["after"] = "ProcessGroupAbortedError"
        ctx.store.set("aborted", "1")
        # configure works again after an abort (torchft's next quorum)
        _configure(pg, addr, 1, 0, 1)
        report["alone"] = _allreduce(pg, 3.0)
        report["errored_after_configure"] = pg.errored()
    else:
        ctx.store.wait(["aborted"])
    pg.shutdown()
    del server
    return report


def test_abort_fails_allreduce_in_flight_within_a_second() -> None:
    report = run_ranks(_abort_in_flight, 2, timeout=60)[0]
    assert report["error"] is not None and report["typed"], report
    assert report["failed_after_s"] < ABORT_BOUND_S, report
    assert report["errored"] == "ProcessGroupAbortedError"
    assert report["after"] == "ProcessGroupAbortedError"
    assert report["alone"] == [3.0, 3.0]
    assert report["errored_after_configure"] is None


# -- compression per call ------------------------------------------------------------------
def _per_call(ctx: RankContext) -> dict[str, object]:
    import hashlib

    import torch
    import torch.distributed as dist

    from cgx_ucx.torchft import ProcessGroupCGX

    server, addr = _store(ctx)
    pg = ProcessGroupCGX()  # no compression in code, none in the environment: exact
    _configure(pg, addr, 0, ctx.rank, 2)
    stats = pg.group.communicator  # type: ignore[union-attr]
    base = torch.linspace(-1.0, 1.0, 1 << 16) * (ctx.rank + 1)

    def run() -> tuple[int, str]:
        x = base.clone()
        before = stats.stats.bytes_sent
        pg.allreduce([x], dist.AllreduceOptions()).wait()
        digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()
        return stats.stats.bytes_sent - before, digest

    exact, exact_digest = run()
    with pg.compressed(bits=2):
        two, two_digest = run()
    again, _ = run()
    pg.shutdown()
    del server
    return {"exact": exact, "two": two, "again": again, "digest": two_digest, "d32": exact_digest}


def test_compression_per_call() -> None:
    """``with pg.compressed(bits=2)`` quantizes the calls inside the block only; the
    quantized result is the same on both ranks."""
    a, b = run_ranks(_per_call, 2, timeout=60, env=MESSAGES_ONLY)
    assert a["two"] * 8 < a["exact"], a
    assert a["again"] == a["exact"], a
    assert a["digest"] == b["digest"] and a["d32"] == b["d32"]
    assert a["digest"] != a["d32"]


# -- many reconfigurations --------------------------------------------------------------------
def _resources() -> dict[str, int]:
    import gc

    # UCX closes the dropped group's endpoints on the engine loop, after configure has
    # returned; and garbage is not a leak: count what is still referenced.
    time.sleep(0.5)
    gc.collect()
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    # The host codec's compile thread is one per process, started the first time a kernel
    # is due (compression.kernels), whenever that is, and so is the staging release thread
    # (started by the first call that stages memory): not threads a reconfiguration leaves.
    transient = ("cgx-compile", "cgx-staging-release")
    compile_threads = sum(t.name in transient for t in threading.enumerate())
    return {
        "rss_kb": int(status["VmRSS"].split()[0]),
        "threads": threading.active_count() - compile_threads,
        "os_threads": int(status["Threads"]) - compile_threads,
        "fds": len(os.listdir("/proc/self/fd")),
        "sockets": sum(_is_socket(f) for f in os.listdir("/proc/self/fd")),
    }


def _is_socket(fd: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:
        return False


def _reconfigure_many(ctx: RankContext, times: int) -> list[dict[str, int]]:
    from cgx_ucx.compression import kernels
    from cgx_ucx.torchft import ProcessGroupCGX

    server, addr = _store(ctx)
    pg = ProcessGroupCGX(bits=4)
    seen = []
    for quorum in range(times):
        _configure(pg, addr, quorum, ctx.rank, 2)
        if quorum == 0:
            # The host codec's kernels load once per process, when the job's compressed
            # calls first add up to COMPILE_AFTER_VALUES (about 60 MiB of RSS): a call that
            # large loads them now, before the measured window, instead of whichever
            # reconfiguration the small calls below would reach that sum at.
            assert _allreduce(pg, 1.0, kernels.COMPILE_AFTER_VALUES) == [2.0, 2.0]
        assert _allreduce(pg, 1.0) == [2.0, 2.0]
        if quorum == times // 5:
            seen.append(_resources())
    # The dropped groups' TCP connections close when both sides have let go, which on a
    # busy machine can lag a few seconds; a leaked descriptor never goes.
    for _ in range(20):
        last = _resources()
        if last["fds"] <= seen[0]["fds"] + _fd_slack(times):
            break
    seen.append(last)
    pg.shutdown()
    del server
    return seen


def _fd_slack(times: int) -> int:
    return max(4, times // 10)


def _check_flat(seen: list[dict[str, int]], times: int) -> None:
    """Nothing grows with the number of reconfigurations: the live group's own
    descriptors vary by a few between two moments, a leak would add several per one."""
    first, last = seen
    assert last["threads"] == first["threads"], seen
    assert last["os_threads"] <= first["os_threads"] + 1, seen
    assert last["fds"] <= first["fds"] + _fd_slack(times), seen
    assert last["rss_kb"] - first["rss_kb"] < 20_000, seen


def test_reconfigure_twenty_times_flat() -> None:
    """Threads, file descriptors (listeners included) and RSS stay flat."""
    for seen in run_ranks(_reconfigure_many, 2, args=(20,), timeout=90):
        _check_flat(seen, 20)


@pytest.mark.slow
def test_reconfigure_hundred_times_flat() -> None:
    for seen in run_ranks(_reconfigure_many, 2, args=(100,), timeout=300):
        _check_flat(seen, 100)


def _groups_on_one_engine(ctx: RankContext, times: int) -> list[dict[str, int]]:
    """cgx groups made and destroyed while something else keeps the engine loop running
    (a default group, or an engine held as here): each group starts and stops its own
    UCX context on that loop."""
    import torch.distributed as dist

    from cgx_ucx.engine import Engine
    from cgx_ucx.torch import ProcessGroupCGX as CGXGroup

    server, addr = _store(ctx)
    host, port = addr.split(":")
    engine = Engine.get(retain=True)
    seen = []
    for i in range(times):
        store = dist.PrefixStore(f"g{i}", dist.TCPStore(host, int(port), is_master=False))
        group = CGXGroup(store, ctx.rank, 2)
        assert _allreduce(group, 1.0) == [2.0, 2.0]
        group.shutdown()
        if i == 1:
            seen.append(_resources())
    for _ in range(20):
        last = _resources()
        if last["fds"] <= seen[0]["fds"] + _fd_slack(times):
            break
    seen.append(last)
    engine.release()
    del server
    return seen


def test_groups_destroyed_on_a_running_engine_release_their_ucx_context() -> None:
    """No descriptor (listening sockets, shared memory, UCX's own) outlives its group."""
    for seen in run_ranks(_groups_on_one_engine, 2, args=(10,), timeout=120):
        _check_flat(seen, 10)
