"""Reduce-scatter: the first half of SRA, optionally quantized (ZeRO++ qgZ's idea).

FSDP reduces each gradient with a reduce-scatter: rank r keeps only shard r of the sum.
That is exactly SRA's scatter-reduce (:mod:`.sra`) with chunk r = shard r, without its
allgather:

1. The buffer (``world_size`` shards of n values) gets a layout of one layer per shard,
   so the plan (:mod:`.plan`) cuts chunk r exactly at shard r.
2. Scatter: each rank quantizes every piece of every peer's shard (``bits`` < 32) and
   sends it to that shard's owner; the first piece carries the signature.
3. Reduce: the owner adds the pieces it receives, peers in rank order, into a float32
   accumulator that starts from its own shard (never quantized: it does not travel),
   divides by the world size for "avg", and writes the result into ``out``.

Only the owner computes a shard and nobody else receives it, so there is no second
quantization (SRA's allgather step): the error of shard r is the quantization error of
the (N-1) peer contributions, each within the codec's bound (half a quantization step
per value of its bucket). With ``bits`` 32 the same path is exact and moves (N-1)/N of
the buffer per rank, half of what an allreduce would.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from ..config import NO_COMPRESSION_BITS
from ..errors import ConfigError
from ..layout import Layout
from ..transport.frames import Coll, Frame
from .allreduce import prepare_allreduce
from .call import Call
from .reduction import AllreduceSpec
from .sra import Sra
from .staging import as_flat, synchronize

__all__ = ["ScatterReduce", "prepare_reduce_scatter", "run_reduce_scatter"]


def prepare_reduce_scatter(
    x: Any,
    out: Any,
    op: str = "sum",
    *,
    world_size: int,
    bits: int | None = None,
    bucket_size: int = 1024,
    stochastic: bool = False,
    seed: int = 0,
) -> tuple[Frame, tuple[Any, Any, AllreduceSpec]]:
    """Check a reduce-scatter of flat ``x`` (world_size * n values) into ``out`` (n)."""
    flat = as_flat(x)
    dst = as_flat(out, "out", writable=True)
    n = dst.size
    if flat.size != world_size * n or dst.dtype != flat.dtype:
        raise ConfigError(
            f"reduce_scatter: x must hold {world_size} x {n} values of out's dtype "
            f"{dst.dtype}, got {flat.size} of {flat.dtype}"
        )
    b = NO_COMPRESSION_BITS if bits is None else bits
    layout = Layout.from_sizes(
        [n] * world_size, bits=[b] * world_size, bucket_sizes=[bucket_size] * world_size
    )
    # The allreduce's checks (op, dtype, bits, seed) and its SRA plan, reused as is.
    template, (_, spec) = prepare_allreduce(
        flat,
        op,
        world_size=world_size,
        layout=layout,
        algorithm="sra",
        stochastic=stochastic,
        seed=seed,
        in_place=False,
    )
    for r, chunk in enumerate(spec.plan.chunks):
        if (chunk.start, chunk.stop) != (r * n, (r + 1) * n):  # pragma: no cover
            raise ConfigError(f"the plan cut shard {r} at [{chunk.start}, {chunk.stop})")
    # The input stays unchanged: the accumulator is staging, never the caller's buffer.
    spec = dataclasses.replace(spec, inplace=False)
    return template.with_(collective=Coll.REDUCE_SCATTER), (flat, dst, spec)


async def run_reduce_scatter(call: Call, state: tuple[Any, Any, AllreduceSpec]) -> Any:
    """Reduce every rank's shard ``rank`` into this rank's ``out``; returns ``out``."""
    flat, dst, spec = state
    await ScatterReduce(call, flat, dst, spec).run()
    synchronize(dst)
    return dst


class ScatterReduce(Sra):
    """SRA's scatter and reduce steps; the reduced shard goes to ``out``, not to peers."""

    def __init__(self, call: Call, x: Any, out: Any, spec: AllreduceSpec) -> None:
        super().__init__(call, x, spec)
        self.out = out

    async def reduce_and_gather(self) -> None:
        """Step 3 only (SRA's run() calls it once the scatter is under way): reduce our
        shard in rank order into ``out``; there is no allgather in a reduce-scatter."""
        ok = await asyncio.gather(*self.sig_futs.values())
        if not all(ok):
            return
        acc = self.accumulator()
        for k, piece in enumerate(self.own.pieces):
            await self.reduce_piece(acc, k, piece)
        self.out[...] = acc
