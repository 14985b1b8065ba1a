"""Array plumbing shared by the collectives: kinds, byte views, staging pool, codec calls.

Buffers are NumPy or CuPy arrays (CuPy is never imported unless a CuPy array shows up).
GPU memory goes to UCX as is (no host copy): UCX moves it with cuda_ipc / cuda_copy.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections import defaultdict
from typing import Any

import ml_dtypes
import numpy as np

from ..compression import decode, decode_add, encode
from ..errors import ConfigError
from .plan import Piece

__all__ = [
    "CODEC_DTYPES",
    "BufferPool",
    "CodecRunner",
    "as_flat",
    "byte_view",
    "is_cupy",
    "mix_seed",
    "synchronize",
    "xp_of",
]

#: Dtypes the codec quantizes; everything else goes uncompressed only.
CODEC_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})
#: Pieces smaller than this run the codec inline on the event loop; larger ones on the
#: communicator's codec thread, so the loop keeps driving UCX while a piece is encoded
#: (the kernels release the GIL). 256 Ki values: about 0.1 ms of 4-bit encoding, the
#: order of a thread hand-off.
CODEC_INLINE_NUMEL = 1 << 18


def is_cupy(a: Any) -> bool:
    mod = type(a).__module__
    return mod.startswith("cupy") and hasattr(a, "__cuda_array_interface__")


def xp_of(a: Any) -> Any:
    if is_cupy(a):
        return sys.modules["cupy"]
    return np


def as_flat(x: Any, what: str = "x") -> Any:
    """A 1-D view of a C-contiguous NumPy/CuPy array (no copy); ConfigError otherwise."""
    if isinstance(x, np.ndarray) or is_cupy(x):
        if not x.flags.c_contiguous:
            raise ConfigError(f"{what} must be C-contiguous")
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
        sys.modules["cupy"].cuda.get_current_stream().synchronize()


def mix_seed(*parts: int) -> int:
    """A 64-bit seed from (seed, sequence, rank, layer, offset): splitmix64 chaining."""
    h = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    for p in parts:
        h = (h ^ (p & mask)) & mask
        h = (h + 0x9E3779B97F4A7C15) & mask
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        h = z ^ (z >> 31)
    return h


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

    def take(self, nbytes: int, like: Any) -> Any:
        kind = "cupy" if is_cupy(like) else "numpy"
        size = 1 << max(int(nbytes) - 1, 0).bit_length() if nbytes > 0 else 0
        with self._lock:
            free = self._free.get((kind, size))
            if free:
                self._idle_bytes -= size
                return free.pop()[:nbytes]
        return xp_of(like).empty(max(size, 1), np.uint8)[:nbytes]

    def give(self, buf: Any) -> None:
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


class CodecRunner:
    """Runs codec work for pieces: small ones inline, large ones on one codec thread."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def run(self, numel: int, fn: Any, *args: Any) -> Any:
        if numel < CODEC_INLINE_NUMEL:
            return fn(*args)
        import asyncio

        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cgx-codec")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


def encode_piece(
    src: Any,
    base: int,
    piece: Piece,
    out: Any,
    stochastic: bool,
    seed: int,
    seq: int,
    rank: int,
    raw_src: Any = None,
    raw_base: int = 0,
) -> Any:
    """Encode values [piece.start, piece.stop) of ``src`` (which starts at ``base``).

    Uncompressed segments are taken from ``raw_src`` when given (the owner's reduced
    values already written back to the caller's buffer, in its dtype).
    """
    pos = 0
    for seg in piece.segments:
        if seg.bits == 32 and raw_src is not None:
            part = raw_src[seg.start - raw_base : seg.stop - raw_base]
        else:
            part = src[seg.start - base : seg.stop - base]
        n = seg.wire_nbytes(part.dtype)
        s = mix_seed(seed, seq, rank, seg.layer, seg.start) if stochastic else 0
        encode(
            part,
            seg.bits,
            seg.bucket_size,
            out=out[pos : pos + n],
            stochastic=stochastic and seg.bits != 32,
            seed=s,
        )
        pos += n
    return out[:pos]


def decode_add_piece(buf: Any, piece: Piece, acc: Any, base: int, dtype: np.dtype) -> None:
    """acc[piece] += decode(buf) segment by segment (acc float32, starting at ``base``)."""
    pos = 0
    for seg in piece.segments:
        n = seg.wire_nbytes(dtype)
        decode_add(buf[pos : pos + n], acc[seg.start - base : seg.stop - base])
        pos += n


def decode_piece(buf: Any, piece: Piece, out: Any, base: int, dtype: np.dtype) -> None:
    """out[piece] = decode(buf) segment by segment (out starting at ``base``)."""
    pos = 0
    for seg in piece.segments:
        n = seg.wire_nbytes(dtype)
        decode(buf[pos : pos + n], out=out[seg.start - base : seg.stop - base])
        pos += n
