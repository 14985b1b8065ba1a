"""The numbering of a communicator's collectives and the table of calls in flight.

Every rank numbers its collectives in call order, from 1 (0 is the connection handshake
and the warm-up inside :func:`~.communicator.connect`); a frame carries its call's
number, so calls in flight at once never mix their messages. A peer's ABORT reaches the
call of its number; one for a call this rank has not started yet is kept until it starts.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TypeVar

from ..errors import CGXError
from ..transport.frames import Frame
from .call import Call, abort_error
from .local import LocalCall
from .transport import Transport

__all__ = ["MAX_EARLY_ABORTS", "CallRegistry"]

#: Early ABORT frames (for collectives this rank has not started yet) kept at most.
MAX_EARLY_ABORTS = 1024

C = TypeVar("C", Call, LocalCall)


class CallRegistry:
    """Numbers a communicator's collectives and holds those in flight, by number.

    Calls numbered on the event loop and on a caller's thread (the mailbox path of
    :meth:`~.communicator.Communicator.run_local`) share one numbering; the synchronous
    face runs a call on its thread only while none of its calls is in flight on the loop.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        #: The number the next collective gets.
        self.next_seq = 1
        self._calls: dict[int, Call | LocalCall] = {}
        self._early: collections.OrderedDict[int, CGXError] = collections.OrderedDict()

    def begin(
        self, make: Callable[[int], C], seq: int | None = None
    ) -> tuple[int, C, CGXError | None]:
        """Number a call (``seq``: a number outside the numbering, the warm-up's 0), make
        it with ``make(seq)`` and register it. Returns its number, the call, and the ABORT
        a peer sent for it before it started (None if none).

        The call is registered before the number moves on (the mailbox path numbers on a
        caller's thread while the loop reads ABORTs): an ABORT read once the call is
        registered finds it, one read before the call was numbered is kept as early.
        """
        counted = seq is None
        if seq is None:
            seq = self.next_seq
        call = make(seq)
        self._calls[seq] = call
        if counted:
            self.next_seq = seq + 1
        return seq, call, self._early.pop(seq, None)

    def end(self, seq: int) -> None:
        """Collective ``seq`` ended here (success or failure)."""
        self._calls.pop(seq, None)

    def on_abort(self, frame: Frame, reason: str) -> None:
        """A peer's ABORT: fails the call of its number, or is kept for a call not started
        yet (the latest :data:`MAX_EARLY_ABORTS`); one for a call that ended is dropped."""
        exc = abort_error(
            frame.src, frame.seq, frame.phase, frame.count, reason, self._transport.rank
        )
        call = self._calls.get(frame.seq)
        if call is not None:
            call.fail(exc)
        elif frame.seq >= self.next_seq:
            self._early[frame.seq] = exc
            while len(self._early) > MAX_EARLY_ABORTS:
                self._early.popitem(last=False)

    def fail_all(self, exc: CGXError) -> None:
        """Fail every call in flight with ``exc`` (the communicator is closing)."""
        for call in list(self._calls.values()):
            call.fail(exc)

    def count(self, name: str) -> None:
        """Count a finished collective ``name`` in the transport's statistics."""
        stats = self._transport.stats
        stats.collectives += 1
        stats.by_collective[name] = stats.by_collective.get(name, 0) + 1
