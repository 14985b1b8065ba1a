"""The ``cgx`` group's ops beyond all_reduce, across spawned processes, against values
computed locally: all_to_all (single tensor with even and uneven splits, lists), the
coalesced allgathers and reduce-scatters, reduce_scatter (exact, and quantized within
the codec's bound and equal to what the shard's owner computes), and the error of an op
the backend cannot do."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
from torch_helpers import run_torch_ranks

BITS, BUCKET = 4, 128


def _join(rank, world, store, **kwargs):
    import torch.distributed as dist

    import cgx_ucx.torch  # noqa: F401  (registers the backend)

    dist.init_process_group(
        "cgx",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
        **kwargs,
    )


def _data(rank, n, seed=0):
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g)


def exact_ops(rank, world, store):
    import torch
    import torch.distributed as dist

    _join(rank, world, store)
    # all_to_all_single, even split: block i of rank r holds 10*r + i.
    inp = torch.tensor([10.0 * rank + i for i in range(world) for _ in range(2)])
    out = torch.empty(2 * world)
    dist.all_to_all_single(out, inp)
    assert out.tolist() == [10.0 * p + rank for p in range(world) for _ in range(2)]
    # Uneven splits: rank r sends (r + i + 1) rows of 3 to rank i.
    sends = [rank + i + 1 for i in range(world)]
    recvs = [p + rank + 1 for p in range(world)]
    rows = torch.cat([torch.full((s, 3), 100 * rank + i) for i, s in enumerate(sends)])
    got = torch.empty(sum(recvs), 3, dtype=rows.dtype)
    dist.all_to_all_single(got, rows, output_split_sizes=recvs, input_split_sizes=sends)
    want = torch.cat([torch.full((s, 3), 100 * p + rank) for p, s in enumerate(recvs)])
    assert torch.equal(got, want)
    # all_to_all with lists of different sizes, integer dtype.
    ins = [torch.arange(i + 1, dtype=torch.int64) + 1000 * rank for i in range(world)]
    outs = [torch.empty(rank + 1, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for p, o in enumerate(outs):
        assert o.tolist() == (torch.arange(rank + 1) + 1000 * p).tolist()
    # all_gather_coalesced: output_lists[p][i] = rank p's inputs[i].
    ins = [torch.full((2, 2), float(rank)), torch.tensor([rank + 0.5])]
    outs = [[torch.empty(2, 2), torch.empty(1)] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    for p in range(world):
        assert outs[p][0].eq(p).all() and outs[p][1].item() == p + 0.5
    # all_gather_into_tensor coalesced, via the coalescing manager.
    a, b = torch.full((3,), float(rank)), torch.full((2,), 10.0 + rank)
    oa, ob = torch.empty(3 * world), torch.empty(2 * world)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(oa, a)
        dist.all_gather_into_tensor(ob, b)
    cm.wait()
    assert oa.tolist() == [float(p) for p in range(world) for _ in range(3)]
    assert ob.tolist() == [10.0 + p for p in range(world) for _ in range(2)]
    # reduce_scatter_tensor, coalesced, and the list form; integer SUM and MAX exact.
    x = torch.arange(4 * world, dtype=torch.int64) * (rank + 1)
    y = torch.arange(2 * world, dtype=torch.int64) + rank
    ox, oy = torch.empty(4, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(ox, x)
        dist.reduce_scatter_tensor(oy, y)
    cm.wait()
    tri = world * (world + 1) // 2
    assert ox.tolist() == [(4 * rank + j) * tri for j in range(4)]
    assert oy.tolist() == [(2 * rank + j) * world + world * (world - 1) // 2 for j in range(2)]
    o = torch.empty(3)
    dist.reduce_scatter(
        o, [torch.full((3,), float(rank * world + i)) for i in range(world)], op=dist.ReduceOp.MAX
    )
    assert o.tolist() == [float((world - 1) * world + rank)] * 3
    assert x.tolist() == (torch.arange(4 * world) * (rank + 1)).tolist()  # input unchanged
    return True


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_exact_ops(world):
    assert run_torch_ranks(exact_ops, world, timeout=150) == [True] * world


def alltoall_single_pair_disagrees(rank, world, store, async_op):
    """all_to_all_single with split sizes where rank 1 expects one row more from rank 0
    than rank 0 sends it; then a correct one (the group still works)."""
    import time

    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CollectiveMismatchError

    _join(rank, world, store)
    sends = [rank + i + 1 for i in range(world)]
    recvs = [p + rank + 1 for p in range(world)]
    rows = torch.cat([torch.full((s, 3), 100 * rank + i) for i, s in enumerate(sends)])
    bad = list(recvs)
    if rank == 1:
        bad[0] += 1
    got = torch.full((sum(bad), 3), -1, dtype=rows.dtype)
    start = time.monotonic()
    try:
        work = dist.all_to_all_single(
            got, rows, output_split_sizes=bad, input_split_sizes=sends, async_op=async_op
        )
        if async_op:
            work.wait()
        kind = "no error"
    except CollectiveMismatchError as exc:
        kind = f"CollectiveMismatchError: {exc}"
    elapsed = time.monotonic() - start
    untouched = bool(got.eq(-1).all())
    good = torch.empty(sum(recvs), 3, dtype=rows.dtype)
    dist.all_to_all_single(good, rows, output_split_sizes=recvs, input_split_sizes=sends)
    want = torch.cat([torch.full((s, 3), 100 * p + rank) for p, s in enumerate(recvs)])
    return kind, elapsed, untouched, torch.equal(good, want)


@pytest.mark.timeout(180)
# async_op=True: the error from work.wait() (a Work's wait() raising is tested in
# test_torch_units as well).
@pytest.mark.parametrize("async_op", [False, True])
def test_alltoall_single_split_sizes_that_differ_fail_both_ranks_of_the_pair(async_op):
    """Rank 0 sends rank 1 two rows of 3 values, rank 1 expects three: both raise
    CollectiveMismatchError (from the call, or from the Work's wait) naming the ranks and
    counts, without waiting out the timeout; the third rank fails too, none writes output."""
    results = run_torch_ranks(alltoall_single_pair_disagrees, 3, args=(async_op,), timeout=150)
    for rank, (kind, elapsed, untouched, good) in enumerate(results):
        assert kind.startswith("CollectiveMismatchError"), (rank, kind)
        assert "rank 0 sends rank 1 6 values, rank 1 expects 9" in kind, (rank, kind)
        assert elapsed < 30, (rank, elapsed)
        if rank < 2:  # its own check, or its partner's ABORT if that came first
            assert untouched, f"rank {rank} wrote output"
        assert good, f"rank {rank}: the next all_to_all_single gave a wrong result"


def compressed_reduce_scatter(rank, world, store):
    import torch
    import torch.distributed as dist

    from cgx_ucx.compression import decode_add, encode
    from cgx_ucx.config import CompressionConfig
    from cgx_ucx.torch import CGXOptions

    cfg = CompressionConfig(bits=BITS, bucket_size=BUCKET, minimal_size=16)
    _join(rank, world, store, pg_options=CGXOptions(compression=cfg))
    n = 3001  # not a multiple of the bucket
    inputs = [_data(p, world * n) for p in range(world)]  # every rank's, known to all
    before = dict(dist.group.WORLD.communicator.stats.by_collective)
    out = torch.empty(n)
    dist.reduce_scatter_tensor(out, inputs[rank].clone())
    avg = torch.empty(n)
    dist.reduce_scatter_tensor(avg, inputs[rank].clone(), op=dist.ReduceOp.AVG)
    after = dist.group.WORLD.communicator.stats.by_collective
    # The owner's computation: its own shard exact, each peer's quantized, rank order.
    shard = slice(rank * n, (rank + 1) * n)
    acc = inputs[rank][shard].numpy().astype(np.float32)
    bound = np.zeros(n, np.float64)
    for p in range(world):
        if p == rank:
            continue
        vals = inputs[p][shard].numpy()
        decode_add(encode(vals, BITS, BUCKET), acc)
        for a in range(0, n, BUCKET):
            b = vals[a : a + BUCKET]
            bound[a : a + BUCKET] += (b.max() - b.min()) / (2**BITS - 1) / 2
    exact = sum(x[shard].double() for x in inputs).numpy()
    err = np.abs(out.numpy().astype(np.float64) - exact)
    assert np.array_equal(out.numpy(), acc), "not what the owner computes"
    assert (err <= bound * (1 + 1e-5) + 1e-5).all(), float((err - bound).max())
    assert err.max() > 0  # it was quantized
    np.testing.assert_allclose(avg.numpy(), acc / world, rtol=1e-6, atol=1e-6)
    assert after.get("reduce_scatter", 0) - before.get("reduce_scatter", 0) == 2
    return True


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_compressed_reduce_scatter_is_the_owners_sum_within_bound(world):
    assert run_torch_ranks(compressed_reduce_scatter, world, timeout=150) == [True] * world


def unsupported(rank, world, store):
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CGXError

    _join(rank, world, store)
    msgs = []
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (4,))
    for call in (
        lambda: dist.all_reduce(sparse),
        lambda: dist.send(torch.zeros(1), (rank + 1) % world, tag=1 << 20),
        # an expanded (stride 0) view: refused before the call, not after it ran
        lambda: dist.all_reduce(torch.ones(1).expand(5)),
    ):
        try:
            call()
        except CGXError as exc:
            assert "No backend type" not in str(exc)
            msgs.append(str(exc))
    dist.barrier()
    return msgs


@pytest.mark.timeout(120)
def test_unsupported_ops_raise_a_cgx_error_naming_them():
    msgs = run_torch_ranks(unsupported, 2, timeout=100)[0]
    assert len(msgs) == 3
    assert "dense" in msgs[0]
    assert "tag must be" in msgs[1]
    assert "expanded view" in msgs[2]
