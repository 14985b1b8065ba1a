"""Node-local shared memory for host buffers: staging a peer maps instead of receiving.

Why: with UCX's peer error handling on (our failure detection needs it), ranks of one
node move host memory through UCX's ``posix``/``sysv`` FIFOs fragment by fragment, both
sides progressing each one, inside a job whose ranks also run the codec: the two-level
allreduce takes 308 ms that way and 209 ms with the segments below (2 x 2 ranks,
1 Gbit/s, 64 MiB, 4 bits; measured by ``python -m cgx_ucx.bench nodes`` with
``CGX_UCX_INTRA_SHM=0``, then without).

Here a rank writes what a node peer needs into a *segment* of its own (a ``memfd``,
anonymous: nothing in ``/dev/shm`` to leak when a rank dies), and sends the peer a
:class:`Descriptor` of where the bytes are (a few dozen bytes, in a keyed frame like any
other data). The peer maps the segment read-only through ``/proc/<pid>/fd/<fd>`` (UCX's
own ``posix`` transport does the same, ``UCX_POSIX_USE_PROC_LINK``) and reads the bytes in
place: one copy in, one read out, no fragments. The opened segment must be the one
described (device and inode checked), so a stale or foreign descriptor fails loudly.

Lifetime is the caller's business: the writer keeps a segment's bytes unchanged until the
reader has said (through the collective's own messages) that it is done with them. Ranks
of one node must see each other's processes (one PID namespace: what torchrun and every
launcher that starts a node's ranks from one agent give); where they cannot, the reader
raises :class:`~cgx_ucx.errors.TransportError` naming ``CGX_UCX_INTRA_SHM=0``, which
moves node-local bytes through UCX instead.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import PeerLostError, ProtocolError, TransportError

__all__ = [
    "DESCRIPTOR_NBYTES",
    "Descriptor",
    "PeerSegments",
    "Segment",
    "SegmentPool",
    "available",
    "map_peer",
    "process_gone",
]

_MAGIC = b"CGXS"
_FORMAT = struct.Struct("<4sIIQQQQQQ")
#: Bytes of a packed :class:`Descriptor`.
DESCRIPTOR_NBYTES = _FORMAT.size
#: Smallest segment (segments come in powers of two, like the staging pool's buffers).
MIN_SEGMENT = 1 << 16
#: Largest segment a peer may describe (a bound checked before anything is mapped).
MAX_SEGMENT = 1 << 40


@functools.cache
def available() -> bool:
    """Whether this process can create segments a node peer could map (Linux; asked
    once: every two-level allreduce's spec asks)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


@dataclass(frozen=True)
class Descriptor:
    """Where ``nbytes`` bytes lie: at ``offset`` in segment ``serial`` of process ``pid``
    (its file descriptor ``fd``, of ``size`` bytes, file identity ``dev``/``ino``)."""

    pid: int
    fd: int
    serial: int
    size: int
    dev: int
    ino: int
    offset: int
    nbytes: int

    def pack(self) -> np.ndarray:
        raw = _FORMAT.pack(
            _MAGIC,
            self.pid,
            self.fd,
            self.serial,
            self.size,
            self.dev,
            self.ino,
            self.offset,
            self.nbytes,
        )
        return np.frombuffer(raw, np.uint8).copy()

    @classmethod
    def unpack(cls, raw: Any) -> Descriptor:
        data = bytes(memoryview(raw).cast("B"))
        if len(data) != DESCRIPTOR_NBYTES:
            raise ProtocolError(
                f"a shared-memory descriptor has {DESCRIPTOR_NBYTES} bytes, not {len(data)}"
            )
        magic, *fields = _FORMAT.unpack(data)
        if magic != _MAGIC:
            raise ProtocolError("not a shared-memory descriptor")
        desc = cls(*fields)
        if not 0 < desc.size <= MAX_SEGMENT or desc.offset + desc.nbytes > desc.size:
            raise ProtocolError(
                f"shared-memory descriptor out of bounds: {desc.nbytes} bytes at "
                f"{desc.offset} in a segment of {desc.size}"
            )
        return desc


class Segment:
    """One ``memfd`` of ``size`` bytes, mapped read-write; :attr:`array` is its bytes."""

    _serials = itertools.count(1)

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("cgx-ucx", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size
        self.serial = next(Segment._serials)
        self._ident = (os.getpid(), fd, self.serial, size, st.st_dev, st.st_ino)
        self.array: np.ndarray = np.frombuffer(self._map, np.uint8)

    def describe(self, offset: int, nbytes: int) -> Descriptor:
        assert offset >= 0 and offset + nbytes <= self.size
        return Descriptor(*self._ident, offset, nbytes)

    def __del__(self) -> None:
        # A segment of a failed collective is never given back (a peer may still read
        # it, so it is never reused): its file goes with it. Peers' mappings stay valid.
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        if getattr(self, "_map", None) is None:
            return
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):  # a view still alive: the map goes with it
            self._map.close()
        self._map = None
        os.close(self.fd)


class SegmentPool:
    """Segments reused across collectives, by power-of-two size (as :class:`BufferPool`).

    :meth:`take` returns a segment of at least ``nbytes``; :meth:`give` puts it back once
    no peer reads it any more. Idle segments are bounded in count per size (:attr:`KEEP`)
    and in bytes (``keep_bytes``): a segment given back beyond that is closed.
    :meth:`trim` closes idle ones down to a smaller bound (the staging pool does, once it
    has gone unused for a while), so the memory a large call grew goes back to the system
    once no peer maps it.
    """

    KEEP = 8
    KEEP_BYTES = 1 << 30

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = int(keep_bytes)
        self._free: dict[int, list[Segment]] = collections.defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Segment:
        size = max(MIN_SEGMENT, 1 << max(int(nbytes) - 1, 0).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self._idle_bytes -= size
                return free.pop()
        return Segment(size)

    def give(self, seg: Segment) -> None:
        with self._lock:
            free = self._free[seg.size]
            if len(free) < self.KEEP and self._idle_bytes + seg.size <= self.keep_bytes:
                free.append(seg)
                self._idle_bytes += seg.size
                return
        seg.close()

    def trim(self, keep_bytes: int) -> None:
        """Close idle segments, largest first, until at most ``keep_bytes`` stay idle."""
        drop: list[Segment] = []
        with self._lock:
            for size in sorted(self._free, reverse=True):
                free = self._free[size]
                while free and self._idle_bytes > keep_bytes:
                    drop.append(free.pop())
                    self._idle_bytes -= size
        for seg in drop:
            seg.close()

    @property
    def idle_bytes(self) -> int:
        """Bytes of the segments kept for reuse."""
        return self._idle_bytes

    def clear(self) -> None:
        with self._lock:
            segs = [s for free in self._free.values() for s in free]
            self._free.clear()
            self._idle_bytes = 0
        for seg in segs:
            seg.close()


class PeerSegments:
    """The node peers' segments this rank has mapped (read-only), by (peer, pid, serial).

    At most :attr:`MAX_MAPPED` segments and :attr:`MAX_MAPPED_BYTES` stay mapped (the
    newest always does); the least recently used goes first. A mapping keeps the peer's
    pages alive after the peer dropped the segment, hence the byte bound. A view still in
    use keeps its mapping until it is dropped.
    """

    MAX_MAPPED = 64
    MAX_MAPPED_BYTES = 2 << 30

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._maps: collections.OrderedDict[tuple[int, int, int], tuple[mmap.mmap, np.ndarray]]
        self._maps = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # clear() may come from the staging pool's timer

    def view(self, peer: int, desc: Descriptor) -> np.ndarray:
        """The ``desc.nbytes`` bytes ``desc`` names, read-only, without a copy."""
        with self._lock:
            return self._view(peer, desc)

    def _view(self, peer: int, desc: Descriptor) -> np.ndarray:
        key = (peer, desc.pid, desc.serial)
        entry = self._maps.get(key)
        if entry is None:
            entry = self._open(peer, desc)
            self._maps[key] = entry
            self._bytes += len(entry[0])
            while len(self._maps) > 1 and (
                len(self._maps) > self.MAX_MAPPED or self._bytes > self.MAX_MAPPED_BYTES
            ):
                _, old = self._maps.popitem(last=False)
                mapped = old[0]
                del old  # drop our array first: its export would keep the map open
                self._bytes -= len(mapped)
                _close_map(mapped)
        else:
            self._maps.move_to_end(key)
        mapped, array = entry
        if desc.size > len(mapped):
            raise ProtocolError(f"rank {peer} described segment {desc.serial} with a new size")
        return array[desc.offset : desc.offset + desc.nbytes]

    def _open(self, peer: int, desc: Descriptor) -> tuple[mmap.mmap, np.ndarray]:
        try:
            return map_peer(self.rank, peer, desc)
        except TransportError as exc:
            if not process_gone(desc.pid):
                raise
            # The group's ranks mapped each other's mailboxes at connect, so they share
            # a PID namespace: a process that is gone by now has exited (a peer killed
            # after it described its bytes). Named, so that every rank blames it.
            raise PeerLostError(
                f"rank {self.rank} cannot read rank {peer}'s shared memory: its process "
                f"{desc.pid} is gone (it exited; or, were the ranks of this node in "
                "separate PID namespaces, set CGX_UCX_INTRA_SHM=0)",
                peer=peer,
            ) from exc

    def clear(self) -> None:
        with self._lock:
            maps = [m for m, _ in self._maps.values()]
            self._maps.clear()
            self._bytes = 0
        for m in maps:
            _close_map(m)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited: no /proc entry, or a zombie
    (which an exited process stays until its parent reaps it, its files closed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3] in (b"Z", b"X")


def map_peer(rank: int, peer: int, desc: Descriptor) -> tuple[mmap.mmap, np.ndarray]:
    """Map the whole segment ``desc`` of node peer ``peer`` read-only (for ``rank``, named
    in errors), its identity checked; the map and its bytes."""
    path = f"/proc/{desc.pid}/fd/{desc.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise TransportError(
            f"rank {rank} cannot map rank {peer}'s shared memory ({path}: "
            f"{exc.strerror}): ranks of one node must run in one PID namespace; set "
            "CGX_UCX_INTRA_SHM=0 to move node-local data through UCX instead"
        ) from exc
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (desc.dev, desc.ino) or st.st_size < desc.size:
            raise TransportError(
                f"rank {rank}: {path} is not the segment rank {peer} described "
                "(another process behind that pid: ranks of one node must share a "
                "PID namespace; set CGX_UCX_INTRA_SHM=0)"
            )
        mapped = mmap.mmap(fd, desc.size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return mapped, np.frombuffer(mapped, np.uint8)


def _close_map(m: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still in use: the map goes with it
        m.close()
