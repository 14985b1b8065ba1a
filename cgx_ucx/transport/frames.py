"""The 64-byte frame header every cgx_ucx message starts with, and its validation.

Each message on the wire is a fixed-size header, optionally followed by a payload sent as
a second message (the payload is received only after the header was validated, into a
buffer of exactly the announced, bounded size). Nothing is unpickled; the header is a
``struct`` with a CRC, so a foreign or corrupted frame is a
:class:`~cgx_ucx.errors.ProtocolError` before any field is trusted.

Layout, little-endian, ``struct`` format ``<4sBBBBQIHHIBBBBQQQII``::

    0   4s  magic         b"CGXF"
    4   B   version       1
    5   B   kind          Kind (HELLO, DATA, SIG, ABORT, BYE)
    6   B   collective    Coll (allreduce, broadcast, allgather, barrier)
    7   B   reduce_op     Op (none, sum, avg)
    8   Q   job           64-bit id of the job (from its membership token)
    16  I   seq           collective sequence number of the sender
    20  H   src           sender rank
    22  H   phase         phase of the collective (algorithm-specific)
    24  I   slot          piece / step index inside the phase
    28  B   dtype         DTYPE_CODES
    29  B   bits          uniform bits of the layout, MIXED_BITS when layers differ
    30  B   algorithm     Algo (sra, ring, direct)
    31  B   flags         bit 0 stochastic rounding
    32  Q   numel         values in the caller's buffer
    40  Q   digest        Layout.digest
    48  Q   payload       bytes of the payload message that follows (0: none)
    56  I   count         pieces the sender sends in this (phase, destination) stream,
                          or the root of a broadcast, or the peer an ABORT names
    60  I   crc           zlib.crc32 of bytes 0..59
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ProtocolError

__all__ = [
    "DTYPE_CODES",
    "FRAME_NBYTES",
    "MAGIC",
    "MAX_PAYLOAD_NBYTES",
    "MIXED_BITS",
    "VERSION",
    "Algo",
    "Coll",
    "Frame",
    "Kind",
    "Op",
    "dtype_code",
    "dtype_from_code",
]

MAGIC = b"CGXF"
VERSION = 1
_STRUCT = struct.Struct("<4sBBBBQIHHIBBBBQQQII")
FRAME_NBYTES: int = _STRUCT.size
assert FRAME_NBYTES == 64
#: Largest payload a peer may announce (bounded before anything is allocated): 16 GiB,
#: above any single gradient bucket or broadcast this library is meant for.
MAX_PAYLOAD_NBYTES = 1 << 34
#: ``bits`` value of a layout whose layers use different widths.
MIXED_BITS = 255


class Kind(enum.IntEnum):
    HELLO = 1  # membership proof: the payload is the job token
    HELLO_ACK = 2
    DATA = 3  # a piece of a collective
    SIG = 4  # a collective's signature only (no data), first message of a collective
    ABORT = 5  # the sender gave up collective ``seq``; payload is a UTF-8 reason
    BYE = 6  # the sender is closing cleanly


class Coll(enum.IntEnum):
    NONE = 0
    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    BARRIER = 4


class Op(enum.IntEnum):
    NONE = 0
    SUM = 1
    AVG = 2


class Algo(enum.IntEnum):
    NONE = 0
    SRA = 1  # scatter-reduce-allgather
    RING = 2
    DIRECT = 3  # broadcast / allgather straight to every peer


class AbortCode(enum.IntEnum):
    MISMATCH = 1
    PEER_LOST = 2
    PROTOCOL = 3
    LOCAL = 4  # the sender failed for a reason of its own (bad argument, codec error)


DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 2,
    np.dtype(ml_dtypes.bfloat16): 3,
    np.dtype(np.float64): 4,
    np.dtype(np.int8): 5,
    np.dtype(np.uint8): 6,
    np.dtype(np.int16): 7,
    np.dtype(np.int32): 8,
    np.dtype(np.int64): 9,
    np.dtype(np.uint16): 10,
    np.dtype(np.uint32): 11,
    np.dtype(np.uint64): 12,
    np.dtype(np.bool_): 13,
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def dtype_code(dtype: Any) -> int:
    """Wire code of a dtype; raises ProtocolError-free ValueError for unsupported ones."""
    dt = np.dtype(dtype)
    try:
        return DTYPE_CODES[dt]
    except KeyError:
        raise ValueError(f"dtype {dt} is not supported on the wire") from None


def dtype_from_code(code: int) -> np.dtype | None:
    return _CODE_DTYPES.get(code)


@dataclass(frozen=True)
class Frame:
    """A decoded, CRC-checked frame header (field meanings in the module docstring)."""

    kind: int
    job: int
    seq: int = 0
    src: int = 0
    phase: int = 0
    slot: int = 0
    collective: int = 0
    reduce_op: int = 0
    dtype: int = 0
    bits: int = 0
    algorithm: int = 0
    flags: int = 0
    numel: int = 0
    digest: int = 0
    payload: int = 0
    count: int = 0

    def pack(self) -> bytes:
        head = _STRUCT.pack(
            MAGIC,
            VERSION,
            self.kind,
            self.collective,
            self.reduce_op,
            self.job,
            self.seq & 0xFFFFFFFF,
            self.src,
            self.phase,
            self.slot,
            self.dtype,
            self.bits,
            self.algorithm,
            self.flags,
            self.numel,
            self.digest,
            self.payload,
            self.count,
            0,
        )
        return head[:60] + struct.pack("<I", zlib.crc32(head[:60]))

    def into(self, buf: np.ndarray) -> np.ndarray:
        """Write the packed header into ``buf`` (uint8, >= 64 bytes); returns buf[:64]."""
        buf[:FRAME_NBYTES] = np.frombuffer(self.pack(), np.uint8)
        return buf[:FRAME_NBYTES]

    def with_(self, **changes: Any) -> Frame:
        return replace(self, **changes)

    @property
    def signature(self) -> tuple[int, ...]:
        """The fields every rank must agree on for one collective."""
        return (
            self.collective,
            self.reduce_op,
            self.dtype,
            self.bits,
            self.algorithm,
            self.flags,
            self.numel,
            self.digest,
        )

    @classmethod
    def unpack(cls, data: Any, *, job: int | None = None) -> Frame:
        """Decode and validate a header; ProtocolError for anything foreign or corrupt."""
        raw = bytes(memoryview(data).cast("B")[:FRAME_NBYTES])
        if len(raw) != FRAME_NBYTES:
            raise ProtocolError(f"frame header of {len(raw)} bytes, expected {FRAME_NBYTES}")
        (crc,) = struct.unpack_from("<I", raw, 60)
        if raw[:4] != MAGIC:
            raise ProtocolError(f"foreign frame: magic {raw[:4]!r}, expected {MAGIC!r}")
        if zlib.crc32(raw[:60]) != crc:
            raise ProtocolError("corrupt frame header (CRC mismatch)")
        f = _STRUCT.unpack(raw)
        if f[1] != VERSION:
            raise ProtocolError(f"frame version {f[1]}, this library speaks {VERSION}")
        try:
            Kind(f[2])
        except ValueError:
            raise ProtocolError(f"unknown frame kind {f[2]}") from None
        frame = cls(
            kind=f[2],
            collective=f[3],
            reduce_op=f[4],
            job=f[5],
            seq=f[6],
            src=f[7],
            phase=f[8],
            slot=f[9],
            dtype=f[10],
            bits=f[11],
            algorithm=f[12],
            flags=f[13],
            numel=f[14],
            digest=f[15],
            payload=f[16],
            count=f[17],
        )
        if job is not None and frame.job != job:
            raise ProtocolError(f"frame of a foreign job {frame.job:#x} (this job {job:#x})")
        if frame.payload > MAX_PAYLOAD_NBYTES:
            raise ProtocolError(
                f"frame announces a {frame.payload}-byte payload, above the "
                f"{MAX_PAYLOAD_NBYTES}-byte bound"
            )
        return frame
