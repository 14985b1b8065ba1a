"""Collectives over a connected transport: allreduce (SRA, ring), broadcast, allgather,
barrier.

The asyncio face is :func:`connect` -> :class:`Communicator`; the synchronous face
(futures, for autograd hooks) is :mod:`cgx_ucx.engine`, a bridge over this one.

Modules: ``communicator`` (numbering, failure handling, the public methods), ``call``
(one collective in flight: signature, staging, frames), ``transport`` (the Protocol the
collectives need from the layer below), ``allreduce`` (spec and dispatch), ``sra`` and
``ring`` (the algorithms, over ``reduction``'s per-piece steps), ``broadcast``,
``allgather``, ``barrier``, ``plan`` (chunks and pipeline pieces), ``piece_codec``
(the codec applied to pieces), ``staging`` (memory handed to UCX).
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
