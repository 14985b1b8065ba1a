"""The record of one peer of a mesh: its two endpoints, its keys and what it told us."""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import CGXError
from .handshake import PairKeys
from .liveness import ProcessId

__all__ = ["Peer"]


class Peer:
    """One peer of a :class:`~cgx_ucx.transport.mesh.Mesh`, by rank."""

    __slots__ = (
        "aborted",
        "answers",
        "asked_at",
        "asks",
        "bye",
        "bye_seq",
        "ctrl",
        "ctrl_task",
        "data",
        "hosts",
        "keys",
        "lost",
        "process",
        "rank",
        "remote",
        "silent",
        "status",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ctrl: Any = None  # error-handling endpoint (listener / create_endpoint)
        self.data: Any = None  # worker-address endpoint
        #: The IP addresses of the host it published (its listener's): where our
        #: connections to it go (resolved at connect, for .stuck).
        self.hosts: frozenset[str] = frozenset()
        #: Its process, when it runs on this machine in our PID namespace (.liveness).
        self.process: ProcessId | None = None
        self.keys: PairKeys | None = None
        #: On another node of the topology: its data goes over the network, whose
        #: transports wake the progress driver by events (:meth:`.progress.Progress.submit`).
        self.remote = False
        self.ctrl_task: asyncio.Task | None = None
        self.lost: CGXError | None = None
        self.bye = False
        #: The last collective the peer started before it said BYE (the BYE's seq).
        self.bye_seq = 0
        self.status: asyncio.Future | None = None  # a STATUS answer being waited for
        #: What the peer's last ABORT said ("collective #n: reason"): a peer that gives
        #: up a call we had already finished, then closes, is reported with its reason.
        self.aborted = ""
        #: STATUS_REQUESTs sent to the peer and its STATUS answers: it answers in order,
        #: so answer n says that it read every control frame sent before request n.
        self.asks = 0
        self.answers = 0
        #: time.monotonic() of the last STATUS_REQUEST sent to it.
        self.asked_at = 0.0
        #: It did not answer a status request, ours or (named in an ABORT) another
        #: rank's: stopped, its loop blocked, or cut off. close() does not wait for its
        #: BYE; any control frame from it clears this.
        self.silent = False
