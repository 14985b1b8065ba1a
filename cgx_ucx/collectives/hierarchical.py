"""The two-level allreduce: node-local reduce-scatter, cross-node allreduce per shard,
node-local allgather (DESIGN.md "Topology").

With ``S`` shards (the smallest node's size; 1 for the leader scheme) the buffer is cut
into ``S`` shards on bucket boundaries (:mod:`.plan`). On a rank of local index ``i``:

1. Intra-node reduce-scatter (phase 1, node peers): the rank sends every piece of shard
   ``j`` to its node's rank of local index ``j`` (for every ``j < S``, ``j != i``); the
   first piece carries the signature. An owner (``i < S``) adds what its node peers sent
   into an accumulator, in local-rank order. Uncompressed by default (the node-local
   transport is rarely the bottleneck and every quantization stage adds error);
   ``HierarchyConfig.intra_compress`` (``CGX_INTRA_COMPRESS=1``) quantizes these pieces.
2. Cross-node allreduce (phases 1-3, the group of local index ``i`` on every node): the
   owners of shard ``i`` run SRA or ring (:mod:`.sra`, :mod:`.ring`, compressed as the
   layout says) on their accumulators through a :class:`~.subgroup.GroupView`. Every rank
   of the smallest node (and as many of every other node) carries cross-node traffic, so
   each node sends about the compressed size of the buffer over its link, not ``L``
   times it. Those algorithms leave the owners of one shard with bit-identical values.
3. Intra-node allgather (phase 4, node peers): each owner writes its shard into the
   caller's buffer (divided by the world size for ``op="avg"``) and sends those bytes,
   uncompressed, to its node peers. Re-quantizing here would add a third rounding of
   values that already crossed the network quantized, to save node-local bytes only.
   Where the shard crossed nodes compressed by SRA into a float32 buffer through shared
   segments, the owner forwards the wire bytes of the cross-node stage instead (one
   frame per cross-node group): every node peer decodes them into its buffer, as the
   other nodes' replicas did, and divides as the owner did. The same values, without
   the owner's copy of its shard into a segment: a decode writes what a copy would and
   reads an eighth of it at 4 bits.

Uncompressed node-local bytes of host buffers do not travel through UCX
(``HierarchyConfig.intra_shm``, on by default): the sender copies them into a shared
segment of its own (:mod:`cgx_ucx.transport.shm`) and sends a descriptor in their place;
the receiver maps the segment and reads them in place (the owner adds its peers' pieces
straight from their segments). A segment is only reused once its readers are done: an
owner's shard bytes (step 3) are released when each node peer's DONE frame (phase 5)
arrived, the pieces a rank sent in step 1 when the owners' step-3 frames arrived (an
owner sends those only after it has added them). Same bytes, same order of additions:
the replicas stay bit-identical either way. The shared path sets a signature flag, so
ranks configured differently raise a mismatch instead of misreading each other.

Every replica on every node thus ends with the bytes the shard's owners computed from one
cross-node allreduce: bit-identical. Ranks of local index ``>= S`` (uneven nodes, e.g.
the third rank of a 3 + 2 job, or every rank but the leader) only send in step 1 and
receive in step 3.

On a single node the same steps are the uncompressed allreduce of host buffers under
``algorithm="auto"`` from :data:`ONE_NODE_MIN_WORLD` ranks on (nothing crosses: step 2 is
skipped): every rank copies each other rank's shard into its segment once, owners add
in place and every rank copies the result out, where the flat algorithms push every byte
through UCX's shared-memory transport (8 KiB fragments, two copies, a rendezvous per
piece). Compressed layouts keep the flat algorithms there, so the bytes are quantized
as asked.

Stages that share a phase number talk to disjoint peers (node peers in 1 and 3, other
nodes in 2), so ranks that disagree on the algorithm still meet on phase 1 and raise
:class:`~cgx_ucx.errors.CollectiveMismatchError`, as for every collective.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import ConfigError, ProtocolError
from ..layout import LayerSpec, Layout
from ..transport import shm
from ..transport.frames import Algo
from ..transport.handshake import MAX_SLOTS
from ..transport.topology import HierarchyConfig, Topology
from .call import PH_SIG, Call, cancel_pending, gather_or_cancel
from .piece_codec import decode_add_piece, decode_piece
from .plan import Chunk, make_plan
from .reduction import AllreduceSpec, PieceSteps
from .ring import ring
from .sra import Table, keep_results, result_table, sra
from .staging import byte_view, synchronize
from .subgroup import GroupView, StageCall

__all__ = [
    "FLAG_INTRA_COMPRESS",
    "FLAG_INTRA_SHM",
    "FLAG_LEADER",
    "ONE_NODE_MIN_WORLD",
    "PH_HIER_DONE",
    "PH_HIER_GATHER",
    "HierarchicalSpec",
    "hierarchical",
    "hierarchical_scheme",
    "hierarchical_spec",
    "shard_layout",
]

#: Phase of step 3 (node-local allgather); steps 1 and 2 use the phases of SRA/ring.
PH_HIER_GATHER = 4
#: Phase of the shared-memory path's "done reading your shard" (node peer -> owner).
PH_HIER_DONE = 5
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


def hierarchical_scheme(
    algorithm: str,
    one_round: bool,
    topology: Topology | None,
    hierarchy: HierarchyConfig | None,
    raw_host: bool = False,
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
    it through shared segments.
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
    if plan == "flat" and raw_host and _one_node_shm(topology, hierarchy):
        return "sharded"
    return None if plan == "flat" else plan


def _one_node_shm(topology: Topology, hierarchy: HierarchyConfig) -> bool:
    return (
        topology.num_nodes == 1
        and topology.world_size >= ONE_NODE_MIN_WORLD
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
    intra_compress = bool(hierarchy.intra_compress) and not base.raw
    intra_shm = (
        hierarchy.intra_shm
        and hierarchy.intra_transport == "local"
        and not intra_compress
        and host
        and shm.available()
    )
    shard_piece = piece_numel * SHARED_PIECE_FACTOR if intra_shm else piece_numel
    plan = make_plan(layout, shards, shard_piece, MAX_SLOTS)
    nodes = topology.num_nodes
    slots = MAX_SLOTS // max(nodes - 1, 1) if cross_algorithm == Algo.RING else MAX_SLOTS
    acc_dtype = base.acc_dtype
    cross = tuple(
        replace(
            base,
            plan=make_plan(shard_layout(layout, chunk), nodes, piece_numel, slots),
            avg=False,  # the owners divide by the world size once, after the cross stage
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


async def hierarchical(call: Call, x: Any, spec: HierarchicalSpec) -> None:
    """Two-level allreduce of the flat array ``x``, in place (see the module docstring)."""
    await Hierarchical(call, x, spec).run()


class Hierarchical(PieceSteps):
    """One two-level allreduce on this rank."""

    def __init__(self, call: Call, x: Any, spec: HierarchicalSpec) -> None:
        super().__init__(call, x, spec)
        assert spec.topology is not None
        self.hspec = spec
        self.node = StageCall(call, GroupView(call.transport, spec.topology.local_peers(call.rank)))
        self.local = self.node.rank  # local index
        self.node_peers = [i for i in range(self.node.world_size) if i != self.local]
        self.owners = list(range(min(spec.shards, self.node.world_size)))
        self.owns = self.local in self.owners
        self.intra_raw = not spec.intra_compress
        self.shm = spec.intra_shm
        loop = asyncio.get_running_loop()
        own = self.plan.chunks[self.local].pieces if self.owns else ()
        #: Per (node peer, piece of our shard): the bytes it sent, once they arrived.
        self.arrived = {
            (p, k): loop.create_future() for p in self.node_peers for k in range(len(own))
        }
        self.sigs = {p: loop.create_future() for p in self.node_peers} if self.owns else {}
        for f in (*self.arrived.values(), *self.sigs.values()):
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.problems: list[str] = []
        self.tasks: list[asyncio.Future] = []
        #: The accumulator's shared segment (the owner's shard is read from it in step 3).
        self.acc_segment: Any = None
        #: The accumulator is empty: the first peer's piece is added to ``x`` into it.
        self.fused = False

    async def run(self) -> None:
        try:
            steps = [self.scatter_send(), *(self.scatter_recv(p) for p in self.sigs)]
            if self.owns:
                steps.append(self.reduce_cross_and_send())
            await gather_or_cancel([*steps, *(self.gather_recv(j) for j in self.others())])
            await gather_or_cancel(self.tasks)
        finally:
            await cancel_pending(self.tasks)
        synchronize(self.x)

    def forwards(self, j: int) -> bool:
        """Whether owner ``j`` forwards its shard's cross-node wire bytes to its node peers
        instead of the values (module doc, step 3): decoded into a float32 caller's
        buffer, they are the owner's values bit for bit."""
        spec = self.hspec
        assert spec.topology is not None
        return (
            self.shm
            and not spec.raw
            and spec.inplace
            and spec.topology.num_nodes > 1
            and all(cross.algorithm == Algo.SRA for _, cross, _ in spec.groups[j])
        )

    def others(self) -> list[int]:
        """Owners (local indices) whose shard this rank receives in step 3."""
        return [j for j in self.owners if j != self.local]

    def intra_nbytes(self, piece: Any) -> int:
        if self.intra_raw:
            return piece.numel * self.dtype.itemsize
        return piece.wire_nbytes(self.dtype)

    # -- step 1: node-local reduce-scatter -----------------------------------------------
    async def scatter_send(self) -> None:
        node, x = self.node, self.x
        segments = {j: self.segment(j) for j in self.others()} if self.shm else {}
        sends = []
        for k in range(self.plan.max_pieces):
            for j in self.others():
                pieces = self.plan.chunks[j].pieces
                if k >= len(pieces):
                    continue
                piece = pieces[k]
                if self.shm:
                    payload = self.share(segments[j], self.plan.chunks[j], piece)
                elif self.intra_raw:
                    payload = self.view(x, 0, piece)
                else:
                    payload = await self.encode(x, 0, piece)
                sends.append(asyncio.ensure_future(node.send(j, PH_SIG, k, payload, len(pieces))))
                # Let the send go out before the next piece is copied or encoded: the
                # owner starts reducing piece k while we prepare k + 1.
                await asyncio.sleep(0)
        await gather_or_cancel(sends)

    # -- the shared-memory path (host buffers, uncompressed node-local bytes) ------------
    def segment(self, j: int) -> Any:
        """A segment for owner ``j``'s whole shard (this call holds it until it ends)."""
        return self.call.take_segment(self.plan.chunks[j].numel * self.dtype.itemsize)

    def describe(self, seg: Any, chunk: Chunk, piece: Any) -> Any:
        """The packed descriptor of ``piece`` in ``seg`` (laid out as ``chunk``)."""
        size = self.dtype.itemsize
        return seg.describe((piece.start - chunk.start) * size, piece.numel * size).pack()

    def share(self, seg: Any, chunk: Chunk, piece: Any) -> Any:
        """Copy ``piece`` of the caller's buffer into ``seg`` (laid out as ``chunk``);
        returns the descriptor that a node peer reads it by."""
        size = self.dtype.itemsize
        offset = (piece.start - chunk.start) * size
        seg.array[offset : offset + piece.numel * size] = self.view(self.x, 0, piece)
        return self.describe(seg, chunk, piece)

    async def recv_shared(self, peer: int, frame: Any, piece: Any) -> Any:
        """The bytes of ``piece`` that node peer ``peer`` described in ``frame``'s
        payload, read-only in its segment."""
        return await self.recv_described(peer, frame, piece.numel * self.dtype.itemsize)

    async def recv_described(self, peer: int, frame: Any, nbytes: int) -> Any:
        """The ``nbytes`` that node peer ``peer`` described in ``frame``'s payload,
        read-only in its segment."""
        real = self.node.view.real(peer)
        if frame.payload != shm.DESCRIPTOR_NBYTES:
            raise ProtocolError(
                f"rank {real} sent {frame.payload} bytes where a shared-memory descriptor "
                f"({shm.DESCRIPTOR_NBYTES}) was due"
            )
        raw = np.empty(shm.DESCRIPTOR_NBYTES, np.uint8)
        await self.node.recv_payload(peer, frame, raw)
        desc = shm.Descriptor.unpack(raw)
        if desc.nbytes != nbytes:
            raise ProtocolError(f"rank {real} described {desc.nbytes} bytes, {nbytes} expected")
        return self.call.pool.peer_view(self.call.rank, real, desc)

    async def scatter_recv(self, p: int) -> None:
        node, pieces = self.node, self.plan.chunks[self.local].pieces
        try:
            for k, piece in enumerate(pieces):
                frame = await node.recv_header(p, PH_SIG, k, first=k == 0)
                if k == 0:
                    problem = await node.check_first(p, frame)
                    if problem:
                        self.problems.append(problem)
                        self.sigs[p].set_result(False)
                        return
                    if frame.count != len(pieces):
                        raise ProtocolError(
                            f"rank {node.view.real(p)} sends {frame.count} pieces, "
                            f"{len(pieces)} expected"
                        )
                    self.sigs[p].set_result(True)
                if self.shm:
                    buf = await self.recv_shared(p, frame, piece)
                else:
                    buf = self.call.take(self.intra_nbytes(piece), self.x)
                    await node.recv_payload(p, frame, buf)
                self.arrived[(p, k)].set_result(buf)
        except BaseException as exc:
            for (q, _), f in self.arrived.items():
                if q == p and not f.done():
                    f.set_exception(exc)
            if not self.sigs[p].done():
                self.sigs[p].set_exception(exc)
            raise

    def accumulator(self, chunk: Chunk) -> Any:
        spec = self.spec
        if spec.inplace:
            return self.x[chunk.start : chunk.stop]
        if not chunk.numel:
            return self.xp.empty(0, spec.acc_dtype)
        nbytes = chunk.numel * spec.acc_dtype.itemsize
        same = spec.acc_dtype == self.dtype
        if self.shm and same and self.node_peers:
            # Its final bytes are the shard the node peers read in step 3: no extra copy.
            self.acc_segment = self.call.take_segment(nbytes)
            acc = self.acc_segment.array[:nbytes].view(spec.acc_dtype)
        else:
            acc = self.call.take(nbytes, self.x).view(spec.acc_dtype)
        if same and self.intra_raw and self.node_peers:
            self.fused = True  # x + the first peer's piece, straight into acc (one pass less)
        else:
            acc[...] = self.x[chunk.start : chunk.stop]
        return acc

    async def reduce_cross_and_send(self) -> None:
        """Our shard: reduce the node's pieces, allreduce across nodes, send to the node."""
        ok = await asyncio.gather(*self.sigs.values())
        self.node.raise_mismatches(sorted(self.problems))
        if not all(ok):
            return
        chunk = self.plan.chunks[self.local]
        groups = self.hspec.groups[self.local]
        acc = self.accumulator(chunk)
        seg = self.acc_segment
        forward = self.forwards(self.local) and bool(self.node_peers)
        tables = [result_table(cross, self.dtype) for _, cross, _ in groups] if forward else []
        if seg is None and self.shm and self.node_peers:
            total = sum(t for _, t in tables)
            seg = self.call.take_segment(max(total, 1)) if forward else self.segment(self.local)
        view = GroupView(self.call.transport, self.hspec.cross_group(self.local))
        stages = []
        offset = 0
        for g, (ks, cross, slot_base) in enumerate(groups):
            await self.reduce(chunk, acc, ks)
            group = StageCall(self.call, view)
            group.slot_base = slot_base
            fwd = None
            if forward:
                fwd = (g, offset, *tables[g])
                offset += tables[g][1]
            stages.append(
                asyncio.ensure_future(self.cross_and_send(chunk, acc, ks, cross, group, seg, fwd))
            )
            # The reduce above does not suspend when the node's pieces are already here:
            # let this group start across nodes before the next group is reduced.
            await asyncio.sleep(0)
        await gather_or_cancel(stages)
        if seg is not None:
            # The segment is this call's until every reader said it is done with it.
            self.tasks.extend(
                asyncio.ensure_future(self.node.recv_header(p, PH_HIER_DONE, 0))
                for p in self.node_peers
            )

    async def cross_and_send(
        self,
        chunk: Chunk,
        acc: Any,
        ks: range,
        cross: AllreduceSpec,
        group: StageCall,
        seg: Any,
        fwd: tuple[int, int, Table, int] | None,
    ) -> None:
        """Pieces ``ks`` of our shard (reduced in the node) across nodes, then to the node.

        ``fwd`` = (group index, offset in ``seg``, :func:`~.sra.result_table`, total) when the
        node peers get the cross-node stage's wire bytes (:meth:`forwards`)."""
        sub = sub_chunk(chunk, ks)
        a = acc[sub.start - chunk.start : sub.stop - chunk.start]
        if group.world_size == 1:
            pass  # one node: nothing crosses
        elif cross.algorithm == Algo.RING:
            await ring(group, a, cross)
        else:
            await sra(group, a, cross, None if fwd is None else keep_results(seg.array, *fwd[1:3]))
        self.finish(sub, a)
        if fwd is not None:
            g, offset, _, total = fwd
            payload = seg.describe(offset, total).pack()
            count = len(self.hspec.groups[self.local])
            self.tasks.extend(
                asyncio.ensure_future(self.node.send(p, PH_HIER_GATHER, g, payload, count))
                for p in self.node_peers
            )
            return
        for k in ks:
            piece = chunk.pieces[k]
            if seg is not None and seg is self.acc_segment:
                payload = self.describe(seg, chunk, piece)  # the final bytes are there
            elif seg is not None:
                payload = self.share(seg, chunk, piece)
            else:
                payload = byte_view(self.x[piece.start : piece.stop])
            for p in self.node_peers:
                self.tasks.append(
                    asyncio.ensure_future(
                        self.node.send(p, PH_HIER_GATHER, k, payload, len(chunk.pieces))
                    )
                )

    async def reduce(self, chunk: Chunk, acc: Any, ks: range) -> None:
        """acc += every node peer's pieces ``ks`` of our shard, peers in local-rank order."""
        base = chunk.start
        for k in ks:
            piece = chunk.pieces[k]
            a = acc[piece.start - base : piece.stop - base]
            for i, p in enumerate(self.node_peers):
                buf = await self.arrived[(p, k)]
                if self.fused and i == 0:
                    src = self.x[piece.start : piece.stop]
                    self.xp.add(src, buf.view(self.dtype), out=a)
                elif self.intra_raw:
                    self.add_raw(a, buf, piece)
                else:
                    await self.codec.run(
                        piece.numel, decode_add_piece, buf, piece, acc, base, self.dtype
                    )
            # Pieces that arrived already do not suspend the loop above: yield, so the
            # groups started across nodes keep their transfers going meanwhile.
            await asyncio.sleep(0)

    def finish(self, chunk: Chunk, acc: Any) -> None:
        """The shard's final values into the caller's buffer (averaged if asked)."""
        if self.spec.avg:
            self.xp.divide(acc, self.n_world, out=acc)
        if not self.spec.inplace:
            self.x[chunk.start : chunk.stop] = acc
        synchronize(self.x)

    # -- step 3: node-local allgather ----------------------------------------------------
    async def gather_recv(self, j: int) -> None:
        """Owner ``j``'s final shard, piece by piece, into the caller's buffer."""
        if self.forwards(j):
            await self.gather_forwarded(j)
            return
        pieces = self.plan.chunks[j].pieces
        for k, piece in enumerate(pieces):
            frame = await self.node.recv_header(j, PH_HIER_GATHER, k)
            if frame.count != len(pieces):
                raise ProtocolError(f"rank {self.node.view.real(j)} announced {frame.count} pieces")
            if self.shm:
                src = await self.recv_shared(j, frame, piece)
                byte_view(self.x[piece.start : piece.stop])[...] = src
            else:
                await self.node.recv_payload(j, frame, self.x[piece.start : piece.stop])
        if self.shm:
            await self.node.send(j, PH_HIER_DONE, 0, None, 1)

    async def gather_forwarded(self, j: int) -> None:
        """Owner ``j``'s shard from the wire bytes of its cross-node stage, group by group
        (:meth:`forwards`): decoded into the caller's buffer, divided as the owner did."""
        chunk = self.plan.chunks[j]
        groups = self.hspec.groups[j]
        for g, (ks, cross, _) in enumerate(groups):
            frame = await self.node.recv_header(j, PH_HIER_GATHER, g)
            if frame.count != len(groups):
                raise ProtocolError(
                    f"rank {self.node.view.real(j)} announced {frame.count} groups, "
                    f"{len(groups)} expected"
                )
            table, total = result_table(cross, self.dtype)
            src = await self.recv_described(j, frame, total)
            sub = sub_chunk(chunk, ks)
            xs = self.x[sub.start : sub.stop]
            for c, part in enumerate(cross.plan.chunks):
                for k, piece in enumerate(part.pieces):
                    pos, n = table[(c, k)]
                    await self.codec.run(
                        piece.numel, decode_piece, src[pos : pos + n], piece, xs, 0, self.dtype
                    )
            if self.spec.avg:
                self.xp.divide(xs, self.n_world, out=xs)
        await self.node.send(j, PH_HIER_DONE, 0, None, 1)
