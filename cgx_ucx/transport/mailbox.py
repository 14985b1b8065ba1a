"""Node-local mailboxes: a small collective's bytes posted in shared memory.

Why: a small allreduce between ranks of one host spends its time in wake-ups, not in
bytes: the caller's thread hands the call to the engine loop, UCX's progress wakes that
loop when a peer's message lands, and the loop wakes the caller (``python -m cgx_ucx.bench
latency`` times each hop). When every rank of a group runs on one host, a rank can instead
*post* its contribution where its peers read it and *watch* their posts: no message, no
loop, no wake-up while both are in the call.

Each rank owns one segment (a ``memfd``, as :mod:`.shm`), mapped read-write by it and
read-only by its peers (through ``/proc/<pid>/fd``, identity checked): a rank writes only
its own memory. Layout, little-endian 64-bit words:

- the header (word index; a collective's number is stored plus one, so that 0 means
  none): 0 magic, 1 state (attached, failed, closed), 2 the number of
  the last collective whose contribution is posted, 3 the number of the last collective
  this rank started over the network (with its signature at 4-11, so a peer waiting here
  for the same number sees the mismatch instead of a silent wait); at byte 256 a ring of
  :data:`ABORTS` abort records (collective number, code, culprit rank, reason length; the
  reason's text at byte 2048 + 256 * entry), so that a failure here reaches a waiting
  peer before anything else this rank does next (its next post, its close).
- two slots, used alternately by collective number: each has 128 bytes of meta (number,
  payload bytes, the 8 signature words) and :data:`SLOT_BYTES` of payload.

Ordering: a writer clears the slot's number, fills the slot, then publishes the number in
the slot's meta and in the header (stores fenced); a reader loads the header's number,
finds the slot whose meta holds it, reads, and checks the meta again afterwards (a
rewrite under it is a ProtocolError, never silent). A rank alternates slots from one post
to the next, so it rewrites a slot two posts later, after its next collective through the
mailboxes finished, which needed every peer's post of it, which each peer makes only after
reading this rank's previous one: two slots need no other acknowledgement.

The loads and stores are plain NumPy ones on x86-64: its CPUs make one core's stores
visible to the others in the order they were made and do not reorder loads, and each is a
separate call that no C compiler moves across another, so the order above holds. Elsewhere
(ARM, POWER) they are compiled Numba functions with a fence around each
(:mod:`._mailbox_kernels`); ``CGX_UCX_MAILBOX_KERNELS`` chooses (:func:`compile_kernels`).
The waits spin for a bounded window (at most a millisecond; the compiled spin releases
the GIL, the NumPy one holds it: a yield between its loads would hand the core to any
other runnable thread for a whole time slice, which made a 2-rank barrier 4x slower), then
yield and sleep; both drivers (a caller's thread, the engine loop) live in
:mod:`cgx_ucx.collectives.local`.
"""

from __future__ import annotations

import contextlib
import mmap
import platform
from typing import Any

import numpy as np

from ..config import ENV_MAILBOX_KERNELS, mailbox_kernels_mode
from ..errors import ConfigError, ProtocolError, TransportError
from .shm import Descriptor, Segment, map_peer, process_gone

__all__ = [
    "SLOT_BYTES",
    "Mailbox",
    "State",
]

#: Payload bytes per slot: the largest contribution (on the wire, after compression) a
#: mailbox collective posts, and so (:data:`~cgx_ucx.collectives.local.LOCAL_ONESHOT_BYTES`)
#: the largest buffer whose allreduce takes the one-round path on a one-host group. 4 MiB:
#: there the one round through shared memory takes 0.3x gloo's time on 2 ranks and 0.9-1.0x
#: on 4 (2 vCPUs), where SRA over messages takes 0.8-0.9x and 1.7-2.5x; with 16 MiB slots
#: the two are within noise of each other at 16 MiB, for four times the resident memory
#: (measured by ``python -m cgx_ucx.bench allreduce --sizes 4 16`` with ``--algorithm
#: auto``, then ``sra``). Pages are only allocated once a post touches them.
SLOT_BYTES = 4 << 20
_MAGIC = 0x3158_4F42_5847_4300  # "\0CGXBOX1"
_HEADER = 4096
_META = 128  # bytes of meta per slot, at 1024 + slot * _META
_META_AT = 1024
SIZE = _HEADER + 2 * SLOT_BYTES
SIG_WORDS = 8

# Header words.
W_MAGIC, W_STATE, W_POSTED, W_STARTED = 0, 1, 2, 3
W_STARTED_SIG = 4  # .. 11
W_FINISHED = 15  # the last collective this rank finished with (read, or gave up)
#: Abort records kept (by collective number modulo this), 4 words each from word 32.
ABORTS = 8
_W_ABORTS = 32
_REASONS_AT = 2048
REASON_BYTES = 256


class State:
    """Values of a mailbox's state word."""

    CONNECTING = 0
    ATTACHED = 1  # mapped every peer: this rank takes part
    FAILED = 2  # could not map a peer: nobody uses mailboxes in this group
    CLOSED = 3  # the communicator closed


#: Whether this CPU keeps one core's stores in order for the others and its loads in order
#: (x86's total store order), so that plain NumPy loads and stores publish a post safely.
ORDERED_CPU = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


# -- ordered loads and stores: plain NumPy unless compile_kernels() swaps in the compiled
# ones (importing this module must not import Numba: the reference codec runs without it).


def _store(words: Any, i: int, value: int) -> None:
    words[i] = value


def _load(words: Any, i: int) -> int:
    return int(words[i])


def _spin(words: Any, i: int, target: int, spins: int) -> bool:
    return bool(words[i] >= target)


def compile_kernels() -> bool:
    """Use the compiled (fenced, GIL-free) loads and stores from here on, compiling them
    or loading them from Numba's cache, where they are needed: a CPU that may reorder
    stores, or ``CGX_UCX_MAILBOX_KERNELS=1``. False when the NumPy ones stay (x86-64 by
    default, or Numba missing there). ConfigError for ``CGX_UCX_MAILBOX_KERNELS=0`` on a
    CPU that may reorder stores: the mailboxes would not be safe there."""
    global _store, _load, _spin
    mode = mailbox_kernels_mode()
    if mode == "0" and not ORDERED_CPU:
        raise ConfigError(
            f"{ENV_MAILBOX_KERNELS}=0: this CPU ({platform.machine()}) may reorder stores, "
            "so the node-local mailboxes need their fenced, compiled loads and stores "
            f"(unset {ENV_MAILBOX_KERNELS}, or CGX_UCX_INTRA_SHM=0 to go without mailboxes)"
        )
    if mode == "0" or (mode == "auto" and ORDERED_CPU):
        return False
    try:
        from . import _mailbox_kernels as k
    except ImportError:
        if ORDERED_CPU:
            return False
        raise ConfigError(
            f"the node-local mailboxes need Numba on this CPU ({platform.machine()}, which "
            "may reorder stores): install numba, or set CGX_UCX_INTRA_SHM=0"
        ) from None
    w = np.zeros(2, np.uint64)
    k.store(w, 0, 1)
    k.load(w, 0)
    k.spin(w, 0, 1, 1)
    peer = w.copy()  # a peer's words are read-only: a signature of their own
    peer.flags.writeable = False
    k.load(peer, 0)
    k.spin(peer, 0, 1, 1)
    _store, _load, _spin = k.store, k.load, k.spin
    return True


class Mailbox:
    """This rank's mailbox and its peers', for one group of ranks on one host.

    Create with :meth:`create`; give :meth:`descriptor` to the peers; :meth:`attach` the
    peers' descriptors; :meth:`settle` agrees with them whether the group uses mailboxes.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._seg: Segment | None = Segment(SIZE)
        self.own = self._seg.array
        self.words = self.own[:_HEADER].view(np.uint64)
        self.words[W_MAGIC] = _MAGIC
        #: Per peer, its header words and its segment's bytes (read-only).
        self.peer_words: dict[int, np.ndarray] = {}
        self.peer_bytes: dict[int, np.ndarray] = {}
        self.peer_pids: dict[int, int] = {}
        self._maps: list[mmap.mmap] = []
        self._closed = False
        self._posts = 0  # contributions posted: slots alternate by this count
        #: Per rank (this one's too), the uint64 meta views of its two slots: made once,
        #: every collective reads them (a view costs a microsecond or two each time).
        self._metas: dict[int, tuple[np.ndarray, np.ndarray]] = {rank: self._slot_metas(self.own)}
        self._slot_mark = [0, 0]  # the collective each of our slots holds, + 1 (0: none)
        self.enabled = False

    # -- setup ------------------------------------------------------------------------
    def descriptor(self) -> Descriptor:
        assert self._seg is not None
        return self._seg.describe(0, SIZE)

    def attach(self, descriptors: dict[int, Descriptor]) -> str | None:
        """Map every peer's segment; None when all mapped, else why not (and this rank's
        state says FAILED, so that every peer gives mailboxes up too)."""
        try:
            for peer, desc in descriptors.items():
                if peer != self.rank:
                    self._map(peer, desc)
        except (OSError, TransportError, ProtocolError) as exc:
            _store(self.words, W_STATE, State.FAILED)
            return str(exc)
        _store(self.words, W_STATE, State.ATTACHED)
        return None

    def _map(self, peer: int, desc: Descriptor) -> None:
        if desc.size != SIZE or desc.offset != 0:
            raise ProtocolError(f"rank {peer}'s mailbox has {desc.size} bytes, not {SIZE}")
        mapped, data = map_peer(self.rank, peer, desc)
        self._maps.append(mapped)
        words = data[:_HEADER].view(np.uint64)
        if int(words[W_MAGIC]) != _MAGIC:
            raise ProtocolError(f"rank {peer}'s segment is not a mailbox")
        self.peer_words[peer] = words
        self.peer_bytes[peer] = data
        self._metas[peer] = self._slot_metas(data)
        self.peer_pids[peer] = desc.pid

    def peer_state(self, peer: int) -> int:
        return int(_load(self.peer_words[peer], W_STATE))

    # -- posting ----------------------------------------------------------------------
    def held(self) -> int:
        """The collective that the slot of this rank's next post still holds (0: none):
        it may be rewritten once every peer :meth:`released` it."""
        return self._slot_mark[self._posts % 2] - 1

    def released(self, peer: int, seq: int) -> bool:
        """Whether ``peer`` is done with this rank's post of collective ``seq``: it
        finished that collective, or posted a later one (a rank's mailbox collectives run
        one at a time, in number order), or gave it up."""
        words = self.peer_words[peer]
        return (
            seq < 0
            or int(_load(words, W_FINISHED)) > seq
            or int(_load(words, W_POSTED)) > seq + 1
            or self.aborted(peer, seq) is not None
        )

    def finished(self, seq: int) -> None:
        """Say that this rank is done with collective ``seq`` (read, or given up)."""
        _store(self.words, W_FINISHED, seq + 1)

    def begin_post(self) -> np.ndarray:
        """The slot this rank's next contribution goes into (the one it did not use last
        time, once every peer :meth:`released` what it holds), marked as holding nothing
        until :meth:`post`; write the payload there."""
        slot = self._posts % 2
        _store(self._metas[self.rank][slot], 0, 0)
        start = _HEADER + slot * SLOT_BYTES
        return self.own[start : start + SLOT_BYTES]

    def post(self, seq: int, sig: np.ndarray, nbytes: int) -> None:
        """Publish collective ``seq``: signature ``sig`` and ``nbytes`` of payload written
        into the slot :meth:`begin_post` returned."""
        meta = self._metas[self.rank][self._posts % 2]
        meta[1] = nbytes
        meta[2 : 2 + SIG_WORDS] = sig
        _store(meta, 0, seq + 1)
        _store(self.words, W_POSTED, seq + 1)
        self._slot_mark[self._posts % 2] = seq + 1
        self._posts += 1

    def announce(self, seq: int, sig: np.ndarray) -> None:
        """Say that collective ``seq`` runs over the network here (signature ``sig``).
        The number is cleared while the signature is rewritten, so that a reader never
        pairs one collective's number with another's signature (see :meth:`started`)."""
        _store(self.words, W_STARTED, 0)
        self.words[W_STARTED_SIG : W_STARTED_SIG + SIG_WORDS] = sig
        _store(self.words, W_STARTED, seq + 1)

    def abort(self, seq: int, code: int, culprit: int, reason: str) -> None:
        """Record that this rank gave up collective ``seq`` (``code``: an AbortCode;
        ``reason``: the error, cut to REASON_BYTES)."""
        i = seq % ABORTS
        w = _W_ABORTS + 4 * i
        text = reason.encode("utf-8", "replace")[:REASON_BYTES]
        at = _REASONS_AT + i * REASON_BYTES
        self.words[w] = 0  # invalid while it is rewritten
        self.own[at : at + len(text)] = np.frombuffer(text, np.uint8)
        self.words[w + 1 : w + 4] = (code, culprit, len(text))
        _store(self.words, w, seq + 1)

    # -- reading peers ----------------------------------------------------------------
    def spin_posted(self, peer: int, seq: int, spins: int) -> bool:
        """Whether ``peer`` posted collective ``seq`` (or later) within ``spins`` loads."""
        return bool(_spin(self.peer_words[peer], W_POSTED, seq + 1, spins))

    def posted(self, peer: int) -> int:
        """The last collective ``peer`` posted (-1: none)."""
        return int(_load(self.peer_words[peer], W_POSTED)) - 1

    def started(self, peer: int) -> tuple[int, np.ndarray]:
        """The last collective ``peer`` started over the network, and its signature; -1
        (none) while the peer rewrites them: the number is read again after the
        signature, and a peer that announced another collective in between (its next
        call, while this rank still waits on the last one) would otherwise look like a
        mismatch."""
        words = self.peer_words[peer]
        seq = int(_load(words, W_STARTED)) - 1
        sig = words[W_STARTED_SIG : W_STARTED_SIG + SIG_WORDS].copy()
        if int(_load(words, W_STARTED)) - 1 != seq:
            return -1, sig
        return seq, sig

    def aborted(self, peer: int, seq: int) -> tuple[int, int, str] | None:
        """(code, culprit, reason) when ``peer`` gave up collective ``seq``."""
        words = self.peer_words[peer]
        i = seq % ABORTS
        w = _W_ABORTS + 4 * i
        if int(_load(words, w)) != seq + 1:
            return None
        code, culprit, n = (int(v) for v in words[w + 1 : w + 4])
        at = _REASONS_AT + i * REASON_BYTES
        reason = bytes(self.peer_bytes[peer][at : at + min(n, REASON_BYTES)])
        if int(_load(words, w)) != seq + 1:  # rewritten meanwhile: a later collective's
            return None
        return code, culprit, reason.decode("utf-8", "replace")

    def contribution(self, peer: int, seq: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``peer``'s posted (signature, payload, slot) of collective ``seq`` (this rank's
        own with ``peer == rank``). ProtocolError when neither slot holds it."""
        data = self.own if peer == self.rank else self.peer_bytes[peer]
        metas = self._metas[peer]
        for slot in (0, 1):
            meta = metas[slot]
            if int(_load(meta, 0)) == seq + 1:
                break
        else:
            held = [int(m[0]) - 1 for m in metas]
            raise ProtocolError(f"rank {peer}'s mailbox holds collectives {held}, not #{seq}")
        nbytes = int(meta[1])
        if nbytes > SLOT_BYTES:
            raise ProtocolError(f"rank {peer} posted {nbytes} bytes, more than a slot")
        start = _HEADER + slot * SLOT_BYTES
        return meta[2 : 2 + SIG_WORDS], data[start : start + nbytes], slot

    def holds(self, peer: int, seq: int, slot: int) -> bool:
        """Whether ``peer``'s ``slot`` still holds collective ``seq`` (checked after the
        payload was read: a writer clears the number before it rewrites the slot)."""
        return int(_load(self._metas[peer][slot], 0)) == seq + 1

    @staticmethod
    def _slot_metas(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The uint64 meta views of slots 0 and 1 of a mailbox's bytes ``data``."""
        m0, m1 = (data[at : at + _META].view(np.uint64) for at in (_META_AT, _META_AT + _META))
        return m0, m1

    def peer_alive(self, peer: int) -> bool:
        """Whether ``peer``'s process still runs (same host: its /proc entry exists and is
        not a zombie, which an exited process stays until its parent reaps it)."""
        return not process_gone(self.peer_pids[peer])

    # -- end --------------------------------------------------------------------------
    def close(self) -> None:
        """Say CLOSED to the peers; this rank's rounds stop (``enabled`` False). The
        memory stays mapped while anything still holds the mailbox (a round on another
        thread reads on safely, then raises); it goes with the object (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.enabled = False
        with contextlib.suppress(Exception):
            _store(self.words, W_STATE, State.CLOSED)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            seg, self._seg = self._seg, None
            if seg is not None:
                self.own = self.words = np.empty(0, np.uint64)
                self._metas = {}  # views of the segment too
                seg.close()
