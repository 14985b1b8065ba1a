"""Whether a rank that published its address is still there, and what it waits for.

While it connects, every rank keeps a liveness mark in the store (``alive/<rank>`` under
the rendezvous generation), written with its address and then every
:data:`MARK_PERIOD_S` by its store thread: the wall-clock time, its process (pid, start
time, PID namespace, machine), the connect phase it is in and the ranks it still waits
for there. When a wait of the connect runs out, :func:`blame` follows these marks from
the ranks this one waits for to the pair that holds everyone up, so that every rank names
the same rank at fault:

- a rank whose process is gone (its machine and PID namespace are ours, so ``/proc``
  tells), or whose mark stopped changing (:data:`STALE_S`; other machines, whose clocks
  are assumed to be synchronized), died after publishing;
- a process that exists but is stopped (SIGSTOP, a debugger) is alive at the host level
  but not answering;
- a live rank still dialing a peer could not reach the address that peer published.

After connecting, the mesh keeps the process of each peer on its machine
(:func:`process_state`), so that a peer that stops answering later is told apart from one
that is cut off.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "MARK_PERIOD_S",
    "STALE_S",
    "LivenessMark",
    "Phase",
    "ProcessId",
    "blame",
    "process_state",
]

#: How often a connecting rank rewrites its mark (one small store write).
MARK_PERIOD_S = 0.5
#: A mark this much older than the reader's clock belongs to a rank that died or stopped:
#: several periods, so a rank on a loaded machine whose store thread runs late is not
#: taken for dead.
STALE_S = 4.0
#: Ranks a mark names as those its rank still waits for.
MAX_PENDING_TOLD = 32
#: Marks :func:`blame` reads at most (one store read each, after the deadline).
MAX_BLAME_READS = 16


class Phase:
    """Where a connecting rank is (the mark's phase code) and how a message says it."""

    ADDRESSES = 0
    DIALING = 1
    HANDSHAKE = 2
    ACCEPTING = 3
    DATA = 4
    DONE = 5
    TEXT = {
        ADDRESSES: "waiting for the addresses of",
        DIALING: "dialing",
        HANDSHAKE: "in the membership handshake with",
        ACCEPTING: "waiting for a connection from",
        DATA: "in the data-channel handshake with",
        DONE: "connected",
    }


def _node_digest(node: str) -> bytes:
    return hashlib.blake2b(node.encode(), digest_size=16).digest()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid``, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    try:
        return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class ProcessId:
    """A process as its machine knows it: pid, start time, PID namespace, machine."""

    pid: int
    start: int
    pidns: int
    node: bytes  # digest of the machine's id (:func:`~.rendezvous.node_id`)

    @classmethod
    def own(cls, node: str) -> ProcessId:
        stat = _stat(os.getpid())
        return cls(os.getpid(), stat[1] if stat else 0, _pid_namespace(), _node_digest(node))

    def local_to(self, node: str) -> bool:
        """Whether this process's ``/proc`` entry is readable from ``node`` as our pid."""
        return (
            self.pidns != 0 and self.pidns == _pid_namespace() and (self.node == _node_digest(node))
        )


def process_state(proc: ProcessId | None, node: str | None = None) -> str | None:
    """ "gone", "stopped" (SIGSTOP, a debugger), "running", or None where the process is
    not on ``node`` in our PID namespace (then nothing can be told from here; without
    ``node``, the caller knows that it is)."""
    if proc is None or (node is not None and not proc.local_to(node)):
        return None
    stat = _stat(proc.pid)
    if stat is None or stat[0] in "ZX" or (proc.start and stat[1] != proc.start):
        return "gone"
    return "stopped" if stat[0] in "Tt" else "running"


@dataclass(frozen=True)
class LivenessMark:
    """One rank's mark in the store (see the module docstring)."""

    time: float
    proc: ProcessId
    phase: int
    pending: tuple[int, ...]

    _HEAD = struct.Struct("<dIQQ16sBH")

    def pack(self) -> bytes:
        pending = self.pending[:MAX_PENDING_TOLD]
        p = self.proc
        head = self._HEAD.pack(self.time, p.pid, p.start, p.pidns, p.node, self.phase, len(pending))
        return head + struct.pack(f"<{len(pending)}H", *pending)

    @classmethod
    def unpack(cls, raw: bytes) -> LivenessMark | None:
        """The mark in ``raw``, None when it is malformed (a mark only ever explains)."""
        if len(raw) < cls._HEAD.size:
            return None
        t, pid, start, pidns, node, phase, n = cls._HEAD.unpack_from(raw)
        if n > MAX_PENDING_TOLD or len(raw) != cls._HEAD.size + 2 * n:
            return None
        pending = struct.unpack_from(f"<{n}H", raw, cls._HEAD.size)
        return cls(t, ProcessId(pid, start, pidns, node), phase, tuple(pending))

    def verdict(self, node: str) -> str | None:
        """Why the rank of this mark cannot be waited for ("gone", "stopped", "stale"), or
        None where it is running (or nothing says otherwise)."""
        state = process_state(self.proc, node)
        if state in ("gone", "stopped"):
            return state
        if state is None and time.time() - self.time > STALE_S:
            return "stale"
        return None


def lost_text(rank: int, mark: LivenessMark, verdict: str, where: str) -> str:
    """The sentence naming a rank that cannot be waited for (``where``: its address)."""
    at = f" ({where})" if where else ""
    pid = mark.proc.pid
    if verdict == "gone":
        return f"rank {rank} died after publishing its address{at}: its process {pid} is gone"
    if verdict == "stopped":
        return (
            f"rank {rank} is alive at the host level but not answering: its process {pid} "
            f"is stopped (SIGSTOP or a debugger) after publishing its address{at}"
        )
    age = time.time() - mark.time
    return (
        f"rank {rank} died (or stopped) after publishing its address{at}: its liveness "
        f"mark in the store is {age:.0f} s old"
    )


async def blame(
    read: Callable[[int], Awaitable[LivenessMark | None]],
    me: int,
    waiting_on: list[int],
    where: Mapping[int, str],
    node: str,
    timeout: float,
    dialing: bool = False,
) -> str | None:
    """The sentence naming the rank at fault when this rank's wait on ``waiting_on`` ran
    out, or None when the marks do not tell.

    Follows the marks (``read``: one rank's, from the store) from the ranks waited for to
    the ones they wait for in turn: the first rank found gone or stopped is at fault; else
    the first live rank still dialing could not reach the peer it dials (at the address
    in ``where``). ``dialing``: this rank's own wait is a dial to ``waiting_on``."""
    queue, seen, reads = [] if dialing else list(waiting_on), {me}, 0
    marks: dict[int, LivenessMark | None] = {}

    async def mark(rank: int) -> LivenessMark | None:
        nonlocal reads
        if rank not in marks and reads < MAX_BLAME_READS:
            reads += 1
            marks[rank] = await read(rank)
        return marks.get(rank)

    async def unreachable(r: int, targets: tuple[int, ...]) -> str:
        for t in targets:
            tm = await mark(t) if t != me else None
            tv = tm.verdict(node) if tm is not None else None
            if tm is not None and tv is not None:
                return lost_text(t, tm, tv, where.get(t, ""))
        t = targets[0]
        return (
            f"rank {r} could not reach rank {t} at {where.get(t, '?')} (published by "
            f"rank {t}): no answer within {timeout:g} s"
        )

    if dialing and waiting_on:
        return await unreachable(me, tuple(waiting_on))
    while queue:
        r = queue.pop(0)
        if r in seen:
            continue
        seen.add(r)
        m = await mark(r)
        if m is None:
            continue
        verdict = m.verdict(node)
        if verdict is not None:
            return lost_text(r, m, verdict, where.get(r, ""))
        if m.phase == Phase.DIALING and m.pending:
            return await unreachable(r, m.pending)
        queue.extend(m.pending)
    return None
