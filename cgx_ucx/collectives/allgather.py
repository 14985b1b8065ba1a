"""Allgather: every rank's buffer into row ``rank`` of every rank's output.

After the signatures are exchanged, each rank copies its own buffer into its row and
sends its bytes to every peer straight from its buffer (pieces of at most
:data:`~.plan.PIECE_BYTES`, one message each); rows from peers are received in place.
"""

from __future__ import annotations

from typing import Any

from ..arrays import check_root, xp_of
from ..errors import ConfigError
from ..transport.frames import Algo, Coll, Frame, Op
from .broadcast import byte_pieces
from .call import PH_DATA, Call, gather_or_cancel, make_template
from .staging import as_flat, byte_view, synchronize

__all__ = ["prepare_allgather", "run_allgather"]


def prepare_allgather(
    x: Any, out: Any, world_size: int, reduce_op: str | None = None, root: int | None = None
) -> tuple[Frame, tuple[Any, Any, Any]]:
    """The signature of gathering ``x``; the flat input, the output's rows and the output
    (``out``, or a new array of shape (world_size, *x.shape) when None). ``reduce_op``:
    the local reduction the gather feeds ("max", "min", "prod", "band", "bor", "bxor");
    ``root``: the one rank that keeps the result (torch's gather). Both are signed, so
    ranks that disagree on them raise a mismatch."""
    if root is not None:
        root = check_root(root, world_size)
    op = Op.NONE
    if reduce_op is not None:
        op = Op.__members__.get(str(reduce_op).upper(), Op.NONE)
        if op in (Op.NONE, Op.SUM, Op.AVG):
            raise ConfigError(
                f"reduce_op must be one of max, min, prod, band, bor, bxor, got {reduce_op!r}"
            )
    flat = as_flat(x)
    dst = out
    if dst is None:
        dst = xp_of(x).empty((world_size, *x.shape), x.dtype)
    if tuple(dst.shape) != (world_size, *x.shape) or dst.dtype != x.dtype:
        raise ConfigError(
            f"out must have shape {(world_size, *x.shape)} and dtype {x.dtype}, "
            f"got {tuple(dst.shape)} {dst.dtype}"
        )
    rows = as_flat(dst, "out", writable=True).reshape(world_size, -1)
    digest = 0 if root is None else root + 1
    template = make_template(
        Coll.ALLGATHER, flat, algorithm=Algo.DIRECT, reduce_op=int(op), digest=digest
    )
    return template, (flat, rows, dst)


async def run_allgather(call: Call, state: tuple[Any, Any, Any]) -> Any:
    """Fill every row of the output; returns the output."""
    flat, rows, dst = state
    await call.exchange_signatures()
    rows[call.rank] = flat
    data = byte_view(flat)
    pieces = byte_pieces(data.size)
    synchronize(flat)
    peers = call.transport.peers

    async def recv_from(p: int) -> None:
        row = byte_view(rows[p])
        for k, (a, b) in enumerate(pieces):
            await call.recv_piece(p, PH_DATA, k, row[a:b])

    await gather_or_cancel(
        [
            *(
                call.send(p, PH_DATA, k, data[a:b], len(pieces))
                for k, (a, b) in enumerate(pieces)
                for p in peers
            ),
            *(recv_from(p) for p in peers),
        ]
    )
    return dst
