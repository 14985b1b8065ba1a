"""Point-to-point across spawned processes: the asyncio face (Communicator.send/recv) and
the torch face (send/recv/isend/irecv/batch_isend_irecv, recv from any source).

Ordering is per (source, destination, tag): many messages on several tags, issued
concurrently, must each land in the receive of the same number in its stream.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from harness import run_ranks
from torch_helpers import run_torch_ranks

from cgx_ucx.collectives import connect
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import CollectiveMismatchError, ConfigError

CFG = CommConfig(timeout=20.0, connect_timeout=30.0)


def _msg(src: int, dst: int, tag: int, i: int, n: int = 5) -> np.ndarray:
    return np.full(n, src * 10_000 + dst * 1_000 + tag * 100 + i, np.int64)


# -- asyncio face ----------------------------------------------------------------------


async def ordered_streams(ctx):
    """Every rank sends 6 messages on each of 3 tags to every peer, all at once; receives
    are issued in a shuffled tag order but in order within a tag."""
    rank, world = ctx.rank, ctx.world_size
    tags, count = (0, 3, 7), 6
    async with await connect(ctx.store, rank, world, config=CFG) as comm:
        peers = [p for p in range(world) if p != rank]
        sends = [
            comm.send(_msg(rank, p, t, i, n=1 + 1000 * (i % 2)), p, t)
            for p in peers
            for t in tags
            for i in range(count)
        ]
        bufs = {
            (p, t, i): np.zeros(1 + 1000 * (i % 2), np.int64)
            for p in peers
            for t in tags
            for i in range(count)
        }
        order = [(p, t, i) for t in reversed(tags) for p in peers for i in range(count)]
        recvs = [comm.recv(bufs[k], k[0], k[1]) for k in order]
        got = await asyncio.gather(*sends, *recvs)
        srcs = got[len(sends) :]
        assert srcs == [k[0] for k in order]
        for (p, t, i), buf in bufs.items():
            np.testing.assert_array_equal(buf, _msg(p, rank, t, i, n=buf.size))
        stats = comm.stats
    return stats.by_collective


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_send_recv_ordered_per_pair_and_tag(world):
    for counts in run_ranks(ordered_streams, world_size=world, timeout=90):
        assert counts["send"] == counts["recv"] == (world - 1) * 18


async def any_source(ctx):
    """Rank 0 receives from any source; the others each send 3 messages on tag 2 and one
    on tag 5. Every message arrives once, each sender's in order."""
    rank, world = ctx.rank, ctx.world_size
    async with await connect(ctx.store, rank, world, config=CFG) as comm:
        if rank != 0:
            for i in range(3):
                await comm.send(_msg(rank, 0, 2, i), 0, tag=2)
            await comm.send(_msg(rank, 0, 5, 0), 0, tag=5)
            await comm.barrier()
            return None
        seen = []
        for _ in range(3 * (world - 1)):
            buf = np.zeros(5, np.int64)
            src = await comm.recv(buf, None, tag=2)
            seen.append((src, int(buf[0])))
        # A receive from a named source after any-source ones takes the next of its stream.
        tail = []
        for p in range(1, world):
            buf = np.zeros(5, np.int64)
            assert await comm.recv(buf, p, tag=5) == p
            tail.append(int(buf[0]))
        await comm.barrier()
        return seen, tail


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_recv_from_any_source(world):
    seen, tail = run_ranks(any_source, world_size=world, timeout=90)[0]
    assert sorted(seen) == sorted(
        (p, int(_msg(p, 0, 2, i)[0])) for p in range(1, world) for i in range(3)
    )
    for p in range(1, world):  # per sender, in send order
        mine = [v for s, v in seen if s == p]
        assert mine == [int(_msg(p, 0, 2, i)[0]) for i in range(3)]
    assert tail == [int(_msg(p, 0, 5, 0)[0]) for p in range(1, world)]


async def mismatched_size(ctx):
    async with await connect(ctx.store, ctx.rank, ctx.world_size, config=CFG) as comm:
        if ctx.rank == 0:
            await comm.send(np.arange(10, dtype=np.float32), 1, tag=1)
            await comm.send(np.arange(4, dtype=np.float32), 1, tag=1)
            await comm.barrier()
            return None
        with pytest.raises(CollectiveMismatchError, match="tag 1: rank 0 sent p2p"):
            await comm.recv(np.zeros(12, np.float32), 0, tag=1)
        # The stream goes on with the next message.
        buf = np.zeros(4, np.float32)
        await comm.recv(buf, 0, tag=1)
        with pytest.raises(ConfigError, match="itself"):
            await comm.send(buf, 1)
        with pytest.raises(ConfigError, match="tag must be"):
            await comm.send(buf, 0, tag=-1)
        await comm.barrier()
        return buf.tolist()


@pytest.mark.timeout(120)
def test_recv_of_another_size_is_a_mismatch():
    assert run_ranks(mismatched_size, world_size=2, timeout=90)[1] == [0.0, 1.0, 2.0, 3.0]


# -- torch face ------------------------------------------------------------------------


def _join_cgx(rank, world, store):
    import datetime

    import torch.distributed as dist

    import cgx_ucx.torch  # noqa: F401  (registers the backend)

    dist.init_process_group(
        "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )


def torch_ring(rank, world, store):
    import torch
    import torch.distributed as dist

    _join_cgx(rank, world, store)

    right, left = (rank + 1) % world, (rank - 1) % world
    results = {}
    # batch_isend_irecv ring exchange, several rounds, with and without tags.
    for rnd in range(3):
        send = torch.arange(4, dtype=torch.float32) + 100 * rank + rnd
        recv = torch.zeros(4)
        ops = [dist.P2POp(dist.irecv, recv, left), dist.P2POp(dist.isend, send, right, tag=0)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        results[f"ring{rnd}"] = recv.tolist()
    # Blocking send/recv with several tags; the receiver asks in the other tag order.
    if rank == 0:
        for tag in (1, 2):
            dist.send(torch.full((3,), float(tag)), 1, tag=tag)
    elif rank == 1:
        b2, b1 = torch.zeros(3), torch.zeros(3)
        w2 = dist.irecv(b2, 0, tag=2)
        dist.recv(b1, 0, tag=1)
        w2.wait()
        results["tags"] = (b1.tolist(), b2.tolist())
    # Any source: rank 0 collects one message from every other rank.
    if rank == 0:
        got = {}
        for _ in range(world - 1):
            b = torch.zeros(2, dtype=torch.int64)
            src = dist.recv(b, tag=9)
            got[src] = b.tolist()
        results["any"] = got
    else:
        dist.send(torch.tensor([rank, rank * rank]), 0, tag=9)
    # Non-contiguous and complex tensors.
    if rank == 0:
        dist.send(torch.arange(12.0).view(3, 4).t(), 1)
        dist.send(torch.tensor([1 + 2j, 3 - 1j]), 1)
    elif rank == 1:
        t = torch.zeros(4, 3)
        dist.recv(t, 0)
        c = torch.zeros(2, dtype=torch.complex64)
        dist.recv(c, 0)
        results["strided"] = t.tolist()
        results["complex"] = [str(v) for v in c.tolist()]
    dist.barrier()
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_torch_point_to_point(world):
    import torch

    res = run_torch_ranks(torch_ring, world, timeout=150)
    for r, out in enumerate(res):
        left = (r - 1) % world
        for rnd in range(3):
            assert out[f"ring{rnd}"] == [100 * left + rnd + i for i in range(4)]
    assert res[1]["tags"] == ([1.0] * 3, [2.0] * 3)
    assert res[0]["any"] == {p: [p, p * p] for p in range(1, world)}
    assert res[1]["strided"] == torch.arange(12.0).view(3, 4).t().tolist()
    assert res[1]["complex"] == [str(1 + 2j), str(3 - 1j)]
