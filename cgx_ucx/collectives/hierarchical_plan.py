"""The two-level allreduce's plan (:mod:`.hierarchical` runs it): which scheme a call
takes, the shards and their cross-node groups, and the spec every rank signs."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ..errors import ConfigError
from ..layout import LayerSpec, Layout
from ..transport import shm
from ..transport.frames import Algo
from ..transport.handshake import MAX_SLOTS
from ..transport.topology import HierarchyConfig, Topology
from .plan import Chunk, make_plan
from .reduction import AllreduceSpec

__all__ = [
    "CROSS_GROUPS",
    "FLAG_INTRA_COMPRESS",
    "FLAG_INTRA_SHM",
    "FLAG_LEADER",
    "ONE_NODE_MIN_WORLD",
    "ONE_NODE_MIN_WORLD_COMPRESSED",
    "SHARED_PIECE_FACTOR",
    "HierarchicalSpec",
    "cross_groups",
    "hierarchical_scheme",
    "hierarchical_spec",
    "shard_layout",
    "sub_chunk",
]

#: Signature flags (bit 0 is stochastic rounding): ranks that disagree on the scheme or
#: on the intra-node compression would expect different messages, so both are signed.
FLAG_LEADER = 2
FLAG_INTRA_COMPRESS = 4
FLAG_INTRA_SHM = 8


@dataclass(frozen=True)
class HierarchicalSpec(AllreduceSpec):
    """An :class:`AllreduceSpec` for two levels. ``plan`` cuts the buffer into the
    ``shards``; ``groups[j]`` is shard ``j``'s cross-node allreduce, as one or more groups
    of its pieces (each group's spec has a plan cutting those pieces among the nodes)."""

    topology: Topology | None = None
    scheme: str = "sharded"  # or "leader" (one shard, owned by local rank 0)
    shards: int = 1
    intra_compress: bool = False
    intra_shm: bool = False
    #: Per shard, the cross-node stage cut into consecutive groups of its pieces, each its
    #: own allreduce on its own slots, started as soon as the node reduced its pieces:
    #: (pieces of the shard, the group's spec, first slot). See :func:`cross_groups`.
    groups: tuple[tuple[tuple[range, AllreduceSpec, int], ...], ...] = ()

    @property
    def flags(self) -> int:
        leader = FLAG_LEADER if self.scheme == "leader" else 0
        shared = FLAG_INTRA_SHM if self.intra_shm else 0
        return leader | shared | (FLAG_INTRA_COMPRESS if self.intra_compress else 0)

    def cross_group(self, local_index: int) -> tuple[int, ...]:
        """The ranks of local index ``local_index`` on every node (node order)."""
        assert self.topology is not None
        return tuple(node[local_index] for node in self.topology.nodes)


#: Ranks of one node from which an uncompressed host allreduce goes through the node's
#: shared segments (module doc). One host, 2 cores, ``python -m cgx_ucx.bench allreduce
#: --bits 32``: 8 ranks, 16 MiB 49.5 ms this way against 165 through UCX (gloo 64),
#: 64 MiB 147 against 609 (gloo 254); 4 ranks, 64 MiB 64.5 against 90 (gloo 108); 2 ranks,
#: 64 MiB 22.6 against 20.6, 256 MiB 94 against 85: two ranks stay flat.
ONE_NODE_MIN_WORLD = 3
#: The same for a compressed allreduce, which runs SRA's steps through the shared
#: segments (:func:`hierarchical_spec`): already from two ranks (one host, 2 cores, 4 bits,
#: ``python -m cgx_ucx.bench allreduce --world 2 --bits 4``: 4 MiB 2.7 ms against 3.4
#: through UCX, 16 MiB 7.6 against 10.0, 64 MiB 30.1 against 38.0).
ONE_NODE_MIN_WORLD_COMPRESSED = 2


def hierarchical_scheme(
    algorithm: str,
    one_round: bool,
    topology: Topology | None,
    hierarchy: HierarchyConfig | None,
    raw_host: bool = False,
    compressed_host: bool = False,
) -> str | None:
    """``"sharded"`` or ``"leader"`` when this allreduce runs on two levels, else None.

    ``algorithm="auto"`` follows ``hierarchy.plan(topology)`` unless the flat choice
    is the one-round path (``one_round``: small buffers, where latency, not bytes,
    dominates);
    ``algorithm="hierarchical"`` asks for two levels even where the configured scheme is
    "flat" ("leader" stays leader), and falls back to flat where they do not apply
    (one node, nodes of one rank, a single-rank node under the sharded scheme).
    ``raw_host``: the buffer is in host memory and uncompressed, and every rank of the
    group mapped every other's node-local shared memory at connect (the group has
    mailboxes): on one node of at least :data:`ONE_NODE_MIN_WORLD` ranks "auto" then runs
    it through shared segments. ``compressed_host``: the same for a host buffer
    of a compressed layout, which then runs SRA's steps through shared segments
    (:func:`hierarchical_spec`).
    """
    if topology is None or topology.world_size == 1:
        return None
    hierarchy = hierarchy if hierarchy is not None else HierarchyConfig()
    if algorithm == "hierarchical":
        if hierarchy.scheme not in ("sharded", "leader"):
            hierarchy = replace(hierarchy, scheme="sharded")
    elif algorithm != "auto" or one_round:
        return None
    plan = hierarchy.plan(topology)
    if plan == "flat" and (raw_host or compressed_host):
        least = ONE_NODE_MIN_WORLD if raw_host else ONE_NODE_MIN_WORLD_COMPRESSED
        if _one_node_shm(topology, hierarchy, least):
            return "sharded"
    return None if plan == "flat" else plan


def _one_node_shm(topology: Topology, hierarchy: HierarchyConfig, least: int) -> bool:
    return (
        topology.num_nodes == 1
        and topology.world_size >= least
        and hierarchy.scheme in ("auto", "sharded")
        and hierarchy.intra_shm
        and hierarchy.intra_transport == "local"
        and shm.available()
    )


@functools.lru_cache(maxsize=64)
def shard_layout(layout: Layout, chunk: Chunk) -> Layout:
    """The layout of values ``[chunk.start, chunk.stop)`` as a buffer of their own.

    Chunks start on bucket boundaries of their layers (:mod:`.plan`), so every bucket of
    the shard is a bucket of the whole layout: quantizing the shard alone gives the same
    buckets and error bound. Layer pieces split across pipeline pieces are joined again.
    """
    specs: list[LayerSpec] = []
    layer_of: list[int] = []
    for piece in chunk.pieces:
        for seg in piece.segments:
            if layer_of and layer_of[-1] == seg.layer:
                last = specs[-1]
                specs[-1] = replace(last, numel=last.numel + seg.numel)
            else:
                specs.append(
                    LayerSpec(seg.start - chunk.start, seg.numel, seg.bits, seg.bucket_size)
                )
                layer_of.append(seg.layer)
    if not specs:
        return Layout((LayerSpec(0, 0, layout.layers[0].bits, layout.layers[0].bucket_size),))
    return Layout(tuple(specs))


#: At most this many cross-node groups per shard (SRA only; ring keeps one).
CROSS_GROUPS = 4

#: Node-local pieces through shared segments are this many times the pieces that travel
#: through UCX: each costs a frame and Python steps, and no transport cuts them. 2 x 2 at
#: 1 and 10 Gbit/s, 16 and 64 MiB, 4 bits, interleaved: 16 MiB pieces 11-15% fewer CPU-ms
#: a rank than 4 MiB ones (64 MiB at 1 Gbit/s 43-47 against 48-51), times equal or
#: shorter; 32 MiB pieces (one group) cost more again. One host, 32 bits, 64 MiB: 4 ranks
#: 47.6/51.8 ms against 62.2/57.1, 8 ranks 115/129 against 139/168.
SHARED_PIECE_FACTOR = 4


def sub_chunk(chunk: Chunk, ks: range) -> Chunk:
    """The pieces ``ks`` of ``chunk`` as a chunk of their own (empty at its start)."""
    if not len(ks):
        return Chunk(chunk.start, chunk.start, ())
    pieces = chunk.pieces[ks.start : ks.stop]
    return Chunk(pieces[0].start, pieces[-1].stop, pieces)


def cross_groups(
    layout: Layout, chunk: Chunk, spec: AllreduceSpec, nodes: int, piece_numel: int, slots: int
) -> tuple[tuple[range, AllreduceSpec, int], ...]:
    """The cross-node stage of one shard as consecutive groups of its pieces.

    Why: the owners reduce their node's pieces, then allreduce the shard across nodes,
    then send it to the node. With one cross-node allreduce per shard, the network waits
    for the whole node-local stage and the node for the whole network stage (on 2 x 2
    ranks at 1 Gbit/s, the 68 ms on the link come on top of 147 ms of CPU). Groups overlap
    them: group g crosses the network while the owner adds the node's pieces of group
    g + 1 (on 2 x 2 ranks, 64 MiB at 4 bits: 177-195 ms against 205-227 with one group,
    same load; ``python -m cgx_ucx.bench nodes --rates 1gbit --sizes 64 --bits 4`` with
    :data:`CROSS_GROUPS` varied). Each group runs SRA on its own slots (``slot_base``), so
    groups of one call never take each other's frames. Ring keeps one group (its slots are
    taken by steps).
    """
    n = len(chunk.pieces)
    whole = ((range(n), spec, 0),)  # ``spec`` already plans the whole shard
    # Uncompressed shards keep one group: the link is their bound, and several
    # rendezvous transfers at once on one endpoint are slower (2 x 2 at 1 Gbit/s, 64 MiB
    # float32: 981-1098 ms with 4 groups against 769-871 with one; the same command at
    # --bits 32).
    count = min(CROSS_GROUPS, n) if spec.algorithm == Algo.SRA and not spec.raw else 1
    if count <= 1:
        return whole
    groups: list[tuple[range, AllreduceSpec, int]] = []
    base = 0
    for g in range(count):
        ks = range(g * n // count, (g + 1) * n // count)
        plan = make_plan(shard_layout(layout, sub_chunk(chunk, ks)), nodes, piece_numel, slots)
        groups.append((ks, replace(spec, plan=plan), base))
        base += plan.max_pieces
    # Too many pieces to give every group its own slots: one group.
    return tuple(groups) if base <= slots else whole


def _accumulator_dtype(dtype: np.dtype, raw: bool) -> np.dtype:
    # The rule of .allreduce: raw integers and 32/64-bit floats in their own dtype.
    if raw and (dtype.kind in "iu" or dtype.itemsize >= 4):
        return dtype
    return np.dtype(np.float32)


def hierarchical_spec(
    base: AllreduceSpec,
    layout: Layout,
    topology: Topology,
    hierarchy: HierarchyConfig | None,
    scheme: str,
    piece_numel: int,
    cross_algorithm: Algo,
    host: bool = True,
) -> HierarchicalSpec:
    """The two-level spec of the allreduce ``base`` describes (``scheme`` from
    :func:`hierarchical_scheme`; ``cross_algorithm`` SRA or ring for the node count;
    ``host``: the buffer is in host memory, which node peers can share)."""
    hierarchy = hierarchy if hierarchy is not None else HierarchyConfig()
    if hierarchy.cross_reduction != "auto":
        cross_algorithm = Algo.SRA if hierarchy.cross_reduction == "sra" else Algo.RING
    if cross_algorithm not in (Algo.SRA, Algo.RING):
        raise ConfigError(f"the cross-node stage runs SRA or ring, not {cross_algorithm.name}")
    shards = 1 if scheme == "leader" else topology.shards
    shared = hierarchy.intra_shm and hierarchy.intra_transport == "local" and host
    shared = shared and shm.available()
    # One node, compressed: SRA's steps through shared segments (every
    # rank encodes its peers' pieces into its segment, each owner adds them from there
    # and requantizes its chunk into its own, every rank decodes that).
    one_node = topology.num_nodes == 1 and not base.raw and shared
    intra_compress = one_node or (bool(hierarchy.intra_compress) and not base.raw)
    intra_shm = shared and (not intra_compress or one_node)
    shard_piece = piece_numel * SHARED_PIECE_FACTOR if intra_shm else piece_numel
    plan = make_plan(layout, shards, shard_piece, MAX_SLOTS)
    nodes = topology.num_nodes
    slots = MAX_SLOTS // max(nodes - 1, 1) if cross_algorithm == Algo.RING else MAX_SLOTS
    acc_dtype = base.acc_dtype
    cross = tuple(
        replace(
            base,
            plan=make_plan(shard_layout(layout, chunk), nodes, piece_numel, slots),
            # The cross stage averages over the whole world as it reduces (requantizing
            # the average, not the sum): no pass over the shard divides after it.
            avg=base.avg,
            divisor=topology.world_size,
            acc_dtype=_accumulator_dtype(acc_dtype, base.raw),
            inplace=_accumulator_dtype(acc_dtype, base.raw) == acc_dtype,
            algorithm=cross_algorithm,
        )
        for chunk in plan.chunks
    )
    groups = tuple(
        cross_groups(layout, chunk, spec, nodes, piece_numel, slots)
        for chunk, spec in zip(plan.chunks, cross, strict=True)
    )
    return HierarchicalSpec(
        plan=plan,
        raw=base.raw,
        avg=base.avg,
        acc_dtype=acc_dtype,
        inplace=base.inplace,
        stochastic=base.stochastic,
        seed=base.seed,
        algorithm=Algo.HIERARCHICAL,
        topology=topology,
        scheme=scheme,
        shards=shards,
        intra_compress=intra_compress,
        intra_shm=intra_shm,
        groups=groups,
    )
