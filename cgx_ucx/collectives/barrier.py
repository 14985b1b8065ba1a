"""Barrier: an exchange of signatures and nothing else.

Every rank sends every peer a bare SIG frame and waits for theirs, so no rank leaves
before all have entered (and a rank that called something else fails everyone).
"""

from __future__ import annotations

from ..transport.frames import Coll, Frame, Kind
from .call import Call

__all__ = ["prepare_barrier", "run_barrier"]


def prepare_barrier() -> tuple[Frame, None]:
    return Frame(kind=Kind.DATA, job=0, collective=Coll.BARRIER), None


async def run_barrier(call: Call, state: None) -> None:
    await call.exchange_signatures()
