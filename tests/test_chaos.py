"""Chaos tests that need more than a killed process: a network link cut between
namespaces in the middle of a stream of allreduces, and a first compressed allreduce whose
CPU kernels must compile (empty Numba cache) under a short timeout.

Each test prints what it measured (time from the fault to every rank's error, close and
process-exit times) so the timings in docs/failures.md can be read off ``pytest -s``.
SIGKILL, world-size mismatch and unreachable-rank cases are in tests/test_failures.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from harness import run_ranks

from cgx_ucx.bench import netns
from cgx_ucx.bench.netns import LinkEmulator
from cgx_ucx.config import CommConfig
from cgx_ucx.transport.status import STATUS_WAIT_S

TESTS_DIR = str(Path(__file__).resolve().parent)
MISSING = netns.missing_prerequisites()
needs_netns = pytest.mark.skipif(
    bool(MISSING), reason="link emulation needs " + ", ".join(MISSING or ["nothing"])
)
#: A prefix of our own: cleanup_stale never touches another test's or benchmark's namespaces.
PREFIX = "cgxchaos"

#: Per-wait timeout of the link-cut ranks: short, so the test stays well under a minute.
CUT_TIMEOUT = 3.0
#: Slack on top of timeout + status query for a loaded machine (scheduling, the ABORT round).
CUT_SLACK = 2.5
#: Teardown after the error: close() (at most ~2 s; 1 s of it is the bounded wait for BYEs
#: that cannot cross the cut).
CLOSE_LIMIT = 2.5
#: From close() returning to the process being gone: Python's own finalization (a full GC
#: over numba's and llvmlite's objects) takes seconds on a loaded machine even without any
#: communicator; this bound only catches a hang at exit (e.g. in UCX).
EXIT_LIMIT = 15.0

# One rank of the link-cut test, run inside its namespace. The store is the harness's
# file store (namespaces share the file system; no torch import). The kernels are
# compiled before connecting: this test is about the link, not the cache (see below).
_CUT_RANK = """
import asyncio, json, os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from harness import DirStore
from cgx_ucx.collectives import connect
from cgx_ucx.compression import cpu
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import CGXError

async def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, timeout = DirStore(sys.argv[2]), float(sys.argv[3])
    # This process as the test sees it, also from inside a PID namespace of its own
    # (/proc is the test's mount: /proc/self names the test's view of this process).
    print(f"PID {os.readlink('/proc/self')}", file=sys.stderr, flush=True)
    cpu.warmup()
    cfg = CommConfig(timeout=timeout, connect_timeout=40.0)
    comm = await connect(store, rank, world, config=cfg, data_error_handling=sys.argv[5] == "1")
    x = np.empty(1 << 18, np.float32)
    out = {"rank": rank, "error": None, "calls": 0}
    try:
        end = time.monotonic() + 40.0
        while time.monotonic() < end:
            x.fill(1.0)
            await comm.allreduce(x, bits=4)
            out["calls"] += 1
            if out["calls"] == 3:
                print("READY", file=sys.stderr, flush=True)
    except CGXError as exc:
        out.update(t_error=time.time(), error=type(exc).__name__, text=str(exc))
        out.update(peer=getattr(exc, "peer", None), alive=getattr(exc, "alive", "n/a"))
    start = time.time()
    if sys.argv[4] == "close":
        await comm.close()
    # else: the error ends the program with the communicator open (its endpoints then go
    # in ucxx's finalizers at interpreter exit)
    out["t_closed"] = time.time()
    out["close_s"] = out["t_closed"] - start
    print(json.dumps(out), flush=True)

asyncio.run(main())
"""


def _drain(stream, sink: list[str], ready: threading.Event | None) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if ready is not None and line.strip() == "READY":
            ready.set()
    stream.close()


#: Runs the victim of a "stop" fault in a PID namespace of its own, so that no other rank
#: can look its process up, as for a rank on another machine.
OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child"]


def _cut_link_run(
    world: int,
    victim: int,
    close: bool = True,
    data_error_handling: bool = True,
    fault: str = "cut",
) -> tuple[float, list[dict], list[float], list[str]]:
    """Start ``world`` ranks (one namespace each), cut ``victim``'s link (``fault``
    "cut") or stop it with SIGSTOP ("stop") once all of them are streaming allreduces;
    returns (fault time, per-rank results of the ranks expected to end, exit times,
    stderr). ``close``: each rank closes its communicator after its error (else it just
    exits). A stopped victim never ends, and gets neither result nor exit time."""
    with (
        LinkEmulator(world, "1gbit", prefix=PREFIX) as link,
        tempfile.TemporaryDirectory(prefix="cgxchaos-") as store_dir,
    ):
        argv = [sys.executable, "-c", _CUT_RANK, TESTS_DIR, store_dir, str(CUT_TIMEOUT)]
        argv.append("close" if close else "exit")
        argv.append("1" if data_error_handling else "0")
        procs = [
            link.popen(
                r,
                (OWN_PID_NAMESPACE if fault == "stop" and r == victim else []) + argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        outs: list[list[str]] = [[] for _ in procs]
        errs: list[list[str]] = [[] for _ in procs]
        ready = [threading.Event() for _ in procs]
        threads = []
        for r, p in enumerate(procs):
            threads.append(threading.Thread(target=_drain, args=(p.stdout, outs[r], None)))
            threads.append(threading.Thread(target=_drain, args=(p.stderr, errs[r], ready[r])))
        for t in threads:
            t.daemon = True
            t.start()
        deadline = time.monotonic() + 45.0
        while not all(e.is_set() for e in ready):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                tails = "\n".join(f"--- rank {r}\n{''.join(e[-20:])}" for r, e in enumerate(errs))
                pytest.fail(f"ranks did not all start streaming allreduces:\n{tails}")
            time.sleep(0.02)
        t_cut = time.time()
        ending = list(range(world))
        if fault == "stop":
            pid = next(int(ln.split()[1]) for ln in errs[victim] if ln.startswith("PID "))
            os.kill(pid, signal.SIGSTOP)
            ending.remove(victim)
        else:
            dev, ns = link.devices[victim], link.namespaces[victim]
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "down"], check=True, timeout=10)
        exits: list[float] = [0.0] * world
        deadline = time.monotonic() + CUT_TIMEOUT + STATUS_WAIT_S + 25.0
        while any(procs[r].poll() is None for r in ending) and time.monotonic() < deadline:
            for r in ending:
                if not exits[r] and procs[r].poll() is not None:
                    exits[r] = time.time()
            time.sleep(0.01)
        for r in ending:
            if not exits[r] and procs[r].poll() is not None:
                exits[r] = time.time()
        hung = [r for r in ending if procs[r].poll() is None]
        # (the emulator's close kills what still runs)
    for t in threads:
        t.join(timeout=5)
    stderr = ["".join(e) for e in errs]
    assert not hung, f"ranks {hung} still running after the link cut:\n" + "\n".join(
        stderr[r][-3000:] for r in hung
    )
    results = []
    for r in ending:
        lines = [ln for ln in outs[r] if ln.startswith("{")]
        assert lines, f"rank {r} printed no result (exit {procs[r].returncode}):\n{stderr[r]}"
        results.append(json.loads(lines[-1]))
    return t_cut, results, exits, stderr


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(90)
# World 2 runs with -m slow only (the default suite's budget): world 3 covers the same
# path in the default run.
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
# UCX destroys a TCP endpoint with a blocking send that retries while the connection's send
# queue cannot drain, which across the cut lasts until the kernel's TCP give-up (minutes).
# So a failed mesh shuts the write side of exactly those connections before its endpoints
# go (cgx_ucx.transport.stuck), and releases them at exit for a rank that exits without
# closing (stuck.release_at_exit, before ucxx's finalizers). tests/test_stuck.py checks
# which connections count as stuck; the exit bound here checks that no process hangs.
@pytest.mark.parametrize("close", [True, False], ids=["close", "no-close"])
# Data endpoints without error handling (CMA mode): UCX closes such an endpoint by
# flushing it, which across the cut never ended (every rank hung in close() or at exit,
# 12 of 12 processes). Endpoints to peers on other nodes handle errors whatever the mode
# (cgx_ucx.transport.connection). -m slow: the default mode covers the rest.
@pytest.mark.parametrize(
    "data_error_handling", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["", "cma"]
)
def test_link_cut_between_namespaces_fails_every_rank_fast(
    world: int, close: bool, data_error_handling: bool
) -> None:
    """UCX never reports a silently cut link, so the per-wait deadline must:
    every rank raises a typed error within timeout + status query + slack of the cut, the
    error says the peer behind the cut did not answer (or is gone), never that it is alive,
    and close() and process exit follow within ~2 s (exit alone, for ranks that let the
    error end the program without closing), whatever the data endpoints' error handling."""
    victim = world - 1
    t_cut, results, exits, stderr = _cut_link_run(world, victim, close, data_error_handling)
    load = os.getloadavg()[0]
    for res, t_exit in zip(results, exits, strict=True):
        r = res["rank"]
        after = res.get("t_error", float("nan")) - t_cut
        print(
            f"link cut, world {world}, data_error_handling={data_error_handling}, rank {r}: "
            f"{res['error']} after {after:.2f} s "
            f"(peer {res.get('peer')}, alive {res.get('alive')}), close {res['close_s']:.2f} s, "
            f"exit {t_exit - res['t_closed']:.2f} s after close, "
            f"{res['calls']} calls, load {load:.1f}: {res.get('text')}"
        )
    for res, t_exit in zip(results, exits, strict=True):
        r = res["rank"]
        assert res["error"] in ("CGXTimeoutError", "PeerLostError"), (r, res)
        after = res["t_error"] - t_cut
        assert 0 < after < CUT_TIMEOUT + STATUS_WAIT_S + CUT_SLACK, (r, after, res)
        assert res["close_s"] < CLOSE_LIMIT, (r, res)
        assert t_exit - res["t_closed"] < EXIT_LIMIT, (r, t_exit - res["t_closed"], stderr[r])
        text = res["text"]
        # Whoever is blamed across the cut is not called alive: it could not answer.
        if (r == victim) != (res["peer"] == victim):
            assert res["alive"] is not True, res
            assert "did not answer" in text or "is gone" in text or "aborted" in text, res
    # The victim's peers name it: directly, through an ABORT naming it, or through the
    # STATUS answer of a live neighbour that waits on it (the neighbour of the cut may
    # time out on that neighbour first).
    for res in results[:victim]:
        assert res["peer"] == victim or f"rank {victim}" in res["text"], res
    # Whoever asked the victim itself tells a cut from a stop: its host acknowledged
    # nothing since (the victim, asking its peers, says the same of theirs).
    asked = [res for res in results if res["error"] == "CGXTimeoutError"]
    assert any(f"is cut off: its host {netns.SUBNET}." in res["text"] for res in asked), asked


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(90)
def test_a_stopped_rank_on_another_machine_is_named_alive_at_the_host_level() -> None:
    """Rank 2, in a namespace of its own (network and PID: no peer can look its process
    up, as on another machine), is stopped. Its host's kernel still acknowledges what it
    is sent, so a survivor that asked it says that it is alive at the host level but not
    answering, not cut off, and one told by that survivor's ABORT says the same. Every
    survivor raises within timeout + status query + slack, closes without waiting for
    the stopped rank and exits."""
    world, victim = 3, 2
    t_stop, results, exits, stderr = _cut_link_run(world, victim, fault="stop")
    load = os.getloadavg()[0]
    for res in results:
        r = res["rank"]
        print(
            f"stopped rank {victim} on another machine, rank {r}: {res['error']} after "
            f"{res.get('t_error', float('nan')) - t_stop:.2f} s (peer {res.get('peer')}), "
            f"close {res['close_s']:.2f} s, exit {exits[r] - res['t_closed']:.2f} s after "
            f"close, load {load:.1f}: {res.get('text')}"
        )
    assert len(results) == world - 1
    for res in results:
        r = res["rank"]
        assert res["error"] in ("CGXTimeoutError", "PeerLostError"), res
        text = res["text"]
        # Said of the rank waited on ("rank 2 is alive at the host level but not
        # answering: its host ... acknowledges at the TCP level"), or, where the survivor
        # waited on a live neighbour that waits on rank 2 (rank 2 stopped after sending
        # to this survivor), of the rank that did not answer its status request ("rank 2
        # did not answer ..., and its host ... acknowledges at the TCP level (alive at
        # the host level)").
        assert f"rank {victim} is alive at the host level but not answering: its host" in text or (
            f"rank {victim} did not answer a status request" in text
            and "(alive at the host level)" in text
        ), res
        assert "acknowledges at the TCP level" in text, res
        assert "is cut off" not in text and "its process" not in text, res
        assert 0 < res["t_error"] - t_stop < CUT_TIMEOUT + STATUS_WAIT_S + CUT_SLACK, res
        assert res["close_s"] < CLOSE_LIMIT, res
        assert exits[r] - res["t_closed"] < EXIT_LIMIT, (r, stderr[r][-3000:])


# ------------------------------------------------------------------ cold kernel cache

#: Short enough that a first call compiling its kernels inside a peer's deadline fails
#: (a cold Numba compile of the codec takes seconds, many more on a loaded machine).
COLD_TIMEOUT = 5.0


async def cold_first_allreduce(ctx):
    """Connect with a short timeout and run a first 4-bit allreduce (on an empty Numba
    cache where the test says so)."""
    from cgx_ucx.collectives import connect
    from cgx_ucx.errors import CGXError

    cfg = CommConfig(timeout=COLD_TIMEOUT, connect_timeout=60.0)
    start = time.monotonic()
    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg)
    connected = time.monotonic() - start
    n = 1 << 16
    x = np.random.default_rng(ctx.rank).standard_normal(n).astype(np.float32)
    want = sum(np.random.default_rng(r).standard_normal(n) for r in range(ctx.world_size))
    start = time.monotonic()
    try:
        await comm.allreduce(x, bits=4)
        outcome = "ok"
    except CGXError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    first = time.monotonic() - start
    await comm.close()
    err = float(np.max(np.abs(x - want))) if outcome == "ok" else float("nan")
    return outcome, connected, first, err


@pytest.mark.slow
@pytest.mark.timeout(260)
@pytest.mark.parametrize(
    "cold_ranks",
    [
        pytest.param((0, 1), id="both-cold"),
        # Rank 0 keeps the default on-disk cache (warm once anything compiled the current
        # codec): the skewed case, one rank waiting for the other's compile.
        pytest.param((1,), id="one-cold"),
    ],
)
def test_cold_kernel_cache_with_short_timeout(cold_ranks: tuple[int, ...]) -> None:
    """Local work (the codec's compile on an empty Numba cache) does not run inside a
    peer's deadline: a first compressed allreduce whose compile outlasts the per-wait
    timeout succeeds, and no rank blames a live peer for it."""
    with tempfile.TemporaryDirectory(prefix="cgxchaos-numba-") as cache:

        def env(rank: int) -> dict[str, str]:
            if rank not in cold_ranks:
                return {}
            path = os.path.join(cache, str(rank))  # one per rank: each compiles for itself
            os.makedirs(path, exist_ok=True)
            return {"NUMBA_CACHE_DIR": path}

        results = run_ranks(cold_first_allreduce, 2, timeout=240, env=env)
    load = os.getloadavg()[0]
    for rank, (outcome, connected, first, err) in enumerate(results):
        print(
            f"cold cache, cold ranks {cold_ranks}: rank {rank} connect {connected:.1f} s, "
            f"first 4-bit allreduce {first:.2f} s, {outcome}, max error {err:.3g}, "
            f"load {load:.1f}"
        )
    for outcome, _, _, err in results:
        assert outcome == "ok", outcome
        # 4 bits, buckets of 1024 N(0, 1) values, 2 ranks: well under one level (~0.5).
        assert err < 3.0, err
