"""Trust across processes: a process that can read the store must not inject
data into a job, join it without the out-of-band secret, or disturb it; communicator
ids never collide, however many communicators a job makes."""

from __future__ import annotations

import asyncio
import os
import struct
import time

import numpy as np
import pytest
from harness import MESSAGES_ONLY, run_ranks

from cgx_ucx.collectives import connect
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import CGXError, CollectiveMismatchError, ProtocolError

CFG = CommConfig(timeout=20.0, connect_timeout=30.0)
N = 32768  # values per allreduce: the payload rides UCX's rendezvous protocol


async def _key(store, key, timeout=40.0):
    """Wait for a store key without blocking the event loop (UCX progress runs on it)."""
    end = time.monotonic() + timeout
    while not store.check([key]):
        assert time.monotonic() < end, f"key {key} not set"
        await asyncio.sleep(0.01)


def _frame_from_rank1(job, comm, seq, phase, slot, numel, payload, dtype=np.float32, **fields):
    """A DATA frame of an allreduce (sum, 32 bits) that claims to come from rank 1."""
    from cgx_ucx.transport.frames import Coll, Frame, Kind, Op, dtype_code

    return Frame(
        kind=Kind.DATA,
        job=job,
        comm=comm,
        seq=seq,
        src=1,
        phase=phase,
        slot=slot,
        collective=Coll.ALLREDUCE,
        reduce_op=Op.SUM,
        dtype=dtype_code(dtype),
        bits=32,
        numel=numel,
        payload=payload,
        **fields,
    )


def _unkeyed_tag(comm: int, seq: int, src: int, phase: int, slot: int, payload: bool) -> int:
    """A tag laid out without a secret (communicator 12 | seq 20 | src 12 | phase 4 |
    slot 15 | payload 1): one that a store reader can compute."""
    t = comm
    t = (t << 20) | (seq & 0xFFFFF)
    t = (t << 12) | src
    t = (t << 4) | phase
    t = (t << 15) | slot
    return (t << 1) | int(payload)


async def _inject(ctx, foreign_job: bool) -> int:
    """Read rank 0's worker address and the job token from the store, connect to rank
    0's worker and post DATA frames claiming to be rank 1 for the next collectives, on
    every tag a store reader could compute, with payloads of 1001.0."""
    import ucxx

    from cgx_ucx.transport.handshake import structured_tag
    from cgx_ucx.transport.rendezvous import PeerAddress

    addr = PeerAddress.unpack(ctx.store.get("cgx/0/addr/0"))
    raw = ctx.store.get("cgx/0/token")
    job = struct.unpack_from("<Q", raw, 0)[0]
    comm = struct.unpack_from("<I", raw, 16)[0] if len(raw) >= 20 else 0
    if foreign_job:
        job ^= 0x5A5A5A5A
    ep = await ucxx.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(addr.worker_address)
    )
    payload = np.full(N, 1001.0, np.float32)
    sends = []
    for seq in range(2, 6):
        for phase in range(4):
            for slot in range(2):
                head = _frame_from_rank1(
                    job, comm, seq, phase, slot, N, payload.nbytes, count=1
                ).pack()
                guesses = [structured_tag(seq, phase, slot, False)]
                token_bits = struct.unpack_from("<H", raw, 8)[0] & 0xFFF  # 12 random bits
                guesses += [_unkeyed_tag(c, seq, 1, phase, slot, False) for c in (comm, token_bits)]
                for tag in guesses:
                    hb = np.frombuffer(head, np.uint8).copy()
                    sends.append(asyncio.ensure_future(ep.send(hb, tag=tag, force_tag=True)))
                    sends.append(
                        asyncio.ensure_future(ep.send(payload, tag=tag | 1, force_tag=True))
                    )
    # Small messages go out eagerly; the payloads wait for a match that must never come.
    await asyncio.wait(sends, timeout=3.0)
    return len(sends)


async def injection(ctx, foreign_job):
    if ctx.rank == 2:
        n = await _inject(ctx, foreign_job)
        ctx.store.set("injected", b"1")
        await _key(ctx.store, "finished/0")
        await _key(ctx.store, "finished/1")
        os._exit(0)  # the injected sends are still pending: skip UCX's teardown
        return n
    async with await connect(ctx.store, ctx.rank, 2, config=CFG) as comm:
        x = np.full(N, ctx.rank + 1.0, np.float32)
        await comm.allreduce(x)  # collective #1: both ranks connected and working
        await _key(ctx.store, "injected")
        outcomes = []
        for _ in range(4):  # collectives #2..#5, the ones the injected frames aim at
            x = np.full(N, ctx.rank + 1.0, np.float32)
            try:
                await comm.allreduce(x)
                outcomes.append("correct" if np.all(x == 3.0) else f"WRONG {x[:4]}")
            except CGXError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
                break
        ctx.store.set(f"finished/{ctx.rank}", b"1")
        return outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("foreign_job", [False, True], ids=["job-token", "foreign-job"])
def test_injected_data_frames_are_never_accepted(foreign_job):
    """A store reader posting DATA frames as rank 1 for future sequence numbers, with the
    job's id or a foreign one, changes no result and fails no rank: the injected frames
    are on tags no receive matches (secret per-pair prefixes), so the job goes on."""
    results = run_ranks(
        injection, 3, args=(foreign_job,), timeout=110, check=False, env=MESSAGES_ONLY
    )
    for r in results[:2]:
        assert r.ok, r.traceback
        assert r.value == ["correct"] * 4, r.value


# -- inline payloads: forged by a member, and mismatches ----------------------------------

#: How rank 1 (holding the pair key, so its frames pass the keyed check) lies about an
#: inline payload on the header of rank 0's next one-round allreduce (100 float32).
FORGERIES = ["over-bound", "over-buffer", "header-only", "short", "no-end-byte"]


def _forged(kind: str, frame, key: bytes) -> np.ndarray:
    from cgx_ucx.transport.frames import FLAG_INLINE, FRAME_NBYTES, INLINE_END, MAX_INLINE_NBYTES

    if kind.startswith("over"):
        # (a) more than MAX_INLINE_NBYTES announced: with a message that fits the
        # receive, or one as long as it says (UCX reports it truncated).
        n = MAX_INLINE_NBYTES + 1
        frame = frame.with_(payload=n)
        body = 100 if kind == "over-bound" else n
    else:
        # (b) the 400 bytes announced, a message that ends early.
        body = {"header-only": 0, "short": 200, "no-end-byte": 400}[kind]
    msg = np.full(FRAME_NBYTES + body + 1, INLINE_END, np.uint8)
    msg[:FRAME_NBYTES] = np.frombuffer(frame.pack(key, FLAG_INLINE), np.uint8)
    return msg if kind.startswith("over") else msg[: FRAME_NBYTES + body]


async def forged_inline(ctx, kind):
    from cgx_ucx.collectives.call import PH_SIG
    from cgx_ucx.transport.frames import Algo

    async with await connect(ctx.store, ctx.rank, 2, config=CFG) as comm:
        await comm.barrier()
        mesh = comm._mesh
        if ctx.rank == 1:
            seq = comm._seq
            frame = _frame_from_rank1(
                mesh.job, mesh.comm_id, seq, PH_SIG, 0, 100, 400, algorithm=Algo.ONESHOT, count=1
            )
            msg = _forged(kind, frame, mesh.peers[0].keys.key)
            tag = mesh.tag(seq, 1, PH_SIG, 0, False)
            sent = asyncio.ensure_future(mesh.send(0, tag, msg, "forged inline frame"))
            await _key(ctx.store, "done/0")
            # Rank 0 has dropped us by now: what the forged send does no longer matters
            # (a short one may never complete), and a pending send would hold up close.
            await asyncio.wait([sent], timeout=1.0)
            sent.cancel()
            return None
        x = np.ones(100, np.float32)
        start = time.monotonic()
        try:
            await comm.allreduce(x, algorithm="oneshot")
            outcome = "no error"
        except ProtocolError as exc:
            outcome = f"ProtocolError: {exc}"
        finally:
            ctx.store.set("done/0", b"1")
        lost = mesh.peers[1].lost
        return outcome, time.monotonic() - start, x.tolist() == [1.0] * 100, type(lost).__name__


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FORGERIES)
def test_forged_inline_payloads_are_refused(kind):
    """(a) FLAG_INLINE announcing more than MAX_INLINE_NBYTES, (b) an inline message
    shorter than its header and payload: a ProtocolError naming the sender at once,
    nothing written, and the sender (it held the pair key) dropped."""
    outcome, elapsed, untouched, lost = run_ranks(
        forged_inline, 2, args=(kind,), timeout=50, env=MESSAGES_ONLY
    )[0]
    assert outcome.startswith("ProtocolError") and "from rank 1" in outcome, outcome
    expected = {"over-bound": "bound", "over-buffer": "oversized message"}.get(kind, "shorter")
    assert expected in outcome, outcome
    assert elapsed < CFG.timeout / 2 and untouched and lost == "ProtocolError"


async def inline_mismatches(ctx):
    """(d) Ranks that disagree, with every frame inline (small host buffers)."""
    out = {}
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        x = np.ones(100, np.float32)
        before = comm.stats.messages_sent
        await comm.allreduce(x, algorithm="oneshot")
        out["messages"] = comm.stats.messages_sent - before
        for algorithm in ("oneshot", "sra"):
            for what in ("numel", "dtype", "op"):
                n = 100 + (ctx.rank == 1 and what == "numel")
                dtype = np.float64 if ctx.rank == 1 and what == "dtype" else np.float32
                op = "avg" if ctx.rank == 1 and what == "op" else "sum"
                x = np.arange(n, dtype=dtype)
                start = time.monotonic()
                try:
                    await comm.allreduce(x, op, algorithm=algorithm)
                    outcome = "no error"
                except CollectiveMismatchError as exc:
                    outcome = str(exc)
                untouched = np.array_equal(x, np.arange(n, dtype=dtype))
                y = np.full(7, ctx.rank, np.int64)
                await comm.allreduce(y)  # still usable
                out[algorithm, what] = (outcome, untouched, time.monotonic() - start, y.tolist())
    return out


@pytest.mark.timeout(90)
def test_mismatch_is_detected_on_every_rank_with_inline_frames():
    results = run_ranks(inline_mismatches, 3, timeout=80, env=MESSAGES_ONLY)
    for rank, out in enumerate(results):
        assert out.pop("messages") == 2, (rank, out)  # one message to each peer: inline
        assert len(out) == 6, out
        for (algorithm, what), got in out.items():
            outcome, untouched, elapsed, y = got
            assert "disagree" in outcome, (rank, algorithm, what, outcome)
            assert untouched and elapsed < CFG.timeout / 2 and y == [3] * 7, (rank, what, got)


async def wrong_secret_intruder(ctx):
    """Ranks 0 and 1 share a secret; rank 2 read the store and dials rank 0 as rank 1
    with a wrong secret while rank 0 waits for the real rank 1."""
    cfg = CommConfig(timeout=20.0, connect_timeout=40.0, secret="right horse battery")
    if ctx.rank == 2:
        import ucxx

        from cgx_ucx.transport import handshake as hs
        from cgx_ucx.transport.rendezvous import PeerAddress

        await _key(ctx.store, "cgx/0/addr/0")
        addr = PeerAddress.unpack(ctx.store.get("cgx/0/addr/0"))
        raw = ctx.store.get("cgx/0/token")
        token, comm = raw[:16], struct.unpack_from("<I", raw, 16)[0]
        job = struct.unpack_from("<Q", token, 0)[0]
        outcomes = []
        for secret in (hs.hash_bytes("wrong"), None):
            auth = hs.Auth(token, job, comm, secret)
            ep = await ucxx.create_endpoint(addr.host, addr.port)
            try:
                await asyncio.wait_for(hs.dial(ep, auth, 1, 0), 10)
                outcomes.append("joined")
            except CGXError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
            ep.abort()
        await asyncio.sleep(0.5)
        ctx.store.set("intruded", b"1")
        return outcomes
    if ctx.rank == 1:
        await _key(ctx.store, "intruded")
    async with await connect(ctx.store, ctx.rank, 2, config=cfg) as comm:
        x = np.full(1000, ctx.rank + 1.0, np.float32)
        await comm.allreduce(x)
        return x.tolist() == [3.0] * 1000, comm._mesh.stats.refused_connections


@pytest.mark.timeout(120)
def test_wrong_secret_cannot_join_and_the_job_is_not_disturbed():
    results = run_ranks(wrong_secret_intruder, 3, timeout=110)
    intruder = results[2]
    assert len(intruder) == 2
    for outcome in intruder:
        assert outcome.startswith("ProtocolError") and "could not prove membership" in outcome
    assert "secret" in intruder[0] or "token" in intruder[0]
    (ok0, refused0), (ok1, _) = results[0], results[1]
    assert ok0 and ok1
    assert refused0 >= 2


async def mismatched_secrets(ctx):
    cfg = CommConfig(timeout=10.0, connect_timeout=30.0, secret=f"secret of rank {ctx.rank}")
    start = time.monotonic()
    try:
        await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg)
    except CGXError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "connected", "", time.monotonic() - start


@pytest.mark.timeout(90)
def test_ranks_with_different_secrets_fail_fast_and_say_so():
    results = run_ranks(mismatched_secrets, 2, timeout=80)
    for kind, text, elapsed in results:
        assert kind in ("RendezvousError", "PeerFailedError"), (kind, text)
        assert "secret" in text, text
        assert elapsed < 10.0, elapsed


def test_secret_from_the_environment_is_never_shown():
    from cgx_ucx.config import resolve_comm

    cfg = resolve_comm(env={"CGX_UCX_SECRET": "hunter2"})
    assert cfg.secret == "hunter2"
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg)
    assert resolve_comm(env={}).secret is None


#: Communicators one job makes in the collision test: with 12 random bits (before issue
#: 13) 200 communicators shared an id with probability ~99%.
GROUPS = 200


async def many_communicators(ctx):
    cfg = CommConfig(timeout=60.0, connect_timeout=60.0)
    comms = []
    try:
        for i in range(GROUPS):
            # A prefix per group, as torch gives each process group its own PrefixStore.
            comms.append(await connect(ctx.store, ctx.rank, 2, config=cfg, prefix=f"g{i}"))
        ids = [c._mesh.comm_id for c in comms]
        xs = [np.full(1000, float(i + ctx.rank), np.float32) for i in range(GROUPS)]
        # All at once: a tag shared by two communicators would mix their messages.
        await asyncio.gather(*(c.allreduce(x) for c, x in zip(comms, xs, strict=True)))
        wrong = [i for i, x in enumerate(xs) if not np.all(x == 2.0 * i + 1.0)]
        return ids, wrong
    finally:
        for c in comms:
            await c.close()


@pytest.mark.timeout(240)
def test_two_hundred_communicators_in_one_job_never_collide():
    (ids0, wrong0), (ids1, wrong1) = run_ranks(many_communicators, 2, timeout=230)
    assert ids0 == ids1 and len(set(ids0)) == GROUPS
    assert wrong0 == wrong1 == []


# -- a payload received together with its header ----------------------------------------

#: How rank 1 sends rank 0 the frame and payload that rank 0 receives with
#: ``recv_frame_into`` (payload receive posted with the header's): as the protocol does,
#: payload first, a header announcing another size, a payload longer than announced.
PREPOSTED = ["header-then-payload", "payload-first", "wrong-size", "oversized"]
PREPOSTED_NBYTES = 1 << 20  # above the inline bound: the payload is its own message


async def preposted(ctx, kind):
    from cgx_ucx.collectives.call import PH_DATA

    async with await connect(ctx.store, ctx.rank, 2, config=CFG) as comm:
        await comm.barrier()
        mesh = comm._mesh
        seq, slot = comm._seq + 5, 3  # a collective and a slot nobody else uses
        n = PREPOSTED_NBYTES
        if ctx.rank == 1:
            size = n + (kind == "wrong-size")
            frame = _frame_from_rank1(
                mesh.job, mesh.comm_id, seq, PH_DATA, slot, n, size, np.uint8, count=4
            )
            head = np.frombuffer(frame.pack(mesh.peers[0].keys.key), np.uint8)
            body = np.arange(n + (kind == "oversized"), dtype=np.uint64).astype(np.uint8)
            await _key(ctx.store, "posted/0")
            sends = [
                (mesh.tag(seq, 1, PH_DATA, slot, False), head),
                (mesh.tag(seq, 1, PH_DATA, slot, True), body),
            ]
            if kind == "payload-first":
                sends.reverse()
            tasks = [asyncio.ensure_future(mesh.send(0, t, m, "test frame")) for t, m in sends]
            await _key(ctx.store, "done/0")
            await asyncio.wait(tasks, timeout=1.0)  # a refused one may never complete
            for t in tasks:
                t.cancel()
            return None
        buf = np.zeros(n, np.uint8)
        got = asyncio.ensure_future(mesh.recv_frame_into(1, seq, PH_DATA, slot, buf))
        await asyncio.sleep(0.05)  # both receives are posted before anything is sent
        ctx.store.set("posted/0", b"1")
        start = time.monotonic()
        try:
            frame = await got
            outcome = f"frame {frame.slot} count {frame.count}"
        except CGXError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            ctx.store.set("done/0", b"1")
        expected = np.arange(n, dtype=np.uint64).astype(np.uint8)
        lost = mesh.peers[1].lost
        return outcome, time.monotonic() - start, np.array_equal(buf, expected), repr(lost)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", PREPOSTED)
def test_payload_posted_with_its_header(kind):
    """A receiver that knows a payload's size posts its receive with the header's: the
    bytes land in place in either order of arrival; a header announcing another size, or
    a payload longer than the buffer, is a ProtocolError naming the sender at once, and
    the sender (it held the pair key) is dropped."""
    outcome, elapsed, landed, lost = run_ranks(
        preposted, 2, args=(kind,), timeout=50, env=MESSAGES_ONLY
    )[0]
    if kind in ("header-then-payload", "payload-first"):
        assert outcome == "frame 3 count 4" and landed and lost == "None", (outcome, lost)
        return
    assert outcome.startswith("ProtocolError") and "rank 1" in outcome, outcome
    expected = "announced 1048577 payload bytes" if kind == "wrong-size" else "oversized"
    assert expected in outcome, outcome
    assert elapsed < CFG.timeout / 2 and "ProtocolError" in lost, lost
