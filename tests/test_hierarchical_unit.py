"""The two-level allreduce (cgx_ucx.collectives.hierarchical) in ONE process, over the
in-memory transport of test_collectives_unit, on fake topologies: 2 x 2, 2 x 3, 3 + 2
(uneven, folding), 3 + 1 (falls back), 3 x 2 and the leader scheme.

Checked: results against a float64 reference (uncompressed: exact on integer-valued data,
float32 rounding otherwise; compressed: within the quantization bound), replicas
bit-identical on every rank of every node, and the messages: across nodes only between
ranks of one cross-node group (the sharded scheme), or only between leaders.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import numpy as np
import pytest
from test_collectives_unit import (
    CFG,
    FakeNetwork,
    assert_replicas_identical,
    int_data,
    ok,
    quantization_bound,
    small_pieces,  # noqa: F401 (autouse fixture: several pieces per chunk)
    smooth_data,
)

from cgx_ucx.collectives import Communicator, hierarchical_plan
from cgx_ucx.collectives.hierarchical import (
    ONE_NODE_MIN_WORLD,
    Hierarchical,
    hierarchical_scheme,
    shard_layout,
)
from cgx_ucx.collectives.plan import make_plan
from cgx_ucx.errors import CollectiveMismatchError
from cgx_ucx.layout import LayerSpec, Layout
from cgx_ucx.transport import shm
from cgx_ucx.transport.topology import HierarchyConfig, Topology

pytestmark = pytest.mark.timeout(120)

LAYOUTS = {"2x2": [2, 2], "2x3": [3, 3], "3+2": [3, 2], "3x2": [2, 2, 2], "3+1": [3, 1]}


def run_nodes(
    sizes: list[int],
    body: Any,
    hierarchy: HierarchyConfig | None = None,
    hierarchies: list[HierarchyConfig] | None = None,
    payloads: Counter | None = None,
) -> tuple[list, Counter]:
    """``body(comm)`` on every rank of a fake job laid out as ``sizes``; per rank its result
    or exception, and the (src, dst) pairs of every frame sent (``payloads``, if given,
    counts the frames with a payload by (src, dst, payload bytes))."""
    topo = Topology.from_node_sizes(sizes)
    world = topo.world_size
    pairs: Counter = Counter()

    async def main() -> list:
        net = FakeNetwork(world)
        for t in net.nodes:
            t.topology = topo
            t.hierarchy = hierarchies[t.rank] if hierarchies else (hierarchy or HierarchyConfig())
            send = t.send_frame

            async def counted(rank, frame, payload=None, extra=(), _send=send, _src=t.rank):
                pairs[(_src, rank)] += 1
                if payloads is not None and payload is not None:
                    payloads[(_src, rank, int(payload.nbytes))] += 1
                await _send(rank, frame, payload, extra)

            t.send_frame = counted
        comms = [Communicator(t, CFG) for t in net.nodes]
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(body(c) for c in comms), return_exceptions=True), 60
            )
        finally:
            for c in comms:
                await c.close()

    return asyncio.run(main()), pairs


def cross_pairs(sizes: list[int], pairs: Counter) -> set[tuple[int, int]]:
    topo = Topology.from_node_sizes(sizes)
    return {(a, b) for a, b in pairs if not topo.same_node(a, b)}


def expected_cross(sizes: list[int], groups: Any) -> set[tuple[int, int]]:
    return {(a, b) for g in groups for a in g for b in g if a != b}


# -- the scheme choice ---------------------------------------------------------------------


def test_scheme_choice_follows_the_topology_and_the_config():
    t22, t31 = Topology.from_node_sizes([2, 2]), Topology.from_node_sizes([3, 1])
    one = Topology.single_node(4)
    assert hierarchical_scheme("auto", False, t22, None) == "sharded"
    assert hierarchical_scheme("auto", True, t22, None) is None  # small buffers
    assert hierarchical_scheme("auto", False, t31, None) is None  # 3 + 1: flat
    assert hierarchical_scheme("auto", False, one, None) is None
    assert hierarchical_scheme("sra", False, t22, None) is None
    assert hierarchical_scheme("hierarchical", True, t22, None) == "sharded"
    flat = HierarchyConfig(scheme="flat")
    assert hierarchical_scheme("auto", False, t22, flat) is None
    assert hierarchical_scheme("hierarchical", False, t22, flat) == "sharded"
    leader = HierarchyConfig(scheme="leader")
    assert hierarchical_scheme("auto", False, t31, leader) == "leader"
    assert hierarchical_scheme("hierarchical", False, one, leader) is None


def test_one_node_runs_uncompressed_host_buffers_through_shared_segments():
    one, two = Topology.single_node(ONE_NODE_MIN_WORLD), Topology.single_node(2)
    if not shm.available():
        pytest.skip("no node-local shared memory here")
    assert hierarchical_scheme("auto", False, one, None, raw_host=True) == "sharded"
    assert hierarchical_scheme("auto", False, one, None) is None  # GPU, or not float32
    assert hierarchical_scheme("auto", False, one, None, compressed_host=True) == "sharded"
    assert hierarchical_scheme("auto", False, two, None, compressed_host=True) == "sharded"
    assert hierarchical_scheme("auto", True, two, None, compressed_host=True) is None
    assert hierarchical_scheme("auto", True, one, None, raw_host=True) is None  # one round
    assert hierarchical_scheme("auto", False, two, None, raw_host=True) is None
    assert hierarchical_scheme("ring", False, one, None, raw_host=True) is None
    for off in (HierarchyConfig(scheme="flat"), HierarchyConfig(intra_shm=False)):
        assert hierarchical_scheme("auto", False, one, off, raw_host=True) is None


def test_shard_layouts_keep_the_bucket_grid():
    layout = Layout(
        (LayerSpec(0, 1500, 4, 128), LayerSpec(1500, 77), LayerSpec(1577, 1001, 2, 100))
    )
    plan = make_plan(layout, 3, 100, 1 << 15)
    for chunk in plan.chunks:
        sub = shard_layout(layout, chunk)
        assert sub.numel == chunk.numel
        for spec in sub.layers:
            start = spec.offset + chunk.start
            whole = next(s for s in layout.layers if s.offset <= start < s.end)
            if whole.compressed:
                assert (start - whole.offset) % whole.bucket_size == 0


# -- results --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["2x2", "2x3", "3+2", "3x2"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16])
def test_uncompressed_is_exact_and_bit_identical(layout, dtype):
    sizes = LAYOUTS[layout]
    world = sum(sizes)
    cases = [0, 1, 7, 5000]

    async def body(comm):
        out = []
        for n in cases:
            x = int_data(comm.rank, n, dtype, -30, 30)
            assert await comm.allreduce(x, algorithm="hierarchical") is x
            out.append(x)
        return out

    results, pairs = run_nodes(sizes, body)
    results = ok(results)
    for i, n in enumerate(cases):
        expect = sum(int_data(r, n, dtype, -30, 30).astype(np.float64) for r in range(world))
        np.testing.assert_array_equal(results[0][i].astype(np.float64), expect)
        assert_replicas_identical([r[i] for r in results])
    groups = Topology.from_node_sizes(sizes).cross_groups
    assert cross_pairs(sizes, pairs) == expected_cross(sizes, groups)


@pytest.mark.parametrize("layout", ["2x2", "2x3", "3+2"])
def test_float32_within_rounding_of_an_n_term_sum(layout):
    sizes = LAYOUTS[layout]
    world = sum(sizes)

    async def body(comm):
        x = smooth_data(comm.rank, 6001)
        await comm.allreduce(x, "avg", algorithm="hierarchical")
        return x

    results = ok(run_nodes(sizes, body)[0])
    xs = [smooth_data(r, 6001).astype(np.float64) for r in range(world)]
    exact = sum(xs) / world
    # N - 1 float32 additions and a division, each within half an ulp of its result.
    tol = world * np.finfo(np.float32).eps * (sum(np.abs(x) for x in xs) / world) + 1e-30
    assert np.all(np.abs(results[0].astype(np.float64) - exact) <= tol)
    assert_replicas_identical(results)


@pytest.mark.parametrize("cross", ["sra", "ring"])
@pytest.mark.parametrize("scheme", ["sharded", "leader"])
def test_average_taken_once_across_nodes(cross, scheme):
    """op="avg": the cross-node stage divides by the whole world's size where it reduces,
    and nothing divides again: uncompressed within the rounding of an n-term sum and
    compressed within its quantization bound, of the average, on both cross-node
    algorithms and both schemes, with the replicas bit-identical."""
    sizes = LAYOUTS["3x2"]
    world = sum(sizes)
    n = 6001

    async def body(comm):
        out = []
        for bits in (32, 4):
            x = smooth_data(comm.rank, n)
            await comm.allreduce(x, "avg", bits=bits, bucket_size=128, algorithm="hierarchical")
            out.append(x)
        return out

    hierarchy = HierarchyConfig(cross_reduction=cross, scheme=scheme)
    results = ok(run_nodes(sizes, body, hierarchy)[0])
    xs = [smooth_data(r, n) for r in range(world)]
    exact = sum(x.astype(np.float64) for x in xs) / world
    tol = world * np.finfo(np.float32).eps * (sum(np.abs(x.astype(np.float64)) for x in xs) / world)
    assert np.all(np.abs(results[0][0] - exact) <= tol + 1e-30)
    bound = quantization_bound(xs, Layout.uniform(n, 4, 128), world) / world
    err = np.abs(results[0][1].astype(np.float64) - exact)
    assert np.all(err <= bound), f"excess {np.max(err - bound, initial=0)}"
    assert np.max(err) > 0  # quantized, so not the exact average
    for i in range(2):
        assert_replicas_identical([r[i] for r in results])


COMPRESSED = [(0, 4, 64), (1, 4, 64), (3001, 4, 128), (777, 2, 100), (9000, 4, 1024)]
MIXED = Layout((LayerSpec(0, 1500, 4, 128), LayerSpec(1500, 77), LayerSpec(1577, 1001, 2, 100)))


@pytest.mark.parametrize("layout", ["2x2", "2x3", "3+2", "3x2"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("intra_compress", [False, True])
def test_compressed_within_bound_and_bit_identical(layout, op, intra_compress):
    sizes = LAYOUTS[layout]
    world = sum(sizes)
    hierarchy = HierarchyConfig(intra_compress=intra_compress)

    async def body(comm):
        out = []
        for n, bits, bucket in COMPRESSED:
            x = smooth_data(comm.rank, n)
            await comm.allreduce(x, op, bits=bits, bucket_size=bucket, algorithm="hierarchical")
            out.append(x)
        x = smooth_data(comm.rank, MIXED.numel)
        await comm.allreduce(x, op, layout=MIXED, algorithm="hierarchical")
        out.append(x)
        return out

    results = ok(run_nodes(sizes, body, hierarchy)[0])
    cases = [Layout.uniform(n, bits, bucket) for n, bits, bucket in COMPRESSED] + [MIXED]
    for i, lay in enumerate(cases):
        xs = [smooth_data(r, lay.numel) for r in range(world)]
        exact = sum(x.astype(np.float64) for x in xs)
        # Two stages across nodes (the inputs of the other nodes, then the sum), one more
        # with intra-node compression: within the bound of `world` >= 3 quantizations.
        bound = quantization_bound(xs, lay, world)
        if op == "avg":
            exact, bound = exact / world, bound / world
        err = np.abs(results[0][i].astype(np.float64) - exact)
        assert np.all(err <= bound), f"{lay}: excess {np.max(err - bound, initial=0)}"
        assert_replicas_identical([r[i] for r in results])


def test_auto_picks_two_levels_for_large_buffers_and_flat_on_3_plus_1():
    async def body(comm):
        x = smooth_data(comm.rank, 64 << 10)  # 256 KiB: past the one-round crossover
        await comm.allreduce(x, bits=4)
        return x

    results, pairs = run_nodes([2, 2], body)
    assert_replicas_identical(ok(results))
    assert cross_pairs([2, 2], pairs) == {(0, 2), (2, 0), (1, 3), (3, 1)}
    results, pairs = run_nodes([3, 1], body)
    assert_replicas_identical(ok(results))
    assert cross_pairs([3, 1], pairs) == {(a, 3) for a in range(3)} | {(3, a) for a in range(3)}


@pytest.mark.parametrize("layout", ["2x2", "3+1", "3x2"])
def test_leader_scheme_crosses_nodes_between_leaders_only(layout):
    sizes = LAYOUTS[layout]
    world = sum(sizes)

    async def body(comm):
        x = smooth_data(comm.rank, 5000)
        await comm.allreduce(x, bits=4, bucket_size=128, algorithm="hierarchical")
        return x

    results, pairs = run_nodes(sizes, body, HierarchyConfig(scheme="leader"))
    results = ok(results)
    assert_replicas_identical(results)
    xs = [smooth_data(r, 5000) for r in range(world)]
    bound = quantization_bound(xs, Layout.uniform(5000, 4, 128), world)
    assert np.all(np.abs(results[0] - sum(x.astype(np.float64) for x in xs)) <= bound)
    leaders = Topology.from_node_sizes(sizes).leaders
    assert cross_pairs(sizes, pairs) == expected_cross(sizes, [leaders])


@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("layout", ["2x2", "3+2"])
def test_shared_memory_path_gives_the_same_bytes_and_keeps_them_off_the_transport(
    monkeypatch, layout, bits
):
    """Node-local host bytes go through shared segments (only descriptors travel), and the
    result is bit for bit the one of the UCX path cut into the same pieces, on every rank,
    over several calls (the segments are reused)."""
    monkeypatch.setattr(hierarchical_plan, "SHARED_PIECE_FACTOR", 1)
    sizes = LAYOUTS[layout]
    n = 40_000

    async def body(comm):
        out = []
        for i in range(3):
            x = smooth_data(comm.rank + 10 * i, n)
            await comm.allreduce(x, bits=bits, bucket_size=128, algorithm="hierarchical")
            out.append(x)
        return out

    topo = Topology.from_node_sizes(sizes)
    runs = {}
    for shared in (True, False):
        payloads: Counter = Counter()
        results, _ = run_nodes(sizes, body, HierarchyConfig(intra_shm=shared), payloads=payloads)
        runs[shared] = ok(results)
        local = Counter()
        for (a, d, nbytes), frames in payloads.items():
            if topo.same_node(a, d):
                local[nbytes] += frames
        if shared:  # descriptors only
            assert set(local) == {shm.DESCRIPTOR_NBYTES}, local
        else:  # the values: at least one shard per node peer and call
            assert sum(b * f for b, f in local.items()) >= 3 * n * 4 // max(sizes), local
    for i in range(3):
        assert_replicas_identical([r[i] for r in runs[True]])
        for rank in range(sum(sizes)):
            np.testing.assert_array_equal(runs[True][rank][i], runs[False][rank][i])


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("layout", ["2x2", "3+2", "3x2"])
def test_owners_forward_the_cross_node_wire_bytes_and_peers_decode_the_same_values(
    monkeypatch, layout, op
):
    """Compressed float32 shards reach node peers as the cross-node stage's wire bytes,
    which they decode (averaged already, for avg): bit for bit the values of the path
    that sends the owner's values (cut into the same pieces), on every rank, with an
    uncompressed layer in the layout."""
    monkeypatch.setattr(hierarchical_plan, "SHARED_PIECE_FACTOR", 1)
    sizes = LAYOUTS[layout]
    forwarded: Counter = Counter()
    real = Hierarchical.gather_forwarded

    async def counting(self, j):
        forwarded[self.rank] += 1
        await real(self, j)

    monkeypatch.setattr(Hierarchical, "gather_forwarded", counting)
    fused: Counter = Counter()  # groups whose last node peer's pieces SRA added
    real_reduce = Hierarchical.reduce

    async def reduce(self, chunk, acc, ks, fuse=False):
        addend = await real_reduce(self, chunk, acc, ks, fuse)
        fused[self.rank] += addend is not None
        return addend

    monkeypatch.setattr(Hierarchical, "reduce", reduce)

    async def body(comm):
        out = []
        for i, lay in enumerate((Layout.uniform(40_000, 4, 128), MIXED)):
            x = smooth_data(comm.rank + 10 * i, lay.numel)
            await comm.allreduce(x, op, layout=lay, algorithm="hierarchical")
            out.append(x)
        return out

    runs = {}
    for shared in (True, False):
        forwarded.clear()
        fused.clear()
        results, _ = run_nodes(sizes, body, HierarchyConfig(intra_shm=shared))
        runs[shared] = ok(results)
        # Shared segments: every owner's groups take the peer's pieces into the encode.
        assert (sum(fused.values()) > 0) == shared, fused
        topo = Topology.from_node_sizes(sizes)
        shards = min(sizes)
        # Every rank hears from every owner of its node but itself, in both calls.
        local = {r: topo.local_peers(r).index(r) for r in range(sum(sizes))}
        due = {r: 2 * (shards - (local[r] < shards)) for r in range(sum(sizes))}
        assert dict(forwarded) == ({r: n for r, n in due.items() if n} if shared else {})
    for i in range(2):
        assert_replicas_identical([r[i] for r in runs[True]])
        for rank in range(sum(sizes)):
            np.testing.assert_array_equal(runs[True][rank][i], runs[False][rank][i])


def test_ranks_that_disagree_on_shared_memory_fail_with_a_mismatch():
    async def body(comm):
        x = smooth_data(comm.rank, 5000)
        await comm.allreduce(x, algorithm="hierarchical")

    configs = [HierarchyConfig(intra_shm=r != 1) for r in range(4)]
    results, _ = run_nodes([2, 2], body, hierarchies=configs)
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results


def test_ranks_that_disagree_on_the_scheme_fail_with_a_mismatch():
    async def body(comm):
        x = smooth_data(comm.rank, 5000)
        await comm.allreduce(x, bits=4, algorithm="hierarchical")

    configs = [HierarchyConfig(intra_compress=r == 1) for r in range(4)]
    results, _ = run_nodes([2, 2], body, hierarchies=configs)
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results


def test_flat_and_hierarchical_ranks_fail_with_a_mismatch():
    async def body(comm):
        x = smooth_data(comm.rank, 5000)
        await comm.allreduce(x, bits=4, algorithm="hierarchical" if comm.rank else "sra")

    results, _ = run_nodes([2, 2], body)
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results


def test_cross_stage_groups_use_disjoint_slots_and_cover_the_shard():
    """Compressed shards cross nodes in up to CROSS_GROUPS groups of consecutive pieces,
    each on its own slot range; uncompressed ones in one group."""
    from cgx_ucx.collectives import allreduce as A
    from cgx_ucx.collectives.hierarchical import CROSS_GROUPS

    topo = Topology.from_node_sizes([2, 2])
    for bits, expect in [(4, CROSS_GROUPS), (32, 1)]:
        x = np.zeros(16 << 20, np.float32)
        _, (_, spec) = A.prepare_allreduce(
            x, world_size=4, bits=bits, algorithm="hierarchical", topology=topo
        )
        for chunk, groups in zip(spec.plan.chunks, spec.groups, strict=True):
            assert len(groups) == expect
            covered = [k for ks, _, _ in groups for k in ks]
            assert covered == list(range(len(chunk.pieces)))
            slots = [set(range(b, b + s.plan.max_pieces)) for _, s, b in groups]
            assert sum(len(s) for s in slots) == len(set().union(*slots))


def test_one_node_shared_segments_need_the_groups_mailboxes():
    """Only a group whose ranks all mapped each other's shared memory at connect (it has
    mailboxes, whose one-round limit it passes) takes the one-node shared-segment path:
    ranks of one node in separate PID namespaces, say, cannot map each other's segments."""
    from cgx_ucx.collectives.allreduce import prepare_allreduce
    from cgx_ucx.collectives.local import LOCAL_ONESHOT_BYTES
    from cgx_ucx.transport.frames import Algo

    if not shm.available():
        pytest.skip("no node-local shared memory here")
    one = Topology.single_node(ONE_NODE_MIN_WORLD)
    x = np.zeros(1 << 22, np.float32)
    kw = dict(world_size=ONE_NODE_MIN_WORLD, topology=one, hierarchy=HierarchyConfig())
    _, (_, spec) = prepare_allreduce(x, oneshot_limit=LOCAL_ONESHOT_BYTES, **kw)
    assert spec.algorithm == Algo.HIERARCHICAL
    _, (_, spec) = prepare_allreduce(x, **kw)  # no mailboxes
    assert spec.algorithm == Algo.SRA
    _, (_, spec) = prepare_allreduce(x, bits=4, oneshot_limit=LOCAL_ONESHOT_BYTES, **kw)
    assert spec.algorithm == Algo.HIERARCHICAL  # SRA's steps through the segments
    assert spec.intra_compress and spec.intra_shm
    _, (_, spec) = prepare_allreduce(x, bits=4, **kw)  # no mailboxes
    assert spec.algorithm == Algo.SRA
    half = x.astype(np.float16)  # a float32 accumulator of its own, the same steps
    _, (_, spec) = prepare_allreduce(half, bits=4, oneshot_limit=LOCAL_ONESHOT_BYTES, **kw)
    assert spec.algorithm == Algo.HIERARCHICAL and not spec.inplace
