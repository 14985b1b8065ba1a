"""Node-local mailboxes: small collectives of a one-host group go through shared
memory instead of messages. Checked in spawned ranks under deadlines: results equal the
message path's bit for bit, replicas are bit-identical, and every failure (a mismatch, a
call that one rank runs over the network, a dead, closed or late peer) is a typed error
on every rank, quickly."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest
from harness import DEAD_EXIT, MESSAGES_ONLY, run_ranks

from cgx_ucx.collectives import connect
from cgx_ucx.collectives.local import LOCAL_ONESHOT_BYTES
from cgx_ucx.config import CommConfig, CompressionConfig
from cgx_ucx.engine import connect_sync
from cgx_ucx.errors import CGXTimeoutError, PeerLostError, ProtocolError
from cgx_ucx.layout import Layout
from cgx_ucx.transport import shm
from cgx_ucx.transport.mailbox import SIZE, Mailbox, State

CFG = CommConfig(timeout=20.0, connect_timeout=30.0)

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc")


def values(rank: int, numel: int, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    return (rng.standard_normal(numel) * (rank + 1)).astype(dtype)


# -- results ---------------------------------------------------------------------------------

CASES = [  # (numel, dtype, bits, op)
    (1, np.float32, 32, "sum"),
    (1024, np.float32, 32, "sum"),
    (1024, np.float32, 4, "avg"),
    (4099, np.float16, 8, "sum"),
    (3000, np.int64, 32, "sum"),
    (2048, np.float16, 32, "avg"),  # summed in a float32 accumulator
    (LOCAL_ONESHOT_BYTES // 4, np.float32, 32, "avg"),
    (LOCAL_ONESHOT_BYTES // 4, np.float32, 4, "sum"),
]

#: Layers of odd sizes: the small ones stay uncompressed, the rest 4-bit in 512-buckets.
MIXED = Layout.from_sizes([3, 1000, 17, 5001, 64], CompressionConfig(bits=4, bucket_size=512))


async def results_job(ctx):
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        out = [comm.mailbox is not None]
        for numel, dtype, bits, op in CASES:
            x = values(ctx.rank, numel, dtype)
            await comm.allreduce(x, op, bits=bits)
            out.append(x)
        for dtype in (np.float32, np.float16):  # stochastic rounding, a mixed layout
            x = values(ctx.rank, MIXED.numel, dtype)
            await comm.allreduce(x, "avg", layout=MIXED, stochastic=True, seed=11)
            out.append(x)
        await comm.barrier()
        b = values(ctx.rank, 3000, np.float64)
        await comm.broadcast(b, root=ctx.world_size - 1)
        g = await comm.allgather(values(ctx.rank, 700, np.int32).reshape(7, 100))
        empty = await comm.allgather(np.zeros(0, np.float32))
        return out, comm.stats.messages_sent, b, g, empty.shape, comm.stats.bytes_sent


@pytest.mark.parametrize(
    ("world", "kernels"),
    [(2, "auto"), (3, "auto"), (2, "1")],
    ids=["2-default", "3-default", "2-compiled"],
)
def test_mailbox_results_equal_the_message_path(world, kernels):
    # default: plain NumPy loads and stores on x86-64; "1": the fenced Numba ones.
    boxed = run_ranks(results_job, world, timeout=120, env={"CGX_UCX_MAILBOX_KERNELS": kernels})
    sent = run_ranks(results_job, world, timeout=120, env=MESSAGES_ONLY)
    assert all(r[0][0] for r in boxed), "a one-host group has mailboxes"
    for r in boxed:  # broadcast and allgather, exact
        assert r[2].tobytes() == values(world - 1, 3000, np.float64).tobytes()
        want = np.stack([values(q, 700, np.int32).reshape(7, 100) for q in range(world)])
        assert r[3].tobytes() == want.tobytes() and r[3].shape == (world, 7, 100)
        assert r[4] == (world, 0)
    assert not any(r[0][0] for r in sent), "CGX_UCX_INTRA_SHM=0 turns them off"
    # Nothing of the calls went through messages (the connect's warm-up did).
    assert boxed[0][1] < sent[0][1]
    # ... but their payload counts in the statistics: each peer read this rank's posts.
    assert boxed[0][5] > 0
    for i, (numel, dtype, bits, op) in enumerate(CASES, start=1):
        mine = boxed[0][0][i]
        for r in range(world):  # replicas bit-identical
            assert boxed[r][0][i].tobytes() == mine.tobytes(), (i, r)
        # the same bits as the message path's one-round allreduce (or SRA beyond its
        # crossover: then within the codec's bound / float rounding)
        other = sent[0][0][i]
        exact = np.sum([values(r, numel, dtype).astype(np.float64) for r in range(world)], 0)
        if op == "avg":
            exact /= world
        if bits == 32 and np.dtype(dtype).kind in "iu":
            assert np.array_equal(mine, exact.astype(dtype))
        elif bits == 32:
            tol = 4 * world * np.finfo(dtype).eps * np.abs(exact).max()
            assert np.abs(mine - exact).max() <= tol
        if numel * np.dtype(dtype).itemsize <= 64 << 10:
            assert mine.tobytes() == other.tobytes(), (i, "differs from the message path")
        else:
            scale = np.abs(exact).max()
            err = np.abs(mine.astype(np.float64) - exact).max()
            assert err <= (0.5 * world if bits < 32 else 1e-5) * scale
    for i in (len(CASES) + 1, len(CASES) + 2):  # the stochastic mixed-layout averages
        mine = boxed[0][0][i]
        assert all(boxed[r][0][i].tobytes() == mine.tobytes() for r in range(world)), i
        assert mine.tobytes() == sent[0][0][i].tobytes(), (i, "differs from the message path")
        parts = [values(r, MIXED.numel, mine.dtype).astype(np.float64) for r in range(world)]
        exact = np.mean(parts, 0)
        for layer in MIXED.layers:  # uncompressed: float rounding; 4-bit: under one unit
            sl = slice(layer.offset, layer.end)
            got, want = mine[sl].astype(np.float64), exact[sl]
            rounding = 2 * np.finfo(mine.dtype).eps * np.abs(want).max()
            unit = max(np.ptp(p[sl]) for p in parts) / 15 if layer.compressed else 0.0
            assert np.abs(got - want).max() <= unit + rounding, (i, layer)


def sync_job(ctx):
    comm = connect_sync(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    try:
        comm.barrier().result(10)
        inline = 0
        for _ in range(20):  # on the caller's thread: done when it returns (unless a peer
            x = values(ctx.rank, 1024)  # was more than HAND_OVER_S late)
            fut = comm.allreduce(x, bits=32)
            inline += fut.done()
            fut.result(10)
        ran_inline = inline > 0
        # allreduce_now (the torch backend's): a call done on this thread comes back as
        # its value with no future; the same values as allreduce's.
        inline_now = 0
        for _ in range(20):
            y = values(ctx.rank, 1024)
            value, fut = comm.allreduce_now(y, bits=32)
            assert (value is y and fut is None) or (value is None and fut.result(10) is y)
            inline_now += fut is None
        # Calls queued behind an engine call keep their order (and use the mailbox from
        # the loop): a large allreduce in flight, then small ones (allreduce_now's too:
        # a future then).
        big = np.ones(4 << 20, np.float32) * (ctx.rank + 1)
        f_big = comm.allreduce(big)
        smalls = [np.full(256, float(i + ctx.rank), np.float32) for i in range(5)]
        fs = [comm.allreduce(s) for s in smalls[:4]]
        value, f_last = comm.allreduce_now(smalls[4])
        assert value is None and f_last is not None
        f_bar = comm.barrier()
        for f in [f_big, *fs, f_last, f_bar]:
            f.result(30)
        threads_ok = _threads(comm)
        ok = ran_inline and inline_now > 0
        return ok, x, float(big[0]), [float(s[0]) for s in smalls], threads_ok, y
    finally:
        comm.close()


def _threads(comm):
    """Two threads calling collectives at once on one communicator: each call is whole."""
    errors = []

    def worker(k):
        try:
            for _ in range(20):
                comm.barrier().result(30)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return not errors


def test_sync_face_runs_on_the_callers_thread_and_keeps_order():
    res = run_ranks(sync_job, 2, timeout=120)
    assert all(r[0] for r in res)
    assert res[0][1].tobytes() == res[1][1].tobytes()
    assert res[0][5].tobytes() == res[1][5].tobytes() == res[0][1].tobytes()
    assert all(r[2] == 3.0 for r in res)
    assert all(r[3] == [2 * i + 1.0 for i in range(5)] for r in res)
    assert all(r[4] for r in res)


# -- failures ----------------------------------------------------------------------------------


async def _outcome(coro):
    start = time.monotonic()
    try:
        await coro
        return "no error", None, time.monotonic() - start
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start


async def mismatch_job(ctx, numel_of):
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        x = np.full(numel_of[ctx.rank], 7.0, np.float32)
        kind, text, took = await _outcome(comm.allreduce(x))
        untouched = bool(np.all(x == 7.0))
        # the communicator goes on working
        y = np.ones(16, np.float32)
        await comm.allreduce(y)
        return kind, text, took, untouched, float(y[0])


async def root_mismatch_job(ctx):
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        x = np.full(64, float(ctx.rank), np.float32)
        kind, _, took = await _outcome(comm.broadcast(x, root=min(ctx.rank, 1)))
        return kind, took, bool(np.all(x == ctx.rank))


def test_broadcast_root_mismatch_fails_every_rank():
    for kind, took, untouched in run_ranks(root_mismatch_job, 3, timeout=90):
        assert kind == "CollectiveMismatchError" and took < 10 and untouched


@pytest.mark.parametrize(
    "numel_of",
    [
        {0: 1024, 1: 2048, 2: 1024},  # both through the mailboxes
        {0: 1024, 1: 4 << 20, 2: 1024},  # one rank's call goes over the network
    ],
)
def test_mismatch_fails_every_rank_fast(numel_of):
    res = run_ranks(mismatch_job, 3, timeout=90, args=(numel_of,))
    for kind, text, took, untouched, after in res:
        assert kind == "CollectiveMismatchError", text
        assert took < 10
        assert untouched
        assert after == 3.0


async def dead_job(ctx):
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        x = np.ones(1024, np.float32)
        await comm.allreduce(x)
        if ctx.rank == 1:
            os._exit(DEAD_EXIT)
        await asyncio.sleep(0.2)
        kind, _, took = await _outcome(comm.allreduce(x))
        return kind, took


def test_dead_peer_is_named_fast():
    res = run_ranks(dead_job, 3, timeout=90, check=False, expect_dead=[1])
    for r in (res[0], res[2]):
        assert r.ok, r.error
        kind, took = r.value
        assert kind == "PeerLostError"
        assert took < 10


async def late_job(ctx):
    cfg = CommConfig(timeout=2.0, connect_timeout=30.0)
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg) as comm:
        await comm.barrier()
        if ctx.rank == 1:
            await asyncio.sleep(4.0)
            return "slept", None
        start = time.monotonic()
        try:
            await comm.barrier()
        except CGXTimeoutError as exc:
            return (exc.peer, exc.alive, "alive" in str(exc)), time.monotonic() - start
        return "no error", None


def test_late_peer_times_out_naming_it():
    res = run_ranks(late_job, 2, timeout=90)
    (peer, alive, says), took = res[0]
    assert (peer, alive, says) == (1, True, True)
    assert 1.5 < took < 6


async def closed_job(ctx):
    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    await comm.barrier()
    if ctx.rank == 1:
        await comm.close()
        return "closed", 0.0
    await asyncio.sleep(0.5)
    kind, _, took = await _outcome(comm.barrier())
    await comm.close()
    return kind, took


def test_closed_peer_fails_the_next_call():
    res = run_ranks(closed_job, 2, timeout=90)
    kind, took = res[0]
    assert kind == "PeerLostError"
    assert took < 10


def sync_dead_job(ctx):
    comm = connect_sync(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    comm.barrier().result(20)
    if ctx.rank == 1:
        os._exit(DEAD_EXIT)
    time.sleep(0.2)
    start = time.monotonic()
    try:
        comm.allreduce(np.ones(64, np.float32)).result(30)
        kind = "no error"
    except PeerLostError:
        kind = "PeerLostError"
    took = time.monotonic() - start
    comm.close(timeout=10)
    return kind, took


def test_sync_face_dead_peer():
    res = run_ranks(sync_dead_job, 2, timeout=90, check=False, expect_dead=[1])
    assert res[0].ok, res[0].error
    kind, took = res[0].value
    assert kind == "PeerLostError" and took < 10


# -- the mailbox itself (one process) ------------------------------------------------------


def test_mailbox_attach_refuses_foreign_segments():
    a, b = Mailbox(0, 2), Mailbox(1, 2)
    try:
        assert a.attach({1: b.descriptor()}) is None
        assert a.words[1] == State.ATTACHED
        assert a.peer_state(1) == State.CONNECTING
        other = shm.Segment(SIZE)  # a segment that is not a mailbox
        c = Mailbox(0, 2)
        why = c.attach({1: other.describe(0, SIZE)})
        assert why is not None and "not a mailbox" in why
        assert c.words[1] == State.FAILED
        small = shm.Segment(1 << 16)
        assert "bytes" in Mailbox(0, 2).attach({1: small.describe(0, 1 << 16)})
        c.close()
        other.close()
        small.close()
    finally:
        a.close()
        b.close()


def test_mailbox_post_and_read_back():
    a, b = Mailbox(0, 2), Mailbox(1, 2)
    try:
        assert a.attach({1: b.descriptor()}) is None
        assert b.attach({0: a.descriptor()}) is None
        sig = np.arange(8, dtype=np.uint64)
        b.begin_post()[:3] = [1, 2, 3]
        assert not a.spin_posted(1, 5, 10)
        b.post(5, sig, 3)
        assert a.spin_posted(1, 5, 10)
        got_sig, payload, slot = a.contribution(1, 5)
        assert list(got_sig) == list(sig) and list(payload) == [1, 2, 3]
        with pytest.raises(ProtocolError):
            a.contribution(1, 7)  # never posted
        # The next post takes the other slot; the one after rewrites this one, which a
        # reader that is still on #5 sees when it checks after reading.
        b.begin_post()[:1] = [9]
        b.post(8, sig, 1)
        assert a.holds(1, 5, slot) and a.contribution(1, 8)[2] != slot
        b.begin_post()
        assert not a.holds(1, 5, slot)
        b.abort(5, 1, 1, "CollectiveMismatchError: x" * 20)
        code, culprit, reason = a.aborted(1, 5)
        assert (code, culprit) == (1, 1) and reason.startswith("CollectiveMismatchError")
        assert len(reason) == 256  # cut to REASON_BYTES
        assert a.aborted(1, 6) is None and a.aborted(1, 13) is None  # 13: the same entry
        b.abort(13, 2, 0, "later")  # a later collective takes the entry over
        assert a.aborted(1, 5) is None and a.aborted(1, 13) == (2, 0, "later")
        b.close()
        assert a.peer_state(1) == State.CLOSED
    finally:
        a.close()
        b.close()


# -- a stuck peer, a close from another thread, disagreeing settings -----------------------


def stuck_peer_job(ctx):
    """Rank 1 is alive but never calls again: every call of rank 0 must end typed, also
    the third, whose slot rank 1 never released (waiting for a slot is bounded too)."""
    comm = connect_sync(ctx.store, ctx.rank, ctx.world_size, config=CommConfig(timeout=2.0))
    comm.barrier().result(10)
    if ctx.rank == 1:
        time.sleep(12)
        return []
    out = []
    for _ in range(3):
        start = time.monotonic()
        try:
            comm.allreduce(np.ones(16, np.float32)).result(15)
            out.append(("no error", 0.0))
        except Exception as exc:
            out.append((type(exc).__name__, time.monotonic() - start))
    return out


def test_a_stuck_peer_times_out_every_call():
    res = run_ranks(stuck_peer_job, 2, timeout=90)
    assert [kind for kind, _ in res[0]] == ["CGXTimeoutError"] * 3
    assert all(took < 6 for _, took in res[0])


#: What a call may end with when a peer, or this rank, closes under it.
EXPECTED_ON_CLOSE = {"ok", "TransportError", "PeerLostError", "CGXTimeoutError"}


def close_race_job(ctx):
    """Rank 0 closes its communicator from the main thread while a worker thread runs
    1 MiB mailbox allreduces on it: the worker's calls end in typed errors (or succeed)."""
    comm = connect_sync(ctx.store, ctx.rank, ctx.world_size, config=CommConfig(timeout=5.0))
    kinds = []

    def worker():
        x = np.ones(1 << 18, np.float32)
        for _ in range(200):
            try:
                comm.allreduce(x, bits=4).result(10)
                kinds.append("ok")
            except Exception as exc:
                kinds.append(type(exc).__name__)
                if type(exc).__name__ not in EXPECTED_ON_CLOSE:
                    kinds.append(str(exc)[:300])  # what the failure says, if it fails
                if comm.closed or isinstance(exc, PeerLostError):
                    return

    t = threading.Thread(target=worker)
    t.start()
    time.sleep(0.3)
    if ctx.rank == 0:
        comm.close(timeout=10)
    t.join(60)
    if ctx.rank == 1:
        comm.close(timeout=10)
    return sorted(set(kinds)), t.is_alive()


def test_close_while_a_thread_runs_mailbox_calls():
    res = run_ranks(close_race_job, 2, timeout=120)
    for kinds, hung in res:
        assert not hung
        assert set(kinds) <= EXPECTED_ON_CLOSE, kinds


async def shm_disagreement_job(ctx):
    try:
        await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "connected", ""


def test_ranks_disagreeing_on_intra_shm_fail_connect_typed():
    env = lambda rank: MESSAGES_ONLY if rank == 0 else {}  # noqa: E731
    for kind, text in run_ranks(shm_disagreement_job, 2, timeout=90, env=env):
        assert kind == "ConfigError" and "CGX_UCX_INTRA_SHM" in text, text


# -- which loads and stores ------------------------------------------------------------------


def test_mailbox_kernels_are_chosen_by_the_cpu_and_the_variable(monkeypatch):
    from cgx_ucx.errors import ConfigError
    from cgx_ucx.transport import mailbox

    monkeypatch.setattr(mailbox, "_store", mailbox._store)  # restored after the test
    monkeypatch.setattr(mailbox, "_load", mailbox._load)
    monkeypatch.setattr(mailbox, "_spin", mailbox._spin)
    monkeypatch.setattr(mailbox, "ORDERED_CPU", True)
    for value in ("auto", "0", "off"):
        monkeypatch.setenv("CGX_UCX_MAILBOX_KERNELS", value)
        assert mailbox.compile_kernels() is False
    monkeypatch.setenv("CGX_UCX_MAILBOX_KERNELS", "sometimes")
    with pytest.raises(ConfigError, match="CGX_UCX_MAILBOX_KERNELS"):
        mailbox.compile_kernels()
    monkeypatch.setattr(mailbox, "ORDERED_CPU", False)  # as on ARM or POWER
    monkeypatch.setenv("CGX_UCX_MAILBOX_KERNELS", "0")
    with pytest.raises(ConfigError, match="may reorder stores"):
        mailbox.compile_kernels()
    monkeypatch.delenv("CGX_UCX_MAILBOX_KERNELS")
    assert mailbox.compile_kernels() is True
    assert mailbox._spin.__module__.endswith("_mailbox_kernels")


def test_numpy_loads_and_stores_see_a_post():
    from cgx_ucx.transport import mailbox

    if mailbox._spin.__module__ != mailbox.__name__:
        pytest.skip("the compiled loads and stores are in use in this process")
    words = np.zeros(4, np.uint64)
    assert not mailbox._spin(words, 2, 1, 256)
    mailbox._store(words, 2, 1)
    assert mailbox._spin(words, 2, 1, 256) and mailbox._spin(words, 2, 1, 1)
    assert mailbox._load(words, 2) == 1 and not mailbox._spin(words, 2, 2, 256)


def lean_job(ctx):
    import sys

    async def main():
        async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
            x = values(ctx.rank, 1024, np.float32)
            await comm.allreduce(x, "sum", bits=4)
            await comm.allreduce(values(ctx.rank, 4096, np.float32), "sum")
            return comm.mailbox is not None, "numba" in sys.modules, x

    return asyncio.run(main())


def test_a_small_job_on_one_host_never_loads_numba():
    """Connect's warm-up and small calls run the codec's NumPy reference and the
    mailboxes' NumPy loads and stores (x86-64): no rank imports Numba (about 115 MiB a
    rank with its kernels), and the results are bit-identical."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the mailboxes compile their fenced loads and stores on this CPU")
    out = run_ranks(lean_job, 2, timeout=60)
    assert [r[:2] for r in out] == [(True, False), (True, False)]
    assert out[0][2].tobytes() == out[1][2].tobytes()


def test_started_never_pairs_one_collectives_number_with_anothers_signature(monkeypatch):
    """A peer announcing its next network collective while this rank reads its last one
    must not look like a mismatch: the writer clears the number while it rewrites the
    signature, and the reader takes the number only if it reads the same one after."""
    from cgx_ucx.transport import mailbox

    a, b = Mailbox(0, 2), Mailbox(1, 2)
    try:
        assert a.attach({1: b.descriptor()}) is None and b.attach({0: a.descriptor()}) is None
        stores = []
        real_store = mailbox._store
        monkeypatch.setattr(
            mailbox, "_store", lambda w, i, v: (stores.append((i, int(v))), real_store(w, i, v))
        )
        b.announce(7, np.full(8, 7, np.uint64))
        assert stores == [(mailbox.W_STARTED, 0), (mailbox.W_STARTED, 8)]
        seq, sig = a.started(1)
        assert seq == 7 and list(sig) == [7] * 8
        # The peer rewrites them between this rank's two loads of the number.
        real_load = mailbox._load
        loads = []

        def load(words, i):
            loads.append(i)
            if i == mailbox.W_STARTED and loads.count(i) == 2:
                b.announce(8, np.full(8, 8, np.uint64))
            return real_load(words, i)

        monkeypatch.setattr(mailbox, "_load", load)
        assert a.started(1)[0] == -1  # not #7 with #8's signature
        assert a.started(1)[0] == 8
    finally:
        a.close()
        b.close()
