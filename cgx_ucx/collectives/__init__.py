"""Collectives over the UCX mesh: allreduce (SRA, ring), broadcast, allgather, barrier.

The asyncio face is :func:`connect` -> :class:`Communicator`; the synchronous face
(futures, for autograd hooks) is :mod:`cgx_ucx.engine`, a bridge over this one.
"""

from .communicator import CommStats, Communicator, connect
from .plan import PIECE_BYTES, Plan, make_plan

__all__ = ["PIECE_BYTES", "CommStats", "Communicator", "Plan", "connect", "make_plan"]
