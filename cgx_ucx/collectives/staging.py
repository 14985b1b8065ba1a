"""Memory the collectives hand to UCX: the caller's buffers as flat byte views, and
reusable staging buffers for compressed pieces and accumulators.

Buffers are NumPy or CuPy arrays (CuPy is never imported unless a CuPy array shows up).
GPU memory goes to UCX as is (no host copy): UCX moves it with cuda_ipc / cuda_copy.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import threading
import time
import weakref
from collections import defaultdict, deque
from typing import Any

import numpy as np

from ..arrays import is_array, is_cupy, xp_of
from ..config import DEFAULT_STAGING_MB
from ..errors import ConfigError
from ..transport.shm import Descriptor, PeerSegments, Segment, SegmentPool

__all__ = [
    "DEFAULT_CAP_BYTES",
    "GAP_MIN_S",
    "RELEASE_AFTER_S",
    "RELEASE_GAPS",
    "RELEASE_MAX_S",
    "RELEASE_THREAD_NAME",
    "BufferPool",
    "as_flat",
    "byte_view",
    "owner",
    "size_class",
    "synchronize",
]

log = logging.getLogger("cgx_ucx.collectives")


def as_flat(x: Any, what: str = "x", writable: bool = False) -> Any:
    """A 1-D view of a C-contiguous NumPy/CuPy array (no copy); ConfigError otherwise.
    ``writable``: the collective writes into it, so a read-only array is refused here,
    before the call starts (else it would fail mid-transfer, on one rank, untyped)."""
    if is_array(x):
        if not x.flags.c_contiguous:
            raise ConfigError(f"{what} must be C-contiguous")
        if writable and not getattr(x.flags, "writeable", True):
            raise ConfigError(f"{what} is read-only: the collective writes its result into it")
        return x.reshape(-1)
    raise ConfigError(
        f"{what} must be a NumPy or CuPy array, got {type(x).__name__} "
        "(torch tensors go through cgx_ucx.torch, or torch.Tensor.numpy() / cupy.from_dlpack)"
    )


def byte_view(x: Any) -> Any:
    """The bytes of a flat contiguous array, as a uint8 view."""
    if x.dtype == np.uint8:
        return x
    if x.size == 0:
        return xp_of(x).empty(0, np.uint8)
    return x.view(np.uint8)


def synchronize(x: Any) -> None:
    """Wait for queued GPU work on ``x``'s device (no-op for NumPy)."""
    if is_cupy(x):
        xp_of(x).cuda.get_current_stream().synchronize()


#: Staging kept idle between calls where no cap is given (``CommConfig.staging_mb``,
#: ``CGX_UCX_STAGING_MB``).
DEFAULT_CAP_BYTES = DEFAULT_STAGING_MB << 20
#: Idle staging over the cap goes back to the system once the pool has gone this long
#: without a call taking or giving any: a loop that calls again sooner (training steps)
#: keeps its working set, so no call pays for fresh pages or new shared segments (the
#: two-level allreduce of 64 MiB on 2x2 ranks took 2.6x the CPU when a 32 MiB cap
#: released its segments after every call), while what a one-off large call grew is
#: returned soon after it.
RELEASE_AFTER_S = 1.0
#: A loop whose bursts of calls come further apart than RELEASE_AFTER_S (training steps
#: of seconds) would lose its working set between every two bursts and pay fresh pages
#: and new shared segments in the next: the two-level allreduce's first call after a
#: release takes about twice a later one (2x2 ranks, 64 MiB, 4 bits, 1 Gbit/s: 231 ms
#: against 97-139). So a pool whose last two pauses (spans of at least GAP_MIN_S without a
#: use that ended in a new call) both lasted, waits RELEASE_GAPS times the shorter of them
#: before releasing, at least RELEASE_AFTER_S and at most RELEASE_MAX_S: a periodic loop
#: keeps its working set from its third burst on, while a one-off pause (setting up, an
#: evaluation) lengthens nothing, and a job that stops calling gets the memory back within
#: RELEASE_MAX_S. 4 ranks on one host, a 64 MiB float32 allreduce every 1.5 s: 129-151 ms
#: (64-73 CPU-ms a rank) every call with a fixed delay, 54-85 ms (26-34) from the third.
RELEASE_GAPS = 2.0
RELEASE_MAX_S = 10.0
GAP_MIN_S = 0.1
#: Host buffers of at least this many bytes are mappings of their own (``mmap``), so
#: that a buffer the pool drops goes back to the system at once: the C allocator keeps
#: freed blocks below its (adaptive, up to 32 MiB) mmap threshold in its heap.
MAP_MIN_BYTES = 256 << 10
#: Size classes: powers of two up to this, then multiples of an eighth of the power of
#: two below (at most 12.5% of a buffer unused, where whole powers of two waste up to half).
FINE_CLASS_BYTES = 64 << 10


def size_class(nbytes: int) -> int:
    """The bytes of the buffer that serves a request of ``nbytes`` (>= 1)."""
    n = max(int(nbytes), 1)
    if n <= FINE_CLASS_BYTES:
        return 1 << (n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def owner(buf: Any) -> Any:
    """The array whose memory ``buf`` views: the last array among its bases (``buf``
    itself if none); for staging, the buffer :meth:`BufferPool.take` allocated."""
    while is_array(getattr(buf, "base", None)):
        buf = buf.base
    return buf


def _host_buffer(size: int) -> np.ndarray:
    if size < MAP_MIN_BYTES:
        return np.empty(size, np.uint8)
    # Private anonymous memory, unmapped when the last view of it goes.
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE), np.uint8)


#: Name of the thread that runs the idle releases (one per process, see _Releaser).
RELEASE_THREAD_NAME = "cgx-staging-release"
#: How long interpreter exit waits for a release in progress to finish.
RELEASE_STOP_S = 1.0


class _Releaser:
    """The idle release of every pool of the process, on one daemon thread started on
    first use that sleeps until the earliest deadline. A pool is due again at most once
    per RELEASE_AFTER_S while calls keep coming: one thread per release would start a
    thread a second per communicator in use. Pools are held weakly (a dropped
    communicator's pool goes at once); the thread ends once no pool is due (a closed
    communicator leaves no thread behind) and at interpreter exit."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: id(pool) -> (monotonic deadline, weak reference to the pool).
        self._due: dict[int, tuple[float, weakref.ref]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    def schedule(self, pool: BufferPool, when: float) -> None:
        """Run ``pool.release_if_idle()`` at ``when`` (time.monotonic), or earlier where it
        is due earlier already."""
        with self._cond:
            if self._stopping:
                return
            due = self._due.get(id(pool))
            if due is None or due[1]() is not pool or when < due[0]:
                self._due[id(pool)] = (when, weakref.ref(pool))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name=RELEASE_THREAD_NAME, daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def cancel(self, pool: BufferPool) -> None:
        """Forget ``pool``'s release; with no other pool due, end the thread and wait
        for it (not with the pool's lock held: the thread may be releasing that pool)."""
        with self._cond:
            due = self._due.get(id(pool))
            if due is not None and due[1]() is pool:
                del self._due[id(pool)]
            thread = self._thread if not self._due else None
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(RELEASE_STOP_S)

    def stop(self) -> None:
        """End the thread (at interpreter exit), after the release it may be running."""
        with self._cond:
            self._stopping = True
            self._due.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(RELEASE_STOP_S)

    def after_fork(self) -> None:
        # A forked child has no such thread, and the lock may have been held at the fork.
        self._cond = threading.Condition()
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    now = time.monotonic()
                    ready = [k for k, (when, _) in self._due.items() if when <= now]
                    if ready:
                        pools = [self._due.pop(k)[1] for k in ready]
                        break
                    if not self._due:  # schedule() starts a new thread when one is due
                        self._thread = None
                        return
                    self._cond.wait(min(when for when, _ in self._due.values()) - now)
            for ref in pools:
                pool = ref()
                if pool is None:
                    continue
                try:
                    pool.release_if_idle()
                except Exception:  # never end the thread every pool relies on
                    log.exception("releasing idle staging")
                del pool


_releaser = _Releaser()
atexit.register(_releaser.stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_releaser.after_fork)


class BufferPool:
    """Staging buffers reused across collectives (no per-call allocation on the hot path).

    Buffers are kept by size class (:func:`size_class`) and device kind, and reused by
    the next calls. Once no call has taken or given any for :meth:`release_delay`
    (:data:`RELEASE_AFTER_S`, longer for a loop whose calls pause longer), at
    most ``cap_bytes`` stay idle (shared segments apart: they have a cap of the same
    size), and the node peers' segments this rank mapped are unmapped: what a
    communicator holds between bursts of calls does not grow with the largest buffer it
    ever reduced. A buffer taken by a collective that failed is simply not given back
    (UCX may still own it).
    """

    #: Idle buffers kept per size class and kind: one 64 MiB SRA call on 2 ranks takes
    #: 32 staging buffers of one class (8 pieces x 4 roles); fewer would mean fresh
    #: pages (page faults) on every call.
    KEEP = 64

    def __init__(self, cap_bytes: int = DEFAULT_CAP_BYTES) -> None:
        if cap_bytes < 0:
            raise ConfigError(f"the staging cap must be >= 0 bytes, got {cap_bytes}")
        self.cap_bytes = int(cap_bytes)
        self._free: dict[tuple[str, int], list[Any]] = defaultdict(list)
        self._idle_bytes = 0
        self._held_bytes = 0
        self._peak_bytes = 0
        self._lock = threading.Lock()
        #: Node-local shared memory (host buffers of the two-level allreduce): this
        #: rank's segments, and the node peers' it has mapped.
        self.segments = SegmentPool()
        self._peer_segments: PeerSegments | None = None
        self._last_use = time.monotonic()
        #: The last two pauses between calls (see RELEASE_GAPS).
        self._pauses: deque[float] = deque(maxlen=2)
        #: A release is scheduled (on the process's releaser thread).
        self._armed = False
        #: ids of the buffers taken and not given back (each alive: its taker holds it).
        self._lent: set[int] = set()

    def take_segment(self, nbytes: int) -> Segment:
        """A shared segment of at least ``nbytes`` (:meth:`give_segment` it back)."""
        with self._lock:
            self._touch()
        return self.segments.take(nbytes)

    def give_segment(self, seg: Segment) -> None:
        self.segments.give(seg)
        self._used()

    def peer_view(self, rank: int, peer: int, desc: Descriptor) -> Any:
        """Node peer ``peer``'s bytes that ``desc`` names, mapped read-only (no copy)."""
        if self._peer_segments is None:
            self._peer_segments = PeerSegments(rank)
        view = self._peer_segments.view(peer, desc)
        self._used()
        return view

    def _touch(self) -> None:
        """Note a use (the lock held), and the pause it ended if it was one."""
        now = time.monotonic()
        if now - self._last_use >= GAP_MIN_S:
            self._pauses.append(now - self._last_use)
        self._last_use = now

    def release_delay(self) -> float:
        """Seconds without a use after which idle staging goes (see RELEASE_GAPS)."""
        if len(self._pauses) < 2:
            return RELEASE_AFTER_S
        return max(RELEASE_AFTER_S, min(RELEASE_GAPS * min(self._pauses), RELEASE_MAX_S))

    def _used(self) -> None:
        """Note a use; make sure a release is due :meth:`release_delay` after the last."""
        with self._lock:
            self._touch()
            if not self._armed:
                self._armed = True
                _releaser.schedule(self, self._last_use + self.release_delay())

    def release_if_idle(self) -> None:
        """On the releaser thread: once the pool has been unused for :meth:`release_delay`, trim
        what is idle to the cap and unmap the peers' segments; earlier, wait for the rest
        of the time."""
        with self._lock:
            if not self._armed:  # cleared meanwhile
                return
            delay = self.release_delay()
            if time.monotonic() - self._last_use < delay:
                _releaser.schedule(self, self._last_use + delay)
                return
            self._armed = False
            drop = self._trim_locked()
        del drop  # host buffers unmap here, outside the lock
        self.segments.trim(self.cap_bytes)
        if self._peer_segments is not None:
            self._peer_segments.clear()

    def _trim_locked(self) -> list[Any]:
        """Take idle buffers out, largest first, until the idle bytes fit the cap."""
        drop: list[Any] = []
        for key in sorted(self._free, key=lambda k: k[1], reverse=True):
            free = self._free[key]
            while free and self._idle_bytes > self.cap_bytes:
                drop.append(free.pop())
                self._idle_bytes -= key[1]
        return drop

    def take(self, nbytes: int, like: Any) -> Any:
        """``nbytes`` of uint8 staging on ``like``'s device (contents undefined)."""
        cupy = is_cupy(like)
        size = size_class(nbytes)
        key = ("cupy" if cupy else "numpy", size)
        with self._lock:
            self._touch()
            self._held_bytes += size
            free = self._free.get(key)
            if free:
                self._idle_bytes -= size
                buf = free.pop()
                self._lent.add(id(buf))
                return buf[:nbytes]
            self._peak_bytes = max(self._peak_bytes, self._held_bytes + self._idle_bytes)
        buf = xp_of(like).empty(size, np.uint8) if cupy else _host_buffer(size)
        with self._lock:
            self._lent.add(id(buf))
        return buf[:nbytes]

    def give(self, buf: Any) -> None:
        """Return a buffer from :meth:`take` (anything else, and a second return, is
        ignored); kept for the next calls (up to :attr:`KEEP` per class) until the pool
        goes unused (class doc)."""
        base = owner(buf)
        kind = "cupy" if is_cupy(base) else "numpy"
        size = base.size
        with self._lock:
            if id(base) not in self._lent:  # not one of ours (or given back already)
                return
            self._lent.discard(id(base))
            self._held_bytes = max(self._held_bytes - size, 0)
            free = self._free[(kind, size)]
            if len(free) < self.KEEP:
                free.append(base)
                self._idle_bytes += size
        self._used()

    def usage(self) -> dict[str, int]:
        """Staging bytes: ``held`` by collectives in progress, ``idle`` kept for the next ones,
        ``peak`` of the two together since the pool was made, and ``cap`` (shared
        segments apart: ``segments``, their idle bytes)."""
        with self._lock:
            return {
                "held": self._held_bytes,
                "idle": self._idle_bytes,
                "peak": self._peak_bytes,
                "cap": self.cap_bytes,
                "segments": self.segments.idle_bytes,
            }

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle_bytes = 0
            armed, self._armed = self._armed, False
        if armed:
            _releaser.cancel(self)
        self.segments.clear()
        if self._peer_segments is not None:
            self._peer_segments.clear()
