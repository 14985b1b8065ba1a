"""How a failed collective is reported: the error this rank raises, what its peers are told.

A rank that fails a call for a reason of its own (bad argument, mismatch, timeout,
cancellation) sends every peer an ABORT with a code, the rank it blames and the reason,
and writes the same record into its node-local mailbox where it has one; a lost peer is
not reported (every survivor sees the loss itself).
"""

from __future__ import annotations

import asyncio
import logging

from ..errors import (
    CGXTimeoutError,
    CollectiveMismatchError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from ..transport.frames import AbortCode
from ..transport.mailbox import Mailbox
from .local import recorded_abort
from .transport import Transport

__all__ = ["abort_record", "broadcast_abort", "explained", "tell_peers"]

log = logging.getLogger("cgx_ucx")

#: What the peers are told of a failure: (AbortCode, the rank blamed, the reason).
AbortRecord = tuple[int, int, str]


def explained(box: Mailbox | None, seq: int, rank: int, exc: BaseException) -> BaseException:
    """The error rank ``rank`` raises for its failure ``exc`` of collective ``seq``.

    That is ``exc``, except for a lost peer where a peer recorded in its mailbox ``box``
    that it gave up collective ``seq``: then what it recorded. A rank that aborts a call
    and closes drops its endpoints once every peer answered the ABORT or said BYE, or
    after CLOSE_WAIT_S, so an ABORT still unread in a slow peer's socket is lost with the
    connection; the mailbox record stays mapped here after its owner is gone.
    """
    if box is None or not isinstance(exc, PeerLostError):
        return exc
    return recorded_abort(box, seq, rank) or exc


def abort_record(box: Mailbox | None, seq: int, rank: int, exc: BaseException) -> AbortRecord:
    """What the peers are told of rank ``rank``'s failure ``exc`` of collective ``seq``:
    (code, culprit rank, reason), also written into the mailbox ``box`` at once.

    A lost peer is told too, naming it, though every survivor sees the loss itself: this
    rank closes next, and a survivor that reads this rank's BYE before it notices the loss
    (8 ranks, a node killed: 1 trial in 10) would blame this rank for leaving; on the
    control channel the ABORT precedes the BYE."""
    if isinstance(exc, CGXTimeoutError | PeerLostError):
        code, peer = AbortCode.PEER_LOST, exc.peer if exc.peer is not None else rank
    elif isinstance(exc, ProtocolError):
        code, peer = AbortCode.PROTOCOL, rank
    elif isinstance(exc, CollectiveMismatchError):
        code, peer = AbortCode.MISMATCH, rank
    elif type(exc) is TransportError:
        # Its communicator closed under the call, or its transport failed: this rank is
        # lost to its peers, not in disagreement with them (a peer reading it as a
        # mismatch would report a closing rank as one that called something else).
        code, peer = AbortCode.PEER_LOST, rank
    elif isinstance(exc, asyncio.CancelledError):
        code, peer = AbortCode.LOCAL, rank
        exc = TransportError("cancelled")
    else:
        code, peer = AbortCode.LOCAL, rank
    reason = f"{type(exc).__name__}: {exc}"
    if box is not None and box.enabled and seq:
        box.abort(seq, int(code), int(peer), reason)
    return int(code), int(peer), reason


async def tell_peers(
    transport: Transport, box: Mailbox | None, seq: int, exc: BaseException
) -> None:
    """Tell the peers that this rank failed collective ``seq`` with ``exc``.

    A lost peer (:func:`abort_record`) and a failure that came as a peer's ABORT are told
    too: the origin's ABORT (or the loss) and this rank's BYE reach a third rank with no
    order between them, so it could read the BYE first and blame this rank; on one
    channel the ABORT precedes the BYE."""
    if transport.closed or transport.world_size == 1:
        return
    await broadcast_abort(transport, seq, abort_record(box, seq, transport.rank, exc))


async def broadcast_abort(transport: Transport, seq: int, record: AbortRecord) -> None:
    """Send ``record`` to every peer as the ABORT of collective ``seq`` (best effort)."""
    try:
        await asyncio.shield(transport.broadcast_abort(seq, *record))
    except Exception as err:
        log.debug("abort notification failed: %s", err)
