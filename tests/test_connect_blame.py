"""Connect failures name the rank at fault on every rank: a published address that does
not answer, a rank that died after publishing, and a peer stopped after connecting
(SIGSTOP), each with three ranks and a short connect timeout. See docs/failures.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from harness import MESSAGES_ONLY, run_ranks

from cgx_ucx.collectives import connect
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import CGXError

#: Connect timeout of these tests: short, and long enough for three ranks to connect on a
#: loaded two-core machine.
CONNECT_TIMEOUT = 8.0
#: What every survivor may take beyond the connect timeout to raise its error.
REPORT_SLACK_S = 2.0
#: Connections a black-hole listener holds unaccepted: its accept queue (backlog 0) is
#: then full, and Linux drops further SYNs, so a dial to it gets no answer at all.
BLACK_HOLE_FILL = 3


@contextlib.contextmanager
def black_hole():
    """A loopback (host, port) whose SYNs are dropped: a dial to it neither connects nor is
    refused, like an address that does not route."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(BLACK_HOLE_FILL):
            s = stack.enter_context(socket.socket())
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
        time.sleep(0.1)
        yield "127.0.0.1", port


def publish_instead(host, port):
    """Make this process publish ``host:port`` as its listener's address (its listener
    stays where it is): an address override for the dialers."""
    from cgx_ucx.transport import connection

    class Override(connection.PeerAddress):
        def __init__(self, _host, _port, *args, **kwargs):
            super().__init__(host, port, *args, **kwargs)

    connection.PeerAddress = Override


async def publishes(ctx, culprit, host, die):
    """``culprit`` publishes ``host`` (or dies right after publishing, ``die``); every
    rank reports (error type, text, seconds)."""
    cfg = CommConfig(timeout=20.0, connect_timeout=CONNECT_TIMEOUT)
    if host is not None and ctx.rank == culprit:
        publish_instead(*host)
    start = time.monotonic()
    task = asyncio.ensure_future(connect(ctx.store, ctx.rank, ctx.world_size, config=cfg))
    if die and ctx.rank == culprit:
        while not ctx.store.check([f"cgx/0/addr/{culprit}"]) and not task.done():
            await asyncio.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm = await task
    except CGXError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    await comm.close()
    return "connected", "", time.monotonic() - start


def _report(results, what):
    for r in results:
        print(f"{what}: rank {r.rank}: {r.value if r.ok else r}")


@pytest.mark.timeout(90)
def test_a_published_address_that_does_not_answer_is_named_by_every_rank():
    with black_hole() as (host, port):
        results = run_ranks(publishes, 3, args=(1, (host, port), False), timeout=60, check=False)
    _report(results, f"rank 1 publishes {host}:{port}")
    for r in results:
        assert r.ok, r.traceback
        kind, text, elapsed = r.value
        assert kind in ("RendezvousError", "PeerFailedError"), r.value
        assert f"rank 2 could not reach rank 1 at {host}:{port} (published by rank 1)" in text
        assert f"no answer within {CONNECT_TIMEOUT:g} s" in text, r.value
        assert elapsed < CONNECT_TIMEOUT + REPORT_SLACK_S, r.value


@pytest.mark.timeout(90)
def test_a_rank_that_dies_after_publishing_is_named_by_every_survivor():
    results = run_ranks(publishes, 3, args=(1, None, True), timeout=60, check=False)
    _report(results, "rank 1 dies after publishing")
    assert results[1].exitcode == -signal.SIGKILL
    for r in (results[0], results[2]):
        assert r.ok, r.traceback
        kind, text, elapsed = r.value
        assert kind in ("RendezvousError", "PeerFailedError", "PeerLostError"), r.value
        assert "rank 1 died after publishing" in text or "rank 1 is gone" in text, r.value
        assert elapsed < CONNECT_TIMEOUT + REPORT_SLACK_S, r.value


# ------------------------------------------------------------ after a failed connect


def _listeners_and_fds() -> tuple[int, int]:
    """(TCP sockets of this process listening on every address, open descriptors): UCX's
    connection listener binds the wildcard address (its transports bind one each)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    wildcard = 0
    for table, anywhere in (("/proc/net/tcp", "00000000"), ("/proc/net/tcp6", "0" * 32)):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                listening = fields[3] == "0A"
                if listening and fields[9] in inodes and fields[1].split(":")[0] == anywhere:
                    wildcard += 1
    return wildcard, len(os.listdir("/proc/self/fd"))


async def parked_then_again(ctx, host):
    """Rank 1 publishes ``host`` (nobody answers there); after the failed connect every
    rank connects again at once under another prefix, then waits past the time its
    parked listener may stay open. Returns what it saw at each step."""
    import numpy as np

    from cgx_ucx.transport import connection
    from cgx_ucx.transport.mesh import LISTENER_PARK_MARGIN_S

    before = _listeners_and_fds()
    real = connection.PeerAddress
    if ctx.rank == 1:
        publish_instead(*host)
    cfg = CommConfig(timeout=20.0, connect_timeout=CONNECT_TIMEOUT)
    try:
        await (await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg)).close()
        first = "connected"
    except CGXError as exc:
        first = type(exc).__name__
    failed = time.monotonic()
    connection.PeerAddress = real
    after_failure = _listeners_and_fds()
    again = CommConfig(timeout=20.0, connect_timeout=30.0)
    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=again, prefix="again")
    x = np.ones(1000, np.float32)
    await comm.allreduce(x)
    await comm.close()
    again_s = time.monotonic() - failed
    await asyncio.sleep(failed + CONNECT_TIMEOUT + LISTENER_PARK_MARGIN_S + 1.0 - time.monotonic())
    return first, float(x[0]), again_s, before, after_failure, _listeners_and_fds()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_connect_leaves_no_listener_and_a_new_one_connects_at_once():
    """A rank whose connect failed while a peer may still dial it keeps its listener open
    (parked) for the connect timeout + a margin, then closes it with no further call, and
    the UCX context with it; meanwhile a new communicator connects at once."""
    with black_hole() as host:
        results = run_ranks(parked_then_again, 3, args=(host,), timeout=100)
    for r, (first, value, again_s, before, after_failure, end) in enumerate(results):
        print(
            f"failed connect, rank {r}: {first}; connected again {again_s:.2f} s after it "
            f"(allreduce {value:g}); wildcard listeners, descriptors: {before} before, "
            f"{after_failure} after the failure, {end} past the parking"
        )
    assert any(after[0] for _, _, _, _, after, _ in results), "no listener was parked"
    for r, (first, value, again_s, before, _, end) in enumerate(results):
        assert first in ("RendezvousError", "PeerFailedError"), first
        assert value == 3.0 and again_s < 10.0, (value, again_s)
        assert end[0] == before[0], (r, before, end)
        # Rank 2 too, which dialed the address that does not answer (the endpoint of its
        # dial that timed out is closed, transport.ucx.release_abandoned_endpoints).
        assert end[1] <= before[1], (r, before, end)


# ------------------------------------------------------------------ a stopped peer

#: Per-wait timeout of the stopped-peer ranks.
STOP_TIMEOUT = 2.0
#: Per-wait timeout of the survivor that learns of the stopped peer from another rank's
#: ABORT (its own wait would run out long after that).
LATE_TIMEOUT = 30.0
#: close() of a survivor: no wait for the BYE of a peer that did not answer a status
#: request, its own or the one of the rank whose ABORT reported the failure (0.3 s
#: measured on 2 loaded cores; a wait for the stopped peer's BYE takes the whole
#: FAILED_CLOSE_WAIT_S of 1 s); a peer that blocks the teardown would hold it for minutes.
STOP_CLOSE_LIMIT = 0.9
#: From close() returning to the process being gone, as tests/test_chaos.py bounds it:
#: Python's own finalization takes seconds on a loaded machine; this catches a hang.
STOP_EXIT_LIMIT = 15.0

# One rank of the stopped-peer test (a separate process, so its exit can be timed).
_STOP_RANK = """
import asyncio, json, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from harness import DirStore
from cgx_ucx.collectives import connect
from cgx_ucx.compression import cpu
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import CGXError

async def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, victim = DirStore(sys.argv[2]), int(sys.argv[3])
    cpu.warmup()
    timeout = float(sys.argv[4].split(",")[rank])
    cfg = CommConfig(timeout=timeout, connect_timeout=40.0)
    comm = await connect(store, rank, world, config=cfg, data_error_handling=sys.argv[5] == "1")
    x = np.ones(1 << 18, np.float32)
    algorithm = sys.argv[6]
    for _ in range(3):
        await comm.allreduce(x, bits=4, algorithm=algorithm)
    await comm.barrier()
    if rank == victim:
        print("STOPPING", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    out = {"rank": rank, "error": None}
    t0 = time.time()
    try:
        while time.time() < t0 + 30:
            await comm.allreduce(x, bits=4, algorithm=algorithm)
    except CGXError as exc:
        out.update(t_error=time.time(), error=type(exc).__name__, text=str(exc))
        out.update(peer=getattr(exc, "peer", None), alive=getattr(exc, "alive", "n/a"))
    start = time.time()
    await comm.close()
    out["t_closed"] = time.time()
    out["close_s"] = out["t_closed"] - start
    print(json.dumps(out), flush=True)

asyncio.run(main())
"""


def _stopped_peer_run(
    world: int,
    victim: int,
    data_error_handling: bool,
    timeouts: list[float],
    algorithm: str = "auto",
    nodes: list[str] | None = None,
):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory(prefix="cgx-stop-") as store_dir:
        argv = [sys.executable, "-c", _STOP_RANK, tests_dir, store_dir, str(victim)]
        argv += [",".join(map(str, timeouts)), "1" if data_error_handling else "0", algorithm]
        env = dict(os.environ, WORLD_SIZE=str(world), **MESSAGES_ONLY)
        envs = [dict(env, RANK=str(r)) for r in range(world)]
        for r, node in enumerate(nodes or ()):
            envs[r]["CGX_UCX_NODE_ID"] = node
        procs = [
            subprocess.Popen(argv, env=envs[r], stdout=subprocess.PIPE, text=True)
            for r in range(world)
        ]
        try:
            assert procs[victim].stdout.readline().strip() == "STOPPING"
            t_stop = time.time()
            exits = {}
            deadline = time.monotonic() + STOP_TIMEOUT + 60
            while len(exits) < world - 1 and time.monotonic() < deadline:
                for r, p in enumerate(procs):
                    if r != victim and r not in exits and p.poll() is not None:
                        exits[r] = time.time()
                time.sleep(0.01)
            outs = {r: procs[r].stdout.read() for r in exits}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
    hung = [r for r in range(world) if r != victim and r not in exits]
    assert not hung, f"ranks {hung} did not exit while rank {victim} was stopped"
    results = {}
    for r, text in outs.items():
        lines = [ln for ln in text.splitlines() if ln.startswith("{")]
        assert lines, f"rank {r} printed no result: {text}"
        results[r] = json.loads(lines[-1])
    return t_stop, results, exits


@pytest.mark.timeout(150)
@pytest.mark.parametrize("data_error_handling", [True, False], ids=["default", "cma"])
def test_a_stopped_peer_is_named_and_every_survivor_exits(data_error_handling):
    """A peer stopped by SIGSTOP (its host still answers) is named by every survivor as
    alive at the host level but not answering, within the timeout + 2 s: rank 0 by its
    own status request, rank 2 (a longer timeout) through rank 0's ABORT. Every survivor
    closes and exits without waiting for it, whatever the data endpoints' error handling:
    rank 2 never asked the stopped peer, and knows from the ABORT that it did not answer."""
    world, victim, relayed = 3, 1, 2
    timeouts = [LATE_TIMEOUT if r == relayed else STOP_TIMEOUT for r in range(world)]
    t_stop, results, exits = _stopped_peer_run(world, victim, data_error_handling, timeouts)
    for r, res in sorted(results.items()):
        print(
            f"stopped peer, data_error_handling={data_error_handling}: rank {r}: "
            f"{res['error']} after {res.get('t_error', 0) - t_stop:.2f} s, close "
            f"{res['close_s']:.2f} s, exit {exits[r] - res['t_closed']:.2f} s after close, "
            f"load {os.getloadavg()[0]:.1f}: {res.get('text')}"
        )
    for r, res in results.items():
        if r == relayed:
            assert res["error"] == "PeerLostError", res
            assert res["text"].startswith("rank 0 aborted collective #"), res
        else:
            assert res["error"] == "CGXTimeoutError", res
        assert res["peer"] == victim, res
        assert f"rank {victim} is alive at the host level but not answering" in res["text"], res
        assert res["t_error"] - t_stop < STOP_TIMEOUT + 1.0 + REPORT_SLACK_S, res
        assert res["close_s"] < STOP_CLOSE_LIMIT, res
        assert exits[r] - res["t_closed"] < STOP_EXIT_LIMIT, res


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ranks_told_of_a_stopped_peer_through_a_live_one_do_not_wait_for_it():
    """Two nodes of two ranks (labels), rank 3 stopped. In the two-level allreduce rank 0
    waits on a live rank that waits on rank 3 (its node peer, or rank 2 across nodes):
    rank 0 (the only short timeout) times out on it, and its ABORT blames it; ranks 1 and 2 learn
    of the failure from that ABORT alone, which also names rank 3 as not answering rank
    0's status request, so neither waits for rank 3's BYE at close."""
    world, victim, first = 4, 3, 0
    timeouts = [STOP_TIMEOUT if r == first else LATE_TIMEOUT for r in range(world)]
    nodes = ["a", "a", "b", "b"]
    t_stop, results, exits = _stopped_peer_run(world, victim, True, timeouts, nodes=nodes)
    for r, res in sorted(results.items()):
        print(
            f"stopped peer behind a live one: rank {r}: {res['error']} after "
            f"{res.get('t_error', 0) - t_stop:.2f} s (peer {res['peer']}), close "
            f"{res['close_s']:.2f} s, exit {exits[r] - res['t_closed']:.2f} s after close, "
            f"load {os.getloadavg()[0]:.1f}: {res.get('text')}"
        )
    assert results[first]["error"] == "CGXTimeoutError", results[first]
    assert results[first]["peer"] != victim and results[first]["alive"], results[first]
    for r, res in results.items():
        if r != first:
            assert res["error"] == "PeerLostError", res
            assert res["text"].startswith(f"rank {first} aborted collective #"), res
        assert f"rank {victim} is alive at the host level but not answering" in res["text"], res
        assert res["close_s"] < STOP_CLOSE_LIMIT, res
        assert exits[r] - res["t_closed"] < STOP_EXIT_LIMIT, res
