"""SRA and ring allreduce (and the other collectives) in ONE process, over an in-memory
transport: fast, deterministic, no UCX.

:class:`FakeTransport` implements :class:`cgx_ucx.collectives.transport.Transport` with
asyncio queues keyed by (src, dst, tag), tag = (seq, phase, slot, payload?), as UCX tags
are: every header is packed and validated (CRC, routing fields) as the real mesh does,
every payload is copied at send time and received into a buffer of exactly the announced
size. ABORT frames reach the other ranks' ``on_abort`` as control messages would.

Results are checked against a float64 NumPy reference: exact for uncompressed sums of
integer-valued data, within a stated quantization bound for compressed layouts; replicas
must be bit-identical across the fake ranks.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from cgx_ucx.collectives import Communicator, allreduce, broadcast, piece_codec
from cgx_ucx.collectives.transport import Transport
from cgx_ucx.compression import decode, encode
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import (
    CGXError,
    CGXTimeoutError,
    CollectiveMismatchError,
    ConfigError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from cgx_ucx.layout import LayerSpec, Layout
from cgx_ucx.transport.frames import FRAME_NBYTES, AbortCode, Algo, Frame, Kind
from cgx_ucx.transport.stats import TransportStats

pytestmark = pytest.mark.timeout(60)

CFG = CommConfig(timeout=60.0, connect_timeout=10.0)
JOB = 0x5EED_CAFE
#: Input bytes per piece in these tests: small, so a few thousand values make several
#: pieces per chunk (the pipelined paths), as megabytes would with the default.
SMALL_PIECE_BYTES = 1024


# -- the fake transport -------------------------------------------------------------------


class FakeNetwork:
    """The wires between the fake ranks of one world: a queue per (src, dst, tag)."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.queues: defaultdict[tuple[int, int, tuple[int, int, int, bool]], asyncio.Queue] = (
            defaultdict(asyncio.Queue)
        )
        self.nodes = [FakeTransport(self, r, world_size, timeout) for r in range(world_size)]

    def queue(self, src: int, dst: int, seq: int, phase: int, slot: int, payload: bool):
        return self.queues[(src, dst, (seq & 0xFFFFFFFF, phase, slot, payload))]


class FakeTransport:
    """One rank's end of a :class:`FakeNetwork` (implements the Transport protocol)."""

    def __init__(self, net: FakeNetwork, rank: int, world_size: int, timeout: float) -> None:
        self.net = net
        self.rank = rank
        self.world_size = world_size
        self.peers = [r for r in range(world_size) if r != rank]
        self.job = JOB
        self.closed = False
        self.stats = TransportStats()
        self.on_abort: Callable[[Frame, str], None] | None = None
        self.timeout = timeout
        self.failure: CGXError | None = None
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()
        self.failed.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.comm_id = 7
        self.activity: list[tuple[str, int, str]] = []

    def collective_started(self, seq: int, what: str) -> None:
        self.activity.append(("started", seq, what))

    def collective_finished(self, seq: int) -> None:
        self.activity.append(("finished", seq, ""))

    def check(self) -> None:
        if self.closed:
            raise TransportError("the communicator is closed")
        if self.failure is not None:
            raise type(self.failure)(str(self.failure))

    def lose(self, rank: int, exc: CGXError) -> None:
        if self.failure is None:
            self.failure = exc
            self.failed.set_exception(exc)

    async def _get(self, queue: asyncio.Queue, what: str, extra: Iterable[asyncio.Future]):
        self.check()
        extra = tuple(extra)
        for f in extra:
            if f.done():
                raise f.exception()
        if not queue.empty():
            return queue.get_nowait()
        get = asyncio.ensure_future(queue.get())
        try:
            await asyncio.wait(
                {get, self.failed, *extra}, timeout=self.timeout, return_when="FIRST_COMPLETED"
            )
        finally:
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            return get.result()
        for f in extra:
            if f.done():
                raise f.exception()
        self.check()
        raise CGXTimeoutError(f"rank {self.rank}: {what} did not arrive", peer=None)

    async def send_frame(
        self, rank: int, frame: Frame, payload: Any = None, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        self.check()
        for f in extra:
            if f.done():
                raise f.exception()
        key = (self.rank, rank, frame.seq, frame.phase, frame.slot)
        self.net.queue(*key, False).put_nowait(frame.pack())
        self.stats.messages_sent += 1
        self.stats.bytes_sent += FRAME_NBYTES
        if payload is not None and frame.payload:
            data = np.array(payload, copy=True)  # the sender may reuse its buffer afterwards
            assert data.dtype == np.uint8 and data.nbytes == frame.payload
            self.net.queue(*key, True).put_nowait(data)
            self.stats.messages_sent += 1
            self.stats.bytes_sent += data.nbytes
        await asyncio.sleep(0)  # a send completes later, as UCX's do

    async def recv_frame(
        self, rank: int, seq: int, phase: int, slot: int, extra: Iterable[asyncio.Future] = ()
    ) -> Frame:
        q = self.net.queue(rank, self.rank, seq, phase, slot, False)
        raw = await self._get(q, f"header {seq}/{phase}/{slot} from {rank}", extra)
        frame = Frame.unpack(raw, job=self.job)
        if (frame.src, frame.seq, frame.phase, frame.slot) != (rank, seq, phase, slot):
            raise ProtocolError("misrouted frame")
        if frame.kind not in (Kind.DATA, Kind.SIG):
            raise ProtocolError(f"unexpected frame kind {frame.kind}")
        self.stats.messages_received += 1
        return frame

    async def recv_payload(
        self, rank: int, frame: Frame, buf: Any, extra: Iterable[asyncio.Future] = ()
    ) -> None:
        if buf.nbytes != frame.payload:
            err = ProtocolError(f"rank {rank} announced {frame.payload} bytes, {buf.nbytes} here")
            self.lose(rank, err)
            raise err
        if frame.payload == 0:
            return
        q = self.net.queue(rank, self.rank, frame.seq, frame.phase, frame.slot, True)
        data = await self._get(q, "payload", extra)
        buf[...] = data
        self.stats.messages_received += 1
        self.stats.bytes_received += data.nbytes

    async def recv_frame_into(
        self,
        rank: int,
        seq: int,
        phase: int,
        slot: int,
        buf: Any,
        extra: Iterable[asyncio.Future] = (),
    ) -> Frame:
        frame = await self.recv_frame(rank, seq, phase, slot, extra)
        await self.recv_payload(rank, frame, buf, extra)
        return frame

    async def exchange_frames(
        self, frame: Frame, payload: Any, peers: Iterable[int], extra: Iterable[asyncio.Future] = ()
    ) -> list[Frame]:
        peers, extra = list(peers), tuple(extra)
        for p in peers:
            await self.send_frame(p, frame, payload, extra)
        # payloads stay queued apart, as the mesh's non-inline ones: recv_payload takes them
        return [await self.recv_frame(p, frame.seq, frame.phase, frame.slot, extra) for p in peers]

    async def broadcast_abort(self, seq: int, code: AbortCode, peer: int, reason: str) -> None:
        frame = Frame(kind=Kind.ABORT, job=self.job, seq=seq, src=self.rank, phase=code, count=peer)
        loop = asyncio.get_running_loop()
        for other in self.net.nodes:
            if other is not self and other.on_abort is not None:
                loop.call_soon(other.on_abort, frame, reason)

    async def close(self) -> None:
        self.closed = True


def _as_transport(t: FakeTransport) -> Transport:
    return t  # type-checks only if FakeTransport satisfies the protocol


# -- running a world in one process -------------------------------------------------------


def run_world(world: int, body: Callable[[Communicator], Any], timeout: float = 60.0) -> list:
    """``body(comm)`` on every fake rank at once; per rank its result or its exception."""

    async def main() -> list:
        net = FakeNetwork(world)
        comms = [Communicator(_as_transport(t), CFG) for t in net.nodes]
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(body(c) for c in comms), return_exceptions=True), timeout
            )
        finally:
            for c in comms:
                await c.close()

    return asyncio.run(main())


def ok(results: list) -> list:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(allreduce, "PIECE_BYTES", SMALL_PIECE_BYTES)
    monkeypatch.setattr(broadcast, "PIECE_BYTES", SMALL_PIECE_BYTES)


def int_data(rank: int, n: int, dtype, low: int = -100, high: int = 100) -> np.ndarray:
    """Integer-valued data: sums of a few of them are exact in every dtype used here."""
    return np.random.default_rng(100 + rank).integers(low, high, n).astype(dtype)


def smooth_data(rank: int, n: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(200 + rank).uniform(-1, 1, n).astype(dtype)


def assert_replicas_identical(results: list) -> None:
    for r, got in enumerate(results[1:], 1):
        assert got.tobytes() == results[0].tobytes(), f"rank {r}'s replica differs from rank 0"


# -- uncompressed: exact ------------------------------------------------------------------

SIZES = [0, 1, 7, 1023, 5000]  # 5000 float32 = 20 KB: several 1 KiB pieces per chunk


EXACT_DTYPES = [np.int32, np.float32, np.float64, np.int64]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["sra", "ring", "oneshot"])
def test_raw_sum_is_exact(world, algorithm):
    cases = [(dtype, n) for dtype in EXACT_DTYPES for n in SIZES]

    async def body(comm):
        out = []
        for dtype, n in cases:
            x = int_data(comm.rank, n, dtype, -1000, 1000)
            assert await comm.allreduce(x, algorithm=algorithm) is x
            out.append(x)
        return out

    results = ok(run_world(world, body))
    for i, (dtype, n) in enumerate(cases):
        expect = sum(int_data(r, n, dtype, -1000, 1000).astype(np.float64) for r in range(world))
        got = results[0][i]
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.astype(np.float64), expect, err_msg=str(cases[i]))
        assert_replicas_identical([r[i] for r in results])


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["sra", "ring", "oneshot"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_raw_16_bit_floats_sum_in_float32(world, algorithm, dtype):
    # bfloat16 holds integers exactly up to 256: 4 ranks of |x| < 60 stay exact.
    async def body(comm):
        x = int_data(comm.rank, 3001, dtype, -60, 60)
        await comm.allreduce(x, algorithm=algorithm)
        return x

    results = ok(run_world(world, body))
    expect = sum(int_data(r, 3001, dtype, -60, 60).astype(np.float64) for r in range(world))
    np.testing.assert_array_equal(results[0].astype(np.float64), expect)
    assert_replicas_identical(results)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("algorithm", ["sra", "ring", "oneshot"])
def test_raw_avg(world, algorithm):
    async def body(comm):
        x = int_data(comm.rank, 2049, np.float32)
        await comm.allreduce(x, "avg", algorithm=algorithm)
        return x

    results = ok(run_world(world, body))
    expect = sum(int_data(r, 2049, np.float32).astype(np.float64) for r in range(world)) / world
    np.testing.assert_allclose(results[0].astype(np.float64), expect, rtol=1e-6)
    assert_replicas_identical(results)


def test_shapes_are_kept_and_the_input_is_reduced_in_place():
    async def body(comm):
        x = int_data(comm.rank, 24, np.int32).reshape(2, 3, 4)
        y = await comm.allreduce(x)
        return x, y

    for x, y in ok(run_world(3, body)):
        assert y is x and x.shape == (2, 3, 4)
        expect = sum(int_data(r, 24, np.int32) for r in range(3)).reshape(2, 3, 4)
        np.testing.assert_array_equal(x, expect)


# -- compressed: within the quantization bound, bit-identical ------------------------------


def quantization_bound(
    xs: list[np.ndarray], layout: Layout, world: int, step: float = 0.5
) -> np.ndarray:
    """Per-value bound on |result - exact sum| for a compressed allreduce.

    Each quantization of a bucket errs by at most ``step`` units (1/2 rounding to
    nearest, 1 stochastic rounding), unit = range / (2^bits - 1).
    Oneshot quantizes each rank's input once (N quantizations of one value, no
    requantization of the sum): within the same bound.
    SRA and ring quantize every value N times: SRA each of the N-1 peers' inputs and
    the sum; the ring the partial sums of 1..N-1 ranks and the sum. A partial sum's range
    in a bucket is at most the sum of the inputs' ranges plus twice the error so far,
    so the error after q quantizations is at most e_q = e_{q-1} + step (R + 2 e_{q-1}) / L,
    R = sum of the ranks' ranges in the bucket, L = 2^bits - 1. Uncompressed layers are
    summed in float32: exact up to its rounding (the last term).
    """
    n = len(xs[0])
    bound = np.zeros(n)
    for spec in layout.layers:
        if not spec.compressed:
            continue
        levels = 2**spec.bits - 1
        for b in range(spec.offset, spec.end, spec.bucket_size):
            e = min(b + spec.bucket_size, spec.end)
            total = sum(float(x[b:e].max() - x[b:e].min()) for x in xs)
            err = 0.0
            for _ in range(world):
                err += step * (total + 2 * err) / levels
            bound[b:e] = err
    exact = np.abs(sum(x.astype(np.float64) for x in xs))
    return bound * (1 + 1e-5) + 1e-5 * exact + 1e-6


COMPRESSED = [
    # (numel, bits, bucket): sizes 0, 1, and non-multiples of the bucket
    (0, 4, 64),
    (1, 4, 64),
    (1000, 4, 64),
    (3001, 4, 128),
    (777, 2, 100),
    (2049, 8, 512),
]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["sra", "ring", "oneshot"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_compressed_within_bound_and_bit_identical(world, algorithm, op):
    async def body(comm):
        out = []
        for n, bits, bucket in COMPRESSED:
            x = smooth_data(comm.rank, n)
            await comm.allreduce(x, op, bits=bits, bucket_size=bucket, algorithm=algorithm)
            out.append(x)
        return out

    results = ok(run_world(world, body))
    for i, (n, bits, bucket) in enumerate(COMPRESSED):
        xs = [smooth_data(r, n) for r in range(world)]
        exact = sum(x.astype(np.float64) for x in xs)
        bound = quantization_bound(xs, Layout.uniform(n, bits, bucket), world)
        if op == "avg":
            exact, bound = exact / world, bound / world
        err = np.abs(results[0][i].astype(np.float64) - exact)
        assert np.all(err <= bound), f"{COMPRESSED[i]}: excess {np.max(err - bound, initial=0)}"
        assert_replicas_identical([r[i] for r in results])


MIXED = Layout(
    (
        LayerSpec(0, 1500, 4, 128),
        LayerSpec(1500, 77, 32, 1024),  # uncompressed (bias-like) between compressed layers
        LayerSpec(1577, 1001, 2, 100),
    )
)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["sra", "ring", "oneshot"])
def test_mixed_layout(world, algorithm):
    dtypes = [np.float32, np.float16]

    async def body(comm):
        out = []
        for dtype in dtypes:
            x = smooth_data(comm.rank, MIXED.numel, dtype)
            await comm.allreduce(x, layout=MIXED, algorithm=algorithm)
            out.append(x)
        return out

    results = ok(run_world(world, body))
    for i, dtype in enumerate(dtypes):
        got = results[0][i]
        assert_replicas_identical([r[i] for r in results])
        xs = [smooth_data(r, MIXED.numel, dtype).astype(np.float32) for r in range(world)]
        exact = sum(x.astype(np.float64) for x in xs)
        bound = quantization_bound(xs, MIXED, world)
        if dtype == np.float16:  # the result is rounded to float16 once more
            bound = bound + np.abs(exact) * 2.0**-11 + 1e-3
        err = np.abs(got.astype(np.float64) - exact)
        assert np.all(err <= bound), f"{dtype}: excess {np.max(err - bound)}"
        # The uncompressed layer: float32 sums, rounded to the buffer's dtype (the ring
        # also rounds its N-1 partial sums, each of magnitude < N, as the raw path does).
        raw = slice(1500, 1577)
        atol = 1e-6 if dtype == np.float32 else world * world * 2.0**-11
        np.testing.assert_allclose(got[raw].astype(np.float64), exact[raw], rtol=0, atol=atol)


@pytest.mark.parametrize("algorithm", ["sra", "ring", "oneshot"])
def test_stochastic_rounding_is_seeded_and_identical(algorithm):
    async def body(comm):
        out = []
        for seed in (7, 7, 8):
            x = smooth_data(comm.rank, 1500)
            await comm.allreduce(x, bits=2, bucket_size=64, stochastic=True, seed=seed)
            out.append(x)
        return out

    results = ok(run_world(3, body))
    for i in range(3):
        assert_replicas_identical([r[i] for r in results])
    # Same seed, but a different sequence number: the rounding differs per call.
    assert results[0][0].tobytes() != results[0][1].tobytes()
    xs = [smooth_data(r, 1500) for r in range(3)]
    bound = quantization_bound(xs, Layout.uniform(1500, 2, 64), 3, step=1.0)
    err = np.abs(results[0][0] - sum(x.astype(np.float64) for x in xs))
    assert np.all(err <= bound)


def test_codec_thread_path_gives_the_inline_result(monkeypatch):
    """Large pieces run the codec on a thread: the same bytes as inline."""

    async def body(comm):
        x = smooth_data(comm.rank, 4000)
        await comm.allreduce(x, bits=4, bucket_size=128)
        return x

    inline = ok(run_world(2, body))
    monkeypatch.setattr(piece_codec, "CODEC_INLINE_NUMEL", 16)
    threaded = ok(run_world(2, body))
    for a, b in zip(inline, threaded, strict=True):
        assert a.tobytes() == b.tobytes()


def test_world_of_one_quantizes_once():
    async def body(comm):
        x = smooth_data(0, 1000)
        y = x.copy()
        await comm.allreduce(x, bits=4, bucket_size=128)
        await comm.allreduce(y)  # uncompressed: untouched
        return x, y

    [(x, y)] = ok(run_world(1, body))
    want = decode(encode(smooth_data(0, 1000), 4, 128))
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y, smooth_data(0, 1000))


# -- the other collectives -------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
def test_broadcast_allgather_barrier(world):
    async def body(comm):
        x = int_data(comm.rank, 3000, np.float32)  # 12 KB: several small pieces
        await comm.broadcast(x, root=world - 1)
        g = await comm.allgather(int_data(comm.rank, 5, np.int64).reshape(5, 1))
        await comm.barrier()
        return x, g, comm.stats.by_collective

    for x, g, counts in ok(run_world(world, body)):
        np.testing.assert_array_equal(x, int_data(world - 1, 3000, np.float32))
        assert g.shape == (world, 5, 1)
        for r in range(world):
            np.testing.assert_array_equal(g[r, :, 0], int_data(r, 5, np.int64))
        assert counts == {"broadcast": 1, "allgather": 1, "barrier": 1}


# -- disagreement and failure -------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "case", ["numel", "op", "bits", "algorithm", "oneshot_vs_sra", "big_numel", "collective"]
)
def test_mismatch_fails_every_rank_then_the_next_call_works(world, case):
    async def body(comm):
        r = comm.rank
        x = smooth_data(r, 101 if case == "numel" and r == 1 else 100)
        try:
            if case == "collective" and r == 1:
                await comm.broadcast(x)
            elif case == "op":
                await comm.allreduce(x, "avg" if r == 1 else "sum")
            elif case == "bits":
                await comm.allreduce(x, bits=2 if r == 1 else 4, bucket_size=64)
            elif case == "algorithm":
                await comm.allreduce(x, algorithm="ring" if r == 1 else "sra")
            elif case == "oneshot_vs_sra":
                await comm.allreduce(x, algorithm="oneshot" if r == 1 else "sra")
            elif case == "big_numel":  # auto: oneshot on the others, SRA on rank 1
                big = np.zeros(allreduce.oneshot_max_bytes(world) // 4 + 1, np.float32)
                await comm.allreduce(big if r == 1 else x)
            else:
                await comm.allreduce(x)
        except CollectiveMismatchError as exc:
            caught = str(exc)
        else:
            caught = None
        y = int_data(r, 10, np.int32)
        await comm.allreduce(y)  # the ranks still agree on what comes next
        return caught, x, y

    results = ok(run_world(world, body))
    for r, (caught, x, y) in enumerate(results):
        assert caught is not None, f"rank {r} saw no mismatch"
        assert "rank 1 called" in caught or "while rank 1 called" in caught, caught
        # Nothing was written into a buffer of a failed call.
        np.testing.assert_array_equal(x, smooth_data(r, x.size))
        np.testing.assert_array_equal(y, sum(int_data(q, 10, np.int32) for q in range(world)))


def test_a_bad_argument_on_one_rank_aborts_the_others_fast():
    async def body(comm):
        x = smooth_data(comm.rank, 100)
        await comm.allreduce(x, "max" if comm.rank == 0 else "sum")

    results = run_world(3, body, timeout=20.0)  # far below the transport's 60 s timeout
    assert isinstance(results[0], ConfigError)
    for r in results[1:]:
        assert isinstance(r, CollectiveMismatchError), repr(r)
        assert "rank 0 aborted" in str(r)


def test_auto_takes_oneshot_below_the_crossover_only():
    small = np.zeros(allreduce.oneshot_max_bytes(2) // 4, np.float32)
    big = np.zeros(small.size + 1, np.float32)
    for x, want in ((small, Algo.ONESHOT), (big, Algo.SRA)):
        _, (_, spec) = allreduce.prepare_allreduce(x, world_size=2)
        assert spec.algorithm == want
    _, (_, spec) = allreduce.prepare_allreduce(small, world_size=2, algorithm="sra")
    assert spec.algorithm == Algo.SRA
    assert allreduce.oneshot_max_bytes(16) < allreduce.oneshot_max_bytes(2)
    with pytest.raises(ConfigError, match="oneshot"):
        allreduce.prepare_allreduce(small, world_size=2, algorithm="tree")


@pytest.mark.parametrize("world", [2, 3])
def test_oneshot_is_one_frame_per_peer(world):
    """One round: each rank sends its peers one header and one payload each, no more."""

    async def body(comm):
        x = int_data(comm.rank, 1000, np.float32)
        await comm.allreduce(x, algorithm="oneshot")
        y = smooth_data(comm.rank, 1000)
        await comm.allreduce(y, bits=4, bucket_size=128, algorithm="oneshot")
        return x, y, comm.stats.messages_sent

    results = ok(run_world(world, body))
    want = sum(int_data(r, 1000, np.float32) for r in range(world))
    for x, _, sent in results:
        np.testing.assert_array_equal(x, want)
        assert sent == 2 * 2 * (world - 1)
    assert_replicas_identical([y for _, y, _ in results])


def test_status_calls_bracket_every_collective():
    """The mesh hears of each collective (for peers' timeout messages), failed ones too."""

    async def body(comm):
        await comm.allreduce(smooth_data(comm.rank, 100), bits=4)
        with pytest.raises(ConfigError):
            await comm.allreduce(smooth_data(comm.rank, 10), "max")
        return comm.transport.activity

    for activity in ok(run_world(1, body)):
        assert activity[0] == ("started", 1, "allreduce, numel 100, bits 4")
        assert activity[1] == ("finished", 1, "")
        assert activity[2] == ("finished", 2, "")


def test_error_messages_name_a_point_to_point_message_as_such():
    """A p2p receive is described as a point-to-point message on its tag, not as a piece
    of a collective; frames of collectives keep their description."""
    from cgx_ucx.collectives.p2p import PH_P2P
    from cgx_ucx.transport.frames import describe_slot

    assert describe_slot(0, PH_P2P, 99) == "point-to-point message 0 on tag 99"
    assert describe_slot(3, 1, 2) == "phase 1 piece 2 of collective #3"


def test_outputs_must_be_writable_inputs_need_not_be():
    """A read-only output is a ConfigError of the call's checks (they run before anything
    moves and abort the peers' call); read-only inputs are fine."""
    from cgx_ucx.collectives.allgather import prepare_allgather
    from cgx_ucx.collectives.alltoall import prepare_alltoall
    from cgx_ucx.collectives.broadcast import prepare_broadcast
    from cgx_ucx.collectives.reduce_scatter import prepare_reduce_scatter

    def ro(a):
        a.flags.writeable = False
        return a

    x, out = ro(np.ones(8, np.float32)), np.zeros((2, 8), np.float32)
    prepare_allgather(x, out, 2)
    with pytest.raises(ConfigError, match="out is read-only"):
        prepare_allgather(np.ones(8, np.float32), ro(out.copy()), 2)
    prepare_reduce_scatter(ro(np.ones(16, np.float32)), np.zeros(8, np.float32), world_size=2)
    with pytest.raises(ConfigError, match="read-only"):
        prepare_reduce_scatter(np.ones(16, np.float32), ro(np.zeros(8, np.float32)), world_size=2)
    prepare_alltoall(ro(np.ones(8, np.float32)), np.zeros(8, np.float32), 0, 2)
    with pytest.raises(ConfigError, match="read-only"):
        prepare_alltoall(np.ones(8, np.float32), ro(np.zeros(8, np.float32)), 0, 2)
    prepare_broadcast(ro(np.ones(8, np.float32)), 0, 2, rank=0)  # the root only reads
    with pytest.raises(ConfigError, match="read-only"):
        prepare_broadcast(ro(np.ones(8, np.float32)), 0, 2, rank=1)
    with pytest.raises(ConfigError, match="read-only"):
        allreduce.prepare_allreduce(ro(np.ones(8, np.float32)), world_size=2)


def test_a_gather_signs_its_root():
    from cgx_ucx.collectives.allgather import prepare_allgather
    from cgx_ucx.collectives.call import describe

    x = np.ones(4, np.float32)
    a, _ = prepare_allgather(x, None, 3, root=0)
    b, _ = prepare_allgather(x, None, 3, root=2)
    c, _ = prepare_allgather(x, None, 3)
    assert len({a.signature, b.signature, c.signature}) == 3
    assert "root=2" in describe(b) and "root" not in describe(c)
    with pytest.raises(ConfigError, match="root"):
        prepare_allgather(x, None, 3, root=3)


# -- all-to-all ---------------------------------------------------------------------------


def a2a_count(src: int, dst: int) -> int:
    """Values rank ``src`` sends rank ``dst`` in the uneven all-to-all tests: several small
    pieces for most pairs (900 values from rank 0 to rank 1), none for some."""
    return 0 if (src + dst) % 3 == 2 else (src + 2 * dst + 1) * 300


def a2a_block(src: int, dst: int) -> np.ndarray:
    return np.arange(a2a_count(src, dst), dtype=np.int64) + 1_000_000 * src + 10_000 * dst


def a2a_counts(rank: int, world: int) -> tuple[list[int], list[int]]:
    """(send counts, receive counts) of ``rank`` when every pair agrees."""
    return [a2a_count(rank, i) for i in range(world)], [a2a_count(p, rank) for p in range(world)]


async def mismatch_text(call) -> str | None:
    """The CollectiveMismatchError's text that awaiting ``call`` raised; None if none."""
    try:
        await call
    except CollectiveMismatchError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_uneven_alltoall_is_exact(world):
    async def body(comm):
        r = comm.rank
        sc, rc = a2a_counts(r, world)
        x = np.concatenate([a2a_block(r, i) for i in range(world)])
        out = np.full(sum(rc), -1, np.int64)
        got = await comm.alltoall(x, out, sc, rc)
        even = np.full(2 * world, -1, np.int32)
        await comm.alltoall(np.repeat(np.arange(world, dtype=np.int32) + 10 * r, 2), even)
        return got, out, even

    for r, (got, out, even) in enumerate(ok(run_world(world, body))):
        want = np.concatenate([a2a_block(p, r) for p in range(world)])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(out, want)  # in place
        np.testing.assert_array_equal(even, np.repeat(10 * np.arange(world) + r, 2))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("liar", ["sender", "receiver"])
@pytest.mark.parametrize("delta", [1, -1])
def test_alltoall_counts_that_differ_fail_both_ranks_of_the_pair(world, liar, delta):
    """Rank 0's send count to rank 1 and rank 1's receive count from rank 0 differ (one
    of the two is off by ``delta``). Both ranks of the pair raise CollectiveMismatchError
    naming the ranks and both counts (the same words on both), before any data moved, so
    the sender cannot finish and return before the receiver's ABORT comes; a third rank
    fails too (the pair's ABORT: it waits for their blocks); the next call works on every
    rank."""

    async def body(comm):
        r = comm.rank
        sc, rc = a2a_counts(r, world)
        if liar == "sender" and r == 0:
            sc[1] += delta
        if liar == "receiver" and r == 1:
            rc[0] += delta
        x = np.arange(sum(sc), dtype=np.int64)
        out = np.full(sum(rc), -1, np.int64)
        caught = await mismatch_text(comm.alltoall(x, out, sc, rc))
        y = int_data(r, 10, np.int32)
        await comm.allreduce(y)
        return caught, out, y

    sent, expected = (900 + delta, 900) if liar == "sender" else (900, 900 + delta)
    words = f"rank 0 sends rank 1 {sent} values, rank 1 expects {expected}"
    results = ok(run_world(world, body, timeout=20.0))  # far below the 60 s timeout
    for r, (caught, out, y) in enumerate(results):
        assert caught is not None, f"rank {r} returned from a bad all-to-all"
        assert words in caught, (r, caught)
        assert "alltoall" in caught, caught
        if r < 2:  # the pair: its own check (or its partner's ABORT), nothing written
            assert (out == -1).all(), f"rank {r} wrote output"
        else:
            assert "rank 0 aborted" in caught or "rank 1 aborted" in caught, caught
        np.testing.assert_array_equal(y, sum(int_data(q, 10, np.int32) for q in range(world)))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["dtype", "collective"])
def test_alltoall_against_another_call_fails_every_rank(world, case):
    """Rank 1 calls an all-to-all of another dtype, or an allgather: every rank raises
    the signature mismatch (the per-peer SIG frames are still a signature)."""

    async def body(comm):
        r = comm.rank
        sc, rc = a2a_counts(r, world)
        dtype = np.float32 if case == "dtype" and r == 1 else np.int64
        x = np.zeros(sum(sc), dtype)
        out = np.full(sum(rc), -1, dtype)
        if case == "collective" and r == 1:
            caught = await mismatch_text(comm.allgather(np.zeros(4, np.int64)))
        else:
            caught = await mismatch_text(comm.alltoall(x, out, sc, rc))
        y = int_data(r, 10, np.int32)
        await comm.allreduce(y)
        return caught, y

    for r, (caught, y) in enumerate(ok(run_world(world, body, timeout=20.0))):
        assert caught is not None and "rank 1 called" in caught, (r, caught)
        want = "float32" if case == "dtype" else "allgather"
        assert want in caught, caught
        np.testing.assert_array_equal(y, sum(int_data(q, 10, np.int32) for q in range(world)))


def test_timeout_label_of_an_alltoall_names_no_numel():
    """A peer's timeout message names the call it waits in; an alltoall's template signs
    no numel (its blocks differ per peer), so "numel 0" would be a false statement."""
    from cgx_ucx.collectives.call import make_template, what
    from cgx_ucx.transport.frames import Coll

    x = np.zeros(12, np.float32)
    a2a = make_template(Coll.ALLTOALL, x, algorithm=Algo.DIRECT).with_(numel=0)
    assert what("alltoall", a2a) == "alltoall"
    assert what("allreduce", make_template(Coll.ALLREDUCE, x)) == "allreduce, numel 12"


def test_a_rank_whose_communicator_closes_under_a_call_is_reported_lost():
    """A rank whose call fails because its communicator closes (or its transport fails)
    tells its peers it left: they raise PeerLostError naming it, not
    CollectiveMismatchError (the ranks did not disagree on anything). A cancelled call or
    a bad argument stays a disagreement: that rank goes on, and so does the group."""
    from cgx_ucx.collectives.call import abort_error
    from cgx_ucx.collectives.failure import abort_record

    closed = TransportError("the communicator was closed during the collective")
    code, culprit, reason = abort_record(None, 5, 0, closed)
    assert (code, culprit) == (AbortCode.PEER_LOST, 0)
    err = abort_error(0, 5, code, culprit, reason, 1)
    assert isinstance(err, PeerLostError) and err.peer == 0, repr(err)
    assert "rank 0 aborted collective #5" in str(err) and "closed" in str(err), str(err)
    for exc in (asyncio.CancelledError(), ConfigError("op must be 'sum' or 'avg'")):
        code, _, reason = abort_record(None, 5, 0, exc)
        assert code == AbortCode.LOCAL
        assert isinstance(abort_error(0, 5, code, 0, reason, 1), CollectiveMismatchError)


def test_a_lost_peer_is_relayed_naming_it():
    """A rank that lost a peer tells the others, naming that peer, before its BYE: a third
    rank that reads the BYE first must not blame the rank that left because of the loss."""
    from cgx_ucx.collectives.call import abort_error
    from cgx_ucx.collectives.failure import abort_record

    lost = PeerLostError("rank 7 is gone (connection reset)", peer=7)
    code, culprit, reason = abort_record(None, 5, 4, lost)
    assert (code, culprit) == (AbortCode.PEER_LOST, 7)
    err = abort_error(4, 5, code, culprit, reason, 0)
    assert isinstance(err, PeerLostError) and err.peer == 7, repr(err)
    assert "rank 4 aborted collective #5: PeerLostError: rank 7 is gone" in str(err), str(err)


def test_prepared_calls_are_reused_across_seeds_only_where_rounding_is_deterministic():
    """A training loop passes a new seed every step: with deterministic rounding the seed
    is never read, so the prepared spec (and its kernels' memo) is reused; with
    stochastic rounding each seed is its own spec; a bad seed is refused either way."""
    cache: dict = {}
    x = np.zeros(4096, np.float32)
    specs = [
        allreduce.prepare_allreduce(x, world_size=2, bits=4, seed=s, cache=cache)[1][1]
        for s in (1, 2, 3)
    ]
    assert specs[0] is specs[1] is specs[2] and len(cache) == 1
    sto = []
    for s in (1, 2):
        _, (_, spec) = allreduce.prepare_allreduce(
            x, world_size=2, bits=4, seed=s, stochastic=True, cache=cache
        )
        sto.append(spec)
    assert sto[0] is not sto[1] and (sto[0].seed, sto[1].seed) == (1, 2)
    for bad in (-1, 2**64):
        with pytest.raises(ConfigError, match="seed"):
            allreduce.prepare_allreduce(x, world_size=2, bits=4, seed=bad, cache=cache)
