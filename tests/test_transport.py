"""Transport pieces that need no second process: frame validation (fuzzed), chunk
plans, the file store of the harness, UCX environment defaults, the progress driver
(no busy waiting), and a one-process mesh."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time

import numpy as np
import pytest
from harness import MESSAGES_ONLY, DirStore, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from cgx_ucx.collectives.plan import make_plan
from cgx_ucx.errors import ProtocolError
from cgx_ucx.layout import LayerSpec, Layout
from cgx_ucx.transport import ucx as ucx_env
from cgx_ucx.transport.frames import (
    FLAG_INLINE,
    FRAME_NBYTES,
    INLINE_END,
    MAX_INLINE_NBYTES,
    MAX_PAYLOAD_NBYTES,
    RECV_NBYTES,
    Frame,
    Kind,
    inlinable,
    inline_message,
    inline_payload,
)
from cgx_ucx.transport.rendezvous import PeerAddress

# -- frames -------------------------------------------------------------------------------


def test_frame_round_trip():
    f = Frame(
        kind=Kind.DATA,
        job=0xDEADBEEF,
        seq=7,
        src=3,
        phase=2,
        slot=9,
        numel=12345,
        digest=2**63 + 5,
        payload=4096,
        count=4,
        dtype=1,
        bits=4,
        algorithm=1,
        flags=1,
    )
    raw = f.pack()
    assert len(raw) == FRAME_NBYTES
    assert Frame.unpack(np.frombuffer(raw, np.uint8), job=0xDEADBEEF) == f


@pytest.mark.parametrize("offset", range(0, FRAME_NBYTES, 5))
def test_any_flipped_byte_is_a_protocol_error(offset):
    raw = bytearray(Frame(kind=Kind.SIG, job=1, seq=1).pack())
    raw[offset] ^= 0x5A
    with pytest.raises(ProtocolError):
        Frame.unpack(raw, job=1)


def test_foreign_job_truncated_and_oversized_frames():
    raw = Frame(kind=Kind.SIG, job=1).pack()
    with pytest.raises(ProtocolError, match="foreign job"):
        Frame.unpack(raw, job=2)
    with pytest.raises(ProtocolError):
        Frame.unpack(raw[:40], job=1)
    # A correct CRC over an announced payload above the bound: still refused.
    big = bytearray(Frame(kind=Kind.DATA, job=1, payload=MAX_PAYLOAD_NBYTES + 1).pack())
    with pytest.raises(ProtocolError, match="bound"):
        Frame.unpack(big, job=1)
    # Unknown kind with a valid check.
    bad = bytearray(raw)
    bad[5] = 99
    bad[64:] = hashlib.blake2b(bytes(bad[:64]), digest_size=16).digest()
    with pytest.raises(ProtocolError, match="kind"):
        Frame.unpack(bad, job=1)


def test_keyed_frames_are_accepted_only_under_their_pair_key():
    key, other = os.urandom(16), os.urandom(16)
    f = Frame(kind=Kind.DATA, job=7, comm=3, seq=5, src=1, payload=100)
    assert Frame.unpack(f.pack(key), job=7, key=key) == f
    for wrong in (other, None):
        with pytest.raises(ProtocolError):
            Frame.unpack(f.pack(key), job=7, key=wrong)
    # An unkeyed (store-reader-made) frame is refused where a key is expected.
    with pytest.raises(ProtocolError, match="authentication"):
        Frame.unpack(f.pack(), job=7, key=key)
    # Any field changed after keying fails the check (seq, payload length...).
    for offset in (16, 20, 24, 56):
        raw = bytearray(f.pack(key))
        raw[offset] ^= 1
        with pytest.raises(ProtocolError, match="authentication"):
            Frame.unpack(raw, job=7, key=key)


def test_header_check_costs_microseconds():
    """The per-frame cost of the keyed check (pack + unpack), against the unkeyed one:
    a 64 MiB allreduce sends a few hundred frames, so microseconds are negligible."""
    key = os.urandom(16)
    f = Frame(kind=Kind.DATA, job=7, comm=3, seq=5, src=1, payload=100)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        Frame.unpack(f.pack(key), job=7, key=key)
    keyed = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        Frame.unpack(f.pack(), job=7)
    plain = (time.perf_counter() - t0) / n
    print(f"frame pack+unpack: keyed {keyed * 1e6:.1f} us, unkeyed {plain * 1e6:.1f} us")
    assert keyed < 1e-3  # generous: a loaded 2-core machine


def test_tag_spaces_never_collide():
    from cgx_ucx.transport.handshake import STRUCT_BITS, allocate_prefix, structured_tag

    prefixes = [allocate_prefix() for _ in range(5000)]
    assert len({p >> STRUCT_BITS for p in prefixes}) == len(prefixes)
    # The structured part stays below the space bits: no two directions share a tag.
    top = structured_tag((1 << 20) - 1, 15, (1 << 15) - 1, True)
    assert top < (1 << STRUCT_BITS)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=80))
def test_random_bytes_only_ever_raise_protocol_error(data):
    with contextlib.suppress(ProtocolError):
        Frame.unpack(data, job=1)


# -- inline payloads ----------------------------------------------------------------------


def _received(message: np.ndarray) -> np.ndarray:
    """What a header receive holds after ``message`` arrived: the zeroed buffer of
    RECV_NBYTES with the message at its start (UCX writes no byte past the message)."""
    buf = np.zeros(RECV_NBYTES, np.uint8)
    buf[: message.nbytes] = message
    return buf


def _checked(buf: np.ndarray, key: bytes) -> tuple[Frame, np.ndarray | None]:
    frame = Frame.unpack(buf, job=7, key=key)
    return frame, inline_payload(frame, buf)


@pytest.mark.parametrize("nbytes", [1, 4096, MAX_INLINE_NBYTES])
def test_inline_message_round_trip(nbytes):
    key = os.urandom(16)
    f = Frame(kind=Kind.DATA, job=7, comm=3, seq=5, src=1, flags=1, numel=nbytes, payload=nbytes)
    payload = np.frombuffer(os.urandom(nbytes), np.uint8)
    msg = inline_message(f, payload, key)
    assert msg.nbytes == FRAME_NBYTES + nbytes + 1 and msg[-1] == INLINE_END
    frame, data = _checked(_received(msg), key)
    assert frame.flags == 1 | FLAG_INLINE  # on the wire; the mesh clears it
    assert frame.with_(flags=frame.flags & ~FLAG_INLINE).signature == f.signature
    assert data is not None and data.tobytes() == payload.tobytes()
    # Without the flag, the bytes after the header are not a payload.
    plain = _received(np.frombuffer(f.pack(key), np.uint8))
    assert _checked(plain, key)[1] is None


def test_inline_flag_is_above_the_collectives_flags():
    from cgx_ucx.collectives.hierarchical import FLAG_INTRA_COMPRESS, FLAG_LEADER

    assert FLAG_INLINE & (1 | FLAG_LEADER | FLAG_INTRA_COMPRESS) == 0


def test_inline_header_over_the_bound_is_refused_before_any_copy():
    """(a) A keyed header with FLAG_INLINE announcing more than MAX_INLINE_NBYTES."""
    key = os.urandom(16)
    for n in (MAX_INLINE_NBYTES + 1, MAX_PAYLOAD_NBYTES):
        f = Frame(kind=Kind.DATA, job=7, payload=n)
        msg = np.zeros(FRAME_NBYTES + 100, np.uint8)
        msg[:FRAME_NBYTES] = np.frombuffer(f.pack(key, FLAG_INLINE), np.uint8)
        msg[-1] = INLINE_END
        with pytest.raises(ProtocolError, match="bound"):
            _checked(_received(msg), key)


@pytest.mark.parametrize("missing", [1, 2, 200, 401])
def test_inline_message_shorter_than_announced_is_refused(missing):
    """(b) FLAG_INLINE with a message shorter than header + payload (+ end byte): the
    zeroed receive buffer has no INLINE_END where the message should have ended."""
    key = os.urandom(16)
    f = Frame(kind=Kind.DATA, job=7, numel=100, payload=400)
    msg = inline_message(f, np.full(100, 1.5, np.float32), key)
    assert _checked(_received(msg), key)[1] is not None
    short = msg[: msg.nbytes - missing]
    with pytest.raises(ProtocolError, match="shorter"):
        _checked(_received(short), key)
    # Payload bytes equal to INLINE_END change nothing: the end byte is looked for
    # after the announced payload only.
    f1 = Frame(kind=Kind.DATA, job=7, payload=400)
    msg1 = inline_message(f1, np.full(400, INLINE_END, np.uint8), key)
    with pytest.raises(ProtocolError, match="shorter"):
        _checked(_received(msg1[:-1]), key)


def test_only_small_contiguous_host_payloads_go_inline():
    x = np.zeros(MAX_INLINE_NBYTES + 1, np.uint8)
    assert inlinable(x[:-1], MAX_INLINE_NBYTES)
    assert not inlinable(x, x.nbytes)  # one byte more: a second message
    assert not inlinable(x[:-1:2], x[:-1:2].nbytes)  # not contiguous
    assert not inlinable(x[:0], 0)
    assert not inlinable(memoryview(x[:10]), 10)  # not a NumPy array (CuPy: the same)


def test_peer_address_round_trip_and_bounds():
    a = PeerAddress("10.0.0.1", 4242, b"\x01" * 300, "node", 3)
    b = PeerAddress.unpack(a.pack())
    assert (b.host, b.port, b.worker_address) == (a.host, a.port, a.worker_address)
    assert (b.node, b.world_size) == ("node", 3)
    from cgx_ucx.errors import RendezvousError

    with pytest.raises(RendezvousError):
        PeerAddress.unpack(a.pack()[:-1])


# -- plans --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
    bits=st.lists(st.sampled_from([2, 4, 8, 32]), min_size=6, max_size=6),
    buckets=st.lists(st.integers(1, 700), min_size=6, max_size=6),
    world=st.integers(1, 5),
    piece=st.integers(1, 3000),
)
def test_plan_cuts_only_at_bucket_multiples(sizes, bits, buckets, world, piece):
    layout = Layout.from_sizes(sizes, bits=bits[: len(sizes)], bucket_sizes=buckets[: len(sizes)])
    plan = make_plan(layout, world, piece, 1000)
    assert len(plan.chunks) == world
    pos = 0
    for chunk in plan.chunks:
        assert chunk.start == pos and len(chunk.pieces) >= 1
        for p in chunk.pieces:
            assert p.start == pos
            for seg in p.segments:
                spec = layout.layers[seg.layer]
                assert spec.offset <= seg.start < seg.stop <= spec.end
                if spec.compressed:
                    assert (seg.start - spec.offset) % spec.bucket_size == 0
            assert sum(s.numel for s in p.segments) == p.numel
            pos = p.stop
        assert chunk.stop == pos
    assert pos == layout.numel


def test_plan_is_balanced_for_uniform_layouts():
    plan = make_plan(Layout.uniform(1 << 20, 4, 1024), 3, 1 << 18, 100)
    sizes = [c.numel for c in plan.chunks]
    assert max(sizes) - min(sizes) <= 1024
    assert all(len(c.pieces) == 2 for c in plan.chunks)


def test_mixed_layout_chunks_respect_each_layer():
    layout = Layout(
        (LayerSpec(0, 1000, 4, 300), LayerSpec(1000, 7, 32), LayerSpec(1007, 999, 2, 128))
    )
    plan = make_plan(layout, 4, 10_000, 10)
    cuts = [c.start for c in plan.chunks[1:]]
    for c in cuts:
        assert c in (0, 300, 600, 900, 1000) or 1000 <= c <= 1007 or (c - 1007) % 128 == 0


# -- store, environment ------------------------------------------------------------------


def test_dir_store(tmp_path):
    s = DirStore(tmp_path)
    assert s.add("n", 1) == 1 and s.add("n", 2) == 3
    s.set("k", b"v")
    assert s.get("k") == b"v" and s.check(["k"]) and not s.check(["nope"])
    with pytest.raises(TimeoutError):
        s.wait(["nope"], 0.05)


def test_ucx_defaults_never_override_the_user(monkeypatch):
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64K")
    monkeypatch.delenv("UCX_TCP_RX_SEG_SIZE", raising=False)
    try:
        applied = ucx_env.apply_env_defaults({"UCX_CGX_TEST_EXTRA": "y"})
    finally:
        os.environ.pop("UCX_CGX_TEST_EXTRA", None)
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == "64K"
    assert os.environ["UCX_TCP_RX_SEG_SIZE"] == "1M"
    assert applied["UCX_TCP_RX_SEG_SIZE"] == "1M" and applied["UCX_CGX_TEST_EXTRA"] == "y"
    assert "UCX_TCP_TX_SEG_SIZE" not in applied


@pytest.mark.parametrize(
    "tls,eager",
    [
        ("tcp", True),
        ("self,tcp", True),
        ("TCP", True),
        (None, False),
        ("sm,tcp", False),
        ("^sm", False),
        ("tcp,cuda_ipc", False),
        ("", False),
    ],
)
def test_tcp_only_transports_send_eagerly(monkeypatch, tls, eager):
    """TCP-only: UCX_RNDV_THRESH=inf (rendezvous handshakes queued behind bulk data
    halved two-way throughput); never with other transports, never over the user's."""
    monkeypatch.delenv("UCX_RNDV_THRESH", raising=False)
    monkeypatch.delenv("UCX_ZCOPY_THRESH", raising=False)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):  # one node
        monkeypatch.delenv(name, raising=False)
    if tls is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", tls)
    applied = ucx_env.apply_env_defaults()
    assert ("UCX_RNDV_THRESH" in applied) == eager
    assert os.environ.get("UCX_RNDV_THRESH") == ("inf" if eager else None)
    assert os.environ.get("UCX_ZCOPY_THRESH") == ("0" if eager else None)
    monkeypatch.setenv("UCX_RNDV_THRESH", "64K")
    monkeypatch.setenv("UCX_ZCOPY_THRESH", "16K")
    assert not {"UCX_RNDV_THRESH", "UCX_ZCOPY_THRESH"} & set(ucx_env.apply_env_defaults())
    assert os.environ["UCX_RNDV_THRESH"] == "64K"
    assert os.environ["UCX_ZCOPY_THRESH"] == "16K"


@pytest.mark.parametrize(
    "tls,families",
    [
        (None, {"tcp", "mm"}),
        ("", {"tcp", "mm"}),
        ("all", {"tcp", "mm"}),
        ("tcp", {"tcp"}),
        ("TCP,self", {"tcp"}),
        ("^sm", {"tcp"}),
        ("^posix", {"tcp", "mm"}),  # sysv still loads
        ("^posix,sysv", {"tcp"}),
        ("sm,self", {"mm"}),
        ("posix,tcp", {"tcp", "mm"}),
        ("^tcp", {"mm"}),
        ("rc,cuda_ipc", set()),
    ],
)
def test_ucx_defaults_only_for_transports_ucx_loads(monkeypatch, tls, families):
    """A default for a transport family UCX_TLS keeps UCX from loading is not set: UCX
    would print "unused environment variable" for it at every start."""
    for name in ucx_env.UCX_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    if tls is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", tls)
    applied = ucx_env.apply_env_defaults()
    got = {"tcp" for n in applied if n.startswith("UCX_TCP_")}
    got |= {"mm" for n in applied if n.startswith("UCX_MM_")}
    assert got == families
    assert ucx_env.tcp_excluded() == ("tcp" not in families)


async def connect_only(ctx):
    from cgx_ucx import CommConfig, connect

    cfg = CommConfig(timeout=20, connect_timeout=15)
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg):
        return "connected"


def test_connect_failures_name_a_ucx_tls_without_tcp(monkeypatch):
    """Both ways a connect fails under such a UCX_TLS (the peer unreachable, or no answer
    before the connect timeout on a loaded host) carry the hint; other values add none."""
    from cgx_ucx.transport import connection

    monkeypatch.setenv("UCX_TLS", "sm,self")
    assert "UCX_TLS=sm,self leaves out tcp" in connection._tls_hint()
    for tls in ("sm,self,tcp", "tcp", "^sm"):
        monkeypatch.setenv("UCX_TLS", tls)
        assert connection._tls_hint() == ""


@pytest.mark.timeout(90)
def test_ucx_tls_without_tcp_fails_to_connect_with_a_hint():
    """UCX connects endpoints to an address through its TCP connection manager: with
    UCX_TLS=sm,self every rank fails to connect, and the error says what to add."""
    results = run_ranks(connect_only, 2, timeout=80, check=False, env={"UCX_TLS": "sm,self"})
    for r in results:
        assert not r.ok
        assert "RendezvousError" in r.traceback or "PeerFailedError" in r.traceback
    assert any("UCX_TLS=sm,self leaves out tcp" in r.traceback for r in results), [
        r.traceback[-400:] for r in results
    ]


@pytest.mark.parametrize(
    "launcher,multi",
    [
        ({}, False),  # no launcher
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}, False),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, True),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0"}, True),  # 3 + 1
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "3"}, True),
        ({"WORLD_SIZE": "four", "LOCAL_WORLD_SIZE": "2"}, False),  # malformed: left alone
    ],
)
def test_multi_node_jobs_send_compressed_pieces_eagerly(monkeypatch, launcher, multi):
    """Several nodes per the launcher: UCX_RNDV_THRESH set (inf without a GPU, a finite
    threshold above every compressed piece with one); never over the user's value."""
    monkeypatch.delenv("UCX_RNDV_THRESH", raising=False)
    monkeypatch.delenv("UCX_TLS", raising=False)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    expected = ucx_env.GPU_MULTI_NODE_RNDV_THRESH if os.path.exists("/dev/nvidiactl") else "inf"
    assert ucx_env.multi_node_defaults() == ({"UCX_RNDV_THRESH": expected} if multi else {})
    applied = ucx_env.apply_env_defaults()
    assert applied.get("UCX_RNDV_THRESH") == (expected if multi else None)
    monkeypatch.setenv("UCX_RNDV_THRESH", "64K")
    assert "UCX_RNDV_THRESH" not in ucx_env.apply_env_defaults()
    assert os.environ["UCX_RNDV_THRESH"] == "64K"


# -- a real UCX context in a child: idle CPU, env applied, clean shutdown ----------------


async def idle_and_shutdown(ctx):
    import threading

    from cgx_ucx.collectives import connect
    from cgx_ucx.config import CommConfig

    comm = await connect(ctx.store, ctx.rank, ctx.world_size, config=CommConfig(timeout=20))
    await comm.barrier()  # requests completed; control receives stay posted
    c0 = time.process_time()
    await asyncio.sleep(1.0)
    idle_cpu = time.process_time() - c0
    env = {
        k: os.environ.get(k)
        for k in (
            "UCX_TCP_TX_SEG_SIZE",
            "UCX_TCP_RX_SEG_SIZE",
            "UCX_MEMTYPE_CACHE",
            "UCX_MM_ERROR_HANDLING",
        )
    }
    await comm.close()
    import ucxx

    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    # Everything but this coroutine and the harness's wrapper around it.
    tasks = [
        t
        for t in asyncio.all_tasks()
        if t is not asyncio.current_task() and "harness.py" not in repr(t)
    ]
    return idle_cpu, env, left, [repr(t)[:300] for t in tasks], ucxx.core._ctx is None


@pytest.mark.timeout(60)
def test_idle_communicator_does_not_spin_and_closes_cleanly():
    results = run_ranks(idle_and_shutdown, 2, timeout=50, env={"UCX_TCP_TX_SEG_SIZE": "128K"})
    for idle_cpu, env, threads, tasks, reset in results:
        # ucxx's own blocking driver kept a core busy here (~1 s of CPU per second).
        assert idle_cpu < 0.2, idle_cpu
        assert env == {
            "UCX_TCP_TX_SEG_SIZE": "128K",
            "UCX_TCP_RX_SEG_SIZE": "1M",
            "UCX_MEMTYPE_CACHE": None,
            "UCX_MM_ERROR_HANDLING": "y",
        }
        assert threads == [] and tasks == [] and reset


async def inline_boundary(ctx):
    """(c) Payloads of exactly MAX_INLINE_NBYTES (one message per frame) and one byte more
    (two): p2p, and a one-round allreduce whose frame carries the raw buffer."""
    from cgx_ucx.collectives import connect
    from cgx_ucx.config import CommConfig

    out = {}
    async with await connect(ctx.store, ctx.rank, 2, config=CommConfig(timeout=20)) as comm:
        await comm.barrier()
        for nbytes in (MAX_INLINE_NBYTES, MAX_INLINE_NBYTES + 1):
            pattern = (np.arange(nbytes) * 7 % 251).astype(np.uint8)
            before = comm.stats.messages_sent
            if ctx.rank == 0:
                await comm.send(pattern, 1)
                p2p_ok = True
            else:
                got = np.zeros(nbytes, np.uint8)
                await comm.recv(got, 0)
                p2p_ok = got.tobytes() == pattern.tobytes()
            p2p_msgs = comm.stats.messages_sent - before
            numel = -(-nbytes // 4)  # float32 values: 16384 (64 KiB) and 16385
            x = np.arange(numel, dtype=np.float32) + ctx.rank
            before = comm.stats.messages_sent
            await comm.allreduce(x, algorithm="oneshot")
            ar_msgs = comm.stats.messages_sent - before
            ar_ok = np.array_equal(x, 2 * np.arange(numel, dtype=np.float32) + 1)
            out[nbytes] = (p2p_ok, p2p_msgs, ar_ok, ar_msgs)
    return out


@pytest.mark.timeout(60)
def test_inline_boundary_payloads_round_trip():
    results = run_ranks(inline_boundary, 2, timeout=50, env=MESSAGES_ONLY)
    for rank, out in enumerate(results):
        for nbytes, (p2p_ok, p2p_msgs, ar_ok, ar_msgs) in out.items():
            messages = 1 if nbytes <= MAX_INLINE_NBYTES else 2
            assert p2p_ok and ar_ok, (rank, nbytes, out)
            assert p2p_msgs == (messages if rank == 0 else 0), (rank, nbytes, out)
            assert ar_msgs == messages, (rank, nbytes, out)


# -- address selection --------------------------------------------------------------------


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (the route to a public one)."""
    from cgx_ucx.transport.rendezvous import local_address_towards

    for target in ("192.0.2.123", "10.255.255.254", "8.8.8.8"):
        addr = local_address_towards(target)
        if addr and not addr.startswith("127."):
            return addr
    return None


@pytest.mark.timeout(30)
def test_default_host_unwraps_prefix_stores(monkeypatch):
    """torch hands the backend PrefixStore(PrefixStore(TCPStore)); the address published
    must be the interface towards the TCPStore's host, not loopback or the hostname's."""
    import datetime

    torch_dist = pytest.importorskip("torch.distributed")
    from cgx_ucx.transport.rendezvous import default_host as _default_host
    from cgx_ucx.transport.rendezvous import store_host

    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    tcp = torch_dist.TCPStore(
        addr, 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    wrapped = torch_dist.PrefixStore("outer", torch_dist.PrefixStore("cgx", tcp))
    assert store_host(wrapped) == addr
    assert _default_host(wrapped) == addr
    # A store without a host falls back to MASTER_ADDR's route.
    monkeypatch.setenv("MASTER_ADDR", addr)
    assert store_host(DirStore.__new__(DirStore)) is None
    assert _default_host(torch_dist.HashStore()) == addr


# -- UCX context lifetime -----------------------------------------------------------------


async def context_kept_while_referenced(ctx):
    """A listener left open (what a cancelled handshake can leave behind) keeps the UCX
    context alive through release(); once it is gone the next release resets UCX."""
    ucxx = ucx_env.acquire("blocking")
    listener = ucxx.create_listener(lambda ep: None)
    ucx_env.release()
    kept = ucxx.core._ctx is not None
    listener.close()
    del listener
    again = ucx_env.acquire("blocking")
    assert again is ucxx
    ucx_env.release()
    reset = ucxx.core._ctx is None

    # A parked listener (a communicator that gave up connecting) stays open, and keeps
    # the context, until its deadline, when both close on the loop with no further call.
    async def reset_within(seconds: float) -> bool:
        # Polled, not one sleep: on a loaded machine the loop may run the deadline late.
        end = time.monotonic() + seconds
        while ucxx.core._ctx is not None and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return ucxx.core._ctx is None

    ucxx = ucx_env.acquire("blocking")
    parked_at = time.monotonic()
    ucx_env.park_listener(ucxx.create_listener(lambda ep: None), 1.0)
    ucx_env.release()
    parked_kept = ucxx.core._ctx is not None
    await asyncio.sleep(0.3)
    # Still open before its deadline (a check that ran late proves nothing either way).
    parked_kept_before = ucxx.core._ctx is not None or time.monotonic() - parked_at >= 1.0
    parked_reset = await reset_within(10.0)
    # A context kept by a holder that goes away later is shut down by a retry.
    ucxx = ucx_env.acquire("blocking")
    listener = ucxx.create_listener(lambda ep: None)
    ucx_env.release()
    held = ucxx.core._ctx is not None
    listener.close()
    del listener
    retried = await reset_within(ucx_env.SHUTDOWN_RETRY_S[0] + 10.0)
    return kept, reset, (parked_kept, parked_kept_before, parked_reset), (held, retried)


def test_release_keeps_a_context_that_is_still_referenced():
    ((kept, reset, parked, retried),) = run_ranks(context_kept_while_referenced, 1, timeout=60)
    assert kept and reset
    assert parked == (True, True, True)
    assert retried == (True, True)


def test_flat_allreduce_pieces_grow_for_large_chunks():
    """Per-piece costs (a rendezvous per message, a codec hand-off) favour larger pieces
    for large chunks: pieces grow to twice the base while every chunk keeps at least
    MIN_PIECES of them to overlap."""
    from cgx_ucx.collectives.allreduce import prepare_allreduce
    from cgx_ucx.collectives.plan import MIN_PIECES, PIECE_BYTES, PIECE_GROWTH, flat_piece_bytes

    mib = 1 << 20
    assert flat_piece_bytes(8 * mib) == PIECE_BYTES  # 2 pieces of 4 MiB: never fewer than that
    assert flat_piece_bytes(MIN_PIECES * 6 * mib) == 6 * mib
    assert flat_piece_bytes(1 << 30) == PIECE_GROWTH * PIECE_BYTES
    x = np.zeros(16 * mib, np.float32)  # 64 MiB: 32 MiB chunks on 2 ranks -> 8 MiB pieces
    _, (_, spec) = prepare_allreduce(x, "sum", world_size=2, bits=4)
    assert {p.stop - p.start for c in spec.plan.chunks for p in c.pieces} == {2 * mib}
    _, (_, spec) = prepare_allreduce(np.zeros(4 * mib, np.float32), "sum", world_size=2, bits=4)
    assert {p.stop - p.start for c in spec.plan.chunks for p in c.pieces} == {mib}


def test_env_rendezvous_under_torchrun_agent_joins_its_store(monkeypatch):
    """Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) rank 0 joins the agent's store
    as a client, under the restart's prefix, as torch's own env:// does, instead of
    trying to serve it."""
    import datetime

    pytest.importorskip("torch")
    from torch.distributed import TCPStore

    from cgx_ucx.transport.rendezvous import env_store

    agent = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    store, rank, world = env_store(10.0)
    assert (rank, world) == (0, 1)
    store.set("cgx_probe", "1")
    agent.set_timeout(datetime.timedelta(seconds=5))
    assert agent.get("/worker/attempt_2/cgx_probe") == b"1"


def test_a_status_answer_names_the_peers_this_rank_waits_on():
    """A rank asked for its status says whom it waits on, the longest wait first: behind
    a cut link, the rank next to the cut times out first on a neighbour that is alive
    and itself waiting, and only this names the rank behind the cut."""
    from cgx_ucx.transport.frames import Frame
    from cgx_ucx.transport.status import MAX_WAITS_TOLD, Activity, PeerStatus

    act = Activity()
    act.finished(9)
    act.started(10, "allreduce, numel 262144, bits 4")
    head, what = act.frame(job=1, src=1)
    assert what == "allreduce, numel 262144, bits 4"  # nothing awaited
    act.wait_begins(2)
    time.sleep(0.05)
    for r in (0, 2, 3, 4, 5):
        act.wait_begins(r)
    head, what = act.frame(job=1, src=1)
    assert what.startswith("allreduce, numel 262144, bits 4; waiting on rank 2 for "), what
    assert what.count("rank ") == MAX_WAITS_TOLD, what
    text = PeerStatus.from_frame(Frame.unpack(head.pack(), job=1), what).describe()
    assert "rank 1 is alive and still in collective #10" in text
    assert "waiting on rank 2" in text, text
    # Every begin has its end: nothing is told once the waits are over.
    for r in (2, 2, 0, 3, 4, 5):
        act.wait_ends(r)
    assert act.waiting_on() == ""
    assert act.frame(job=1, src=1)[1] == "allreduce, numel 262144, bits 4"
    # Point-to-point waits outside any collective are told too.
    idle = Activity()
    idle.wait_begins(3)
    text = PeerStatus(rank=1, answered=True, what=idle.frame(1, 1)[1]).describe()
    assert text.startswith("rank 1 is alive and has not started any collective (waiting on rank 3")


async def peer_addresses_by_name(ctx):
    from cgx_ucx.collectives import connect
    from cgx_ucx.config import CommConfig

    comm = await connect(
        ctx.store, ctx.rank, ctx.world_size, config=CommConfig(timeout=20), host="localhost"
    )
    await comm.barrier()
    hosts = {r: sorted(p.hosts) for r, p in comm._mesh.peers.items()}
    await comm.close()
    return hosts


@pytest.mark.timeout(60)
def test_peers_published_by_name_have_their_addresses_resolved_at_connect():
    """What a failed mesh releases at close (transport.stuck) goes by the peers' IP
    addresses, resolved while connecting (on the resolver thread, like the dial), so that
    teardown never waits for a name server."""
    for rank, hosts in enumerate(run_ranks(peer_addresses_by_name, 2, timeout=50)):
        (peer,) = hosts
        assert peer == 1 - rank
        assert "127.0.0.1" in hosts[peer], hosts
