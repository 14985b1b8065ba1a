"""Broadcast: the root's buffer copied into every rank's, in pieces (one message each).

After the signatures are exchanged (every rank agrees on numel, dtype and root), the root
sends its bytes to every peer straight from its buffer (no staging, no copy) and the
others receive them in place.
"""

from __future__ import annotations

from typing import Any

from ..arrays import check_root
from ..transport.frames import Algo, Coll, Frame
from ..transport.handshake import MAX_SLOTS
from .call import PH_DATA, Call, gather_or_cancel, make_template
from .plan import PIECE_BYTES
from .staging import as_flat, byte_view, synchronize

__all__ = ["byte_pieces", "prepare_broadcast", "run_broadcast"]


def byte_pieces(nbytes: int) -> list[tuple[int, int]]:
    """[start, stop) byte ranges of at most PIECE_BYTES each (one empty range for 0)."""
    if nbytes == 0:
        return [(0, 0)]
    count = min(-(-nbytes // PIECE_BYTES), MAX_SLOTS)
    step = -(-nbytes // count)
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def prepare_broadcast(
    x: Any, root: int, world_size: int, rank: int | None = None
) -> tuple[Frame, tuple[Any, int]]:
    """The signature of broadcasting ``x`` from ``root``; the flat view and the root
    (``rank``: this rank; every rank but the root receives into ``x``)."""
    flat = as_flat(x, writable=rank is not None and rank != root)
    root = check_root(root, world_size)
    return make_template(Coll.BROADCAST, flat, algorithm=Algo.DIRECT, digest=root), (flat, root)


async def run_broadcast(call: Call, state: tuple[Any, int]) -> None:
    """Copy the root's flat array into every rank's, in place."""
    flat, root = state
    await call.exchange_signatures()
    data = byte_view(flat)
    pieces = byte_pieces(data.size)
    if call.rank == root:
        synchronize(flat)
        await gather_or_cancel(
            call.send(p, PH_DATA, k, data[a:b], len(pieces))
            for k, (a, b) in enumerate(pieces)
            for p in call.transport.peers
        )
    else:
        for k, (a, b) in enumerate(pieces):
            await call.recv_piece(root, PH_DATA, k, data[a:b])
