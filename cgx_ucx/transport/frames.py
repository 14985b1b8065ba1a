"""The 80-byte frame header every cgx_ucx message starts with, and its validation.

Each message on the wire is a fixed-size header, optionally followed by a payload sent as
a second message (the payload is received only after the header was validated, into a
buffer of exactly the announced, bounded size). Nothing is unpickled; the header is a
``struct`` closed by a 16-byte check, so a foreign or corrupted frame is a
:class:`~cgx_ucx.errors.ProtocolError` before any field is trusted.

The check is BLAKE2b-128 over bytes 0..63. Once two ranks completed their handshake
(:mod:`.handshake`) it is keyed with their pair key, so a header is accepted only from
the peer that holds that key (issue 13: UCX tags are worker-wide, and a process that
read the store could post frames claiming to be a member). Before that (the HELLO
exchange) it is unkeyed and only detects corruption. Payloads are not covered: they
travel on tags derived from a per-pair secret that no store reader knows, and a MAC
over every payload byte would cost more than the quantized transfer itself.

Layout, little-endian, ``struct`` format ``<4sBBBBQIIHHIBBBBIQQQ16s``::

    0   4s  magic         b"CGXF"
    4   B   version       2 (1 had a 60-byte body and a CRC32; no communicator id)
    5   B   kind          Kind (HELLO, HELLO_ACK, PROOF, DATA, SIG, ABORT, BYE, STATUS...)
    6   B   collective    Coll (allreduce, broadcast, allgather, barrier, p2p, ...)
    7   B   reduce_op     Op (none, sum, avg)
    8   Q   job           64-bit id of this communicator instance (from its token)
    16  I   comm          communicator id, agreed through the store (never random)
    20  I   seq           collective sequence number of the sender
    24  H   src           sender rank
    26  H   phase         phase of the collective (algorithm-specific)
    28  I   slot          piece / step index inside the phase
    32  B   dtype         DTYPE_CODES
    33  B   bits          uniform bits of the layout, MIXED_BITS when layers differ
    34  B   algorithm     Algo (sra, ring, direct)
    35  B   flags         bit 0 stochastic rounding
    36  I   count         pieces the sender sends in this (phase, destination) stream,
                          or the root of a broadcast, or the peer an ABORT names
    40  Q   numel         values in the caller's buffer
    48  Q   digest        Layout.digest
    56  Q   payload       bytes of the payload message that follows (0: none)
    64  16s check         BLAKE2b-128 of bytes 0..63 (keyed with the pair key, see above)
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ProtocolError

__all__ = [
    "CHECK_NBYTES",
    "DTYPE_CODES",
    "FRAME_NBYTES",
    "KEY_NBYTES",
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
VERSION = 2
_BODY = struct.Struct("<4sBBBBQIIHHIBBBBIQQQ")
#: Bytes of the header check (BLAKE2b digest size).
CHECK_NBYTES = 16
#: Bytes of a pair key (BLAKE2b key).
KEY_NBYTES = 16
FRAME_NBYTES: int = _BODY.size + CHECK_NBYTES
assert _BODY.size == 64 and FRAME_NBYTES == 80
#: Largest payload a peer may announce (bounded before anything is allocated): 16 GiB,
#: above any single gradient bucket or broadcast this library is meant for.
MAX_PAYLOAD_NBYTES = 1 << 34
#: ``bits`` value of a layout whose layers use different widths.
MIXED_BITS = 255


class Kind(enum.IntEnum):
    HELLO = 1  # handshake step 1 (dialer): payload is its nonce
    HELLO_ACK = 2  # step 2 (acceptor): its nonce, its proof, a masked tag prefix
    DATA = 3  # a piece of a collective
    SIG = 4  # a collective's signature only (no data), first message of a collective
    ABORT = 5  # the sender gave up collective ``seq``; payload is a UTF-8 reason
    BYE = 6  # the sender is closing cleanly
    PROOF = 7  # handshake step 3 (dialer): its proof, a masked tag prefix
    STATUS_REQUEST = 8  # "where are you?" (sent when a wait on the receiver timed out)
    STATUS = 9  # answer: seq = last started, count = last finished, payload = description


class Coll(enum.IntEnum):
    NONE = 0
    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    BARRIER = 4
    P2P = 5  # a point-to-point message (its own phase, see cgx_ucx.collectives.p2p)
    ALLTOALL = 6
    REDUCE_SCATTER = 7


class Op(enum.IntEnum):
    NONE = 0
    SUM = 1
    AVG = 2


class Algo(enum.IntEnum):
    NONE = 0
    SRA = 1  # scatter-reduce-allgather
    RING = 2
    DIRECT = 3  # broadcast / allgather straight to every peer
    ONESHOT = 4  # allreduce in one round: every rank sends its whole buffer to every peer
    HIERARCHICAL = 5  # two levels: node-local reduce-scatter, cross-node, node-local allgather


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
    """A decoded, checked frame header (field meanings in the module docstring)."""

    kind: int
    job: int
    seq: int = 0
    comm: int = 0
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

    def pack(self, key: bytes | None = None) -> bytes:
        """The 80 header bytes; the check is keyed with ``key`` (a pair key) when given."""
        body = _BODY.pack(
            MAGIC,
            VERSION,
            self.kind,
            self.collective,
            self.reduce_op,
            self.job,
            self.comm,
            self.seq & 0xFFFFFFFF,
            self.src,
            self.phase,
            self.slot,
            self.dtype,
            self.bits,
            self.algorithm,
            self.flags,
            self.count,
            self.numel,
            self.digest,
            self.payload,
        )
        return body + _check(body, key)

    def into(self, buf: np.ndarray, key: bytes | None = None) -> np.ndarray:
        """Write the packed header into ``buf`` (uint8, >= 80 bytes); returns buf[:80]."""
        buf[:FRAME_NBYTES] = np.frombuffer(self.pack(key), np.uint8)
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
    def unpack(cls, data: Any, *, job: int | None = None, key: bytes | None = None) -> Frame:
        """Decode and validate a header; ProtocolError for anything foreign or corrupt.

        With ``key`` the check must be keyed with it: a frame from anyone but the holder
        of the pair key fails ("failed authentication")."""
        raw = bytes(memoryview(data).cast("B")[:FRAME_NBYTES])
        if len(raw) != FRAME_NBYTES:
            raise ProtocolError(f"frame header of {len(raw)} bytes, expected {FRAME_NBYTES}")
        if raw[:4] != MAGIC:
            raise ProtocolError(f"foreign frame: magic {raw[:4]!r}, expected {MAGIC!r}")
        if raw[4] != VERSION:
            raise ProtocolError(f"frame version {raw[4]}, this library speaks {VERSION}")
        body = raw[: _BODY.size]
        if not hmac.compare_digest(raw[_BODY.size :], _check(body, key)):
            if key is not None:
                raise ProtocolError("frame failed authentication (not keyed by this pair)")
            raise ProtocolError("corrupt frame header (check mismatch)")
        f = _BODY.unpack(body)
        try:
            Kind(f[2])
        except ValueError:
            raise ProtocolError(f"unknown frame kind {f[2]}") from None
        frame = cls(
            kind=f[2],
            collective=f[3],
            reduce_op=f[4],
            job=f[5],
            comm=f[6],
            seq=f[7],
            src=f[8],
            phase=f[9],
            slot=f[10],
            dtype=f[11],
            bits=f[12],
            algorithm=f[13],
            flags=f[14],
            count=f[15],
            numel=f[16],
            digest=f[17],
            payload=f[18],
        )
        if job is not None and frame.job != job:
            raise ProtocolError(f"frame of a foreign job {frame.job:#x} (this job {job:#x})")
        if frame.payload > MAX_PAYLOAD_NBYTES:
            raise ProtocolError(
                f"frame announces a {frame.payload}-byte payload, above the "
                f"{MAX_PAYLOAD_NBYTES}-byte bound"
            )
        return frame


def _check(body: bytes, key: bytes | None) -> bytes:
    if key is None:
        return hashlib.blake2b(body, digest_size=CHECK_NBYTES).digest()
    return hashlib.blake2b(body, key=key, digest_size=CHECK_NBYTES).digest()
