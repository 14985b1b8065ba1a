"""Failure cases across spawned processes, each under a deadline: a rank killed
mid-collective, ranks that disagree, foreign and malformed frames, a silent peer, the
TCP transport. Every survivor must raise the typed error naming the culprit quickly;
nothing may hang and no output may be written on a mismatch."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
from harness import DEAD_EXIT, MESSAGES_ONLY, run_ranks

from cgx_ucx.collectives import connect
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import (
    CGXTimeoutError,
    CollectiveMismatchError,
    PeerLostError,
    ProtocolError,
)
from cgx_ucx.layout import LayerSpec, Layout
from cgx_ucx.transport.mesh import FAILED_CLOSE_WAIT_S

CFG = CommConfig(timeout=20.0, connect_timeout=30.0)


async def outcome(call) -> tuple[str, float]:
    """(the name of the error ``call`` raised, or "no error"; seconds it took)."""
    start = time.monotonic()
    try:
        await call
        kind = "no error"
    except Exception as exc:
        kind = type(exc).__name__
    return kind, time.monotonic() - start


async def killed_mid_collective(ctx, victim):
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        x = np.ones(4 << 20, np.float32)
        await comm.allreduce(x, bits=4)  # warm up: everyone connected and working
        task = asyncio.ensure_future(comm.allreduce(x, bits=4))
        if ctx.rank == victim:
            await asyncio.sleep(0.002)  # let messages get in flight
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            await task
        except PeerLostError as exc:
            elapsed = time.monotonic() - start
            # The communicator stays broken: the next call fails at once, same peer.
            with pytest.raises(PeerLostError) as again:
                await comm.barrier()
            return type(exc).__name__, exc.peer, elapsed, again.value.peer
        return "no error", None, 0.0, None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world,tls", [(3, None), (4, None), (2, "tcp")])
def test_killed_rank_is_named_by_every_survivor(world, tls):
    victim = world - 1
    env = {"UCX_TLS": tls} if tls else None
    results = run_ranks(
        killed_mid_collective, world, args=(victim,), timeout=80, check=False, env=env
    )
    assert results[victim].exitcode == -signal.SIGKILL
    for r in results[:victim]:
        assert r.ok, r.traceback
        kind, peer, elapsed, peer_again = r.value
        assert kind == "PeerLostError" and peer == victim and peer_again == victim, r.value
        # Detected through the control channel, long before the 20 s timeout.
        assert elapsed < CFG.timeout / 2, elapsed


MISMATCHES = {
    "numel": lambda rank: dict(n=1000 if rank == 1 else 1001),
    "dtype": lambda rank: dict(dtype=np.float16 if rank == 1 else np.float32),
    "op": lambda rank: dict(op="avg" if rank == 1 else "sum"),
    "bits": lambda rank: dict(bits=8 if rank == 1 else 4),
    "layout": lambda rank: dict(
        layout=Layout((LayerSpec(0, 500, 4, 64), LayerSpec(500, 501, 4, 64)))
        if rank == 1
        else Layout((LayerSpec(0, 501, 4, 64), LayerSpec(501, 500, 4, 64)))
    ),
    "algorithm": lambda rank: dict(algorithm="ring" if rank == 1 else "sra"),
    "collective": lambda rank: dict(collective="broadcast" if rank == 1 else "allreduce"),
    # The torch backend's MAX/MIN/...: an allgather signed with the local reduction.
    "gather-op": lambda rank: dict(collective="allgather", op="min" if rank == 1 else "max"),
    # The torch backend's gather: an allgather signed with the root that keeps it.
    "gather-root": lambda rank: dict(collective="allgather", op=None, root=1 if rank == 1 else 0),
}


async def mismatched(ctx, kinds):
    """Each kind of disagreement in turn on one communicator (it must survive them all)."""
    out = {}
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        for what in kinds:
            args = dict(n=1001, dtype=np.float32, op="sum", bits=4, layout=None, algorithm="sra")
            args["collective"] = "allreduce"
            args.update(MISMATCHES[what](ctx.rank))
            x = np.arange(args["n"], dtype=args["dtype"])
            before = x.copy()
            start = time.monotonic()
            out_rows = np.zeros((ctx.world_size, args["n"]), args["dtype"])
            try:
                if args["collective"] == "broadcast":
                    await comm.broadcast(x)
                elif args["collective"] == "allgather":
                    await comm.allgather(x, out_rows, reduce_op=args["op"], root=args.get("root"))
                else:
                    bits = None if args["layout"] is not None else args["bits"]
                    await comm.allreduce(
                        x, args["op"], bits=bits, layout=args["layout"], algorithm=args["algorithm"]
                    )
                outcome = "no error"
            except CollectiveMismatchError as exc:
                outcome = str(exc)
            elapsed = time.monotonic() - start
            untouched = x.tobytes() == before.tobytes() and not out_rows.any()
            # The communicator is still usable afterwards.
            y = np.full(7, ctx.rank, np.int64)
            await comm.allreduce(y)
            out[what] = (outcome, untouched, elapsed, y.tolist())
    return out


@pytest.mark.timeout(120)
def test_mismatch_raises_on_every_rank_and_writes_nothing():
    kinds = sorted(MISMATCHES)
    results = run_ranks(mismatched, 3, args=(kinds,), timeout=110)
    for what in kinds:
        for rank_result in results:
            outcome, untouched, elapsed, y = rank_result[what]
            assert outcome != "no error" and "disagree" in outcome, (what, outcome)
            assert untouched, f"{what}: output written despite the mismatch"
            # Detected from the signatures, not by waiting out the 20 s timeout.
            assert elapsed < CFG.timeout / 2, (what, elapsed)
            assert y == [3] * 7
        assert "rank 1 called" in results[0][what][0]


def a2a_count(src: int, dst: int) -> int:
    """Values rank ``src`` sends rank ``dst`` in the all-to-all tests: two 4 MiB pieces
    from rank 0 to rank 1 (600k int64), more from rank 2 to rank 1, none for some pairs."""
    return 0 if (src + dst) % 3 == 2 else (src + 2 * dst + 1) * 200_000


def a2a_block(src: int, dst: int) -> np.ndarray:
    return np.arange(a2a_count(src, dst), dtype=np.int64) + 10_000_000 * src + 1_000_000 * dst


def alltoall_pair_disagrees(ctx, liar):
    """Through the synchronous engine (node-local mailboxes as configured by default: the
    all-to-all goes over messages anyway): an uneven all-to-all whose pairs agree, then one
    where rank 0's send count to rank 1 and rank 1's receive count from rank 0 differ by
    one value (``liar`` is off), then an allreduce."""
    from cgx_ucx.engine import connect_sync

    r, world = ctx.rank, ctx.world_size
    comm = connect_sync(ctx.store, r, world, config=CFG)
    try:
        sc = [a2a_count(r, i) for i in range(world)]
        rc = [a2a_count(p, r) for p in range(world)]
        x = np.concatenate([a2a_block(r, i) for i in range(world)])
        out = np.full(sum(rc), -1, np.int64)
        comm.alltoall(x, out, sc, rc).result(CFG.timeout * 2)
        exact = out.tobytes() == np.concatenate([a2a_block(p, r) for p in range(world)]).tobytes()
        if liar == "sender" and r == 0:
            sc[1] += 1
        if liar == "receiver" and r == 1:
            rc[0] += 1
        x = np.zeros(sum(sc), np.int64)
        out = np.full(sum(rc), -1, np.int64)
        start = time.monotonic()
        try:
            comm.alltoall(x, out, sc, rc).result(CFG.timeout * 2)
            kind = "no error"
        except Exception as exc:
            kind = f"{type(exc).__name__}: {exc}"
        elapsed = time.monotonic() - start
        untouched = bool((out == -1).all())
        y = np.full(7, r, np.int64)
        comm.allreduce(y).result(CFG.timeout * 2)
        return exact, kind, elapsed, untouched, y.tolist()
    finally:
        comm.close()


@pytest.mark.timeout(120)
# The receiver's side is covered in process too (test_collectives_unit).
@pytest.mark.parametrize("liar", ["sender", "receiver"])
def test_alltoall_counts_that_differ_fail_both_ranks_of_the_pair(liar):
    """Both ranks of a pair whose counts differ raise CollectiveMismatchError naming the
    two ranks and counts, from the signatures (not the timeout), writing nothing; before,
    the sender returned as if the call had worked. The third rank fails too (the pair's
    ABORT); the next call works on every rank."""
    results = run_ranks(alltoall_pair_disagrees, 3, args=(liar,), timeout=110)
    n = a2a_count(0, 1)
    sent, expected = (n + 1, n) if liar == "sender" else (n, n + 1)
    words = f"rank 0 sends rank 1 {sent} values, rank 1 expects {expected}"
    for r, (exact, kind, elapsed, untouched, y) in enumerate(results):
        assert exact, f"rank {r}: the agreeing all-to-all gave a wrong result"
        assert kind.startswith("CollectiveMismatchError: ") and words in kind, (r, kind)
        assert elapsed < CFG.timeout / 2, (r, elapsed)
        if r < 2:  # its own check, or its partner's ABORT if that came first
            assert untouched, f"rank {r} wrote output"
        assert y == [3] * 7


async def local_error_aborts_peers(ctx, late, timeout):
    # late > 0: rank 1 is a starved process for that long (its loop does not run while
    # rank 0 aborts and closes), then runs a few turns (a reset connection is seen) before
    # the call. ``timeout`` also bounds rank 0's close wait.
    cfg = CommConfig(timeout=timeout, connect_timeout=30.0)
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg) as comm:
        # Rank 0 passes an invalid argument: it raises ConfigError at once; the others
        # must not wait out the timeout.
        x = np.ones(100, np.int32 if ctx.rank == 0 else np.float32)
        if late and ctx.rank == 1:
            time.sleep(late)
            for _ in range(20):
                await asyncio.sleep(0)
        return await outcome(comm.allreduce(x, bits=4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "late, timeout, shm",
    [
        (0.0, CFG.timeout, "1"),
        # Longer than FAILED_CLOSE_WAIT_S: rank 0's close waits for rank 1 to read its ABORT.
        pytest.param(FAILED_CLOSE_WAIT_S + 0.5, CFG.timeout, "0", id="starved-network"),
        # Longer than even that wait (min(CLOSE_WAIT_S, timeout)): one host's mailbox.
        pytest.param(3.0, 2.0, "1", id="starved-past-close"),
    ],
)
def test_local_argument_error_aborts_the_others(late, timeout, shm):
    """The others raise CollectiveMismatchError (the cause), not the timeout or a lost
    peer, also a rank that comes late: rank 0's close waits (bounded) for every peer to
    read its ABORT or say BYE before its endpoints go, and on one host the mailbox's
    abort record says why when the peer comes later than that."""
    env = {"CGX_UCX_INTRA_SHM": shm}
    results = run_ranks(local_error_aborts_peers, 3, args=(late, timeout), env=env, timeout=50)
    assert results[0][0] == "ConfigError"
    for kind, elapsed in results[1:]:
        assert kind == "CollectiveMismatchError" and elapsed < CFG.timeout / 2


async def read_only_buffers(ctx):
    """Rank 1 passes a read-only array where the call writes; each call's error kind and
    whether the rank's buffer was left untouched."""
    out = {}
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        # 8 MiB: past the one-host mailboxes' 4 MiB slots, so the network path is checked too.
        for what, n in (("allreduce", 1000), ("allreduce", 1 << 21), ("broadcast", 1 << 21)):
            x = np.full(n, float(ctx.rank + 1), np.float32)
            before = x.copy()
            if ctx.rank == 1:
                x.flags.writeable = False
            call = comm.allreduce(x) if what == "allreduce" else comm.broadcast(x, root=0)
            kind, _ = await outcome(call)
            out[f"{what} {n}"] = (kind, x.tobytes() == before.tobytes())
        y = np.ones(8, np.float32)
        await comm.allreduce(y)  # still usable
        out["after"] = y.tolist()
    return out


@pytest.mark.timeout(60)
def test_a_read_only_output_is_refused_before_anything_moves():
    r0, r1 = run_ranks(read_only_buffers, 2, timeout=50)
    for key in ("allreduce 1000", "allreduce 2097152", "broadcast 2097152"):
        assert r1[key] == ("ConfigError", True), (key, r1[key])
        assert r0[key] == ("CollectiveMismatchError", True), (key, r0[key])
    assert r0["after"] == r1["after"] == [2.0] * 8


async def cancelled_while_waiting(ctx):
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        x = np.ones(1000, np.float32)  # small: the one-round path, every op posted at once
        start = time.monotonic()
        if ctx.rank == 0:
            # Rank 1 has not called yet: our receive is posted and waiting when cancelled.
            task = asyncio.ensure_future(comm.allreduce(x))
            await asyncio.sleep(0.5)
            task.cancel()
            try:
                await task
                kind = "no error"
            except asyncio.CancelledError:
                kind = "CancelledError"
            # The peer must hear why before we close.
            await asyncio.sleep(1.0)
        else:
            await asyncio.sleep(1.0)
            try:
                await comm.allreduce(x)
                kind = "no error"
            except Exception as exc:
                kind = f"{type(exc).__name__}: {exc}"
        return kind, time.monotonic() - start


@pytest.mark.timeout(60)
def test_a_cancelled_small_call_raises_cancelled_and_aborts_the_peer():
    (kind0, _), (kind1, elapsed1) = run_ranks(cancelled_while_waiting, 2, timeout=50)
    assert kind0 == "CancelledError"
    assert kind1.startswith("CollectiveMismatchError") and "rank 0 aborted" in kind1, kind1
    assert "cancelled" in kind1 and elapsed1 < CFG.timeout / 2, (kind1, elapsed1)


async def aborts_a_finished_call_then_closes(ctx):
    """Rank 1 gives up a collective that rank 0 had already finished (its ABORT arrives
    after the fact), then closes: rank 0's next call names the abort's reason, not
    only the close."""
    from cgx_ucx.transport.frames import AbortCode

    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    await comm.allreduce(np.ones(100, np.float32))
    seq = comm._seq - 1  # the call both ranks just finished
    if ctx.rank == 0:
        ctx.store.set("finished", "1")
    if ctx.rank == 1:
        await _key(ctx.store, "finished")  # rank 0 is past it: the ABORT comes late
        await comm._mesh.broadcast_abort(
            seq, AbortCode.LOCAL, 1, "decoding failed after the exchange"
        )
        await comm.close()
        ctx.store.set("closed", "1")
        return seq, ""
    try:
        return seq, await _error_after_peer_closed(ctx, comm)
    finally:
        await comm.close()


async def _error_after_peer_closed(ctx, comm) -> str:
    """Once the peer said it closed: what the next allreduce raises (PeerLostError)."""
    await _key(ctx.store, "closed")
    await asyncio.sleep(0.5)
    try:
        await comm.allreduce(np.ones(100, np.float32))
        return "no error"
    except PeerLostError as exc:
        return str(exc)


@pytest.mark.timeout(60)
def test_abort_of_a_finished_call_is_named_when_the_peer_closes():
    (seq, text), _ = run_ranks(aborts_a_finished_call_then_closes, 2, timeout=50)
    assert "rank 1 closed its communicator" in text, text
    assert f"after aborting collective #{seq}: decoding failed after the exchange" in text, text


async def closes_before_its_peer(ctx):
    """Rank 1 closes right after a collective; rank 0 is still open. Rank 0 logs no
    warning for that clean end (it would read as a failure at the end of every job whose
    ranks finish at different times), and its next call still fails, naming the close."""
    import logging

    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    await comm.allreduce(np.ones(100, np.float32))
    if ctx.rank == 1:
        await comm.close()
        ctx.store.set("closed", "1")
        return [], ""
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("cgx_ucx").addHandler(handler)
    try:
        return warnings, await _error_after_peer_closed(ctx, comm)
    finally:
        logging.getLogger("cgx_ucx").removeHandler(handler)
        await comm.close()


@pytest.mark.timeout(60)
def test_a_peer_closing_first_is_quiet_until_the_next_call():
    (warnings, text), _ = run_ranks(closes_before_its_peer, 2, timeout=50)
    assert warnings == [], warnings
    assert "rank 1 closed its communicator" in text, text


async def peer_dies_while_we_close(ctx):
    """Rank 0 closes while rank 1 is still open; rank 1 then dies. Rank 0's close
    waits for rank 1's BYE (bounded by CLOSE_WAIT_S): it must stop waiting as soon as
    rank 1 is known lost, not sit out the full bound."""
    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    await comm.allreduce(np.ones(100, np.float32))
    if ctx.rank == 1:
        await _key(ctx.store, "closing")
        await asyncio.sleep(0.5)
        os._exit(DEAD_EXIT)
    ctx.store.set("closing", "1")
    start = time.monotonic()
    await comm.close()
    return time.monotonic() - start


@pytest.mark.timeout(60)
def test_close_stops_waiting_for_a_peer_that_dies_meanwhile():
    from cgx_ucx.transport.mesh import CLOSE_WAIT_S

    seconds, _ = run_ranks(peer_dies_while_we_close, 2, timeout=50, expect_dead=[1])
    assert seconds < CLOSE_WAIT_S / 2, f"close took {seconds:.2f} s after the peer died"


async def closes_while_its_peer_calls(ctx):
    """Rank 1 closes after collective #1 while rank 0 starts #2: rank 0 raises at once,
    naming the close (it waited until rank 1's close gave up on rank 0's BYE, ~10 s), and
    rank 1's close returns without sitting out its wait for that BYE."""
    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    await comm.allreduce(np.ones(100, np.float32))
    start = time.monotonic()
    if ctx.rank == 1:
        await comm.close()
        return "closed", time.monotonic() - start
    try:
        await comm.allreduce(np.ones(100, np.float32))
        return "no error", time.monotonic() - start
    except PeerLostError as exc:
        return str(exc), time.monotonic() - start
    finally:
        await comm.close()


@pytest.mark.timeout(60)
def test_a_peer_that_closes_fails_the_next_call_at_once():
    from cgx_ucx.transport.mesh import CLOSE_WAIT_S

    (text, seconds), (_, close_seconds) = run_ranks(closes_while_its_peer_calls, 2, timeout=50)
    assert "rank 1 closed its communicator" in text, text
    assert seconds < CLOSE_WAIT_S / 2, seconds
    assert close_seconds < CLOSE_WAIT_S / 2, close_seconds


async def silent_peer(ctx):
    cfg = CommConfig(timeout=2.0, connect_timeout=30.0)
    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg)
    closing = 0.0
    try:
        await comm.allreduce(np.ones(1000, np.float32))  # collective #1 on every rank
        if ctx.rank == 2:
            # Alive but silent: never joins collective #2.
            for _ in range(50):
                await asyncio.sleep(0.1)
                if comm._mesh.failure is not None:
                    break
            return "silent", None, 0.0, "", None, 0.0
        start = time.monotonic()
        try:
            await comm.allreduce(np.ones(1000, np.float32))
            return "no error", None, 0.0, "", None, 0.0
        except PeerLostError as exc:
            elapsed = time.monotonic() - start
            alive = getattr(exc, "alive", None)
            closing = time.monotonic()
            await comm.close()
            closing = time.monotonic() - closing
            return type(exc).__name__, exc.peer, elapsed, str(exc), alive, closing
    finally:
        await comm.close()


@pytest.mark.timeout(60)
def test_silent_peer_times_out_named():
    """A live rank that does not join a collective is reported as alive, with the
    collective it last started, not as gone; the teardown after that failure
    takes at most ~2 s."""
    results = run_ranks(silent_peer, 3, timeout=50)
    for kind, peer, elapsed, text, alive, closing in results[:2]:
        assert kind in ("CGXTimeoutError", "PeerLostError") and peer == 2
        assert 1.5 < elapsed < 6.0, elapsed
        assert closing < 2.5, closing
        if kind == "CGXTimeoutError":
            assert alive is True and "rank 2 is alive" in text, text
            assert "collective #1 (allreduce, numel 1000)" in text, text
            assert "is gone" not in text
    assert any(r[0] == "CGXTimeoutError" for r in results[:2])
    assert issubclass(CGXTimeoutError, PeerLostError)


async def _key(store, key, timeout=30.0):
    """Wait for a store key without blocking the event loop (UCX progress runs on it)."""
    end = time.monotonic() + timeout
    while not store.check([key]):
        assert time.monotonic() < end, f"key {key} not set"
        await asyncio.sleep(0.01)


async def foreign_connection(ctx):
    """Ranks 0 and 1 form a communicator; rank 2 is an outsider poking rank 0's listener."""
    from cgx_ucx.transport.rendezvous import PeerAddress

    if ctx.rank < 2:
        async with await connect(ctx.store, ctx.rank, 2, config=CFG) as comm:
            ctx.store.set(f"ready/{ctx.rank}", b"1")
            await _key(ctx.store, "poked")
            x = np.full(10, ctx.rank + 1.0, np.float32)
            await comm.allreduce(x)
            return x.tolist()
    import ucxx

    await _key(ctx.store, "ready/0")
    await _key(ctx.store, "ready/1")
    addr = PeerAddress.unpack(ctx.store.get("cgx/0/addr/0"))
    # 1: garbage instead of a HELLO; 2: a well-formed HELLO with a wrong token.
    from cgx_ucx.transport.frames import Frame, Kind

    outcomes = []
    for payload in (os.urandom(64), Frame(kind=Kind.HELLO, job=0, payload=16).pack()):
        ep = await ucxx.create_endpoint(addr.host, addr.port)
        await ep.send(np.frombuffer(payload, np.uint8).copy())
        await ep.send(np.frombuffer(os.urandom(16), np.uint8).copy())
        try:
            await asyncio.wait_for(ep.recv(np.empty(64, np.uint8)), 3)
            outcomes.append("answered")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
        ep.abort()
    ctx.store.set("poked", b"1")
    return outcomes


@pytest.mark.timeout(60)
def test_foreign_connection_is_closed_and_ignored():
    results = run_ranks(foreign_connection, 3, timeout=50)
    assert results[0] == results[1] == [3.0] * 10
    assert "answered" not in results[2]


async def malformed_frame(ctx, algorithm):
    from cgx_ucx.errors import CGXError
    from cgx_ucx.transport.frames import FRAME_NBYTES

    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        await comm.barrier()
        mesh = comm._mesh
        x = np.full(100, ctx.rank + 1.0, np.float32)
        if ctx.rank == 1:
            # A member sends garbage where rank 0 expects the next collective's header.
            seq = comm._seq
            junk = np.frombuffer(os.urandom(FRAME_NBYTES), np.uint8).copy()
            await mesh.send(0, mesh.tag(seq, 1, 1, 0, False), junk, "junk")
            # Rank 0 rejects it and tells us (ABORT). Rank 0's own frames may already be
            # on the wire (one message each), so our call may also complete
            # before the ABORT comes: then with rank 0's correct values, and the next
            # call must fail at once, naming rank 0.
            start = time.monotonic()
            try:
                await comm.allreduce(x, algorithm=algorithm)
            except CGXError as exc:
                return "same call", type(exc).__name__, str(exc), time.monotonic() - start, None
            values = x.tolist()
            start = time.monotonic()
            try:
                await comm.allreduce(np.ones(100, np.float32), algorithm=algorithm)
                return "next call", "no error", "", time.monotonic() - start, values
            except CGXError as exc:
                return "next call", type(exc).__name__, str(exc), time.monotonic() - start, values
        start = time.monotonic()
        try:
            await comm.allreduce(x, algorithm=algorithm)
            return "no error", None, None, None
        except ProtocolError as exc:
            # Garbage fails the pair's keyed check: nobody is proven guilty, so the
            # communicator fails without dropping rank 1 (its control channel stays up).
            return "ProtocolError", str(exc), time.monotonic() - start, mesh.peers[1].lost


async def exchange_refuses_a_separate_payload(ctx):
    from cgx_ucx.transport.frames import Frame, Kind

    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        mesh = comm._mesh
        big = np.zeros(128 << 10, np.uint8)  # over the inline bound: a message of its own
        frame = Frame(
            kind=Kind.DATA, job=mesh.job, seq=99, src=ctx.rank, phase=1, payload=big.nbytes
        )
        sent_before = mesh.stats.messages_sent
        try:
            await mesh.exchange_frames(frame, big, [1 - ctx.rank])
            kind = "no error"
        except ValueError as exc:
            kind = str(exc)
        await comm.barrier()  # the mesh still works: nothing was posted
        return kind, mesh.stats.messages_sent - sent_before


@pytest.mark.timeout(60)
def test_one_round_exchange_refuses_payloads_that_cannot_go_inline():
    """A payload sent as a message of its own could wait for a rendezvous that its
    receiver posts only after the round: refused before anything is posted."""
    for kind, sent in run_ranks(
        exchange_refuses_a_separate_payload, 2, timeout=50, env=MESSAGES_ONLY
    ):
        assert "inline payloads only" in kind, kind
        assert sent == 1  # the barrier's SIG frame only


async def malformed_while_a_peer_is_late(ctx):
    from cgx_ucx.transport.frames import FRAME_NBYTES

    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        await comm.barrier()
        mesh = comm._mesh
        x = np.ones(100, np.float32)  # small: one round, every receive posted at once
        if ctx.rank == 1:
            junk = np.frombuffer(os.urandom(FRAME_NBYTES), np.uint8).copy()
            await mesh.send(0, mesh.tag(comm._seq, 1, 1, 0, False), junk, "junk")
        elif ctx.rank == 2:
            await asyncio.sleep(6.0)  # late, but well inside the timeout
        return await outcome(comm.allreduce(x))


@pytest.mark.timeout(60)
def test_malformed_header_fails_the_round_before_a_late_peer_arrives():
    """Rank 0 checks each header of a one-round call as it arrives: rank 1's junk fails
    the call at once, not once the late rank 2 has sent its own header."""
    results = run_ranks(malformed_while_a_peer_is_late, 3, timeout=50, env=MESSAGES_ONLY)
    kind0, elapsed0 = results[0]
    assert kind0 == "ProtocolError" and elapsed0 < 3.0, results[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["sra", "oneshot"])
def test_malformed_frame_is_protocol_error_on_both_ranks(algorithm):
    """Rank 0 rejects a forged header: ProtocolError there on that call, quickly, rank 1
    not dropped. Rank 1 learns it from rank 0's ABORT, or (rank 0's frame already sent)
    completes that call correctly and fails the next one naming rank 0; never a hang,
    never wrong numbers."""
    results = run_ranks(malformed_frame, 2, args=(algorithm,), timeout=50, env=MESSAGES_ONLY)
    kind, text, elapsed, lost = results[0]
    assert kind == "ProtocolError" and "rank 1" in text, results[0]
    assert elapsed < CFG.timeout / 2 and lost is None, results[0]
    when, kind, text, elapsed, values = results[1]
    assert kind in ("ProtocolError", "PeerLostError") and "rank 0" in text, results[1]
    assert elapsed < CFG.timeout / 2, results[1]  # not the deadline: ABORT or BYE said it
    if when == "same call":
        assert "rank 0 aborted" in text, results[1]
    else:
        assert when == "next call" and values == [3.0] * 100, results[1]


async def lonely_rank(ctx):
    """A rank whose peer never shows up: RendezvousError at the connect deadline."""
    import threading

    import ucxx

    from cgx_ucx.errors import RendezvousError

    start = time.monotonic()
    with pytest.raises(RendezvousError):
        await connect(ctx.store, 0, 2, config=CommConfig(timeout=5.0, connect_timeout=2.0))
    elapsed = time.monotonic() - start
    await asyncio.sleep(0.2)
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    return elapsed, ucxx.core._ctx is None, threads


@pytest.mark.timeout(60)
def test_missing_peer_is_a_rendezvous_error_at_the_deadline():
    elapsed, released, threads = run_ranks(lonely_rank, 1, timeout=50)[0]
    assert 1.5 < elapsed < 2.0 + 1.0  # connect_timeout, overrun by less than 1 s
    assert released and threads == []


async def one_rank_unreachable(ctx, connect_timeout):
    """Rank 0 publishes an address nobody can dial; every rank must fail fast."""
    from cgx_ucx.errors import RendezvousError

    cfg = CommConfig(timeout=20.0, connect_timeout=connect_timeout)
    host = "unreachable.invalid" if ctx.rank == 0 else None
    start = time.monotonic()
    try:
        comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg, host=host)
    except (RendezvousError, PeerLostError) as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)
    await comm.close()
    return "connected", time.monotonic() - start, ""


#: 2 ranks: with 3, the rank that also accepted a half-finished handshake from the third
#: sometimes (1 run in 4) crashed with SIGSEGV in ucxx.reset() while tearing down (open).
WORLD = 2


@pytest.mark.timeout(120)
def test_connect_failure_on_one_rank_fails_every_rank_quickly():
    """Reported: rank 1 could not dial rank 0 and the others waited out the whole
    connect timeout (900 s). The failing rank publishes its failure in the store; every
    rank's connect ends within seconds, far inside the (here 60 s) connect timeout."""
    connect_timeout = 60.0
    results = run_ranks(one_rank_unreachable, WORLD, args=(connect_timeout,), timeout=100)
    for rank, (kind, elapsed, text) in enumerate(results):
        assert kind in ("RendezvousError", "PeerFailedError", "PeerLostError"), (rank, kind)
        assert elapsed < 20.0, (rank, elapsed, text)
    assert any("cannot connect to rank 0" in text for _, _, text in results), results


async def world_size_mismatch(ctx, sizes):
    from cgx_ucx.errors import RendezvousError

    start = time.monotonic()
    try:
        await connect(ctx.store, ctx.rank, sizes[ctx.rank], config=CommConfig(connect_timeout=60))
    except RendezvousError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "connected", "", time.monotonic() - start


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)])
def test_world_size_mismatch_is_reported_fast_with_both_sizes(sizes):
    """Ranks started with different world sizes fail within 5 s with an error naming both
    sizes, not a connect timeout blaming a live rank."""
    results = run_ranks(world_size_mismatch, 2, args=(sizes,), timeout=80)
    for kind, text, elapsed in results:
        assert kind in ("RendezvousError", "PeerFailedError"), (kind, text)
        assert "world size mismatch" in text and "world_size 2" in text, text
        assert "world_size 3" in text, text
        assert elapsed < 5.0, elapsed
        assert "rank 0: rank 0:" not in text and "rank 1: rank 1:" not in text, text


#: Connect attempts in the repeated three-rank failure test: a crash in ucxx.reset()
#: after a failed connect shows in a fraction of attempts only, so one proves little.
REPEATS = 20


async def middle_rank_unreachable(ctx, repeats):
    """Rank 1 (of 3) publishes an address nobody can dial, ``repeats`` times over."""
    from cgx_ucx.errors import RendezvousError

    cfg = CommConfig(timeout=20.0, connect_timeout=10.0)
    host = "unreachable.invalid" if ctx.rank == 1 else None
    out = []
    for i in range(repeats):
        start = time.monotonic()
        try:
            comm = await connect(
                ctx.store, ctx.rank, ctx.world_size, config=cfg, host=host, prefix=f"try{i}"
            )
        except (RendezvousError, PeerLostError) as exc:
            out.append((type(exc).__name__, time.time(), time.monotonic() - start, str(exc)))
            continue
        await comm.close()
        out.append(("connected", time.time(), time.monotonic() - start, ""))
    return out


@pytest.mark.timeout(400)
def test_unreachable_rank_is_named_by_every_rank_within_two_seconds():
    """A rank that cannot be reached is named by every rank (including the one whose dial
    to it hangs) within 2 s of the first failure, without overrunning connect_timeout or
    blaming a healthy rank, and UCX's reset is survived each time."""
    results = run_ranks(middle_rank_unreachable, 3, args=(REPEATS,), timeout=380)
    for i in range(REPEATS):
        attempt = [r[i] for r in results]
        first = min(t for _, t, _, _ in attempt)
        for rank, (kind, t, elapsed, text) in enumerate(attempt):
            assert kind in ("RendezvousError", "PeerFailedError"), (i, rank, kind)
            assert "cannot connect to rank 1" in text, (i, rank, text)
            assert "rank 0: rank 0:" not in text and "rank 2: rank 2:" not in text, text
            assert t - first < 2.0, (i, rank, t - first, text)
            assert elapsed < 10.0 + 1.0, (i, rank, elapsed)


#: Long enough for 4 ranks to connect on a loaded 2-core machine (a connect takes ~1 s;
#: the ranks are started before the clock runs); the survivors wait this long.
KILL_CONNECT_TIMEOUT = 15.0
#: What a survivor may overrun connect_timeout by: its error path (abort, close) on a
#: machine with more runnable processes than cores.
OVERRUN_S = 2.0


async def killed_at(ctx, victim, when):
    """``victim`` SIGKILLs itself during connect or while idle; the others must raise a
    typed error naming it, within the connect timeout (+OVERRUN_S) or at their next call."""
    from cgx_ucx.errors import CGXError

    cfg = CommConfig(timeout=20.0, connect_timeout=KILL_CONNECT_TIMEOUT)
    start = time.monotonic()
    if when == "connect":
        task = asyncio.ensure_future(connect(ctx.store, ctx.rank, ctx.world_size, config=cfg))
        if ctx.rank == victim:
            while not ctx.store.check([f"cgx/0/addr/{victim}"]) and not task.done():
                await asyncio.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm = await task
        except CGXError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start
        # Connected before the victim died: the first call must fail, naming it.
        start = time.monotonic()
    else:
        comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg)
        await comm.barrier()
        if ctx.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0.5)
        start = time.monotonic()
    try:
        await comm.allreduce(np.ones(1000, np.float32))
        return "no error", "", time.monotonic() - start
    except PeerLostError as exc:
        return type(exc).__name__, f"peer {exc.peer}: {exc}", time.monotonic() - start
    finally:
        await comm.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world,when",
    # World 4 killed at connect waits out KILL_CONNECT_TIMEOUT as world 3 does: slow.
    [(3, "connect"), (3, "idle"), pytest.param(4, "connect", marks=pytest.mark.slow), (4, "idle")],
)
def test_rank_killed_at_connect_or_idle(world, when):
    victim = 1
    results = run_ranks(killed_at, world, args=(victim, when), timeout=100, check=False)
    assert results[victim].exitcode == -signal.SIGKILL
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, r.traceback
        kind, text, elapsed = r.value
        assert kind != "no error", r.value
        if when == "idle":
            assert kind == "PeerLostError" and text.startswith(f"peer {victim}:"), r.value
            assert elapsed < 5.0, r.value
        else:
            assert elapsed < KILL_CONNECT_TIMEOUT + OVERRUN_S, r.value
