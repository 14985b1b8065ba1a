"""Where a rank is: the collectives it started and finished, as told to a peer that asks.

When a wait on a peer times out, the mesh asks that peer on the control channel
(STATUS_REQUEST) and the peer answers with a STATUS frame built from its
:class:`Activity`, so the timeout error can say "rank 1 is alive and still in collective
#3 (allreduce, numel 4096)" rather than "rank 1 is gone" (torch's flight recorder is
the model). The communicator reports starts and ends through
:meth:`~cgx_ucx.transport.mesh.Mesh.collective_started` / ``collective_finished``; without
them the mesh still knows the latest collective this rank sent a frame for.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from .frames import Coll, Frame, Kind

__all__ = ["STATUS_WAIT_S", "Activity", "PeerStatus"]

#: How long a timed-out wait waits for the peer's STATUS answer: a live peer's event
#: loop answers within milliseconds; one that does not answer within this is reported
#: as not answering (blocked, or cut off), never as gone.
STATUS_WAIT_S = 1.0
#: Longest description a STATUS frame carries.
MAX_WHAT_NBYTES = 256
#: Peers a STATUS answer names as the ones this rank waits on (the longest waits).
MAX_WAITS_TOLD = 3
#: One wait in a STATUS answer's text, as :meth:`Activity.waiting_on` writes it.
_WAIT = re.compile(r"rank (\d+) for [0-9.]+ s")


class Activity:
    """This rank's collectives: the latest started (seq, description) and finished seq,
    and the peers it is waiting on now (so that a rank that timed out on this one learns
    who this one waits for: behind a cut link, the rank next to it in a ring times out
    first and would otherwise only hear "alive and still in collective #n")."""

    __slots__ = ("_explicit", "_waits", "finished_seq", "started_seq", "what")

    def __init__(self) -> None:
        self.started_seq = 0
        self.what = ""
        self.finished_seq = 0
        self._explicit = False  # the communicator reports finishes (else unknown)
        #: peer -> [operations waiting on it, monotonic time the oldest one began]
        self._waits: dict[int, list] = {}

    def wait_begins(self, rank: int) -> None:
        """An operation with ``rank`` is being waited for (pair with :meth:`wait_ends`)."""
        w = self._waits.get(rank)
        if w is None:
            self._waits[rank] = [1, time.monotonic()]
        else:
            w[0] += 1

    def wait_ends(self, rank: int) -> None:
        w = self._waits.get(rank)
        if w is not None:
            w[0] -= 1
            if w[0] <= 0:
                del self._waits[rank]

    def waiting_on(self) -> str:
        """ "waiting on rank 2 for 2.9 s, rank 0 for 0.1 s" (the longest waits first), or
        "" when nothing is awaited."""
        if not self._waits:
            return ""
        now = time.monotonic()
        longest = sorted(self._waits.items(), key=lambda kv: kv[1][1])[:MAX_WAITS_TOLD]
        return "waiting on " + ", ".join(f"rank {r} for {now - w[1]:.1f} s" for r, w in longest)

    def started(self, seq: int, what: str) -> None:
        if seq >= self.started_seq:
            self.started_seq, self.what = seq, what

    def finished(self, seq: int) -> None:
        self._explicit = True
        self.finished_seq = max(self.finished_seq, seq)

    def sending(self, frame: Frame) -> None:
        """Called for every frame sent: the fallback record of the latest collective."""
        if frame.seq > self.started_seq:
            self.started_seq = frame.seq
            try:
                name = Coll(frame.collective).name.lower()
            except ValueError:
                name = f"collective kind {frame.collective}"
            self.what = f"{name}, numel {frame.numel}"

    def frame(self, job: int, src: int) -> tuple[Frame, str]:
        """The STATUS answer: seq = latest started, count = latest finished + 1 (0: this
        rank does not know), payload = the description."""
        count = self.finished_seq + 1 if self._explicit else 0
        head = Frame(kind=Kind.STATUS, job=job, src=src, seq=self.started_seq, count=count)
        waits = self.waiting_on()
        what = f"{self.what}; {waits}" if waits and self.what else (waits or self.what)
        return head, what.encode()[:MAX_WHAT_NBYTES].decode(errors="ignore")


@dataclass
class PeerStatus:
    """What a peer said about itself (or that it is gone / did not answer)."""

    rank: int
    gone: bool = False
    answered: bool = False
    started_seq: int = 0
    finished_seq: int | None = None
    what: str = ""
    #: Its process as this machine sees it, when it runs here (.liveness.process_state):
    #: "running", "stopped" or "gone"; "" when unknown. ``pid``: that process.
    process: str = ""
    pid: int = 0
    #: Where its process is not seen stopped or gone: whether its host's kernel
    #: acknowledged anything at the TCP level since it was asked (.stuck): "answers",
    #: "silent", or "" when nothing tells. ``host``: that host's address.
    host_state: str = ""
    host: str = ""

    @classmethod
    def from_frame(cls, frame: Frame, what: str) -> PeerStatus:
        finished = frame.count - 1 if frame.count else None
        return cls(frame.src, False, True, frame.seq, finished, what)

    @property
    def waits_on(self) -> list[int]:
        """The ranks the peer said it waits on, longest wait first (from its answer)."""
        _, sep, waits = self.what.rpartition("waiting on ")
        if not self.answered or not sep:
            return []
        return [int(r) for r in _WAIT.findall(waits)[:MAX_WAITS_TOLD]]

    @property
    def alive(self) -> bool | None:
        """True: it answered; False: its control channel is down; None: no answer."""
        if self.gone:
            return False
        return True if self.answered else None

    def describe(self) -> str:
        r = self.rank
        if self.gone:
            return f"rank {r} is gone"
        if not self.answered:
            asked = f"did not answer a status request within {STATUS_WAIT_S:g} s"
            if self.process == "stopped":
                return (
                    f"rank {r} is alive at the host level but not answering: its process "
                    f"{self.pid} is stopped (SIGSTOP or a debugger) and {asked}"
                )
            if self.process == "gone":
                return f"rank {r} is gone: its process {self.pid} exited, and {asked}"
            if self.host_state == "silent":
                why = "the link is cut or the host is down"
                if self.process:  # running here: only the link can be at fault
                    why = f"its process {self.pid} is running: the link is cut"
                return (
                    f"rank {r} is cut off: its host {self.host} acknowledged nothing since "
                    f"it was asked, and it {asked} ({why})"
                )
            if self.process == "running":
                acks = f" and its host {self.host} acknowledges" if self.host_state else ""
                return (
                    f"rank {r} is connected but {asked}; its process {self.pid} is running"
                    f"{acks} (busy outside its event loop{'' if acks else ', or cut off'})"
                )
            if self.host_state == "answers":
                return (
                    f"rank {r} is alive at the host level but not answering: its host "
                    f"{self.host} acknowledges at the TCP level, and it {asked} (stopped, "
                    "a debugger, or blocked outside its event loop)"
                )
            return f"rank {r} is connected but {asked} (busy outside its event loop, or cut off)"
        if self.started_seq == 0:
            waits = f" ({self.what})" if self.what else ""  # point-to-point waits only
            return f"rank {r} is alive and has not started any collective{waits}"
        latest = f"collective #{self.started_seq} ({self.what})"
        if self.finished_seq is None:
            return f"rank {r} is alive; the latest collective it started is {latest}"
        if self.finished_seq >= self.started_seq:
            return f"rank {r} is alive and idle; it finished {latest}"
        return f"rank {r} is alive and still in {latest}"
