"""Collectives over a connected transport: allreduce (SRA, ring), broadcast, allgather,
barrier.

The asyncio face is :func:`connect` -> :class:`Communicator`; the synchronous face
(futures, for autograd hooks) is :mod:`cgx_ucx.engine`, a bridge over this one.

Modules: ``communicator`` (``connect`` and the public methods), ``bootstrap`` (the codec
made ready on every rank inside ``connect``), ``registry`` (call numbering, calls in
flight, early ABORTs), ``failure`` (the error raised and the ABORT the peers get),
``mailbox_path`` (collectives through node-local mailboxes), ``call`` (one collective in
flight: signature, staging, frames), ``transport`` (the Protocol the collectives need
from the layer below), ``allreduce`` (spec and dispatch), ``sra`` and ``ring`` (the
algorithms, over ``reduction``'s per-piece steps), ``broadcast``, ``allgather``,
``barrier``, ``plan`` (chunks and pipeline pieces), ``piece_codec`` (the codec applied to
pieces), ``staging`` (memory handed to UCX).
"""

from .communicator import CommStats, Communicator, connect
from .plan import PIECE_BYTES, Plan, make_plan
from .transport import Transport

__all__ = [
    "PIECE_BYTES",
    "CommStats",
    "Communicator",
    "Plan",
    "Transport",
    "connect",
    "make_plan",
]
