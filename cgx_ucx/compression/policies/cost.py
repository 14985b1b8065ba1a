"""The cost model of one compressed allreduce: wire time plus codec time, per layer."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...arrays import check_positive_int, xp_of
from ...config import NO_COMPRESSION_BITS
from ...errors import ConfigError
from ..codec import decode_add, encode, encoded_nbytes

__all__ = ["CodecCost", "allreduce_seconds", "layer_seconds", "probe_codec"]


@dataclass(frozen=True)
class CodecCost:
    """Codec speed on this device: bytes of float32 input per second, and a per-call cost.

    ``encode_bps``: :func:`~cgx_ucx.compression.encode`; ``decode_bps``:
    :func:`~cgx_ucx.compression.decode_add`; ``overhead_s``: fixed seconds per call
    (dispatch, kernel launch), measured on a 1-value buffer.
    """

    encode_bps: float
    decode_bps: float
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("encode_bps", "decode_bps"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ConfigError(f"overhead_s must be >= 0, got {self.overhead_s!r}")


def allreduce_seconds(nbytes: float, world_size: int, bandwidth: float) -> float:
    """Wire time of a scatter-reduce-allgather of ``nbytes`` per rank.

    Each rank sends ``(w-1)/w`` of the buffer in the scatter-reduce and again in the
    allgather: ``2 * (w-1)/w * nbytes / bandwidth`` (bandwidth in bytes/s per peer link).
    """
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * nbytes / bandwidth


def layer_seconds(
    numel: int,
    bits: int,
    bucket_size: int,
    world_size: int,
    bandwidth: float,
    codec: CodecCost | None,
) -> float:
    """Modeled seconds one rank spends on one layer in a SRA allreduce.

    Uncompressed: wire time of ``4 * numel`` bytes. Compressed: wire time of the encoded
    bytes (:func:`~cgx_ucx.compression.codec.encoded_nbytes`) plus the codec, with no
    overlap (conservative towards not compressing): per rank the scatter-reduce encodes
    the ``(w-1)/w`` of the layer its peers own and decode-adds ``(w-1)/w`` into its own
    share; the owner then encodes and decodes its reduced ``1/w``; the allgather decodes
    ``(w-1)/w``. In all: one encode of the layer and ``(2w-1)/w`` decodes, and about
    three codec calls.
    """
    if world_size <= 1:
        return 0.0
    if bits == NO_COMPRESSION_BITS:
        return allreduce_seconds(4.0 * numel, world_size, bandwidth)
    if codec is None:
        raise ConfigError("the codec cost is needed to time a compressed layer")
    wire = allreduce_seconds(float(encoded_nbytes(numel, bits, bucket_size)), world_size, bandwidth)
    w = world_size
    work = (
        4.0 * numel / codec.encode_bps
        + 4.0 * numel * (2 * w - 1) / w / codec.decode_bps
        + 3.0 * codec.overhead_s
    )
    return wire + work


def _device_sync(xp: Any) -> Callable[[], None]:
    if xp is np:
        return lambda: None
    return lambda: xp.cuda.get_current_stream().synchronize()


def probe_codec(
    bits: int = 4,
    bucket_size: int = 1024,
    *,
    numel: int = 1 << 22,
    repeats: int = 3,
    like: Any = None,
) -> CodecCost:
    """Measure the codec kernels on this device: median encode and decode_add passes.

    ``like``: an array whose device/array module to measure on (default: host NumPy).
    Two 16 MiB inputs are used in turn: a buffer encoded again and again stays in the
    last-level cache and runs several times faster than a fresh one, which would make
    compression look cheap. The per-call overhead comes from a 1-value buffer. Kernels
    only: :func:`cgx_ucx.agreement.make_link_probe` measures the engine's whole
    compressed path instead.
    """
    numel = check_positive_int(numel, "numel")
    repeats = check_positive_int(repeats, "repeats")
    xp = np if like is None else xp_of(like)
    rng = np.random.default_rng(0)
    xs = [xp.asarray(rng.standard_normal(numel).astype(np.float32)) for _ in range(2)]
    acc = xp.zeros(numel, np.float32)
    tiny = xp.ones(1, np.float32)
    tiny_acc = xp.zeros(1, np.float32)
    outs = [xp.empty(encoded_nbytes(numel, bits, bucket_size), np.uint8) for _ in range(2)]
    tiny_out = xp.empty(encoded_nbytes(1, bits, bucket_size), np.uint8)
    sync = _device_sync(xp)

    def median(fn: Callable[[int], Any]) -> float:
        fn(0)  # warm-up: JIT compilation, kernel build
        sync()
        times = []
        for k in range(repeats):
            t0 = time.perf_counter()
            fn(k % 2)
            sync()
            times.append(time.perf_counter() - t0)
        return max(float(np.median(times)), 1e-9)

    t_enc = median(lambda k: encode(xs[k], bits, bucket_size, out=outs[k]))
    bufs = [encode(xs[k], bits, bucket_size, out=outs[k]) for k in range(2)]
    t_dec = median(lambda k: decode_add(bufs[k], acc))
    tiny_buf = encode(tiny, bits, bucket_size, out=tiny_out)
    t_over = min(
        median(lambda k: encode(tiny, bits, bucket_size, out=tiny_out)),
        median(lambda k: decode_add(tiny_buf, tiny_acc)),
    )
    return CodecCost(4.0 * numel / t_enc, 4.0 * numel / t_dec, t_over)
