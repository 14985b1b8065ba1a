"""Small collectives of a one-host group through node-local mailboxes.

Where every rank of a communicator runs on one host (and node-local shared memory is on,
``CGX_UCX_INTRA_SHM``), the one-round allreduce (:mod:`.oneshot`) and the barrier do not
send messages: each rank posts its contribution in its own mailbox
(:mod:`cgx_ucx.transport.mailbox`) and watches its peers' mailboxes, then reduces the N
contributions in rank order exactly as :mod:`.oneshot` does (own contribution read back
from the bytes it posted; compressed layouts encoded once and every contribution decoded),
so replicas stay bit-identical and the results equal the message path's.

Whether a call takes this path depends only on what every rank agrees on (the signature,
through the algorithm "auto" picks, and the group's mailbox, which all ranks or none
use), never on timing. Two drivers run it:

- :func:`wait_blocking`, on the caller's thread (a :class:`~cgx_ucx.engine.SyncCommunicator`
  call with nothing else in flight): no hop to the engine loop and back.
- :func:`wait_async`, on the engine loop (the asyncio core, or a call queued behind
  others), so calls keep their order.

Both spin for a bounded window (compiled, GIL released; skipped on an oversubscribed host)
while peers are expected any moment, then sleep with a growing interval. Failures keep the
message path's guarantees: a signature that differs is a
:class:`~cgx_ucx.errors.CollectiveMismatchError` on every rank (each rank compares every
posted signature, and a peer that runs the same number over the network is seen through
its announcement); a rank that fails records an abort its peers read; a peer that dies,
closes or is late past the timeout is named in a typed error.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..arrays import is_cupy
from ..errors import (
    CGXError,
    CGXTimeoutError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from ..transport import progress
from ..transport.frames import Algo, Coll, Frame
from ..transport.mailbox import SLOT_BYTES, Mailbox, State
from .call import abort_error, describe, mismatch_error, what
from .reduction import AllreduceSpec, encode_one_round, host_run
from .staging import byte_view

__all__ = [
    "HAND_OVER_S",
    "LOCAL_ONESHOT_BYTES",
    "AllgatherOp",
    "AllreduceOp",
    "BarrierOp",
    "BroadcastOp",
    "LocalCall",
    "LocalOp",
    "Round",
    "allreduce_fits",
    "finish_allreduce",
    "post_allreduce",
    "signature_words",
    "wait_async",
    "wait_blocking",
]

#: Under algorithm="auto", a one-host group with mailboxes takes the one-round path up to
#: this many bytes of the caller's buffer (any world size): nothing crosses a network, so
#: the crossover is where a slot ends, not where bandwidth starts to count.
LOCAL_ONESHOT_BYTES = SLOT_BYTES
#: Seconds a waiting rank spins before it sleeps, on a caller's thread and on the engine
#: loop (where the spin holds the loop up): ranks in step post within tens of us of each
#: other, and a sleeper's wake-up costs about as much as the whole call.
SPIN_S = 1e-3
LOOP_SPIN_S = 500e-6
#: Ordered loads per compiled spin call (a few microseconds each).
SPINS = 256
#: Then seconds of yielding (sched_yield: a peer sharing the core runs, this thread stays
#: ready), and sleeps between checks from FIRST_SLEEP_S, doubling to MAX_SLEEP_S (on the
#: loop a sleep lasts at least a millisecond: epoll's resolution).
YIELD_S = 2e-3
#: Seconds a caller's thread waits (spinning, then yielding) before it hands the rest of
#: the wait to the engine loop and returns a pending future: it must not be held for a
#: late peer (an async_op call, or a wait with a timeout of its own).
HAND_OVER_S = 1e-3
FIRST_SLEEP_S = 50e-6
MAX_SLEEP_S = 1e-3
#: Seconds between checks that a missing peer's process still exists.
ALIVE_PERIOD_S = 0.05


class LocalCall:
    """Stands for a mailbox collective running on a caller's thread in the communicator's
    table of calls, so that an abort a peer sends over the network reaches it."""

    def __init__(self) -> None:
        self.error: CGXError | None = None

    def fail(self, exc: CGXError) -> None:
        if self.error is None:
            self.error = exc


def signature_words(template: Frame) -> np.ndarray:
    return np.array(template.signature, np.uint64)


def _frame_of(template: Frame, words: np.ndarray) -> Frame:
    """``template`` with the signature fields ``words`` carries (to describe a peer's call)."""
    names = ("collective", "reduce_op", "dtype", "bits", "algorithm", "flags", "numel", "digest")
    return template.with_(**{n: int(w) for n, w in zip(names, words, strict=True)})


def recorded_abort(box: Mailbox, seq: int, rank: int) -> CGXError | None:
    """The first peer's abort record of collective ``seq`` in its mailbox, as the error
    it means on ``rank``; None where no peer recorded one."""
    for p in box.peer_words:
        abort = box.aborted(p, seq)
        if abort is not None:
            return abort_error(p, seq, *abort, rank)
    return None


class Round:
    """One mailbox collective on this rank: post, wait for every peer's post, read.

    ``check`` raises the communicator's failure, if any (a lost peer seen by the network
    layer, an abort a peer sent over the network)."""

    def __init__(
        self,
        box: Mailbox,
        seq: int,
        name: str,
        template: Frame,
        timeout: float,
        check: Callable[[], None],
    ) -> None:
        self.box = box
        self.seq = seq
        self.name = name
        self.template = template
        self.sig = signature_words(template)
        self._sig_bytes = self.sig.tobytes()  # compared with every posted signature
        self.timeout = timeout
        self.check = check
        self.rank = box.rank
        self.peers = [p for p in range(box.world_size) if p != box.rank]
        self.missing = list(self.peers)
        self.held = -1  # while claiming: the collective our next slot still holds
        self._slots: list[int] = []  # the slot each rank's contribution was read from
        #: Payload bytes this rank posted (each peer reads them) and read from its peers.
        self.sent = 0
        self.received = 0
        self.start = time.monotonic()
        self._alive_at = self.start

    def buffer(self) -> np.ndarray:
        """Where this rank writes its payload, before :meth:`post`."""
        return self.box.begin_post()

    def post(self, nbytes: int) -> None:
        self.box.post(self.seq, self.sig, nbytes)
        self.sent = nbytes

    def claim(self, spins: int) -> bool:
        """True once every peer is done with what this rank's next slot holds (at once,
        but for a collective that ended early on some rank: a third rank's abort, say).
        The first step of a round, before its payload is written."""
        held = self.box.held()
        try:
            self.missing = [p for p in self.missing if not self.box.released(p, held)]
        except KeyError:
            raise TransportError("the communicator was closed during the collective") from None
        if self.missing:
            self.held = held
            return False
        self.missing = list(self.peers)
        self.held = -1
        return True

    def end(self) -> None:
        """The last step of a round, whatever its outcome: peers may rewrite its slots."""
        if self.box.enabled:
            self.box.finished(self.seq)

    def poll(self, spins: int) -> bool:
        """True once every peer posted; raises what makes waiting pointless."""
        box, seq = self.box, self.seq
        if not box.enabled:
            raise TransportError("the communicator was closed during the collective")
        try:
            self.missing = [
                p for p in self.missing if not box.spin_posted(p, seq, spins) and self._absent(p)
            ]
        except KeyError:  # closed under us: the mappings are gone
            raise TransportError("the communicator was closed during the collective") from None
        return not self.missing

    def _absent(self, p: int) -> bool:
        """True while peer ``p`` may still post; raises if it will not."""
        box, seq = self.box, self.seq
        abort = box.aborted(p, seq)
        closed = box.peer_state(p) == State.CLOSED
        started, sig = box.started(p)
        # Loaded after the above: a peer that posted, then failed, closed or moved on
        # (its stores in that order) has posted.
        if box.spin_posted(p, seq, 1):
            return False
        if abort is not None:
            raise abort_error(p, seq, *abort, self.rank)
        if started == seq:
            if not np.array_equal(sig, self.sig):
                raise mismatch_error(seq, self.name, [self._mismatch(p, sig)])
            raise ProtocolError(
                f"collective #{seq} ({self.name}): rank {p} runs it over the network while "
                f"rank {self.rank} runs it through node-local shared memory (a device buffer "
                "on one rank and a host buffer on another?)"
            )
        if closed:
            raise PeerLostError(
                f"rank {p} closed its communicator; collective #{seq} ({self.name}) here needs it",
                peer=p,
            )
        return True

    def _explain(self, p: int) -> None:
        """Raise why peer ``p``'s slot holds another collective (it failed or went over
        the network with this one), if its mailbox says."""
        abort = self.box.aborted(p, self.seq)
        if abort is not None:
            raise abort_error(p, self.seq, *abort, self.rank)
        started, sig = self.box.started(p)
        if started == self.seq and not np.array_equal(sig, self.sig):
            raise mismatch_error(self.seq, self.name, [self._mismatch(p, sig)])

    def _mismatch(self, p: int, sig: np.ndarray) -> str:
        return (
            f"rank {p} called {describe(_frame_of(self.template, sig))} while rank "
            f"{self.rank} called {describe(self.template)}"
        )

    def overdue(self) -> None:
        """The slow checks, between sleeps: the communicator's failure, the deadline, and
        whether the missing peers' processes still exist."""
        self.check()
        now = time.monotonic()
        if now - self._alive_at >= ALIVE_PERIOD_S:
            self._alive_at = now
            for p in self.missing:
                if not self.box.peer_alive(p):
                    raise PeerLostError(
                        f"rank {p} is gone (its process exited) during collective "
                        f"#{self.seq} ({self.name})",
                        peer=p,
                    )
        if now - self.start > self.timeout:
            p = self.missing[0]
            raise CGXTimeoutError(
                f"collective #{self.seq} ({self.name}): "
                + (
                    f"no contribution from rank {p}"
                    if self.held < 0
                    else f"rank {p} did not release this rank's post of collective #{self.held}"
                )
                + f" within {self.timeout:g} s; rank {p} is alive, {self._doing(p)}",
                peer=p,
                alive=True,
            )

    def _doing(self, p: int) -> str:
        """What peer ``p``'s mailbox says it last started (for a timeout's message)."""
        box = self.box
        posted = box.posted(p)
        started, sig = box.started(p)
        if started > posted:
            return f"last in collective #{started} ({self._what(sig)}, over the network)"
        if posted < 0:
            return "in no collective since it connected"
        try:
            sig, _, _ = box.contribution(p, posted)
        except ProtocolError:
            return f"last in collective #{posted}"
        return f"last in collective #{posted} ({self._what(sig)})"

    def _what(self, sig: np.ndarray) -> str:
        frame = _frame_of(self.template, sig)
        code = frame.collective
        name = Coll(code).name.lower() if code in Coll._value2member_map_ else str(code)
        return what(name, frame)

    def contributions(self) -> list[np.ndarray]:
        """Every rank's payload in rank order, after checking each signature."""
        out, problems, self._slots = [], [], []
        for q in range(self.box.world_size):
            try:
                sig, payload, slot = self.box.contribution(q, self.seq)
            except ProtocolError:
                self._explain(q)
                raise
            if q != self.rank and sig.tobytes() != self._sig_bytes:
                problems.append(self._mismatch(q, sig))
            out.append(payload)
            self._slots.append(slot)
        self.received = sum(int(p.size) for q, p in enumerate(out) if q != self.rank)
        if problems:
            raise mismatch_error(self.seq, self.name, problems)
        return out

    def verify(self) -> None:
        """After reading the contributions: ProtocolError if a peer rewrote its slot
        meanwhile (it went on while this rank was still reading: a protocol violation)."""
        for q, slot in enumerate(self._slots):
            if q != self.rank and not self.box.holds(q, self.seq, slot):
                raise ProtocolError(
                    f"collective #{self.seq} ({self.name}): rank {q} rewrote its mailbox "
                    "while this rank was reading it"
                )


def _spins() -> int:
    return 0 if progress.no_spare_core() else SPINS


def wait_blocking(r: Round, budget: float, poll: Callable[[int], bool] | None = None) -> bool:
    """Wait on this thread until every peer posted ``r`` (or ``poll``, e.g.
    :meth:`Round.claim`, says True), at most ``budget`` seconds (then False: the caller
    hands the rest to :func:`wait_async`)."""
    poll = r.poll if poll is None else poll
    spins = _spins()
    if poll(spins):
        return True
    start = time.perf_counter()
    spin_end = start + (SPIN_S if spins else 0.0)
    while time.perf_counter() < spin_end:
        if poll(spins):
            return True
    end = start + budget
    while True:
        r.overdue()
        if time.perf_counter() >= end:
            return False
        if spins:
            os.sched_yield()  # a peer sharing this core runs now
        else:
            # A full host: a yield hands the core to another process for a whole time
            # slice; a short sleep comes back with the scheduler's credit for sleepers.
            time.sleep(FIRST_SLEEP_S)
        if poll(1):
            return True


async def wait_async(r: Round, poll: Callable[[int], bool] | None = None) -> None:
    """Wait on the event loop until every peer posted ``r`` (or ``poll`` says True; a
    short spin holds the loop up; then it yields and sleeps, letting other collectives
    progress)."""
    poll = r.poll if poll is None else poll
    spins = _spins()
    if poll(spins):
        return
    spin_end = time.perf_counter() + (LOOP_SPIN_S if spins else 0.0)
    while time.perf_counter() < spin_end:
        if poll(spins):
            return
    now = time.perf_counter()
    yield_end = now + (YIELD_S if spins else 0.0)
    # A full host: no yields (see wait_blocking), and for HAND_OVER_S short sleeps of the
    # thread, as wait_blocking sleeps, each followed by a turn of the loop's other
    # callbacks: a timer of the loop's lasts at least a millisecond (epoll's resolution),
    # longer than a whole call (4 ranks on 2 cores, 4 KiB at 32 bits: 1.2-1.3 ms a call
    # waiting on timers, 0.38 ms with these sleeps).
    short_end = now if spins else now + HAND_OVER_S
    pause = 0.0 if spins else FIRST_SLEEP_S
    while True:
        r.overdue()
        if time.perf_counter() < short_end:
            time.sleep(FIRST_SLEEP_S)
            await asyncio.sleep(0)
        else:
            if not pause:
                os.sched_yield()  # the loop's turn goes on, but a peer sharing this core runs
            await asyncio.sleep(pause)
        if poll(1):
            return
        if time.perf_counter() > yield_end:
            pause = min(max(pause * 2, FIRST_SLEEP_S), MAX_SLEEP_S)


# -- the one-round allreduce ---------------------------------------------------------------


def allreduce_fits(flat: Any, spec: AllreduceSpec) -> bool:
    """Whether this allreduce goes through the mailboxes (given a group that has them):
    the one-round algorithm, a host buffer, a contribution that fits one slot."""
    if spec.algorithm != Algo.ONESHOT or is_cupy(flat):
        return False
    piece = spec.plan.chunks[0].pieces[0]
    nbytes = flat.nbytes if spec.raw else piece.wire_nbytes(flat.dtype)
    return nbytes <= SLOT_BYTES


def post_allreduce(r: Round, flat: Any, spec: AllreduceSpec) -> int:
    """Write this rank's contribution (raw bytes, or encoded once) and post it; returns
    its size in bytes."""
    buf = r.buffer()
    if spec.raw:
        raw = byte_view(flat)
        nbytes = int(raw.size)
        buf[:nbytes] = raw
    else:
        nbytes = int(encode_one_round(spec, flat, buf, r.seq, r.rank).size)
    r.post(nbytes)
    return nbytes


def finish_allreduce(r: Round, flat: Any, spec: AllreduceSpec) -> None:
    """x = the rank-ordered reduction of every posted contribution: the same float
    operations as :mod:`.oneshot`'s, in fewer passes over memory (the first two
    contributions added in one; a float32 buffer is its own accumulator)."""
    parts = r.contributions()
    dtype = flat.dtype
    with np.errstate(over="ignore"):  # IEEE overflow to inf, as the message path
        if spec.raw:
            acc = flat if spec.acc_dtype == dtype else np.empty(flat.size, spec.acc_dtype)
            if len(parts) == 1:
                acc[...] = _values(parts[0], dtype)
            else:
                v0, v1 = _values(parts[0], dtype), _values(parts[1], dtype)
                np.add(v0, v1, out=acc, dtype=acc.dtype)
            for part in parts[2:]:
                np.add(acc, _values(part, dtype), out=acc)
        else:
            run = host_run(spec, dtype)
            acc = flat if dtype == np.float32 else np.empty(flat.size, np.float32)
            acc[...] = 0
            for part in parts:
                run.decode_add(part, acc)
        r.verify()
        if spec.avg:
            np.divide(acc, len(parts), out=acc)
        if acc is not flat:
            flat[...] = acc


def _values(part: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return part.view(dtype) if part.size else np.empty(0, dtype)


# -- what each collective posts and does with the posts ----------------------------------


class LocalOp(Protocol):
    """A collective's two steps around the wait: post this rank's part, use everyone's
    (returning the collective's result)."""

    def post(self, r: Round) -> int: ...

    def finish(self, r: Round) -> Any: ...


class AllreduceOp:
    """The one-round allreduce of ``flat`` as ``spec`` says (:func:`allreduce_fits`)."""

    def __init__(self, flat: Any, spec: AllreduceSpec) -> None:
        self.flat = flat
        self.spec = spec

    @classmethod
    def of(cls, state: tuple[Any, AllreduceSpec]) -> AllreduceOp | None:
        """The op for a prepared allreduce, None where it does not fit a mailbox."""
        flat, spec = state
        return cls(flat, spec) if allreduce_fits(flat, spec) else None

    def post(self, r: Round) -> int:
        return post_allreduce(r, self.flat, self.spec)

    def finish(self, r: Round) -> None:
        finish_allreduce(r, self.flat, self.spec)


class BarrierOp:
    """The barrier: an empty post; everyone's signature checked."""

    @classmethod
    def of(cls, state: None) -> BarrierOp:
        return cls()

    def post(self, r: Round) -> int:
        r.post(0)
        return 0

    def finish(self, r: Round) -> None:
        r.contributions()
        r.verify()


def _fits(flat: Any) -> bool:
    """A host buffer whose bytes fit one slot."""
    return not is_cupy(flat) and flat.nbytes <= SLOT_BYTES


def _post_bytes(r: Round, flat: Any) -> int:
    raw = byte_view(flat)
    r.buffer()[: raw.size] = raw
    r.post(int(raw.size))
    return int(raw.size)


def _payload(r: Round, parts: list[np.ndarray], q: int, nbytes: int) -> np.ndarray:
    if parts[q].size != nbytes:
        raise ProtocolError(
            f"collective #{r.seq} ({r.name}): rank {q} posted {parts[q].size} bytes, "
            f"{nbytes} expected"
        )
    return parts[q]


class BroadcastOp:
    """The root posts its buffer; every other rank copies it (and posts nothing, but its
    signature, so that every rank checks every other)."""

    def __init__(self, flat: Any, root: int) -> None:
        self.flat = flat
        self.root = root

    @classmethod
    def of(cls, state: tuple[Any, int]) -> BroadcastOp | None:
        flat, root = state
        return cls(flat, root) if _fits(flat) else None

    def post(self, r: Round) -> int:
        if r.rank == self.root:
            return _post_bytes(r, self.flat)
        r.post(0)
        return 0

    def finish(self, r: Round) -> None:
        parts = r.contributions()
        if r.rank != self.root:
            data = _payload(r, parts, self.root, int(self.flat.nbytes))
            byte_view(self.flat)[...] = data
        r.verify()


class AllgatherOp:
    """Every rank posts its buffer; every rank copies all of them into its output rows."""

    def __init__(self, flat: Any, rows: Any, dst: Any) -> None:
        self.flat = flat
        self.rows = rows
        self.dst = dst

    @classmethod
    def of(cls, state: tuple[Any, Any, Any]) -> AllgatherOp | None:
        flat, rows, dst = state
        return cls(flat, rows, dst) if _fits(flat) and not is_cupy(rows) else None

    def post(self, r: Round) -> int:
        return _post_bytes(r, self.flat)

    def finish(self, r: Round) -> Any:
        parts = r.contributions()
        nbytes = int(self.flat.nbytes)
        for q in range(len(parts)):
            data = _payload(r, parts, q, nbytes)
            if q == r.rank:
                self.rows[q] = self.flat
            elif nbytes:
                self.rows[q] = data.view(self.flat.dtype)
        r.verify()
        return self.dst
