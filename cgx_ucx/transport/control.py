"""The control channel of a mesh: its receive loop, ABORT/BYE frames, peer status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from typing import Any

import numpy as np

from ..errors import CGXError, CGXTimeoutError, PeerLostError, ProtocolError
from . import ucx as _ucx
from .frames import FRAME_NBYTES, AbortCode, Frame, Kind
from .liveness import process_state
from .peer import Peer
from .progress import post_recv, post_send
from .state import MeshState
from .status import STATUS_WAIT_S, PeerStatus
from .stuck import host_acknowledges

__all__ = ["MAX_EARLY_ABORT_FRAMES", "MAX_NAMED_SILENT", "MAX_REASON_NBYTES", "MeshControl"]

log = logging.getLogger("cgx_ucx.transport")

#: Largest reason text an ABORT frame carries.
MAX_REASON_NBYTES = 1024
#: ABORT frames kept while no communicator listens yet (one per peer and call at most).
MAX_EARLY_ABORT_FRAMES = 64
#: Ranks a timed-out wait's message follows, from who the late peer waits on (_behind).
MAX_STATUS_HOPS = 3
#: Ranks an ABORT names as not answering the sender's status request, at most. They
#: follow the reason in its payload, one little-endian u16 each; the frame's ``slot``
#: (unused by ABORT otherwise) says how many. A rank that learns of a failure from the
#: ABORT alone (it never asked the stopped or cut-off peer itself) then does not wait
#: for their BYE at close either.
MAX_NAMED_SILENT = 64


class MeshControl(MeshState):
    """The control channel of a :class:`~cgx_ucx.transport.mesh.Mesh`: one receive loop
    per peer, ABORT/BYE/STATUS frames, and the status of peers that are late."""

    def _on_ctrl_closed(self, rank: int) -> None:
        # Called from UCX progress (the loop thread in blocking/polling mode, the progress
        # thread in thread mode).
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # Two hops: UCX calls this inside worker.progress(), before the progress driver
        # resolves the receives completed in the same call; a BYE that arrived just
        # before the connection closed must be seen first (then the close is quiet).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.call_soon, self._peer_closed, rank, "connection closed")

    def _peer_closed(self, rank: int, how: str) -> None:
        p = self.peers[rank]
        if self._closing or p.lost is not None:
            return
        if p.bye or self._bye_fut is not None:
            # A clean close: later collectives report it, nothing to warn about now.
            text = f"rank {rank} closed its communicator"
            if p.aborted:
                text += f" after aborting {p.aborted}"
            self.lose(rank, PeerLostError(text, peer=rank), quiet=True)
        else:
            self.lose(rank, PeerLostError(f"rank {rank} is gone ({how})", peer=rank))

    async def _control_loop(self, p: Peer) -> None:
        buf = np.empty(FRAME_NBYTES, np.uint8)
        errors = _ucx.errors()
        assert p.keys is not None
        while True:
            try:
                await post_recv(p.ctrl, buf, None)
                frame = Frame.unpack(buf, job=self.job, key=p.keys.key)
                if frame.src != p.rank:
                    raise ProtocolError(f"control frame from rank {p.rank} claims rank {frame.src}")
                named = 2 * frame.slot if frame.kind == Kind.ABORT else 0
                if named > min(2 * MAX_NAMED_SILENT, frame.payload):
                    raise ProtocolError(f"ABORT naming {frame.slot} silent ranks")
                if frame.payload > MAX_REASON_NBYTES + named:
                    raise ProtocolError(f"control payload of {frame.payload} bytes")
                reason, silent = "", ()
                if frame.payload:
                    text = np.empty(frame.payload, np.uint8)
                    await post_recv(p.ctrl, text, None)
                    raw = text.tobytes()
                    cut = len(raw) - named
                    reason = raw[:cut].decode("utf-8", errors="replace")
                    silent = struct.unpack(f"<{frame.slot}H", raw[cut:])
            except asyncio.CancelledError:
                return
            except ProtocolError as exc:
                if not self._closing:
                    self.lose(p.rank, ProtocolError(f"rank {p.rank}: {exc}"))
                return
            except errors:
                if not self._closing:
                    self._peer_closed(p.rank, "connection reset")
                return
            if not self._on_control(p, frame, reason, silent):
                return

    def _on_control(self, p: Peer, frame: Frame, reason: str, silent: tuple[int, ...] = ()) -> bool:
        """Act on one control frame (``silent``: the ranks an ABORT names as not
        answering its sender); False ends the control loop."""
        p.silent = False  # it speaks again (a stopped process continued)
        if frame.kind == Kind.BYE:
            p.bye, p.bye_seq = True, frame.seq
            self._bye_seen()
            self._check_bye(p)
        elif frame.kind == Kind.ABORT:
            self._aborts += 1
            self.told_silent(p.rank, silent)
            p.aborted = f"collective #{frame.seq}: {reason or f'abort code {frame.phase}'}"
            if self._on_abort is not None:
                self._on_abort(frame, reason)
            elif len(self._early_aborts) < MAX_EARLY_ABORT_FRAMES:
                self._early_aborts.append((frame, reason))
        elif frame.kind == Kind.STATUS_REQUEST:
            head, what = self.activity.frame(self.job, self.rank)
            self._spawn(self.send_control(p.rank, head, what))
        elif frame.kind == Kind.STATUS:
            p.answers += 1
            self._bye_seen()
            if p.status is not None and not p.status.done():
                p.status.set_result(PeerStatus.from_frame(frame, reason))
        else:
            if not self._closing:
                self.lose(p.rank, ProtocolError(f"unexpected control frame kind {frame.kind}"))
            return False
        return True

    @property
    def on_abort(self) -> Any:
        """Called with (frame, reason) for every ABORT; ABORTs received before it was
        set are delivered when it is."""
        return self._on_abort

    @on_abort.setter
    def on_abort(self, callback: Any) -> None:
        self._on_abort = callback
        early, self._early_aborts = self._early_aborts, []
        if callback is not None:
            for frame, reason in early:
                callback(frame, reason)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def send_control(
        self, rank: int, frame: Frame, reason: str = "", tail: bytes = b""
    ) -> None:
        """Best-effort control frame (ABORT/BYE/STATUS) with a short bounded wait
        (``tail``: binary fields after the reason, an ABORT's silent ranks)."""
        p = self.peers[rank]
        if p.lost is not None or p.ctrl is None or p.keys is None:
            return
        text = reason.encode()[:MAX_REASON_NBYTES] + tail
        frame = frame.with_(payload=len(text), comm=self.comm_id)
        try:
            head = np.frombuffer(frame.pack(p.keys.key), np.uint8).copy()
            sends = [post_send(p.ctrl, head, None)]
            if text:
                sends.append(post_send(p.ctrl, np.frombuffer(text, np.uint8).copy(), None))
            await asyncio.wait_for(asyncio.gather(*sends), min(self.config.timeout, 5.0))
        except (TimeoutError, *_ucx.errors()) as exc:
            log.debug("rank %d: control frame to rank %d not sent: %s", self.rank, rank, exc)

    async def broadcast_abort(self, seq: int, code: AbortCode, peer: int, reason: str) -> None:
        self._aborts += 1
        self._told = True
        # The peers that did not answer our status request (see MAX_NAMED_SILENT).
        silent = sorted(r for r, q in self.peers.items() if q.silent)[:MAX_NAMED_SILENT]
        frame = Frame(
            kind=Kind.ABORT,
            job=self.job,
            seq=seq,
            src=self.rank,
            phase=int(code),
            count=peer,
            slot=len(silent),
        )
        tail = struct.pack(f"<{len(silent)}H", *silent)
        await asyncio.gather(*(self.send_control(r, frame, reason, tail) for r in self.peers))

    # -- status -------------------------------------------------------------------------
    def collective_started(self, seq: int, what: str) -> None:
        """Record that collective ``seq`` started here (``what``: e.g. "allreduce, numel
        4096"); peers that time out waiting for us are told."""
        self.activity.started(seq, what)
        for p in self.peers.values():
            if p.bye:
                self._check_bye(p)

    def _check_bye(self, p: Peer) -> None:
        """A peer that said BYE after collective #n will not take part in a later one: a
        collective of ours past n that is running now fails at once, naming the close,
        rather than when the peer's endpoints go (the peer waits up to CLOSE_WAIT_S for
        our BYE first). Collectives up to n are left alone: the BYE travels on the control
        channel and may overtake the peer's last data frames."""
        if self._closing or p.lost is not None or not p.bye:
            return
        act = self.activity
        if act.started_seq > max(p.bye_seq, act.finished_seq):
            text = (
                f"rank {p.rank} closed its communicator after collective #{p.bye_seq}; "
                f"collective #{act.started_seq} ({act.what}) here needs it"
            )
            if p.aborted:  # why it left
                text += f"; it aborted {p.aborted}"
            self.lose(p.rank, PeerLostError(text, peer=p.rank), quiet=True)

    def collective_finished(self, seq: int) -> None:
        self.activity.finished(seq)

    async def peer_status(self, rank: int, timeout: float = STATUS_WAIT_S) -> PeerStatus:
        """Ask ``rank`` on the control channel where it is; ``PeerStatus.gone`` when its
        control channel is down, ``answered`` False when it did not answer in time."""
        p = self.peers[rank]
        if p.lost is not None or p.ctrl is None:
            return PeerStatus(rank, gone=True)
        if p.status is None or p.status.done():
            assert self._loop is not None
            p.status = self._loop.create_future()
            await self._ask(rank)
        with contextlib.suppress(TimeoutError):
            got = await asyncio.wait_for(asyncio.shield(p.status), timeout)
            if got is not None:
                got.rank = rank
                return got
        return PeerStatus(rank, gone=p.lost is not None)

    async def _ask(self, rank: int) -> int:
        """Send ``rank`` a STATUS_REQUEST; returns the number of the answer to it."""
        p = self.peers[rank]
        p.asks += 1
        p.asked_at = time.monotonic()
        req = Frame(kind=Kind.STATUS_REQUEST, job=self.job, comm=self.comm_id, src=self.rank)
        await self.send_control(rank, req)
        return p.asks

    async def _status_of(self, rank: int) -> PeerStatus:
        """:meth:`peer_status`, with the state of its process where it runs on this
        machine (.liveness) when it does not answer."""
        status = await self.peer_status(rank, min(STATUS_WAIT_S, self.config.timeout))
        p = self.peers[rank]
        if status.answered or status.gone:
            return status
        if p.process is not None:
            status.process, status.pid = process_state(p.process) or "", p.process.pid
        if status.process in ("", "running") and p.hosts:  # does its kernel acknowledge?
            since = time.monotonic() - p.asked_at
            answers = host_acknowledges(p.hosts, since)
            status.host_state = {True: "answers", False: "silent"}.get(answers, "")
            status.host = ", ".join(sorted(p.hosts))
        return status

    def _behind(self, status: PeerStatus, statuses: dict[int, PeerStatus]) -> str:
        """Who a live late peer waits on, followed rank by rank through the answers in
        ``statuses`` ("; rank 6 is alive and still in ... waiting on rank 7 ...; rank 7
        is alive at the host level but not answering ..."), then every rank that did not
        answer at all: the rank that holds the others up is named even where a rank next
        to it timed out first, or sits behind a cut link."""
        seen, out = {self.rank, status.rank}, []
        for _ in range(MAX_STATUS_HOPS):
            nxt = [r for r in status.waits_on if r not in seen and r in statuses]
            if not status.answered or not nxt:
                break
            seen.add(nxt[0])
            status = statuses[nxt[0]]
            out.append(status.describe())
        silent = [
            st
            for r, st in sorted(statuses.items())
            if not (st.answered or st.gone) and r not in seen
        ]
        out.extend(_silent_ranks(silent))
        return "".join(f"; {text}" for text in out)

    async def _timed_out(self, rank: int, what: str) -> CGXError:
        # Every connected peer is asked at once (one status wait in all), for _behind.
        asked = [r for r, p in self.peers.items() if p.lost is None and p.ctrl is not None]
        answers = await asyncio.gather(*(self._status_of(r) for r in {rank, *asked}))
        statuses = {st.rank: st for st in answers}
        for st in answers:
            if not (st.answered or st.gone):
                self.peers[st.rank].silent = True
        status = statuses[rank]
        exc = CGXTimeoutError(
            f"rank {self.rank}: rank {rank} did not complete {what} within "
            f"{self.config.timeout:g} s: {status.describe()}{self._behind(status, statuses)}",
            peer=rank,
            alive=status.alive,
        )
        if status.gone:
            self.lose(rank, exc)
        else:
            self.fail(exc)  # never tear down a peer that is still there
        return exc


def _silent_ranks(silent: list[PeerStatus]) -> list[str]:
    """The ranks that did not answer, grouped by what their hosts' kernels said:
    "rank 6, rank 7 did not answer a status request within 1 s, and their host
    10.213.0.4 acknowledged nothing since (cut off)"."""
    asked = f"did not answer a status request within {STATUS_WAIT_S:g} s"
    told = {
        "silent": ("acknowledged nothing since (cut off)",) * 2,
        "answers": ("acknowledges", "acknowledge"),
    }
    out = []
    for state in ("silent", "answers", ""):
        group = [st for st in silent if st.host_state == state]
        if not group:
            continue
        ranks = ", ".join(f"rank {st.rank}" for st in group)
        if not state:
            out.append(f"{ranks} {asked}")
            continue
        hosts = sorted({h for st in group for h in st.host.split(", ")})
        whose = "its" if len(group) == 1 else "their"
        one, several = told[state]
        host = (
            f"host {hosts[0]} {one}" if len(hosts) == 1 else f"hosts {', '.join(hosts)} {several}"
        )
        if state == "answers":
            host += " at the TCP level (alive at the host level)"
        out.append(f"{ranks} {asked}, and {whose} {host}")
    return out
