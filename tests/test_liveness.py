"""The liveness marks of a connect (cgx_ucx.transport.liveness) and the waits a STATUS
answer names, without processes: packing, what a process's state says, and which rank
:func:`blame` names."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from cgx_ucx.transport.control import _silent_ranks
from cgx_ucx.transport.liveness import (
    MAX_PENDING_TOLD,
    STALE_S,
    LivenessMark,
    Phase,
    ProcessId,
    blame,
    process_state,
)
from cgx_ucx.transport.rendezvous import node_id
from cgx_ucx.transport.status import PeerStatus

NODE = node_id()


def mark(phase: int, pending=(), age: float = 0.0, proc: ProcessId | None = None) -> LivenessMark:
    return LivenessMark(time.time() - age, proc or ProcessId.own(NODE), phase, tuple(pending))


def test_a_mark_round_trips_and_a_malformed_one_is_none():
    m = mark(Phase.DIALING, range(MAX_PENDING_TOLD))
    assert LivenessMark.unpack(m.pack()) == m
    assert LivenessMark.unpack(m.pack()[:-1]) is None
    assert LivenessMark.unpack(b"short") is None
    longer = mark(Phase.DIALING, range(MAX_PENDING_TOLD + 5))
    assert LivenessMark.unpack(longer.pack()).pending == tuple(range(MAX_PENDING_TOLD))


def test_process_state_tells_running_stopped_and_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = ProcessId.own(NODE)
        assert process_state(proc, NODE) == "running"
        other = ProcessId(child.pid, 0, proc.pidns, proc.node)
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(100):
            if process_state(other, NODE) == "stopped":
                break
            time.sleep(0.01)
        assert process_state(other, NODE) == "stopped"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert process_state(other, NODE) == "gone"
        # Another machine, or another PID namespace: nothing can be told from here.
        assert process_state(other, "another machine") is None
        assert process_state(ProcessId(child.pid, 0, proc.pidns + 1, proc.node), NODE) is None
    finally:
        child.kill()
        child.wait()


def _blame(marks: dict[int, LivenessMark], me: int, waiting_on: list[int], dialing=False):
    async def read(rank: int) -> LivenessMark | None:
        return marks.get(rank)

    where = {r: f"10.0.0.{r}:{5000 + r}" for r in range(8)}
    return asyncio.run(blame(read, me, waiting_on, where, NODE, 10.0, dialing))


def test_blame_names_the_rank_whose_address_does_not_answer_from_every_rank():
    marks = {
        0: mark(Phase.DATA, [2]),
        1: mark(Phase.ACCEPTING, [2]),
        2: mark(Phase.DIALING, [1]),
    }
    text = "rank 2 could not reach rank 1 at 10.0.0.1:5001 (published by rank 1): no answer"
    # Rank 0 waits on rank 2's data hello, rank 1 on its connection, rank 2 dials rank 1.
    for me, waiting_on, dialing in ((0, [2], False), (1, [2], False), (2, [1], True)):
        assert text in _blame(marks, me, waiting_on, dialing), me


def test_blame_names_a_rank_that_died_or_stopped_after_publishing():
    other_machine = ProcessId(1, 0, 1, b"\0" * 16)
    stale = mark(Phase.ACCEPTING, [], age=STALE_S + 5, proc=other_machine)
    marks = {0: mark(Phase.ACCEPTING, [1]), 1: stale, 2: mark(Phase.DIALING, [1])}
    for me in (0, 2):
        text = _blame(marks, me, [1])
        assert text.startswith("rank 1 died (or stopped) after publishing its address"), text
    gone = ProcessId(2**22 + 1, 0, ProcessId.own(NODE).pidns, ProcessId.own(NODE).node)
    marks[1] = mark(Phase.ACCEPTING, [], proc=gone)
    assert _blame(marks, 2, [1]).startswith("rank 1 died after publishing its address")
    # A live rank on another machine whose mark is fresh is not blamed for being there.
    marks[1] = mark(Phase.ACCEPTING, [], proc=other_machine)
    assert _blame(marks, 0, [1]) is None


def test_a_status_answer_names_the_ranks_it_waits_on():
    what = "allreduce, numel 65536, bits 4; waiting on rank 1 for 5.0 s, rank 16 for 0.2 s"
    assert PeerStatus(0, answered=True, started_seq=5, what=what).waits_on == [1, 16]
    assert PeerStatus(0, answered=True, started_seq=5, what="allreduce").waits_on == []
    assert PeerStatus(0, answered=False, what=what).waits_on == []


def test_ranks_that_did_not_answer_are_grouped_by_what_their_hosts_said():
    cut = [PeerStatus(r, host_state="silent", host="10.0.0.4") for r in (6, 7)]
    stopped = PeerStatus(3, host_state="answers", host="10.0.0.2")
    unknown = PeerStatus(5)
    text = "; ".join(_silent_ranks([*cut, stopped, unknown]))
    assert text == (
        "rank 6, rank 7 did not answer a status request within 1 s, and their host "
        "10.0.0.4 acknowledged nothing since (cut off); rank 3 did not answer a status "
        "request within 1 s, and its host 10.0.0.2 acknowledges at the TCP level (alive at "
        "the host level); rank 5 did not answer a status request within 1 s"
    )
    two = [PeerStatus(r, host_state="answers", host=f"10.0.0.{r}") for r in (1, 2)]
    assert _silent_ranks(two) == [
        "rank 1, rank 2 did not answer a status request within 1 s, and their hosts "
        "10.0.0.1, 10.0.0.2 acknowledge at the TCP level (alive at the host level)"
    ]


def test_an_abort_naming_silent_ranks_ends_the_wait_for_their_bye():
    """A rank that learns of a failure from an ABORT never asked the ranks the sender
    found silent; the ABORT names them, so close() stops waiting for their BYE (and
    waits for it again once they speak)."""
    from cgx_ucx.config import CommConfig
    from cgx_ucx.transport.control import MeshControl
    from cgx_ucx.transport.frames import AbortCode, Frame, Kind

    async def main():
        mesh = MeshControl(0, 4, CommConfig(timeout=5.0), bytes(32), data_error_handling=False)
        mesh._bye_fut = asyncio.get_running_loop().create_future()
        mesh.peers[1].bye = True
        abort = Frame(kind=Kind.ABORT, job=mesh.job, seq=5, src=2, phase=AbortCode.PEER_LOST)
        # The sender itself and ranks outside the mesh are never marked.
        mesh._on_control(mesh.peers[2], abort.with_(count=3), "timed out", (0, 2, 9))
        assert not any(p.silent for p in mesh.peers.values())
        assert not mesh._bye_fut.done() and not mesh._troubled
        mesh._on_control(mesh.peers[2], abort.with_(count=3), "timed out", (3,))
        assert mesh.peers[3].silent and mesh._troubled
        assert not mesh._bye_fut.done()  # rank 2 has not said BYE yet
        mesh._on_control(mesh.peers[2], Frame(kind=Kind.BYE, job=mesh.job, src=2), "")
        assert mesh._bye_fut.done()
        status = Frame(kind=Kind.STATUS, job=mesh.job, src=3)
        mesh._on_control(mesh.peers[3], status, "")
        assert not mesh.peers[3].silent

    asyncio.run(main())
