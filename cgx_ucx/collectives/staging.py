"""Memory the collectives hand to UCX: the caller's buffers as flat byte views, and
reusable staging buffers for compressed pieces and accumulators.

Buffers are NumPy or CuPy arrays (CuPy is never imported unless a CuPy array shows up).
GPU memory goes to UCX as is (no host copy): UCX moves it with cuda_ipc / cuda_copy.
"""

from __future__ import annotations

import mmap
import threading
from collections import defaultdict
from typing import Any

import numpy as np

from ..arrays import is_array, is_cupy, xp_of
from ..config import DEFAULT_STAGING_MB
from ..errors import ConfigError
from ..transport.shm import Descriptor, PeerSegments, Segment, SegmentPool

__all__ = [
    "DEFAULT_CAP_BYTES",
    "BufferPool",
    "as_flat",
    "byte_view",
    "owner",
    "size_class",
    "synchronize",
]


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


class BufferPool:
    """Staging buffers reused across collectives (no per-call allocation on the hot path).

    Buffers are kept by size class (:func:`size_class`) and device kind. At most
    ``cap_bytes`` stay idle between calls, over all classes and shared segments apart
    (the segments have a cap of the same size): a call that needs more allocates the
    rest and releases it when it returns, so what a communicator holds does not grow
    with the largest buffer it ever reduced. A buffer taken by a collective that failed
    is simply not given back (UCX may still own it).
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
        self.segments = SegmentPool(self.cap_bytes)
        self._peer_segments: PeerSegments | None = None

    def take_segment(self, nbytes: int) -> Segment:
        """A shared segment of at least ``nbytes`` (:meth:`give_segment` it back)."""
        return self.segments.take(nbytes)

    def give_segment(self, seg: Segment) -> None:
        self.segments.give(seg)

    def peer_view(self, rank: int, peer: int, desc: Descriptor) -> Any:
        """Node peer ``peer``'s bytes that ``desc`` names, mapped read-only (no copy)."""
        if self._peer_segments is None:
            self._peer_segments = PeerSegments(rank)
        return self._peer_segments.view(peer, desc)

    def take(self, nbytes: int, like: Any) -> Any:
        """``nbytes`` of uint8 staging on ``like``'s device (contents undefined)."""
        cupy = is_cupy(like)
        size = size_class(nbytes)
        key = ("cupy" if cupy else "numpy", size)
        with self._lock:
            self._held_bytes += size
            free = self._free.get(key)
            if free:
                self._idle_bytes -= size
                return free.pop()[:nbytes]
            self._peak_bytes = max(self._peak_bytes, self._held_bytes + self._idle_bytes)
        buf = xp_of(like).empty(size, np.uint8) if cupy else _host_buffer(size)
        return buf[:nbytes]

    def give(self, buf: Any) -> None:
        """Return a buffer from :meth:`take` (anything else is ignored); kept for the next
        calls while the idle bytes stay within the cap, else released."""
        base = owner(buf)
        kind = "cupy" if is_cupy(base) else "numpy"
        size = base.size
        if base.dtype != np.uint8 or size_class(size) != size:  # not one of ours
            return
        with self._lock:
            self._held_bytes = max(self._held_bytes - size, 0)
            free = self._free[(kind, size)]
            if len(free) < self.KEEP and self._idle_bytes + size <= self.cap_bytes:
                free.append(base)
                self._idle_bytes += size

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
        self.segments.clear()
        if self._peer_segments is not None:
            self._peer_segments.clear()
