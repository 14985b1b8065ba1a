"""Memory the collectives hand to UCX: the caller's buffers as flat byte views, and
reusable staging buffers for compressed pieces and accumulators.

Buffers are NumPy or CuPy arrays (CuPy is never imported unless a CuPy array shows up).
GPU memory goes to UCX as is (no host copy): UCX moves it with cuda_ipc / cuda_copy.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import numpy as np

from ..arrays import is_array, is_cupy, xp_of
from ..errors import ConfigError
from ..transport.shm import Descriptor, PeerSegments, Segment, SegmentPool

__all__ = ["BufferPool", "as_flat", "byte_view", "synchronize"]


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


class BufferPool:
    """Staging buffers reused across collectives (no per-call allocation on the hot path).

    Buffers are kept by power-of-two size class and device kind. A buffer taken by a
    collective that failed is simply not given back (UCX may still own it).
    """

    #: Idle buffers kept per size class and kind: one 64 MiB SRA call on 2 ranks takes
    #: 32 staging buffers of one class (8 pieces x 4 roles); fewer would mean fresh
    #: pages (page faults) on every call.
    KEEP = 64
    #: Idle bytes kept at most over all classes (a huge one-off call must not pin memory).
    KEEP_BYTES = 1 << 30

    def __init__(self) -> None:
        self._free: dict[tuple[str, int], list[Any]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()
        #: Node-local shared memory (host buffers of the two-level allreduce): this
        #: rank's segments, and the node peers' it has mapped.
        self.segments = SegmentPool()
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
        kind = "cupy" if is_cupy(like) else "numpy"
        size = 1 << max(int(nbytes) - 1, 0).bit_length() if nbytes > 0 else 0
        with self._lock:
            free = self._free.get((kind, size))
            if free:
                self._idle_bytes -= size
                return free.pop()[:nbytes]
        return xp_of(like).empty(max(size, 1), np.uint8)[:nbytes]

    def give(self, buf: Any) -> None:
        """Return a buffer from :meth:`take` (anything else is ignored)."""
        base = buf.base if buf.base is not None else buf
        kind = "cupy" if is_cupy(base) else "numpy"
        size = base.size
        if size & (size - 1):  # not one of ours
            return
        with self._lock:
            free = self._free[(kind, size)]
            if len(free) < self.KEEP and self._idle_bytes + size <= self.KEEP_BYTES:
                free.append(base)
                self._idle_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle_bytes = 0
        self.segments.clear()
        if self._peer_segments is not None:
            self._peer_segments.clear()
