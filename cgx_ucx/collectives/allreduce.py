"""Allreduce: the caller's arguments checked and turned into a spec and a signature
(:func:`prepare_allreduce`), then run by one algorithm (:func:`run_allreduce`).

- SRA, scatter-reduce-allgather (:mod:`.sra`): two communication steps; the default up
  to :data:`SRA_MAX_WORLD` ranks.
- ring (:mod:`.ring`): 2(N-1) hops between neighbours only, for large worlds.
- oneshot (:mod:`.oneshot`): one round, every rank sends its whole buffer to every peer
  and all reduce in rank order; for small buffers, where the per-message cost dominates.

SRA and ring pipeline by piece (:mod:`.plan`); all three compress per layer as the layout
says and leave every replica bit-identical. A world of one still quantizes compressed
layers once, so the result is what N ranks would produce.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import CODEC_DTYPES, SEED_LIMIT, check_root, check_seed, is_cupy
from ..config import NO_COMPRESSION_BITS
from ..errors import ConfigError
from ..layout import Layout
from ..transport.frames import MIXED_BITS, Algo, Coll, Frame, Op
from ..transport.handshake import MAX_SLOTS
from .call import Call, make_template, signed_root
from .hierarchical import hierarchical, hierarchical_scheme, hierarchical_spec
from .oneshot import oneshot
from .piece_codec import requantize_piece
from .plan import PIECE_BYTES, flat_piece_bytes, make_plan
from .reduction import AllreduceSpec
from .ring import ring
from .sra import sra
from .staging import as_flat, synchronize

__all__ = [
    "ONESHOT_MAX_BYTES",
    "SRA_MAX_WORLD",
    "AllreduceSpec",
    "oneshot",
    "oneshot_max_bytes",
    "prepare_allreduce",
    "requantize_alone",
    "ring",
    "run_allreduce",
    "sra",
]

#: World sizes up to this use SRA under algorithm="auto": on one host or a few nodes
#: its two communication steps beat the ring's 2(N-1); CGX used SRA within a node.
SRA_MAX_WORLD = 8

#: Under algorithm="auto", buffers of at most this many bytes (the caller's, before
#: compression) take the one-round path, per world size: the crossover with SRA
#: measured by ``python -m cgx_ucx.bench latency``. One round costs
#: (N-1) whole buffers per rank against SRA's 2(N-1)/N, so the crossover falls with N.
ONESHOT_MAX_BYTES: dict[int, int] = {2: 256 << 10, 3: 128 << 10, 4: 64 << 10}


def oneshot_max_bytes(world_size: int) -> int:
    """The auto crossover for ``world_size`` ranks (beyond the table: scaled as 1/N)."""
    if world_size in ONESHOT_MAX_BYTES:
        return ONESHOT_MAX_BYTES[world_size]
    top = max(ONESHOT_MAX_BYTES)
    return ONESHOT_MAX_BYTES[top] * top // max(world_size, 1)


def prepare_allreduce(
    x: Any,
    op: str = "sum",
    *,
    world_size: int,
    layout: Layout | None = None,
    bits: int | None = None,
    bucket_size: int = 1024,
    algorithm: str = "auto",
    stochastic: bool = False,
    seed: int = 0,
    topology: Any = None,
    hierarchy: Any = None,
    cache: dict | None = None,
    in_place: bool = True,
    root: int | None = None,
    oneshot_limit: int | None = None,
) -> tuple[Frame, tuple[Any, AllreduceSpec]]:
    """Check an allreduce's arguments (ConfigError for the first bad one) and return its
    signature frame and what :func:`run_allreduce` needs: the flat view of ``x`` and the
    spec. Arguments as for :meth:`~.communicator.Communicator.allreduce`.

    ``cache``: a dict owned by the caller for one world size, topology and hierarchy
    (a communicator's), where the frame and spec of each call are kept by its arguments:
    a training loop repeats the same small calls, and building the plan and signature
    again is a good part of such a call's cost. ``in_place``: the result is written into
    ``x`` (a read-only ``x`` is refused); False for callers that only read it. ``root``:
    the one rank that keeps the result (torch's reduce): signed (the call is then a
    ``reduce`` in mismatch messages), so ranks that disagree on it raise a mismatch.
    ``oneshot_limit``: the "auto" crossover to the one-round path in bytes, instead of
    :func:`oneshot_max_bytes` (a one-host group with mailboxes: :mod:`.local`); every
    rank of a communicator passes the same."""
    flat = as_flat(x, writable=in_place)
    if root is not None:
        root = check_root(root, world_size)
    key = _cache_key(flat, op, layout, bits, bucket_size, algorithm, stochastic, seed, cache)
    if key is not None:
        key = (*key, root)
        hit = cache.get(key)  # type: ignore[union-attr]
        if hit is not None:
            return hit[0], (flat, hit[1])
    template, spec = _prepare(
        flat, op, world_size, layout, bits, bucket_size, algorithm, stochastic, seed, topology,
        hierarchy, oneshot_limit
    )  # fmt: skip
    if root is not None:
        template = template.with_(collective=Coll.REDUCE, digest=signed_root(template.digest, root))
    if key is not None:
        if len(cache) >= PREPARED_CACHE_SIZE:  # type: ignore[arg-type]
            del cache[next(iter(cache))]  # type: ignore[union-attr,arg-type]
        cache[key] = (template, spec)  # type: ignore[index]
    return template, (flat, spec)


#: Argument sets a communicator keeps prepared (oldest dropped first).
PREPARED_CACHE_SIZE = 64


def _cache_key(
    flat: Any, op: Any, layout: Any, bits: Any, bucket_size: Any, algorithm: Any,
    stochastic: Any, seed: Any, cache: dict | None,
) -> tuple | None:  # fmt: skip
    """The cache key of these arguments, None when they are not cached: no cache, or a
    value of an unexpected type (left to the checks, which name it). A Layout is frozen
    and compares by value, so an equal one built anew for each call still hits."""
    if cache is None or (layout is not None and type(layout) is not Layout):
        return None
    if type(op) is not str or type(algorithm) is not str or type(bucket_size) is not int:
        return None
    if type(seed) is not int or (bits is not None and type(bits) is not int):
        return None
    if not stochastic and 0 <= seed < SEED_LIMIT:
        # Deterministic rounding never reads the seed: callers that pass a new one every
        # step (the DDP hook's per-step seed) still hit.
        seed = 0
    return (flat.size, flat.dtype, is_cupy(flat), op, layout, bits, bucket_size, algorithm,
            bool(stochastic), seed)  # fmt: skip


def _prepare(
    flat: Any, op: str, world_size: int, layout: Layout | None, bits: int | None,
    bucket_size: int, algorithm: str, stochastic: bool, seed: int, topology: Any,
    hierarchy: Any, oneshot_limit: int | None = None,
) -> tuple[Frame, AllreduceSpec]:  # fmt: skip
    if op not in ("sum", "avg"):
        raise ConfigError(f"op must be 'sum' or 'avg', got {op!r}")
    lay = _layout(flat.size, layout, bits, bucket_size)
    dtype = np.dtype(flat.dtype)
    avg = op == "avg"
    _check_dtype(dtype, lay.compressed, avg)
    # Two levels: "auto" where the topology and its HierarchyConfig say so,
    # "hierarchical" asked for; flat where they do not apply.
    flat_name = "auto" if algorithm == "hierarchical" else algorithm
    algo = _algorithm(flat_name, world_size, flat.size * dtype.itemsize, oneshot_limit)
    # Host bytes, and a group whose ranks all mapped each other's node-local shared
    # memory (it has mailboxes: oneshot_limit is theirs).
    shared_host = not is_cupy(flat) and oneshot_limit is not None
    scheme = hierarchical_scheme(
        algorithm,
        algo == Algo.ONESHOT,
        topology,
        hierarchy,
        raw_host=shared_host and not lay.compressed,
        compressed_host=shared_host and lay.compressed,
    )
    algo = Algo.HIERARCHICAL if scheme is not None else algo
    seed = check_seed(seed)
    raw = not lay.compressed
    acc_dtype = _accumulator_dtype(dtype, raw)
    if algo == Algo.ONESHOT:
        plan = make_plan(lay, 1, max(lay.numel, 1), 1)  # one piece: the whole buffer
    else:
        # Two levels keep the tuned PIECE_BYTES; flat plans grow pieces for large chunks.
        chunk_bytes = flat.size * dtype.itemsize // max(world_size, 1)
        piece_bytes = (
            PIECE_BYTES if scheme is not None else flat_piece_bytes(chunk_bytes, PIECE_BYTES)
        )
        piece_numel = max(piece_bytes // dtype.itemsize, 1)
        slots = MAX_SLOTS // max(world_size - 1, 1) if algo == Algo.RING else MAX_SLOTS
        plan = make_plan(lay, world_size, piece_numel, slots)
    spec = AllreduceSpec(
        plan=plan,
        raw=raw,
        avg=avg,
        acc_dtype=acc_dtype,
        inplace=acc_dtype == dtype,
        stochastic=bool(stochastic),
        seed=seed,
        algorithm=algo,
    )
    if scheme is not None:
        cross = Algo.SRA if topology.num_nodes <= SRA_MAX_WORLD else Algo.RING
        spec = hierarchical_spec(
            spec, lay, topology, hierarchy, scheme, piece_numel, cross, host=not is_cupy(flat)
        )
    template = make_template(
        Coll.ALLREDUCE,
        flat,
        reduce_op=Op.AVG if avg else Op.SUM,
        bits=_uniform_bits(lay),
        algorithm=algo,
        flags=(1 if stochastic and lay.compressed else 0) | getattr(spec, "flags", 0),
        digest=lay.digest,
    )
    return template, spec


async def run_allreduce(call: Call, state: tuple[Any, AllreduceSpec]) -> None:
    """Allreduce the flat array in place, as :func:`prepare_allreduce` specified."""
    flat, spec = state
    if call.world_size == 1:
        # Sum and average of one buffer are the buffer; compressed layers still go
        # through one quantization, as they would with more ranks.
        if not spec.raw:
            requantize_alone(call, flat, spec)
        return
    if spec.algorithm == Algo.HIERARCHICAL:
        await hierarchical(call, flat, spec)  # type: ignore[arg-type]
    elif spec.algorithm == Algo.ONESHOT:
        await oneshot(call, flat, spec)
    elif spec.algorithm == Algo.RING:
        await ring(call, flat, spec)
    else:
        await sra(call, flat, spec)


def requantize_alone(call: Call, flat: Any, spec: AllreduceSpec) -> None:
    """World size 1: the result is the quantized input (what N ranks would produce)."""
    for chunk in spec.plan.chunks:
        for piece in chunk.pieces:
            acc = flat[piece.start : piece.stop].astype(np.float32)
            buf = call.take(piece.wire_nbytes(flat.dtype), flat)
            requantize_piece(
                acc, piece.start, piece, buf, flat, spec.stochastic, spec.seed, call.seq, call.rank
            )
    synchronize(flat)


# -- argument checks --------------------------------------------------------------------


def _layout(numel: int, layout: Layout | None, bits: int | None, bucket_size: int) -> Layout:
    if layout is None:
        return Layout.uniform(numel, NO_COMPRESSION_BITS if bits is None else bits, bucket_size)
    if bits is not None:
        raise ConfigError("give either layout= or bits=, not both")
    if not isinstance(layout, Layout):
        raise ConfigError(f"layout must be a cgx_ucx.Layout, got {type(layout).__name__}")
    layout.check(numel)
    return layout


def _check_dtype(dtype: np.dtype, compressed: bool, avg: bool) -> None:
    if compressed and dtype not in CODEC_DTYPES:
        raise ConfigError(
            f"compression needs float32/float16/bfloat16 values, got {dtype}; "
            "use bits=32 for this buffer"
        )
    if dtype == np.bool_ or (dtype.kind not in "fiu" and dtype not in CODEC_DTYPES):
        raise ConfigError(f"allreduce cannot sum {dtype} values")
    if avg and dtype.kind in "iu":
        raise ConfigError("op='avg' needs floating-point values")


_ALGORITHMS = {"sra": Algo.SRA, "ring": Algo.RING, "oneshot": Algo.ONESHOT}


def _algorithm(algorithm: str, world_size: int, nbytes: int, limit: int | None = None) -> Algo:
    """The algorithm to run; "auto" depends only on what the signature carries (numel,
    dtype) and the world size, so ranks that agree on the call agree on the choice."""
    if algorithm == "auto":
        if nbytes <= (oneshot_max_bytes(world_size) if limit is None else limit):
            return Algo.ONESHOT
        return Algo.SRA if world_size <= SRA_MAX_WORLD else Algo.RING
    if algorithm not in _ALGORITHMS:
        raise ConfigError(
            f"algorithm must be 'auto', 'sra', 'ring' or 'oneshot', got {algorithm!r}"
        )
    return _ALGORITHMS[algorithm]


def _accumulator_dtype(dtype: np.dtype, raw: bool) -> np.dtype:
    """Integers and 32/64-bit floats sum in their own dtype (exact, in place when raw);
    16-bit floats, and every compressed layout, sum in float32."""
    if raw and (dtype.kind in "iu" or dtype.itemsize >= 4):
        return dtype
    return np.dtype(np.float32)


def _uniform_bits(layout: Layout) -> int:
    """The bits every non-empty layer uses, MIXED_BITS when they differ."""
    layer_bits = {s.bits for s in layout.layers if s.numel}
    if len(layer_bits) == 1:
        return layer_bits.pop()
    return NO_COMPRESSION_BITS if not layer_bits else MIXED_BITS
