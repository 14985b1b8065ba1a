"""The 80-byte frame header every cgx_ucx message starts with, and its validation.

Each message on the wire is a fixed-size header, optionally followed by a payload sent as
a second message, received into a buffer of exactly the announced, bounded size. The
payload is used only after its header was validated; its receive is posted after the
header arrived, or with the header's where the receiver knows the size beforehand (the
pieces of a collective after the first: see ``MeshData.recv_frame_into``). Nothing is
unpickled; the header is a ``struct`` closed by a 16-byte check, so a foreign or corrupted
frame is a :class:`~cgx_ucx.errors.ProtocolError` before any field is trusted.

A small contiguous host payload (at most :data:`MAX_INLINE_NBYTES`) instead travels in
the header's own message (one message and one wake-up per frame rather than two),
with :data:`FLAG_INLINE` set: ``header (80) | payload (n) | INLINE_END (1 byte)``.
Every data-channel header receive is posted with room for that (:data:`RECV_NBYTES`, the
receiver cannot know beforehand) into a zeroed buffer; :func:`inline_payload` checks the
keyed header, the bound and the end byte (a message shorter than announced leaves a zero
there) before a single payload byte is used. Device payloads never go inline.

The check is BLAKE2b-128 over bytes 0..63. Once two ranks completed their handshake
(:mod:`.handshake`) it is keyed with their pair key, so a header is accepted only from
the peer that holds that key (UCX tags are worker-wide, and a process that read the
store could post frames claiming to be a member). Before that (the HELLO
exchange) it is unkeyed and only detects corruption. Payloads are not covered: they
travel on tags derived from a per-pair secret that no store reader knows, and a MAC
over every payload byte would cost more than the quantized transfer itself.

Layout, little-endian, ``struct`` format ``<4sBBBBQIIHHIBBBBIQQQ16s``::

    0   4s  magic         b"CGXF"
    4   B   version       :data:`VERSION` (frames of another version are refused)
    5   B   kind          Kind (HELLO, HELLO_ACK, PROOF, DATA, SIG, ABORT, BYE, STATUS...)
    6   B   collective    Coll (allreduce, broadcast, allgather, barrier, p2p, ...)
    7   B   reduce_op     Op (none, sum, avg; max ... bxor: an allgather's local reduction)
    8   Q   job           64-bit id of this communicator instance (from its token)
    16  I   comm          communicator id, agreed through the store (never random)
    20  I   seq           collective sequence number of the sender
    24  H   src           sender rank
    26  H   phase         phase of the collective (algorithm-specific; an ABORT's: its
                          AbortCode)
    28  I   slot          piece / step index inside the phase (an ABORT's: how many
                          silent ranks its payload names, see below)
    32  B   dtype         DTYPE_CODES
    33  B   bits          uniform bits of the layout, MIXED_BITS when layers differ
    34  B   algorithm     Algo (sra, ring, direct)
    35  B   flags         bits 0-6 signed by the collective (bit 0 stochastic rounding,
                          bits 1-3 the hierarchical scheme); bit 7 FLAG_INLINE (wire
                          only, cleared before the signature is compared): see above
    36  I   count         pieces the sender sends in this (phase, destination) stream,
                          or the root of a broadcast, or the peer an ABORT names
    40  Q   numel         values in the caller's buffer (an all-to-all's SIG frame: the
                          values the sender sends this receiver; its other frames: 0)
    48  Q   digest        Layout.digest (an all-to-all's SIG frame: the values the sender
                          expects from this receiver; its other frames: 0)
    56  Q   payload       bytes of the payload (a message that follows, or inline; 0: none)
    64  16s check         BLAKE2b-128 of bytes 0..63 (keyed with the pair key, see above)

Control frames (ABORT, BYE, STATUS, on the control channel) send their payload as a second
message, never inline. An ABORT's payload is its reason, UTF-8, at most
``control.MAX_REASON_NBYTES`` bytes, followed by ``slot`` ranks (at most
``control.MAX_NAMED_SILENT``), one little-endian u16 each: the peers that did not answer the
sender's status request (a stopped or cut-off process). ``payload`` counts both parts, so
the reason is its first ``payload - 2 * slot`` bytes; ``count`` is the rank the ABORT
blames, ``seq`` the collective it gave up. Its receiver does not wait for the named ranks'
BYE when it closes, although it never asked them itself. An ABORT naming more ranks than
that bound or than its payload holds, or whose reason exceeds its bound, is a
ProtocolError.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass, field, fields
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ProtocolError

__all__ = [
    "CHECK_NBYTES",
    "DTYPE_CODES",
    "FLAG_INLINE",
    "FRAME_NBYTES",
    "INLINE_END",
    "KEY_NBYTES",
    "MAGIC",
    "MAX_INLINE_NBYTES",
    "MAX_PAYLOAD_NBYTES",
    "MIXED_BITS",
    "PH_P2P",
    "RECV_NBYTES",
    "VERSION",
    "Algo",
    "Coll",
    "Frame",
    "Kind",
    "Op",
    "copy_inline",
    "describe_slot",
    "dtype_code",
    "dtype_from_code",
    "inlinable",
    "inline_message",
    "inline_payload",
]

MAGIC = b"CGXF"
#: 3: an all-to-all's SIG frames carry the pair's block sizes (numel, digest), which a
#: rank of version 2 would misread: frames of another version are refused.
VERSION = 3
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
#: ``flags`` bit of a frame whose payload follows the header in the same message. The
#: top bit: the lower ones are the collectives' own signed flags (hierarchical.py uses
#: bits 1 to 3), which must never set it.
FLAG_INLINE = 0x80
#: Largest payload sent inline. Every data-channel header receive is posted with room
#: for it (the receiver cannot know beforehand), so it stays small: above it the extra
#: copy on both sides outweighs the second message.
MAX_INLINE_NBYTES = 1 << 16
#: The byte that closes an inline message. The receive buffer is zeroed, so a message
#: shorter than header + announced payload + 1 leaves 0 where this byte is looked for.
INLINE_END = 0xC5
#: Size of every data-channel header receive: a header with the largest inline payload.
RECV_NBYTES = FRAME_NBYTES + MAX_INLINE_NBYTES + 1
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
    REDUCE = 8  # an allreduce whose result one root keeps (torch's reduce): root signed


class Op(enum.IntEnum):
    NONE = 0
    SUM = 1
    AVG = 2
    # An allgather that feeds a local reduction (the torch backend's exact reductions)
    # signs the reduction with these, so ranks that disagree on it raise a mismatch.
    MAX = 3
    MIN = 4
    PROD = 5
    BAND = 6
    BOR = 7
    BXOR = 8


class Algo(enum.IntEnum):
    NONE = 0
    SRA = 1  # scatter-reduce-allgather
    RING = 2
    DIRECT = 3  # broadcast / allgather straight to every peer
    ONESHOT = 4  # allreduce in one round: every rank sends its whole buffer to every peer
    HIERARCHICAL = 5  # two levels: node-local reduce-scatter, cross-node, node-local allgather


#: Phase of every point-to-point frame (collectives use 1-5; 15 is the data HELLO): its
#: seq is the message's number on its (pair, tag) stream, its slot the user's tag.
PH_P2P = 8


def describe_slot(seq: int, phase: int, slot: int) -> str:
    """What a frame of (seq, phase, slot) carries, for error messages."""
    if phase == PH_P2P:
        return f"point-to-point message {seq} on tag {slot}"
    return f"phase {phase} piece {slot} of collective #{seq}"


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
    #: The payload bytes that arrived inline with this header (a uint8 view of the
    #: received message), or None; not part of the header (nor of equality).
    inline: Any = field(default=None, compare=False, repr=False)

    def pack(self, key: bytes | None = None, extra_flags: int = 0) -> bytes:
        """The 80 header bytes; the check is keyed with ``key`` (a pair key) when given.
        ``extra_flags``: wire-only flag bits (FLAG_INLINE) or-ed into ``flags``."""
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
            self.flags | extra_flags,
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
        """A copy with ``changes`` (field names only, as ``dataclasses.replace``).

        On every frame of every call: a plain dictionary copy instead of ``replace``,
        which rebuilds the frame field by field through the frozen dataclass's setters
        (several times slower, three times per call)."""
        unknown = changes.keys() - _FRAME_FIELDS
        if unknown:
            raise TypeError(f"Frame has no field(s) {sorted(unknown)}")
        new = object.__new__(Frame)
        state = new.__dict__
        state.update(self.__dict__)
        state.update(changes)
        return new

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


#: Frame.with_ accepts these names only (as dataclasses.replace would).
_FRAME_FIELDS = frozenset(f.name for f in fields(Frame))


def inlinable(payload: Any, nbytes: int) -> bool:
    """Whether ``payload`` goes inline: host memory, contiguous, at most
    MAX_INLINE_NBYTES (device payloads never: inlining them would cost a device-to-host
    copy and a synchronisation)."""
    return (
        0 < nbytes <= MAX_INLINE_NBYTES
        and isinstance(payload, np.ndarray)
        and payload.flags.c_contiguous
        and payload.nbytes == nbytes
    )


def inline_message(frame: Frame, payload: np.ndarray, key: bytes | None = None) -> np.ndarray:
    """The one message of a frame with its payload inline (see the module docstring);
    ``payload`` must be :func:`inlinable` with ``frame.payload`` bytes."""
    n = frame.payload
    msg = np.empty(FRAME_NBYTES + n + 1, np.uint8)
    msg[:FRAME_NBYTES] = np.frombuffer(frame.pack(key, FLAG_INLINE), np.uint8)
    msg[FRAME_NBYTES:-1] = payload.reshape(-1).view(np.uint8)
    msg[-1] = INLINE_END
    return msg


def inline_payload(frame: Frame, message: np.ndarray) -> np.ndarray | None:
    """The inline payload of a received, already checked header ``frame`` (a view of
    ``message``, the zeroed receive buffer), None when ``frame`` has no FLAG_INLINE.
    ProtocolError when the flag announces more than MAX_INLINE_NBYTES, or the message
    ended before header + payload + INLINE_END; nothing is copied before these checks."""
    if not frame.flags & FLAG_INLINE:
        return None
    n = frame.payload
    if n > MAX_INLINE_NBYTES:
        raise ProtocolError(
            f"inline payload of {n} bytes announced, above the {MAX_INLINE_NBYTES}-byte bound"
        )
    end = FRAME_NBYTES + n
    if message.nbytes <= end or int(message[end]) != INLINE_END:
        raise ProtocolError(f"inline message shorter than its header and {n} payload bytes")
    return message[FRAME_NBYTES:end]


def copy_inline(buf: Any, data: np.ndarray) -> None:
    """Copy an inline payload (host bytes) into the caller's receive buffer (host, or a
    device buffer whose peer sent host memory)."""
    if isinstance(buf, np.ndarray):
        buf.reshape(-1).view(np.uint8)[...] = data
        return
    import cupy

    cupy.asarray(buf).reshape(-1).view(cupy.uint8).set(data)


def _check(body: bytes, key: bytes | None) -> bytes:
    if key is None:
        return hashlib.blake2b(body, digest_size=CHECK_NBYTES).digest()
    return hashlib.blake2b(body, key=key, digest_size=CHECK_NBYTES).digest()
