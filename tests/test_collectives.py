"""Collectives across spawned processes: exact uncompressed sums, compressed error
bounds, bit-identical replicas, several collectives in flight, both faces (asyncio and
the synchronous engine), world sizes 1-4, sizes 0, 1 and non-multiples of the bucket."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest
from harness import run_ranks

from cgx_ucx.collectives import connect
from cgx_ucx.config import CommConfig
from cgx_ucx.layout import LayerSpec, Layout

CFG = CommConfig(timeout=20.0, connect_timeout=30.0)


def rank_data(rank: int, n: int, dtype, low=-1000, high=1000) -> np.ndarray:
    """Integer-valued data: every sum of a few of them is exactly representable."""
    return np.random.default_rng(1000 + rank).integers(low, high, n).astype(dtype)


def smooth_data(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(2000 + rank).standard_normal(n).astype(np.float32)


# -- bodies run in the ranks (module level: spawned children import them) ---------------


def _range(dtype):
    # bfloat16 holds integers exactly up to 256: keep sums of 4 ranks below that.
    return (-60, 60) if np.dtype(dtype).itemsize == 2 else (-100, 100)


async def exact_sums(ctx):
    """Uncompressed SUM/AVG for several dtypes and sizes; returns the results for checking."""
    out = {}
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16, ml_dtypes.bfloat16):
            for n in (0, 1, 1023, 70_001):
                x = rank_data(ctx.rank, n, dtype, *_range(dtype))
                await comm.allreduce(x)
                out[(np.dtype(dtype).name, n, "sum")] = x
        x = rank_data(ctx.rank, 5000, np.float32)
        await comm.allreduce(x, "avg")
        out[("float32", 5000, "avg")] = x
        for algo in ("sra", "ring", "oneshot"):
            x = rank_data(ctx.rank, 300_007, np.int64)
            await comm.allreduce(x, algorithm=algo)
            out[("int64", 300_007, algo)] = x
        stats = comm.stats
    return out, stats.collectives


async def warm_up_at_connect(ctx):
    from cgx_ucx.collectives import communicator

    calls = []
    collective = communicator.Communicator._collective

    async def spy(self, name, prepare, body, seq=None, **kwargs):
        calls.append((name, self._seq if seq is None else seq))
        return await collective(self, name, prepare, body, seq, **kwargs)

    communicator.Communicator._collective = spy
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        at_connect = list(calls)
        s = comm.stats
        counted = (s.collectives, s.messages_sent, s.messages_received, s.bytes_sent)
        await comm.warm_up()  # connect ran it: nothing more
        x = rank_data(ctx.rank, 1000, np.float32)
        await comm.allreduce(x, bits=4)
        return at_connect, counted, calls[len(at_connect) :], x, comm.mailbox is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3])
def test_connect_warms_up_outside_the_callers_numbering(world):
    """connect runs one compressed allreduce, so that the caller's first call does not pay
    for first runs, at sequence number 0 on every rank: the caller's first collective
    is still #1, and the statistics count none of the warm-up's traffic. A one-host group
    runs it once more through its node-local mailboxes, also at 0."""
    results = run_ranks(warm_up_at_connect, world, timeout=100)
    for at_connect, counted, later, x, boxed in results:
        assert boxed == (world > 1)
        assert at_connect == ([] if world == 1 else [("warm-up", 0)] * 2)
        assert counted == (0, 0, 0, 0)
        assert later == [("allreduce", 1)]
        np.testing.assert_array_equal(x, results[0][3])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_uncompressed_sum_is_exact(world):
    results = run_ranks(exact_sums, world, timeout=100)
    for key, got in results[0][0].items():
        dtype, n = key[0], key[1]
        dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        lo, hi = _range(dt) if key[2] == "sum" and n != 300_007 else (-1000, 1000)
        inputs = [rank_data(r, n, dt, lo, hi) for r in range(world)]
        expect = sum(x.astype(np.float64) for x in inputs)
        if key[2] == "avg":
            expect = expect / world
            np.testing.assert_allclose(got.astype(np.float64), expect, rtol=1e-6)
        else:
            np.testing.assert_array_equal(got.astype(np.float64), expect, err_msg=str(key))
        for other in results[1:]:
            np.testing.assert_array_equal(other[0][key], got, err_msg=f"replica differs {key}")
    assert results[0][1] == len(results[0][0])


async def compressed(ctx, cases):
    out = []
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        for n, bits, bucket, algorithm, dtype_name in cases:
            dtype = (
                np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(dtype_name)
            )
            x = smooth_data(ctx.rank, n).astype(dtype)
            await comm.allreduce(x, bits=bits, bucket_size=bucket, algorithm=algorithm)
            out.append(x)
    return out


def _bound(xs, bits, bucket, algorithm):
    """Per-value error bound: each quantization step errs by at most unit/2.

    SRA quantizes every input once (unit <= range_i / (2^b - 1)) and the sum once; the
    ring re-quantizes partial sums at each of N-1 hops. Bound both by (steps) times the
    per-bucket unit of the sum of ranges (a safe over-estimate).
    """
    world, n = len(xs), len(xs[0])
    levels = 2**bits - 1
    total = np.zeros(n)
    for b in range(0, n, bucket):
        total[b : b + bucket] = sum(
            float(x[b : b + bucket].max() - x[b : b + bucket].min()) for x in xs
        )
    steps = world + 1 if algorithm in ("sra", "oneshot") else 2 * world
    return steps * total / levels / 2 + 1e-5 * np.abs(sum(xs))


COMPRESSED_CASES = {
    # world: [(n, bits, bucket, algorithm, dtype)]
    2: [
        (100_003, 4, 1024, "sra", "float32"),
        (1, 4, 1024, "sra", "float32"),
        (0, 4, 1024, "ring", "float32"),
        (5_000, 4, 1024, "oneshot", "float32"),
        (3_001, 4, 128, "auto", "bfloat16"),
    ],
    3: [
        (65_537, 2, 512, "sra", "float32"),
        (65_537, 8, 100, "ring", "float32"),
        (5_000, 4, 64, "ring", "bfloat16"),
        (65_537, 4, 512, "oneshot", "float16"),
    ],
    4: [
        (40_000, 4, 1000, "sra", "float16"),
        (30_011, 3, 256, "ring", "float32"),
        (10_000, 4, 512, "oneshot", "float32"),
    ],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", sorted(COMPRESSED_CASES))
def test_compressed_within_bound_and_identical(world):
    cases = COMPRESSED_CASES[world]
    results = run_ranks(compressed, world, args=(cases,), timeout=110)
    for i, (n, bits, bucket, algorithm, dtype) in enumerate(cases):
        got = results[0][i]
        for r in results[1:]:
            assert r[i].tobytes() == got.tobytes(), f"replicas differ: {cases[i]}"
        exact = sum(smooth_data(r, n).astype(np.float64) for r in range(world))
        err = np.abs(got.astype(np.float64) - exact)
        bound = _bound([smooth_data(r, n) for r in range(world)], bits, bucket, algorithm)
        if dtype != "float32":  # inputs and outputs rounded to 16 bits as well
            bound = bound + np.abs(exact) * 2**-7 * (world + 1) + 1e-3
        assert np.all(err <= bound), f"{cases[i]}: max excess {np.max(err - bound)}"


async def mixed_layout(ctx):
    # Layers: compressed 4-bit, uncompressed (bias-like), compressed 2-bit with odd buckets.
    layout = Layout(
        (
            LayerSpec(0, 50_000, 4, 512),
            LayerSpec(50_000, 77, 32, 1024),
            LayerSpec(50_077, 33_333, 2, 100),
        )
    )
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        x = smooth_data(ctx.rank, layout.numel)
        await comm.allreduce(x, layout=layout)
        y = smooth_data(ctx.rank, layout.numel)
        await comm.allreduce(y, layout=layout, stochastic=True, seed=7)
        return x, y


@pytest.mark.timeout(60)
def test_mixed_layout_uncompressed_layer_exact():
    results = run_ranks(mixed_layout, 3, timeout=50)
    exact = sum(smooth_data(r, 83_410).astype(np.float64) for r in range(3))
    for x, y in results:
        assert x.tobytes() == results[0][0].tobytes()
        assert y.tobytes() == results[0][1].tobytes()
    x = results[0][0]
    # The uncompressed layer is summed in float32: exact up to float32 rounding.
    np.testing.assert_allclose(x[50_000:50_077], exact[50_000:50_077], rtol=1e-6, atol=1e-6)
    xs = [smooth_data(r, 83_410) for r in range(3)]
    err = np.abs(x - exact)
    assert np.all(err[:50_000] <= _bound([a[:50_000] for a in xs], 4, 512, "sra"))
    assert np.all(err[50_077:] <= _bound([a[50_077:] for a in xs], 2, 100, "sra"))


async def in_flight(ctx):
    """Several collectives at once, completed out of order; results must not mix."""
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        xs = [rank_data(ctx.rank, 10_000 + 997 * i, np.float32) for i in range(6)]
        b = np.arange(5.0) if ctx.rank == 1 else np.zeros(5)
        calls = [comm.allreduce(x, bits=None if i % 2 else 8) for i, x in enumerate(xs)]
        calls.insert(2, comm.broadcast(b, root=1))
        calls.insert(4, comm.barrier())
        calls.append(comm.allgather(np.full(2, ctx.rank)))
        res = await asyncio.gather(*calls)
        return xs, b, res[-1]


@pytest.mark.timeout(60)
def test_several_collectives_in_flight():
    results = run_ranks(in_flight, 3, timeout=50)
    for i in range(6):
        n = 10_000 + 997 * i
        exact = sum(rank_data(r, n, np.float32).astype(np.float64) for r in range(3))
        got = results[0][0][i]
        for other in results[1:]:
            assert other[0][i].tobytes() == got.tobytes()
        if i % 2:
            np.testing.assert_array_equal(got, exact)
        else:
            assert np.abs(got - exact).max() < 6000 / 255 * 3
    for _, b, g in results:
        np.testing.assert_array_equal(b, np.arange(5.0))
        np.testing.assert_array_equal(g, np.repeat(np.arange(3), 2).reshape(3, 2))


def sync_face(ctx):
    """The synchronous engine: futures, order preserved, close stops the thread."""
    import threading

    from cgx_ucx.engine import connect_sync

    comm = connect_sync(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    xs = [rank_data(ctx.rank, 4099, np.float32) for _ in range(4)]
    futs = [comm.allreduce(x, bits=4 if i % 2 else None) for i, x in enumerate(xs)]
    futs.append(comm.barrier())
    for f in futs:
        f.result(30)
    g = comm.allgather(np.array([ctx.rank * 10])).result(30)
    comm.close()
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    # A second communicator in the same process afterwards works.
    comm2 = connect_sync(ctx.store, ctx.rank, ctx.world_size, config=CFG)
    y = rank_data(ctx.rank, 10, np.int64)
    comm2.allreduce(y).result(30)
    comm2.close()
    return xs, g, threads, y


@pytest.mark.timeout(60)
def test_sync_engine_and_reconnect():
    results = run_ranks(sync_face, 2, timeout=50)
    for i in (0, 2):
        exact = sum(rank_data(r, 4099, np.float32) for r in range(2))
        np.testing.assert_array_equal(results[0][0][i], exact)
    for xs, g, threads, y in results:
        assert xs[1].tobytes() == results[0][0][1].tobytes()
        np.testing.assert_array_equal(g, [[0], [10]])
        assert threads == [], f"threads left after close: {threads}"
        np.testing.assert_array_equal(y, rank_data(0, 10, np.int64) + rank_data(1, 10, np.int64))


async def single(ctx):
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        x = rank_data(0, 1000, np.float32)
        await comm.allreduce(x)
        y = smooth_data(0, 3000)
        await comm.allreduce(y, bits=8)
        await comm.barrier()
        return x, y


@pytest.mark.timeout(30)
def test_world_size_one():
    x, y = run_ranks(single, 1, timeout=25)[0]
    np.testing.assert_array_equal(x, rank_data(0, 1000, np.float32))
    assert np.abs(y - smooth_data(0, 3000)).max() < 8 / 255


async def over_tcp_env_store(ctx):
    """env:// rendezvous (a torch TCPStore) with UCX restricted to TCP."""
    import os

    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    comm = await connect(config=CFG)  # store=None: env://
    try:
        x = rank_data(ctx.rank, 200_003, np.float32)
        await comm.allreduce(x)
        y = smooth_data(ctx.rank, 50_000)
        await comm.allreduce(y, bits=4, algorithm="ring")
        import ucxx

        return x, y, sorted(ucxx.get_active_transports())
    finally:
        await comm.close()


@pytest.mark.timeout(90)
def test_tcp_transport_with_env_rendezvous():
    import socket

    with socket.socket() as s:  # a free port for the TCPStore
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"UCX_TLS": "tcp", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    results = run_ranks(over_tcp_env_store, 2, timeout=80, env=env)
    exact = sum(rank_data(r, 200_003, np.float32) for r in range(2))
    for x, y, transports in results:
        np.testing.assert_array_equal(x, exact)
        assert y.tobytes() == results[0][1].tobytes()
        assert "tcp" in transports and "posix" not in transports and "cma" not in transports
    xs = [smooth_data(r, 50_000) for r in range(2)]
    err = np.abs(results[0][1] - sum(x.astype(np.float64) for x in xs))
    assert np.all(err <= _bound(xs, 4, 1024, "ring"))


async def one_node_uncompressed(ctx):
    from cgx_ucx.collectives import hierarchical

    runs = []
    original = hierarchical.Hierarchical.run

    async def counted(self):
        runs.append((self.spec.topology.num_nodes, self.requantizes))
        await original(self)

    hierarchical.Hierarchical.run = counted
    n = 3 * (4 << 20) // 4 + 12_345  # several 4 MiB pieces a shard, and a ragged end
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        out = []
        for dtype, op in [(np.float32, "sum"), (np.int32, "sum"), (np.float64, "avg")]:
            x = rank_data(ctx.rank, n, dtype)
            await comm.allreduce(x, op)
            out.append(x)
        compressed = smooth_data(ctx.rank, n)
        await comm.allreduce(compressed, bits=4)
        return out, runs, compressed


@pytest.mark.timeout(90)
def test_one_node_uncompressed_allreduce_goes_through_shared_segments():
    """Three ranks of one host: an uncompressed host allreduce takes the node's shared
    segments (no cross-node stage); sums are exact and every replica bit-identical."""
    results = run_ranks(one_node_uncompressed, 3, timeout=80)
    n = 3 * (4 << 20) // 4 + 12_345
    for out, runs, compressed in results:
        # The three uncompressed calls, then the compressed one, on one node.
        assert runs == [(1, False)] * 3 + [(1, True)], runs
        for got, first in zip(out, results[0][0], strict=True):
            assert got.tobytes() == first.tobytes()
        assert compressed.tobytes() == results[0][2].tobytes()
    out = results[0][0]
    for got, dtype in zip(out[:2], (np.float32, np.int32), strict=True):
        np.testing.assert_array_equal(got, sum(rank_data(r, n, dtype) for r in range(3)))
    np.testing.assert_allclose(
        out[2], sum(rank_data(r, n, np.float64) for r in range(3)) / 3, rtol=1e-15
    )
    exact = sum(smooth_data(r, n).astype(np.float64) for r in range(3))
    assert 0 < np.max(np.abs(results[0][2] - exact)) < 0.1 * np.max(np.abs(exact))


async def one_node_compressed(ctx, n):
    from cgx_ucx.collectives import hierarchical

    runs = []
    original = hierarchical.Hierarchical.run

    async def counted(self):
        runs.append(self.requantizes)
        await original(self)

    hierarchical.Hierarchical.run = counted
    mixed = Layout(
        (
            LayerSpec(0, n // 2, 4, 512),
            LayerSpec(n // 2, 1000),  # a bias-like layer at 32 bits
            LayerSpec(n // 2 + 1000, n - n // 2 - 1000, 2, 256),
        )
    )
    cases = [dict(bits=4), dict(bits=8, op="avg"), dict(layout=mixed), dict(bits=2, op="avg")]
    out = []
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        for kw in cases:
            shared, flat = smooth_data(ctx.rank, n), smooth_data(ctx.rank, n)
            await comm.allreduce(shared, **kw)
            await comm.allreduce(flat, algorithm="sra", **kw)
            out.append((shared, flat))
        for dtype, kw in [(np.float16, dict(bits=4)), (ml_dtypes.bfloat16, dict(bits=8, op="avg"))]:
            shared, flat = (smooth_data(ctx.rank, n).astype(dtype) for _ in range(2))
            await comm.allreduce(shared, **kw)
            await comm.allreduce(flat, algorithm="sra", **kw)
            out.append((shared, flat))
        stochastic = smooth_data(ctx.rank, n)
        await comm.allreduce(stochastic, bits=4, stochastic=True, seed=7)
        return out, runs, stochastic


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_one_node_compressed_allreduce_is_sra_through_shared_segments(world):
    """A compressed allreduce of ranks of one host goes through the node's shared
    segments: every rank ends with SRA's bytes exactly (sum and avg, mixed widths with a
    32-bit layer, float16 and bfloat16 buffers), stochastic rounding leaves every replica
    bit-identical, and the error stays within SRA's bound."""
    n = world * (4 << 20) // 4 + 12_345  # several pieces a chunk, and a ragged end
    results = run_ranks(one_node_compressed, world, args=(n,), timeout=110)
    for out, runs, stochastic in results:
        # The shared path ran for each case and the stochastic call, never for "sra".
        assert runs == [True] * 7, runs
        for shared, flat in out:
            assert shared.tobytes() == flat.tobytes()
        assert stochastic.tobytes() == results[0][2].tobytes()
    xs = [smooth_data(r, n) for r in range(world)]
    exact = sum(x.astype(np.float64) for x in xs)
    err = np.abs(results[0][0][0][0] - exact)
    assert np.max(err) > 0 and np.all(err <= _bound(xs, 4, 1024, "sra"))
