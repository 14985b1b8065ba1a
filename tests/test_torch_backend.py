"""The ``cgx`` torch.distributed backend across spawned processes."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import pytest

pytest.importorskip("torch")

from torch_helpers import DEAD_EXIT, run_torch_ranks


def _init(rank: int, world: int, store: Any, timeout_s: float = 60.0) -> Any:
    import torch.distributed as dist

    import cgx_ucx.torch  # noqa: F401  (registers the backend)

    dist.init_process_group(
        "cgx",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


# -- exact collectives ---------------------------------------------------------------------
def _exact_ops(rank: int, world: int, store: Any) -> None:
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CGXError, ConfigError

    os.environ.pop("CGX_COMPRESSION_QUANTIZATION_BITS", None)
    pg = _init(rank, world, store)
    assert dist.get_backend() == "cgx" and pg.name() == "cgx"
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
    ranks = torch.arange(world)

    for n in (0, 1, 1001):
        base = torch.arange(n)
        # SUM of integers and AVG of floats: exact through the uncompressed path.
        t = base * (rank + 1)
        dist.all_reduce(t)
        assert torch.equal(t, base * int((ranks + 1).sum()))
        f = torch.full((n,), float(rank))
        dist.all_reduce(f, op=dist.ReduceOp.AVG)
        assert torch.equal(f, torch.full((n,), float(ranks.float().mean())))
        # MAX / MIN / PRODUCT / bitwise through allgather + local reduction.
        m = base + rank
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        assert torch.equal(m, base + world - 1)
        m = base.float() - rank
        dist.all_reduce(m, op=dist.ReduceOp.MIN)
        assert torch.equal(m, base.float() - (world - 1))
        p = torch.full((n,), rank + 2, dtype=torch.int32)
        dist.all_reduce(p, op=dist.ReduceOp.PRODUCT)
        assert torch.equal(p, torch.full((n,), int((ranks + 2).prod()), dtype=torch.int32))
        b = torch.full((n,), rank == 0)
        dist.all_reduce(b, op=dist.ReduceOp.BOR)
        assert bool(b.all())

    # Unsigned types torch has no max/min for: reduced on the host with NumPy.
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        u = torch.tensor([rank * 7 + 1, 60000 - rank, 3], dtype=dtype)
        dist.all_reduce(u, op=dist.ReduceOp.MAX)
        assert u.tolist() == [(world - 1) * 7 + 1, 60000, 3]
        u = torch.tensor([rank * 7 + 1, 60000 - rank, 3], dtype=dtype)
        dist.all_reduce(u, op=dist.ReduceOp.MIN)
        assert u.tolist() == [1, 60000 - (world - 1), 3]

    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        h = torch.full((37,), 0.5 * (rank + 1), dtype=dtype)
        dist.all_reduce(h)
        assert torch.equal(h, torch.full((37,), 0.5 * float((ranks + 1).sum()), dtype=dtype))

    z = torch.full((5,), complex(rank, -rank), dtype=torch.complex64)
    dist.all_reduce(z)
    assert torch.equal(z, torch.full((5,), complex(ranks.sum(), -ranks.sum()), dtype=z.dtype))

    # A non-contiguous tensor is staged and written back.
    nc = torch.zeros(6, 4)
    view = nc.t()
    view.fill_(rank + 1.0)
    dist.all_reduce(view)
    assert torch.equal(nc, torch.full((6, 4), float((ranks + 1).sum())))

    # async_op: wait() and get_future() as gloo's.
    a = torch.ones(5) * rank
    work = dist.all_reduce(a, async_op=True)
    assert work.wait() is True and work.is_completed()
    assert torch.equal(a, torch.full((5,), float(ranks.sum())))
    a2 = torch.ones(3)
    fut = dist.all_reduce(a2, async_op=True).get_future()
    assert torch.equal(fut.wait()[0], torch.full((3,), float(world)))
    chained = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(lambda f: 7)
    assert chained.wait() == 7

    # broadcast / allgather / reduce_scatter / gather / scatter / reduce / barrier
    x = torch.arange(10.0) if rank == world - 1 else torch.zeros(10)
    dist.broadcast(x, src=world - 1)
    assert torch.equal(x, torch.arange(10.0))
    outs = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), rank))
    assert all(torch.equal(o, torch.full((3,), r)) for r, o in enumerate(outs))
    flat = torch.empty(world * 4)
    dist.all_gather_into_tensor(flat, torch.full((4,), float(rank)))
    assert torch.equal(flat, torch.arange(world).float().repeat_interleave(4))
    rs = torch.empty(2)
    src = torch.arange(world * 2.0)
    dist.reduce_scatter_tensor(rs, src)
    assert torch.equal(rs, src[rank * 2 : rank * 2 + 2] * world)
    assert torch.equal(src, torch.arange(world * 2.0))  # input untouched
    g = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), g, dst=0)
    if rank == 0:
        assert all(torch.equal(t, torch.full((2,), float(r))) for r, t in enumerate(g))
    s = torch.empty(2)
    dist.scatter(s, [torch.full((2,), 10.0 + r) for r in range(world)] if rank == 0 else None)
    assert torch.equal(s, torch.full((2,), 10.0 + rank))
    red = torch.full((3,), float(rank + 1))
    dist.reduce(red, dst=1)
    expected = float((ranks + 1).sum()) if rank == 1 else float(rank + 1)
    assert torch.equal(red, torch.full((3,), expected))
    dist.barrier()

    # Bad input: typed errors, never a hang.
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)
    except ConfigError:
        pass
    else:
        raise AssertionError("integer AVG must be refused")
    try:
        # A point-to-point tag outside its range is refused.
        dist.send(torch.ones(1), dst=(rank + 1) % world, tag=1 << 20)
    except CGXError:
        pass
    else:
        raise AssertionError("send must be refused with a CGXError")
    dist.barrier()  # still usable after refused calls


@pytest.mark.timeout(150)
def test_exact_collectives() -> None:
    run_torch_ranks(_exact_ops, 2, timeout=140)


def _subgroups_under_torchrun(rank: int, world: int, store: Any) -> list[float]:
    # torchrun's variables describe the job (one node of `world` ranks), not the group.
    os.environ.update(GROUP_RANK="0", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    _init(rank, world, store)
    pair = dist.new_group(ranks=[2, 0], backend="cgx")  # unsorted, some of the node's ranks
    t = torch.full((16,), float(rank + 1))
    if rank in (0, 2):
        dist.all_reduce(t, group=pair)
    dist.barrier()
    return t.tolist()[:1]


@pytest.mark.timeout(120)
def test_subgroups_of_some_ranks_of_a_node_under_torchrun() -> None:
    """A cgx subgroup holding some of a node's ranks, launched as torchrun does (its
    variables describe the node, not the group), reduces within the subgroup."""
    assert run_torch_ranks(_subgroups_under_torchrun, 3, timeout=110) == [[4.0], [2.0], [4.0]]


def _all_reduce_failing_before_submit(fail: bool) -> None:
    import torch
    import torch.distributed as dist

    from cgx_ucx.torch import ops

    original = ops.allreduce_into

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torch refused the tensor")

    if fail:
        ops.allreduce_into = refused
    try:
        dist.all_reduce(torch.ones(2))
    finally:
        ops.allreduce_into = original


def _one_rank_argument_error(rank: int, world: int, store: Any) -> list[str]:
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CGXError

    _init(rank, world, store, timeout_s=30)
    seen = []
    cases = [
        # gather: the root's outputs do not match the input (the others' calls are fine)
        lambda: dist.gather(
            torch.ones(4), [torch.empty(3) for _ in range(world)] if rank == 0 else None, dst=0
        ),
        # all_gather: one rank passes a list of the wrong length
        lambda: dist.all_gather([torch.empty(2) for _ in range(world + rank)], torch.ones(2)),
        # scatter: the root's inputs differ in size (refused on the root, like the others)
        lambda: dist.scatter(
            torch.empty(2),
            [torch.ones(2 + i) for i in range(world)] if rank == 0 else None,
            src=0,
        ),
        # any other error before the call is submitted (here a RuntimeError on rank 1)
        lambda: _all_reduce_failing_before_submit(rank == 1),
    ]
    for case in cases:
        start = time.monotonic()
        try:
            case()
            seen.append("no error")
        except (CGXError, RuntimeError) as exc:
            seen.append(f"{type(exc).__name__} {time.monotonic() - start:.1f}")
        t = torch.ones(3)
        dist.all_reduce(t)  # the group is still usable, on every rank
        assert t.tolist() == [float(world)] * 3
    return seen


@pytest.mark.timeout(120)
def test_an_argument_error_on_one_rank_fails_the_others_at_once() -> None:
    """A ConfigError the backend finds on one rank, before the call starts, refuses that
    call on the engine: the peers raise CollectiveMismatchError at once instead of
    waiting out the 30 s timeout."""
    seen = run_torch_ranks(_one_rank_argument_error, 2, timeout=110)
    kinds = [[s.split()[0] for s in rank] for rank in seen]
    assert kinds == [
        ["ConfigError", "CollectiveMismatchError", "ConfigError", "CollectiveMismatchError"],
        ["CollectiveMismatchError", "ConfigError", "CollectiveMismatchError", "RuntimeError"],
    ], seen
    assert all(float(s.split()[1]) < 10 for rank in seen for s in rank), seen


def _monitored_barrier_with_a_late_rank(rank: int, world: int, store: Any) -> str:
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CGXTimeoutError

    pg = _init(rank, world, store, timeout_s=30)
    outcome = "returned"
    if rank == 1:
        time.sleep(4)
    try:
        pg.monitored_barrier(datetime.timedelta(seconds=1))
    except CGXTimeoutError as exc:
        outcome = f"{type(exc).__name__} peer={exc.peer}: {exc}"
    t = torch.ones(2)
    dist.all_reduce(t)  # the barrier completed once rank 1 came: the group goes on
    assert t.tolist() == [2.0, 2.0]
    return outcome


@pytest.mark.timeout(120)
def test_monitored_barrier_names_the_late_rank() -> None:
    """As gloo's: past the timeout, the ranks that did not reach the barrier are named,
    and the error says the late rank is alive."""
    late0, late1 = run_torch_ranks(_monitored_barrier_with_a_late_rank, 2, timeout=110)
    assert late0.startswith("CGXTimeoutError peer=1:"), late0
    assert "rank(s) [1] did not reach the barrier within 1 s" in late0, late0
    assert "rank 1 is alive" in late0, late0
    assert late1 == "returned", late1


# -- compressed all_reduce -----------------------------------------------------------------
def _compressed(rank: int, world: int, store: Any) -> None:
    import torch
    import torch.distributed as dist

    from cgx_ucx.config import CompressionConfig

    pg = _init(rank, world, store)
    os.environ["CGX_COMPRESSION_MINIMAL_SIZE"] = "16"
    checked_lossy = False
    for bits in (2, 4, 8):
        os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = str(bits)  # read at each call
        # Constant buckets decode exactly, so constant inputs reduce exactly.
        c = torch.full((3000,), 0.25 * (rank + 1))
        dist.all_reduce(c)
        assert torch.equal(c, torch.full((3000,), 0.25 * world * (world + 1) / 2)), bits
        for bucket in (64, 512, 2048):
            os.environ["CGX_COMPRESSION_BUCKET_SIZE"] = str(bucket)
            n = 5000  # not a multiple of any bucket size
            ramp = torch.arange(n, dtype=torch.float32) + rank
            exact = world * torch.arange(n, dtype=torch.float64) + world * (world - 1) / 2
            dist.all_reduce(ramp)
            err = (ramp.double() - exact).abs().max().item()
            bound = 2 * min(bucket, n) / (2**bits - 1) * world * (world + 1)
            assert err < bound, (bits, bucket, err, bound)
            checked_lossy |= err > 0
            # Every rank ends with the same bits (the owner re-quantizes its chunk too).
            rows = [torch.empty(n) for _ in range(world)]
            dist.all_gather(rows, ramp)
            assert all(torch.equal(rows[0], r) for r in rows[1:])
    assert checked_lossy, "compression was never applied"

    # Tiny tensors (under the minimal size) stay exact even with compression on.
    os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = "2"
    tiny = torch.tensor([0.1, 0.7, -3.3]) * (rank + 1)
    want = torch.tensor([0.1, 0.7, -3.3]) * sum(range(1, world + 1))
    dist.all_reduce(tiny)
    assert torch.allclose(tiny, want, rtol=0, atol=1e-6)
    # Explicit configuration in code beats the environment ...
    pg.compression = CompressionConfig(bits=32)
    r = torch.arange(5000.0) * (rank + 1)
    dist.all_reduce(r)
    assert torch.equal(r, torch.arange(5000.0) * (world * (world + 1) / 2))
    # ... and None goes back to the environment.
    pg.compression = None
    assert pg.compression.bits == 2


@pytest.mark.timeout(150)
def test_compressed_allreduce_bounds() -> None:
    run_torch_ranks(_compressed, 3, timeout=140)


# -- failure -------------------------------------------------------------------------------
def _dead_peer(rank: int, world: int, store: Any, timeout_s: float) -> float:
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CGXError

    _init(rank, world, store, timeout_s=timeout_s)
    dist.all_reduce(torch.ones(4))  # the job works ...
    if rank == 1:
        os._exit(DEAD_EXIT)  # ... then this rank dies without a word
    time.sleep(0.5)
    t0 = time.monotonic()
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    try:
        work.wait()
    except CGXError:
        pass
    else:
        raise AssertionError("all_reduce with a dead peer must raise")
    took = time.monotonic() - t0
    assert work.is_completed() and isinstance(work.exception(), CGXError)
    # The group stays failed: later calls raise too (at once), they never hang.
    t1 = time.monotonic()
    try:
        dist.broadcast(torch.ones(10), src=0)
    except CGXError:
        pass
    else:
        raise AssertionError("a collective after a lost peer must raise")
    assert time.monotonic() - t1 < timeout_s + 3.0
    return took


@pytest.mark.timeout(120)
def test_dead_peer_errors_within_timeout() -> None:
    timeout_s = 6.0
    took = run_torch_ranks(_dead_peer, 2, args=(timeout_s,), timeout=100, expect_dead=[1])[0]
    assert took < timeout_s + 3.0, took


def _abandoned_receive(rank: int, world: int, store: Any) -> list[str]:
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CGXTimeoutError

    _init(rank, world, store, timeout_s=30)
    seen: list[str] = []
    if rank == 1:
        t = torch.zeros(4)
        work = dist.irecv(t, 0, tag=2)
        with pytest.raises(CGXTimeoutError):
            work.wait(datetime.timedelta(seconds=0.5))
    dist.barrier()
    if rank == 0:
        dist.send(torch.full((4,), 1.0), 1, tag=2)
        dist.send(torch.full((4,), 5.0), 1, tag=3)  # another tag: its stream is intact
    else:
        late = torch.zeros(4)
        try:
            dist.recv(late, 0, tag=2)
            seen.append(f"took {late.tolist()}")
        except CGXTimeoutError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
        other = torch.zeros(4)
        dist.recv(other, 0, tag=3)
        seen.append(f"tag 3 {other.tolist()}")
    dist.barrier()
    t = torch.ones(2)
    dist.all_reduce(t)  # the group goes on
    assert t.tolist() == [2.0, 2.0]
    return seen


@pytest.mark.timeout(120)
def test_a_receive_whose_wait_timed_out_fails_its_stream_loudly() -> None:
    """An irecv whose wait(timeout) raised is cancelled, so it never takes a later message
    into the abandoned tensor; its (src, tag) stream fails with a CGXTimeoutError naming
    the abandoned receive, and other tags go on."""
    seen = run_torch_ranks(_abandoned_receive, 2, timeout=110)
    assert seen[0] == []
    assert seen[1][0].startswith("CGXTimeoutError") and "abandoned" in seen[1][0], seen
    assert seen[1][1] == "tag 3 [5.0, 5.0, 5.0, 5.0]", seen


def _reduce_roots(rank: int, world: int, store: Any) -> list[str]:
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import CollectiveMismatchError

    _init(rank, world, store, timeout_s=30)
    seen = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        t = torch.full((8,), rank + 1)
        try:
            dist.reduce(t, dst=rank, op=op)  # every rank names itself the root
            seen.append("no error")
        except CollectiveMismatchError as exc:
            seen.append(f"mismatch root={rank}" if f"root={rank}" in str(exc) else str(exc))
        t = torch.full((4,), float(rank + 1))
        dist.reduce(t, dst=0)  # agreeing ranks: the root has the sum, the others theirs
        assert t.tolist() == [float(sum(range(1, world + 1))) if rank == 0 else rank + 1.0] * 4
    return seen


@pytest.mark.timeout(120)
def test_reduce_roots_are_signed() -> None:
    """The root is part of a reduce's signature, on the summing and the exact (MAX) path:
    ranks that pass different dst values get a mismatch naming the root, never a sum kept
    or dropped by each rank's own idea of the root."""
    seen = run_torch_ranks(_reduce_roots, 2, timeout=110)
    assert seen == [["mismatch root=0"] * 2, ["mismatch root=1"] * 2], seen


_NO_DESTROY = """
import torch, torch.distributed as dist
import cgx_ucx
dist.init_process_group("cgx")
t = torch.ones(4)
dist.all_reduce(t)
assert t.tolist() == [2.0] * 4
"""


@pytest.mark.timeout(120)
def test_an_exit_without_destroy_says_bye_and_warns_nobody(tmp_path) -> None:
    """Process groups still open at interpreter exit are closed then: a job ending without
    destroy_process_group() says BYE to its peers, and no rank logs a WARNING that its
    peer is gone."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "no_destroy.py"
    script.write_text(_NO_DESTROY)
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=100)
        assert p.returncode == 0, err
        assert "is gone" not in err and "communicator failed" not in err, err
