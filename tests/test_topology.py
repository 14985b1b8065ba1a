"""Topology (which ranks share a node), torch_cgx's hierarchy knobs, transports per level."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from harness import run_ranks

from cgx_ucx.errors import ConfigError, TransportError
from cgx_ucx.transport import levels
from cgx_ucx.transport.topology import (
    HierarchyConfig,
    NodeHints,
    Topology,
    host_identity,
    resolve_hierarchy,
)

# ------------------------------------------------------------------------ layouts


def test_two_by_two_is_hierarchical_with_one_group_per_local_index() -> None:
    t = Topology.from_node_sizes([2, 2])
    assert t.world_size == 4 and t.num_nodes == 2 and t.node_sizes == (2, 2)
    assert t.node_of == (0, 0, 1, 1) and t.local_rank == (0, 1, 0, 1)
    assert t.nodes == ((0, 1), (2, 3))
    assert t.is_hierarchical and t.shards == 2
    assert t.cross_groups == ((0, 2), (1, 3))
    assert t.cross_group(3) == (1, 3) and t.leaders == (0, 2)
    assert t.local_peers(2) == (2, 3) and t.local_size(1) == 2
    assert t.same_node(0, 1) and not t.same_node(1, 2)
    assert t.describe() == "2 nodes [2, 2] (given)"


@pytest.mark.parametrize(
    ("sizes", "hierarchical", "shards", "plan_auto", "plan_leader"),
    [
        ([4], False, 4, "flat", "flat"),  # one node: as today
        ([1, 1, 1, 1], False, 1, "flat", "flat"),  # nodes of one rank: nothing to gain
        ([3, 1], False, 1, "flat", "leader"),  # a single-rank node caps the shards at 1
        ([1, 3], False, 1, "flat", "leader"),
        ([3, 2], True, 2, "sharded", "leader"),  # the third rank owns no shard
        ([2, 2, 2], True, 2, "sharded", "leader"),
    ],
)
def test_uneven_and_degenerate_layouts(
    sizes: list[int], hierarchical: bool, shards: int, plan_auto: str, plan_leader: str
) -> None:
    t = Topology.from_node_sizes(sizes)
    assert t.is_hierarchical is hierarchical and t.shards == shards
    assert HierarchyConfig().plan(t) == plan_auto
    assert HierarchyConfig(scheme="sharded").plan(t) == plan_auto
    assert HierarchyConfig(scheme="leader").plan(t) == plan_leader
    assert HierarchyConfig(scheme="flat").plan(t) == "flat"
    # Every rank is in exactly one node; groups take local index j of every node.
    assert sorted(r for node in t.nodes for r in node) == list(range(sum(sizes)))
    for j, group in enumerate(t.cross_groups):
        assert [t.local_rank[r] for r in group] == [j] * t.num_nodes
        assert [t.node_of[r] for r in group] == list(range(t.num_nodes))


def test_three_plus_two_leaves_the_extra_rank_out_of_the_cross_level() -> None:
    t = Topology.from_node_sizes([3, 2])
    assert t.cross_groups == ((0, 3), (1, 4))
    assert t.cross_group(2) is None


def test_labels_in_any_rank_order_number_nodes_by_lowest_rank() -> None:
    t = Topology.from_labels(["b", "a", "b", "a", "c"])
    assert t.node_of == (0, 1, 0, 1, 2) and t.local_rank == (0, 0, 1, 1, 0)
    assert t.nodes == ((0, 2), (1, 3), (4,))
    assert Topology.single_node(3).nodes == ((0, 1, 2),)


@pytest.mark.parametrize(
    ("node_of", "local", "match"),
    [
        ((1, 0), (0, 0), "numbered by their lowest rank"),
        ((0, 0), (0, 0), "must be 0..1"),
        ((0, 1), (0,), "one node and one local rank per rank"),
        ((), (), "one node and one local rank per rank"),
    ],
)
def test_malformed_topologies_are_refused(node_of: tuple, local: tuple, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Topology(node_of, local)
    with pytest.raises(ConfigError):
        Topology.from_node_sizes([2, 0])


# ------------------------------------------------------------------------ hints


def _launcher(group: int, local: int, size: int, host: str = "h") -> NodeHints:
    return NodeHints(host=host, group_rank=group, local_rank=local, local_world_size=size)


def test_launcher_variables_win_over_the_host_identity() -> None:
    # One host identity for all (the emulation's kernel), two nodes by the launcher.
    hints = [_launcher(0, 0, 2), _launcher(0, 1, 2), _launcher(1, 0, 2), _launcher(1, 1, 2)]
    t = Topology.from_hints(hints)
    assert t.source == "launcher" and t.node_sizes == (2, 2) and t.cross_groups == ((0, 2), (1, 3))
    # The launcher's LOCAL_RANK is the local index even when not in rank order.
    swapped = [_launcher(0, 1, 2), _launcher(0, 0, 2), _launcher(1, 0, 1)]
    t = Topology.from_hints(swapped)
    assert t.local_rank == (1, 0, 0) and t.nodes == ((1, 0), (2,))


def test_inconsistent_launcher_variables_are_an_error() -> None:
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):  # 3 members, a 2-rank node
        Topology.from_hints([_launcher(0, 0, 2), _launcher(0, 1, 2), _launcher(0, 1, 2)])
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):  # one node, two sizes
        Topology.from_hints([_launcher(0, 0, 2), _launcher(0, 1, 3)])
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        Topology.from_hints([_launcher(0, 0, 2), _launcher(0, 0, 2)])
    with pytest.raises(ConfigError, match="LOCAL_RANK"):  # some ranks of a node: distinct
        Topology.from_hints([_launcher(0, 1, 4), _launcher(0, 1, 4)])
    with pytest.raises(ConfigError, match="LOCAL_RANK"):  # ... and below LOCAL_WORLD_SIZE
        Topology.from_hints([_launcher(0, 0, 4), _launcher(0, 4, 4)])


def test_a_subgroup_holding_some_ranks_of_each_node() -> None:
    """``dist.new_group(ranks=...)`` under torchrun: the launcher's variables describe the
    job, the group holds some ranks of a node: a valid topology, not a ConfigError."""
    # Job of 2 nodes x 4; the group is local ranks 1 and 3 of each node.
    t = Topology.from_hints(
        [_launcher(0, 1, 4), _launcher(0, 3, 4), _launcher(1, 1, 4), _launcher(1, 3, 4)]
    )
    assert t.source == "launcher" and t.node_sizes == (2, 2) and t.local_rank == (0, 1, 0, 1)
    assert t.is_hierarchical and t.cross_groups == ((0, 2), (1, 3))
    # Local index 0 of each node (a cross-node group): one rank per node, flat.
    t = Topology.from_hints([_launcher(0, 0, 2), _launcher(1, 0, 2)])
    assert t.node_of == (0, 1) and not t.is_hierarchical
    # Two of a 3-rank node, listed out of LOCAL_RANK order.
    t = Topology.from_hints([_launcher(0, 2, 3), _launcher(0, 0, 3)])
    assert t.node_sizes == (2,) and t.local_rank == (1, 0)


def test_host_identity_when_not_every_rank_has_the_launcher_variables() -> None:
    hints = [_launcher(0, 0, 1, host="x"), NodeHints(host="x"), NodeHints(host="y")]
    t = Topology.from_hints(hints)
    assert t.source == "host" and t.node_of == (0, 0, 1) and t.local_rank == (0, 1, 0)


def test_explicit_override_wins_and_must_be_everywhere() -> None:
    hints = [
        NodeHints(host="h", override="a", group_rank=0),
        NodeHints(host="h", override="b", group_rank=0),
    ]
    t = Topology.from_hints(hints)
    assert t.source == "override" and t.node_of == (0, 1)
    with pytest.raises(ConfigError, match=r"not on ranks \[1\]"):
        Topology.from_hints([NodeHints(host="h", override="a"), NodeHints(host="h")])


def test_hints_from_env_config_beats_the_variable() -> None:
    env = {"GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    h = NodeHints.from_env(env, host="me")
    assert (h.group_rank, h.local_rank, h.local_world_size, h.override) == (1, 0, 2, None)
    assert NodeHints.from_env({**env, "CGX_UCX_NODE_ID": "rack7"}, host="me").override == "rack7"
    assert NodeHints.from_env({"CGX_UCX_NODE_ID": "x"}, node_id="y", host="me").override == "y"
    assert NodeHints.from_env({}).host == host_identity()
    with pytest.raises(ConfigError, match="GROUP_RANK"):
        NodeHints.from_env({"GROUP_RANK": "one"})
    with pytest.raises(ConfigError, match="node id"):
        NodeHints.from_env({}, node_id="")


def test_hints_round_trip_and_malformed_bytes_are_refused() -> None:
    h = NodeHints(host="host|boot|net:1|ipc:2", override="n1", group_rank=3, local_rank=1)
    assert NodeHints.unpack(h.pack()) == h
    for raw in (
        b"\xff",
        b"[]",
        b'{"host": "h"}',
        b'{"host":"h","override":null,"group_rank":-1,"local_rank":null,"local_world_size":null}',
        b'{"host":"h","override":null,"group_rank":true,"local_rank":null,"local_world_size":null}',
        b'{"host":"h","override":"","group_rank":null,"local_rank":null,"local_world_size":null}',
        b"x" * 5000,
    ):
        with pytest.raises(ConfigError):
            NodeHints.unpack(raw)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_host_identity_tells_network_namespaces_of_one_kernel_apart() -> None:
    code = "from cgx_ucx.transport.topology import host_identity; print(host_identity())"
    other = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    mine = host_identity()
    # Same host name and kernel boot, another network namespace: another node.
    assert other != mine and other.split("|")[:2] == mine.split("|")[:2]


# ------------------------------------------------------------------------ torch_cgx knobs


def test_hierarchy_defaults_and_torch_cgx_variables() -> None:
    assert resolve_hierarchy(env={}) == HierarchyConfig()
    env = {
        "CGX_INTRA_BROADCAST": "1",
        "CGX_INNER_COMMUNICATOR_TYPE": "MPI",
        "CGX_INNER_REDUCTION_TYPE": "Ring",
        "CGX_CROSS_REDUCTION_TYPE": "SRA",
        "CGX_INTRA_COMPRESS": "1",
    }
    h = resolve_hierarchy(env=env)
    assert h == HierarchyConfig("leader", "network", "ring", "sra", True)
    assert resolve_hierarchy(env={"CGX_INTRA_BROADCAST": "0"}).scheme == "sharded"
    assert resolve_hierarchy(env={"CGX_INNER_COMMUNICATOR_TYPE": "SHM"}).intra_transport == "local"
    assert resolve_hierarchy(env={"CGX_INNER_COMMUNICATOR_TYPE": "NCCL"}).intra_transport == "local"
    # Explicit configuration wins over the variables; None means "not given".
    h = resolve_hierarchy(env=env, scheme="flat", intra_compress=False, cross_reduction=None)
    assert (h.scheme, h.intra_compress, h.cross_reduction) == ("flat", False, "sra")
    base = HierarchyConfig(scheme="leader")
    assert resolve_hierarchy(base, env={}).scheme == "leader"


@pytest.mark.parametrize(
    "env",
    [
        {"CGX_INNER_COMMUNICATOR_TYPE": "GLOO"},
        {"CGX_CROSS_REDUCTION_TYPE": "tree"},
        {"CGX_INTRA_BROADCAST": "yes"},
    ],
)
def test_unknown_torch_cgx_values_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=next(iter(env))):
        resolve_hierarchy(env=env)


def test_hierarchy_validation() -> None:
    with pytest.raises(ConfigError, match="scheme"):
        HierarchyConfig(scheme="tree")
    with pytest.raises(ConfigError, match="intra_compress"):
        HierarchyConfig(intra_compress=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown"):
        resolve_hierarchy(env={}, nodes=2)


# ------------------------------------------------------------------------ levels


def test_endpoint_plan_dials_full_addresses_inside_a_node_only() -> None:
    t = Topology.from_node_sizes([2, 2])
    assert levels.endpoint_plan(t, 1) == {
        0: ("node-local", "full"),
        2: ("cross-node", "net"),
        3: ("cross-node", "net"),
    }
    mpi = HierarchyConfig(intra_transport="network")
    assert levels.address_kind(t, 0, 1, mpi) == "net"
    assert levels.address_kind(Topology.single_node(2), 0, 1) == "full"
    with pytest.raises(TransportError):
        levels.address_kind(t, 2, 2)


async def _connect_both_ways(ctx: Any) -> dict[str, str]:
    """Dial the peer's full and network-only address; name each endpoint's transports."""
    import asyncio

    import ucxx

    ucxx.init(progress_mode="thread")
    try:
        addrs = levels.worker_addresses(levels.ucp_worker_handle(ucxx))
        assert len(addrs["net"]) < len(addrs["full"])
        for kind, raw in addrs.items():
            ctx.store.set(f"{kind}{ctx.rank}", raw)
        peer = 1 - ctx.rank
        out = {}
        for i, kind in enumerate(("full", "net")):
            address = ucxx.get_ucx_address_from_buffer(ctx.store.get(f"{kind}{peer}"))
            ep = await ucxx.create_endpoint_from_worker_address(address)
            buf = np.full(1 << 16, ctx.rank, np.uint8)
            got = np.empty_like(buf)
            await asyncio.gather(
                ep.send(buf, tag=10 + i, force_tag=True), ucxx.recv(got, tag=10 + i)
            )
            assert (got == peer).all()
            out[kind] = levels.format_transports(levels.endpoint_transports(ep.ucp_endpoint))
            ctx.store.set(f"done{kind}{ctx.rank}", b"1")
            ctx.store.get(f"done{kind}{peer}")
            await ep.close()
        return out
    finally:
        ucxx.reset()


@pytest.mark.timeout(120)
def test_network_only_address_keeps_an_endpoint_off_shared_memory() -> None:
    if "UCX_TLS" in os.environ:
        pytest.skip("UCX_TLS is set: this test needs UCX free to use every transport")
    # The engine's default (cgx_ucx.transport.ucx): shared memory despite error handling.
    env = {"UCX_MM_ERROR_HANDLING": "y"}
    results = run_ranks(_connect_both_ways, world_size=2, timeout=90, env=env)
    for got in results:
        net = got["net"].split("+")
        assert net and all(lane.startswith(("tcp/", "rc", "ud", "dc")) for lane in net), got
        # One host: the full address reaches the peer by something other than the network.
        assert not got["full"].startswith("tcp/"), got
