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
   For ``op="avg"`` they divide by the whole world's size where they reduce (before
   requantizing), so no pass over the shard divides afterwards, on any rank.
3. Intra-node allgather (phase 4, node peers): each owner writes its shard into the
   caller's buffer and sends those bytes, uncompressed, to its node peers. Re-quantizing
   here would add a third rounding of values that already crossed the network quantized,
   to save node-local bytes only.
   Where the shard crossed nodes compressed by SRA into a float32 buffer through shared
   segments, the owner forwards the wire bytes of the cross-node stage instead (one
   frame per cross-node group): every node peer decodes them into its buffer, as the
   other nodes' replicas did. The same values, without
   the owner's copy of its shard into a segment: a decode writes what a copy would and
   reads an eighth of it at 4 bits.

Uncompressed node-local bytes of host buffers do not travel through UCX
(``HierarchyConfig.intra_shm``, on by default): the sender copies them into a shared
segment of its own (:mod:`cgx_ucx.transport.shm`) and sends a descriptor in their place;
the receiver maps the segment and reads them in place (the owner adds its peers' pieces
straight from their segments; across nodes by SRA, the last peer's pieces are added as
the encode reads them, :meth:`Hierarchical.fusable`). A segment is only reused once its
readers are done: an owner's shard bytes (step 3) are released when each node peer's
DONE frame (phase 5) arrived, the pieces a rank sent in step 1 when the owners' step-3
frames arrived (an owner sends those only after it has added them). Same bytes, same
order of additions: the replicas stay bit-identical either way. The shared path sets a
signature flag, so ranks configured differently raise a mismatch instead of misreading
each other.

Every replica on every node thus ends with the bytes the shard's owners computed from one
cross-node allreduce: bit-identical. Ranks of local index ``>= S`` (uneven nodes, e.g.
the third rank of a 3 + 2 job, or every rank but the leader) only send in step 1 and
receive in step 3.

On a single node the same steps are the uncompressed allreduce of host buffers under
``algorithm="auto"`` from :data:`ONE_NODE_MIN_WORLD` ranks on (nothing crosses: step 2 is
skipped): every rank copies each other rank's shard into its segment once, owners add
in place and every rank copies the result out, where the flat algorithms push every byte
through UCX's shared-memory transport (8 KiB fragments, two copies, a rendezvous per
piece). A buffer of a compressed layout runs SRA's steps the same way, with the
same bytes and values: every rank encodes the pieces of its peers' chunks into its
segment, each owner adds them from there in rank order, requantizes its chunk into its
own segment (decoding it into its buffer) and every rank decodes those wire bytes into
its buffer, without a byte of payload through UCX; from
:data:`ONE_NODE_MIN_WORLD_COMPRESSED` ranks on.

Stages that share a phase number talk to disjoint peers (node peers in 1 and 3, other
nodes in 2), so ranks that disagree on the algorithm still meet on phase 1 and raise
:class:`~cgx_ucx.errors.CollectiveMismatchError`, as for every collective.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ..transport import shm
from ..transport.frames import Algo
from .call import PH_SIG, Call, cancel_pending, gather_or_cancel
from .hierarchical_plan import (
    CROSS_GROUPS,
    FLAG_INTRA_COMPRESS,
    FLAG_INTRA_SHM,
    FLAG_LEADER,
    ONE_NODE_MIN_WORLD,
    ONE_NODE_MIN_WORLD_COMPRESSED,
    SHARED_PIECE_FACTOR,
    HierarchicalSpec,
    hierarchical_scheme,
    hierarchical_spec,
    shard_layout,
    sub_chunk,
)
from .piece_codec import decode_piece
from .plan import Chunk
from .reduction import AllreduceSpec, PieceSteps
from .ring import ring
from .sra import Table, keep_results, result_table, sra
from .staging import byte_view, synchronize
from .subgroup import GroupView, StageCall

__all__ = [
    "CROSS_GROUPS",
    "FLAG_INTRA_COMPRESS",
    "FLAG_INTRA_SHM",
    "FLAG_LEADER",
    "ONE_NODE_MIN_WORLD",
    "ONE_NODE_MIN_WORLD_COMPRESSED",
    "PH_HIER_DONE",
    "PH_HIER_GATHER",
    "SHARED_PIECE_FACTOR",
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


def _joined(bufs: list[Any]) -> Any:
    """The byte arrays ``bufs`` as one array, where they are back-to-back slices of one
    array (a peer's segment); else None."""
    if not bufs:
        return None
    whole = bufs[0].base
    start = pos = bufs[0].ctypes.data
    for b in bufs:
        if not isinstance(whole, np.ndarray) or b.base is not whole or b.ctypes.data != pos:
            return None
        pos += b.nbytes
    offset = start - whole.ctypes.data
    return whole[offset : offset + (pos - start)]


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
        #: One node, compressed, through shared segments (:func:`hierarchical_spec`): the
        #: owners requantize their chunks as SRA's do and share the wire bytes.
        self.requantizes = self.shm and not self.intra_raw
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
                if self.requantizes:
                    pos, n = self.wire_span(j, k)
                    seg = segments[j]
                    await self.encode(x, 0, piece, dst=seg.array[pos : pos + n])
                    payload = seg.describe(pos, n).pack()
                elif self.shm:
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
        """A segment for owner ``j``'s whole shard (this call holds it until it ends):
        its values, or its pieces' wire bytes where they are encoded."""
        if self.requantizes:
            return self.call.take_segment(max(self.wire_total(j), 1))
        return self.call.take_segment(self.plan.chunks[j].numel * self.dtype.itemsize)

    def wire_span(self, j: int, k: int) -> tuple[int, int]:
        """(offset, bytes) of the wire bytes of piece ``k`` of chunk ``j`` where chunk
        ``j``'s pieces lie back to back (in :func:`~.sra.result_table`'s order)."""
        table, _ = result_table(self.spec, self.dtype)
        pos, n = table[(j, k)]
        return pos - table[(j, 0)][0], n

    def wire_total(self, j: int) -> int:
        """The wire bytes of chunk ``j``."""
        pieces = len(self.plan.chunks[j].pieces)
        return sum(self.wire_span(j, pieces - 1)) if pieces else 0

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
        return await self.recv_described(peer, frame, self.intra_nbytes(piece))

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

    async def accept_first(self, p: int, frame: Any, count: int) -> bool:
        """Whether node peer ``p``'s first frame is of this collective (if not, it is
        drained and noted), announcing ``count`` pieces."""
        node = self.node
        problem = await node.check_first(p, frame)
        if problem:
            self.problems.append(problem)
            self.sigs[p].set_result(False)
            return False
        if frame.count != count:
            raise ProtocolError(
                f"rank {node.view.real(p)} sends {frame.count} pieces, {count} expected"
            )
        self.sigs[p].set_result(True)
        return True

    async def scatter_recv(self, p: int) -> None:
        node, pieces = self.node, self.plan.chunks[self.local].pieces
        try:
            for k, piece in enumerate(pieces):
                if k == 0 or self.shm:
                    frame = await node.recv_header(p, PH_SIG, k, first=k == 0)
                    if k == 0 and not await self.accept_first(p, frame, len(pieces)):
                        return
                if self.shm:
                    buf = await self.recv_shared(p, frame, piece)
                else:
                    buf = self.call.take(self.intra_nbytes(piece), self.x)
                    if k == 0:
                        await node.recv_payload(p, frame, buf)
                    else:  # its size is known: the payload's receive goes with the header's
                        await node.recv_piece(p, PH_SIG, k, buf)
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
        if self.requantizes:
            await self.requantize_and_share(chunk, acc)
            return
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
            group = StageCall(self.call, view)
            group.slot_base = slot_base
            addend = await self.reduce(chunk, acc, ks, fuse=self.fusable(cross, group))
            fwd = None
            if forward:
                fwd = (g, offset, *tables[g])
                offset += tables[g][1]
            stages.append(
                asyncio.ensure_future(
                    self.cross_and_send(chunk, acc, ks, cross, group, seg, fwd, addend)
                )
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
        addend: Any = None,
    ) -> None:
        """Pieces ``ks`` of our shard (reduced in the node) across nodes, then to the node.

        ``fwd`` = (group index, offset in ``seg``, :func:`~.sra.result_table`, total) when the
        node peers get the cross-node stage's wire bytes (:meth:`forwards`). ``addend``: the
        last node peer's pieces ``ks``, not added yet (:meth:`reduce` with ``fuse``): the
        cross-node stage adds them as it encodes."""
        sub = sub_chunk(chunk, ks)
        a = acc[sub.start - chunk.start : sub.stop - chunk.start]
        if group.world_size == 1:
            pass  # one node: nothing crosses
        elif cross.algorithm == Algo.RING:
            await ring(group, a, cross)
        else:
            keep = None if fwd is None else keep_results(seg.array, *fwd[1:3])
            await sra(group, a, cross, keep, addend)
        self.finish(sub, a, averaged=group.world_size > 1)
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

    async def requantize_and_share(self, chunk: Chunk, acc: Any) -> None:
        """One node, compressed (:attr:`requantizes`): each piece of our chunk reduced as
        SRA's owner does (node peers in order, the last one's piece added, the average
        taken and the sum requantized in one pass, decoded into the caller's buffer),
        its wire bytes written into our segment and described to every node peer, which
        decodes them; the segment is ours until each of them said it is done."""
        seg = self.segment(self.local)
        *first, last = self.node_peers
        count = len(chunk.pieces)
        for k, piece in enumerate(chunk.pieces):
            for p in first:
                await self.decode_add(await self.arrived[(p, k)], piece, acc, chunk.start)
            pos, n = self.wire_span(self.local, k)
            buf = await self.arrived[(last, k)]
            await self.reduce_requantize_into(
                buf, piece, acc, chunk.start, seg.array[pos : pos + n]
            )
            payload = seg.describe(pos, n).pack()
            self.tasks.extend(
                asyncio.ensure_future(self.node.send(p, PH_HIER_GATHER, k, payload, count))
                for p in self.node_peers
            )
        synchronize(self.x)
        self.tasks.extend(
            asyncio.ensure_future(self.node.recv_header(p, PH_HIER_DONE, 0))
            for p in self.node_peers
        )

    def fusable(self, cross: AllreduceSpec, group: StageCall) -> bool:
        """Whether the last node peer's pieces can be added by the cross-node stage as it
        encodes (:func:`~.sra.sra`'s addend) instead of by :meth:`reduce`: float32 host
        values reduced in place, read from the peer's shared segment, an SRA across
        nodes of a compressed layout. The same additions in the same order: the same
        values and bytes, one pass over the shard fewer."""
        return (
            self.shm
            and self.intra_raw
            and bool(self.node_peers)
            and self.spec.inplace  # (so the accumulator is x itself, not fused into)
            and self.dtype == np.float32
            and not cross.raw
            and cross.algorithm == Algo.SRA
            and group.world_size > 1
        )

    async def reduce(self, chunk: Chunk, acc: Any, ks: range, fuse: bool = False) -> Any:
        """acc += every node peer's pieces ``ks`` of our shard, peers in local-rank order.

        ``fuse``: the last peer's pieces are left out and returned, as one read-only
        array laid out as the pieces' span of ``acc``, where they lie back to back in its
        segment (else they are added as the others, and None is returned)."""
        base = chunk.start
        last = self.node_peers[-1] if fuse else None
        for k in ks:
            piece = chunk.pieces[k]
            a = acc[piece.start - base : piece.stop - base]
            for i, p in enumerate(self.node_peers):
                buf = await self.arrived[(p, k)]
                if p == last:
                    continue
                if self.fused and i == 0:
                    src = self.x[piece.start : piece.stop]
                    self.xp.add(src, buf.view(self.dtype), out=a)
                elif self.intra_raw:
                    self.add_raw(a, buf, piece)
                else:
                    await self.decode_add(buf, piece, acc, base)
            # Pieces that arrived already do not suspend the loop above: yield, so the
            # groups started across nodes keep their transfers going meanwhile.
            await asyncio.sleep(0)
        if last is None:
            return None
        bufs = [self.arrived[(last, k)].result() for k in ks]
        joined = _joined(bufs)
        if joined is None:
            for k, buf in zip(ks, bufs, strict=True):
                piece = chunk.pieces[k]
                self.add_raw(acc[piece.start - base : piece.stop - base], buf, piece)
            return None
        return joined.view(self.dtype)

    def finish(self, chunk: Chunk, acc: Any, averaged: bool) -> None:
        """The shard's final values into the caller's buffer, averaged if asked and the
        cross-node stage (``averaged``: it ran) did not average them already."""
        if self.spec.avg and not averaged:
            self.xp.divide(acc, self.divisor, out=acc)
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
        into_x = not (self.requantizes or self.shm)
        for k, piece in enumerate(pieces):
            if into_x:
                dst = self.x[piece.start : piece.stop]
                frame = await self.node.recv_piece(j, PH_HIER_GATHER, k, dst)
            else:
                frame = await self.node.recv_header(j, PH_HIER_GATHER, k)
            if frame.count != len(pieces):
                raise ProtocolError(f"rank {self.node.view.real(j)} announced {frame.count} pieces")
            if self.requantizes:  # the owner's wire bytes, decoded from its segment
                src = await self.recv_described(j, frame, self.wire_span(j, k)[1])
                await self.codec.run(piece.numel, decode_piece, src, piece, self.x, 0, self.dtype)
            elif self.shm:
                src = await self.recv_shared(j, frame, piece)
                byte_view(self.x[piece.start : piece.stop])[...] = src
        if self.shm:
            await self.node.send(j, PH_HIER_DONE, 0, None, 1)

    async def gather_forwarded(self, j: int) -> None:
        """Owner ``j``'s shard from the wire bytes of its cross-node stage, group by group
        (:meth:`forwards`): decoded into the caller's buffer (the cross-node stage
        averaged the values already, as the owner's)."""
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
        await self.node.send(j, PH_HIER_DONE, 0, None, 1)
