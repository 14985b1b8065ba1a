"""The asyncio face: ``comm = await connect(...)``, then collectives on NumPy/CuPy arrays.

Collectives are numbered in call order (every rank must issue them in the same order,
as with any MPI-style library); several may be in flight at once (``asyncio.gather``
of several ``allreduce`` calls), their messages never mix. Each call carries its
signature to every peer; a rank whose arguments differ makes the call fail with
:class:`~cgx_ucx.errors.CollectiveMismatchError` on every rank, before any output is
written. A rank that fails a call for a reason of its own (bad argument, lost peer,
timeout) sends the others an ABORT frame so they fail fast instead of waiting out the
timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..config import NO_COMPRESSION_BITS, CommConfig, resolve_comm
from ..errors import (
    CGXError,
    CGXTimeoutError,
    CollectiveMismatchError,
    ConfigError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from ..layout import Layout
from ..transport.frames import MIXED_BITS, AbortCode, Algo, Coll, Frame, Kind, Op, dtype_code
from ..transport.mesh import MAX_SLOTS, Mesh, TransportStats
from ..transport.rendezvous import env_store
from .allreduce import AllreduceSpec, ring, sra
from .arrays import CODEC_DTYPES, BufferPool, CodecRunner, as_flat, byte_view, synchronize
from .call import PH_DATA, Call, gather_or_cancel
from .plan import PIECE_BYTES, make_plan

__all__ = ["CommStats", "Communicator", "connect"]

log = logging.getLogger("cgx_ucx")

#: World sizes up to this use SRA under algorithm="auto": on one host or a few nodes
#: its two communication steps beat the ring's 2(N-1); CGX used SRA within a node.
SRA_MAX_WORLD = 8
#: Early ABORT frames (for collectives this rank has not started yet) kept at most.
MAX_EARLY_ABORTS = 1024


@dataclass
class CommStats:
    """What a communicator moved: payload + header bytes and message counts, collectives."""

    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    collectives: int
    by_collective: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def connect(
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    config: CommConfig | None = None,
    prefix: str = "cgx",
    host: str | None = None,
    data_error_handling: bool = True,
) -> Communicator:
    """Join the job and return a connected :class:`Communicator`.

    ``store`` is a torch.distributed Store (anything with set/get/wait/add); ``None``
    means env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE as torchrun sets them; a
    TCPStore is created, importing torch only then). ``host`` is the address peers dial
    for this rank (default: the interface that routes to the store's host).
    ``data_error_handling=False`` allows CMA zero-copy between processes of one host at
    the risk that a peer dying mid-transfer aborts this process (UCX treats the failed
    copy as fatal; see :mod:`cgx_ucx.transport.mesh`).
    """
    config = config if config is not None else resolve_comm()
    if store is None:
        store, env_rank, env_world = env_store(config.connect_timeout)
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    if rank is None or world_size is None:
        raise ConfigError("rank and world_size are required with an explicit store")
    mesh = await Mesh.connect(
        store, int(rank), int(world_size), config, prefix, host, data_error_handling
    )
    return Communicator(mesh, config)


class Communicator:
    """A connected group of ranks. Create with :func:`connect`; close with :meth:`close`."""

    def __init__(self, mesh: Mesh, config: CommConfig) -> None:
        self._mesh = mesh
        self._config = config
        self._seq = 1  # 0 is the connection handshake
        self._calls: dict[int, Call] = {}
        self._early: collections.OrderedDict[int, CGXError] = collections.OrderedDict()
        self._pool = BufferPool()
        self._codec = CodecRunner()
        self._closed = False
        self._loop = asyncio.get_running_loop()
        mesh.on_abort = self._on_abort
        _share_codec_threads(len(mesh.local_ranks))

    # -- properties ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._mesh.rank

    @property
    def world_size(self) -> int:
        return self._mesh.world_size

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def config(self) -> CommConfig:
        return self._config

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this communicator runs on (every call must come from it)."""
        return self._loop

    @property
    def stats(self) -> CommStats:
        s: TransportStats = self._mesh.stats
        return CommStats(
            s.bytes_sent,
            s.bytes_received,
            s.messages_sent,
            s.messages_received,
            s.collectives,
            dict(s.by_collective),
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Communicator rank {self.rank}/{self.world_size} {state}>"

    # -- lifecycle ----------------------------------------------------------------------
    async def close(self) -> None:
        """Release endpoints, the listener, threads and staging memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for call in list(self._calls.values()):
            call.fail(TransportError("the communicator was closed during the collective"))
        await self._mesh.close()
        self._codec.close()
        self._pool.clear()

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- machinery ----------------------------------------------------------------------
    def _on_abort(self, frame: Frame, reason: str) -> None:
        code, src = frame.phase, frame.src
        text = f"rank {src} aborted collective #{frame.seq}: {reason}"
        exc: CGXError
        if code == AbortCode.PEER_LOST:
            exc = PeerLostError(text, peer=frame.count if frame.count != self.rank else src)
        elif code == AbortCode.PROTOCOL:
            exc = ProtocolError(text)
        else:
            exc = CollectiveMismatchError(text)
        call = self._calls.get(frame.seq)
        if call is not None:
            call.fail(exc)
        elif frame.seq >= self._seq:
            self._early[frame.seq] = exc
            while len(self._early) > MAX_EARLY_ABORTS:
                self._early.popitem(last=False)

    async def _collective(self, name: str, coll: Coll, prepare: Any, body: Any) -> Any:
        if asyncio.get_running_loop() is not self._loop:
            raise TransportError("a communicator must be used from the event loop that created it")
        if self._closed:
            raise TransportError("the communicator is closed")
        seq = self._seq
        self._seq += 1
        call = Call(self, seq, name)
        self._calls[seq] = call
        early = self._early.pop(seq, None)
        if early is not None:
            call.fail(early)
        started = time.perf_counter()
        try:
            self._mesh.check()
            template, state = prepare()
            call.template = template.with_(job=self._mesh.job, seq=seq, src=self.rank)
            result = await body(call, state)
        except BaseException as exc:
            await self._after_failure(call, exc)
            raise
        finally:
            del self._calls[seq]
        call.give_back_all()
        stats = self._mesh.stats
        stats.collectives += 1
        stats.by_collective[name] = stats.by_collective.get(name, 0) + 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s #%d done in %.3f ms", name, seq, (time.perf_counter() - started) * 1e3)
        return result

    async def _after_failure(self, call: Call, exc: BaseException) -> None:
        """Tell the peers, unless they know already (they raised it, or saw the loss)."""
        if call.abort.done() or self._mesh.closed or self.world_size == 1:
            return
        if isinstance(exc, CGXTimeoutError):
            code, peer = AbortCode.PEER_LOST, exc.peer if exc.peer is not None else self.rank
        elif isinstance(exc, PeerLostError):
            return  # every survivor sees the loss on its control channel
        elif isinstance(exc, ProtocolError):
            code, peer = AbortCode.PROTOCOL, self.rank
        elif isinstance(exc, CollectiveMismatchError):
            code, peer = AbortCode.MISMATCH, self.rank
        elif isinstance(exc, asyncio.CancelledError):
            code, peer = AbortCode.LOCAL, self.rank
            exc = TransportError("cancelled")
        else:
            code, peer = AbortCode.LOCAL, self.rank
        try:
            await asyncio.shield(
                self._mesh.broadcast_abort(call.seq, code, peer, f"{type(exc).__name__}: {exc}")
            )
        except Exception as err:
            log.debug("abort notification failed: %s", err)

    def _template(self, coll: Coll, x: Any, **fields: Any) -> Frame:
        try:
            dt = dtype_code(x.dtype)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return Frame(kind=Kind.DATA, job=0, collective=coll, dtype=dt, numel=int(x.size), **fields)

    # -- collectives --------------------------------------------------------------------
    async def allreduce(
        self,
        x: Any,
        op: str = "sum",
        *,
        layout: Layout | None = None,
        bits: int | None = None,
        bucket_size: int = 1024,
        algorithm: str = "auto",
        stochastic: bool = False,
        seed: int = 0,
    ) -> Any:
        """Sum (or average) ``x`` across ranks, in place; returns ``x``.

        ``layout`` gives per-layer bits / bucket sizes (bits=32: that layer travels
        uncompressed); without it the buffer is one layer of ``bits`` (default 32: exact
        uncompressed allreduce) and ``bucket_size``. Compression needs float32, float16
        or bfloat16 values; integer and float64 buffers reduce uncompressed only.
        ``algorithm``: "sra" (scatter-reduce-allgather), "ring", or "auto" (SRA up to
        8 ranks). Stochastic rounding is seeded by (seed, sequence number, rank, layer).
        """

        def prepare() -> tuple[Frame, tuple[Any, AllreduceSpec]]:
            flat = as_flat(x)
            if op not in ("sum", "avg"):
                raise ConfigError(f"op must be 'sum' or 'avg', got {op!r}")
            lay = layout
            if lay is None:
                lay = Layout.uniform(
                    flat.size, NO_COMPRESSION_BITS if bits is None else bits, bucket_size
                )
            elif bits is not None:
                raise ConfigError("give either layout= or bits=, not both")
            if not isinstance(lay, Layout):
                raise ConfigError(f"layout must be a cgx_ucx.Layout, got {type(lay).__name__}")
            lay.check(flat.size)
            dtype = np.dtype(flat.dtype)
            compressed = lay.compressed
            if compressed and dtype not in CODEC_DTYPES:
                raise ConfigError(
                    f"compression needs float32/float16/bfloat16 values, got {dtype}; "
                    "use bits=32 for this buffer"
                )
            if dtype == np.bool_ or (dtype.kind not in "fiu" and dtype not in CODEC_DTYPES):
                raise ConfigError(f"allreduce cannot sum {dtype} values")
            avg = op == "avg"
            if avg and dtype.kind in "iu":
                raise ConfigError("op='avg' needs floating-point values")
            algo = algorithm
            if algo == "auto":
                algo = "sra" if self.world_size <= SRA_MAX_WORLD else "ring"
            if algo not in ("sra", "ring"):
                raise ConfigError(f"algorithm must be 'auto', 'sra' or 'ring', got {algorithm!r}")
            if not isinstance(seed, int) or not 0 <= seed < 2**64:
                raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}")
            raw = not compressed
            if raw:
                acc_dtype = (
                    dtype if dtype.kind in "iu" or dtype.itemsize >= 4 else np.dtype(np.float32)
                )
            else:
                acc_dtype = np.dtype(np.float32)
            inplace = raw and acc_dtype == dtype
            piece_numel = max(PIECE_BYTES // dtype.itemsize, 1)
            slots = MAX_SLOTS // max(self.world_size - 1, 1) if algo == "ring" else MAX_SLOTS
            plan = make_plan(lay, self.world_size, piece_numel, slots)
            spec = AllreduceSpec(
                plan, raw, avg, np.dtype(acc_dtype), inplace, bool(stochastic), seed
            )
            layer_bits = {s.bits for s in lay.layers if s.numel}
            uniform = (
                layer_bits.pop()
                if len(layer_bits) == 1
                else (NO_COMPRESSION_BITS if not layer_bits else MIXED_BITS)
            )
            template = self._template(
                Coll.ALLREDUCE,
                flat,
                reduce_op=Op.AVG if avg else Op.SUM,
                bits=uniform,
                algorithm=Algo.SRA if algo == "sra" else Algo.RING,
                flags=1 if stochastic and compressed else 0,
                digest=lay.digest,
            )
            return template, (flat, spec)

        async def body(call: Call, state: tuple[Any, AllreduceSpec]) -> Any:
            flat, spec = state
            if self.world_size == 1:
                # Sum and average of one buffer are the buffer; compressed layers still
                # go through one quantization, as they would with more ranks.
                if not spec.raw:
                    _self_requantize(call, flat, spec)
                return x
            if call.template is not None and call.template.algorithm == Algo.RING:
                await ring(call, flat, spec)
            else:
                await sra(call, flat, spec)
            return x

        return await self._collective("allreduce", Coll.ALLREDUCE, prepare, body)

    async def broadcast(self, x: Any, root: int = 0) -> Any:
        """Copy ``root``'s ``x`` into every rank's ``x`` (same shape and dtype everywhere)."""

        def prepare() -> tuple[Frame, Any]:
            flat = as_flat(x)
            if not isinstance(root, int) or not 0 <= root < self.world_size:
                raise ConfigError(f"root must be a rank in 0..{self.world_size - 1}, got {root!r}")
            return self._template(Coll.BROADCAST, flat, algorithm=Algo.DIRECT, digest=root), flat

        async def body(call: Call, flat: Any) -> Any:
            await call.exchange_signatures()
            data = byte_view(flat)
            pieces = _byte_pieces(data.size)
            if self.rank == root:
                synchronize(flat)
                await gather_or_cancel(
                    call.send(p, PH_DATA, k, data[a:b], len(pieces))
                    for k, (a, b) in enumerate(pieces)
                    for p in self._mesh.peers
                )
            else:
                for k, (a, b) in enumerate(pieces):
                    frame = await call.recv_header(root, PH_DATA, k)
                    await call.recv_payload(root, frame, data[a:b])
            return x

        return await self._collective("broadcast", Coll.BROADCAST, prepare, body)

    async def allgather(self, x: Any, out: Any = None) -> Any:
        """Every rank's ``x`` into ``out[rank]`` on every rank; ``out`` shape (world, *x.shape)."""

        def prepare() -> tuple[Frame, Any]:
            flat = as_flat(x)
            dst = out
            if dst is None:
                from .arrays import xp_of

                dst = xp_of(x).empty((self.world_size, *x.shape), x.dtype)
            if tuple(dst.shape) != (self.world_size, *x.shape) or dst.dtype != x.dtype:
                raise ConfigError(
                    f"out must have shape {(self.world_size, *x.shape)} and dtype {x.dtype}, "
                    f"got {tuple(dst.shape)} {dst.dtype}"
                )
            rows = as_flat(dst, "out").reshape(self.world_size, -1)
            return self._template(Coll.ALLGATHER, flat, algorithm=Algo.DIRECT), (flat, rows, dst)

        async def body(call: Call, state: Any) -> Any:
            flat, rows, dst = state
            await call.exchange_signatures()
            rows[self.rank] = flat
            data = byte_view(flat)
            pieces = _byte_pieces(data.size)
            synchronize(flat)

            async def recv_from(p: int) -> None:
                row = byte_view(rows[p])
                for k, (a, b) in enumerate(pieces):
                    frame = await call.recv_header(p, PH_DATA, k)
                    await call.recv_payload(p, frame, row[a:b])

            await gather_or_cancel(
                [
                    *(
                        call.send(p, PH_DATA, k, data[a:b], len(pieces))
                        for k, (a, b) in enumerate(pieces)
                        for p in self._mesh.peers
                    ),
                    *(recv_from(p) for p in self._mesh.peers),
                ]
            )
            return dst

        return await self._collective("allgather", Coll.ALLGATHER, prepare, body)

    async def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

        def prepare() -> tuple[Frame, Any]:
            return Frame(kind=Kind.DATA, job=0, collective=Coll.BARRIER), None

        async def body(call: Call, _: Any) -> None:
            await call.exchange_signatures()

        await self._collective("barrier", Coll.BARRIER, prepare, body)


def _share_codec_threads(local_ranks: int) -> None:
    """Give the CPU codec ``cores // local ranks`` threads, unless someone chose already.

    A parallel Numba kernel waits for its slowest thread; with several ranks per host
    each running all-core kernels, threads wait for time slices: measured on 2 cores,
    2 ranks, a 64 MiB 4-bit allreduce took 380 ms with 2 codec threads per rank and
    45 ms with 1.
    """
    try:
        from ..compression import cpu
    except ImportError:  # pragma: no cover
        return
    if getattr(cpu, "_threads", None) is not None or not hasattr(cpu, "set_num_threads"):
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cpu.num_threads()
    threads = max(1, min(cores // max(local_ranks, 1), limit))
    cpu.set_num_threads(threads)
    log.info("codec threads per rank: %d (%d cores, %d ranks here)", threads, cores, local_ranks)


def _byte_pieces(nbytes: int) -> list[tuple[int, int]]:
    """[start, stop) byte ranges of at most PIECE_BYTES each (one empty range for 0)."""
    if nbytes == 0:
        return [(0, 0)]
    count = min(-(-nbytes // PIECE_BYTES), MAX_SLOTS)
    step = -(-nbytes // count)
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def _self_requantize(call: Call, flat: Any, spec: AllreduceSpec) -> None:
    """World size 1: the result is the quantized input (what N ranks would produce)."""
    from .allreduce import _requantize

    for chunk in spec.plan.chunks:
        for piece in chunk.pieces:
            acc = flat[piece.start : piece.stop].astype(np.float32)
            buf = call.take(piece.wire_nbytes(flat.dtype), flat)
            _requantize(acc, piece.start, piece, buf, flat, flat.dtype, spec, call.seq, 0)
    synchronize(flat)
