"""Membership handshake, pair keys and the secret tag spaces of the data channel.

Trust model. The job token (drawn by rank 0, kept in the store) proves membership: whoever
can read the store is trusted, as with gloo and NCCL. With an out-of-band secret
(``CommConfig.secret`` / ``CGX_UCX_SECRET``, set by the launcher on every rank) the
proofs are keyed with it as well, so reading the store is not enough to join.

Control channel (an error-handling endpoint through the listener; ucxx gives each such
endpoint random 64-bit tags, so nobody else can post on it), dialer D -> acceptor A:

1. D sends HELLO: its rank, the rank it meant to reach, a fresh nonce ``n_d``.
2. A sends HELLO_ACK: a fresh nonce ``n_a``, its proof ``P(k, "acceptor", D, A, n_d, n_a)``
   and the tag prefix A chose for what D will send it (masked, see below).
3. D checks A's proof, then sends PROOF: its own proof and the prefix D chose for what A
   will send it. A checks D's proof.

``k`` is the token, or HMAC(secret, token) with a secret; proofs are HMAC-SHA256 bound to
both nonces and both ranks, so a recorded proof is useless in another handshake. Both sides
then derive the pair key (BLAKE2b key of every header between them, :mod:`.frames`) and
the masks of the prefixes from ``k`` and the nonces: neither ever goes to the store, and a
store reader who cannot also sniff the link learns neither (with a secret, a sniffer
cannot either).

Data channel (worker-address endpoints; UCX matches tags across the whole worker, so a tag
proves nothing by itself): a data tag is ``prefix XOR (seq | phase | slot | payload bit)``,
the structured part in the low :data:`STRUCT_BITS` bits. The *receiver* chooses the prefix
of every direction it receives on: 64 random bits whose top :data:`SPACE_BITS` bits (the
tag space) no other direction of this process ever had (:func:`allocate_prefix`). So two
communicators, or two peers, can never match each other's messages (collision-free by
construction, however many process groups a job makes), and a process that read the store
cannot post on a tag any receive will match without guessing 64 secret bits.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError, TransportError
from .frames import FRAME_NBYTES, KEY_NBYTES, Frame, Kind
from .progress import post_recv, post_send

__all__ = [
    "PHASE_HELLO",
    "SPACE_BITS",
    "STRUCT_BITS",
    "Auth",
    "PairKeys",
    "accept",
    "allocate_prefix",
    "dial",
    "release_prefix",
    "structured_tag",
]

NONCE_NBYTES = 16
PROOF_NBYTES = 16
PREFIX_NBYTES = 8
#: Low bits of a data tag: sequence 20 | phase 4 | slot 15 | payload 1.
SEQ_BITS, PHASE_BITS, SLOT_BITS = 20, 4, 15
STRUCT_BITS = SEQ_BITS + PHASE_BITS + SLOT_BITS + 1
#: Top bits of a prefix: the tag space, unique per receive direction in this process.
SPACE_BITS = 64 - STRUCT_BITS
MAX_SLOTS = 1 << SLOT_BITS
#: Phase number reserved for the data-channel HELLO.
PHASE_HELLO = (1 << PHASE_BITS) - 1
#: Draws before giving up on a free tag space (only reachable after ~10^7 directions).
MAX_PREFIX_DRAWS = 10_000

_spaces: set[int] = set()
_spaces_lock = threading.Lock()


def allocate_prefix() -> int:
    """A secret 64-bit tag prefix in a tag space this process never handed out before.

    Spaces are never reused while the process lives: a late message of a closed
    communicator can never match a receive of a later one.
    """
    with _spaces_lock:
        for _ in range(MAX_PREFIX_DRAWS):
            prefix = secrets.randbits(64)
            space = prefix >> STRUCT_BITS
            if space not in _spaces:
                _spaces.add(space)
                return prefix
    raise TransportError("no free data-channel tag space left in this process")


def release_prefix(prefix: int) -> None:
    """Give back a prefix no message was ever sent on (a handshake that failed)."""
    with _spaces_lock:
        _spaces.discard(prefix >> STRUCT_BITS)


def structured_tag(seq: int, phase: int, slot: int, payload: bool) -> int:
    """The low bits of a data tag (the per-pair prefix is XORed on by the mesh)."""
    if not 0 <= slot < MAX_SLOTS:
        raise TransportError(f"slot {slot} out of range (max {MAX_SLOTS - 1})")
    t = seq & ((1 << SEQ_BITS) - 1)
    t = (t << PHASE_BITS) | phase
    t = (t << SLOT_BITS) | slot
    return (t << 1) | int(payload)


@dataclass(frozen=True)
class PairKeys:
    """What two ranks share after the handshake (never written to the store)."""

    key: bytes  # keys the check of every frame header between the two
    tx: int  # prefix of the data tags we send to the peer (the peer chose it)
    rx: int  # prefix of the data tags we receive from the peer (we chose it)


class Auth:
    """Membership proofs and key derivation of one communicator (see the module doc)."""

    def __init__(self, token: bytes, job: int, comm: int, secret: bytes | None = None) -> None:
        self.job, self.comm = job, comm
        self.has_secret = secret is not None
        self._k = token if secret is None else hmac.digest(secret, b"cgx-member" + token, "sha256")

    def _mac(self, label: bytes, dialer: int, acceptor: int, n_d: bytes, n_a: bytes) -> bytes:
        msg = label + struct.pack("<QIII", self.job, self.comm, dialer, acceptor) + n_d + n_a
        return hmac.digest(self._k, msg, "sha256")

    def proof(self, role: bytes, dialer: int, acceptor: int, n_d: bytes, n_a: bytes) -> bytes:
        return self._mac(b"proof/" + role, dialer, acceptor, n_d, n_a)[:PROOF_NBYTES]

    def pair_key(self, dialer: int, acceptor: int, n_d: bytes, n_a: bytes) -> bytes:
        return self._mac(b"pair-key", dialer, acceptor, n_d, n_a)[:KEY_NBYTES]

    def mask(self, direction: bytes, dialer: int, acceptor: int, n_d: bytes, n_a: bytes) -> int:
        raw = self._mac(b"mask/" + direction, dialer, acceptor, n_d, n_a)[:PREFIX_NBYTES]
        return int.from_bytes(raw, "little")

    def frame(self, kind: Kind, src: int, count: int, payload: int) -> Frame:
        return Frame(kind=kind, job=self.job, comm=self.comm, src=src, count=count, payload=payload)

    @property
    def refusal_hint(self) -> str:
        return "wrong secret (CGX_UCX_SECRET)" if self.has_secret else "wrong job token"


async def _send(ep: Any, frame: Frame, body: bytes) -> None:
    await post_send(ep, np.frombuffer(frame.pack(), np.uint8).copy(), None)
    await post_send(ep, np.frombuffer(body, np.uint8).copy(), None)


async def _recv(ep: Any, auth: Auth, kind: Kind, nbytes: int) -> tuple[Frame, bytes]:
    buf = np.empty(FRAME_NBYTES, np.uint8)
    await post_recv(ep, buf, None)
    frame = Frame.unpack(buf, job=auth.job)
    if frame.kind != kind or frame.payload != nbytes:
        raise ProtocolError(f"expected a {kind.name} frame, got kind {frame.kind}")
    if frame.comm != auth.comm:
        raise ProtocolError(f"frame of communicator {frame.comm}, this is {auth.comm}")
    body = np.empty(nbytes, np.uint8)
    await post_recv(ep, body, None)
    return frame, body.tobytes()


def _prefix_bytes(prefix: int, mask: int) -> bytes:
    return (prefix ^ mask).to_bytes(PREFIX_NBYTES, "little")


def _unmask(raw: bytes, mask: int) -> int:
    return int.from_bytes(raw, "little") ^ mask


async def dial(ep: Any, auth: Auth, me: int, peer: int) -> PairKeys:
    """The dialer's side on a fresh control endpoint to ``peer``; ProtocolError on refusal."""
    n_d = secrets.token_bytes(NONCE_NBYTES)
    await _send(ep, auth.frame(Kind.HELLO, me, peer, NONCE_NBYTES), n_d)
    frame, body = await _recv(ep, auth, Kind.HELLO_ACK, NONCE_NBYTES + PROOF_NBYTES + 8)
    if frame.src != peer:
        raise ProtocolError(f"rank {peer}'s address answered as rank {frame.src}")
    n_a, proof, masked = body[:16], body[16:32], body[32:]
    if not hmac.compare_digest(proof, auth.proof(b"acceptor", me, peer, n_d, n_a)):
        raise ProtocolError(f"rank {peer} could not prove membership ({auth.refusal_hint}?)")
    rx = allocate_prefix()
    try:
        mine = _prefix_bytes(rx, auth.mask(b"to-dialer", me, peer, n_d, n_a))
        await _send(
            ep,
            auth.frame(Kind.PROOF, me, peer, PROOF_NBYTES + PREFIX_NBYTES),
            auth.proof(b"dialer", me, peer, n_d, n_a) + mine,
        )
    except BaseException:
        release_prefix(rx)
        raise
    tx = _unmask(masked, auth.mask(b"to-acceptor", me, peer, n_d, n_a))
    return PairKeys(auth.pair_key(me, peer, n_d, n_a), tx, rx)


async def accept(ep: Any, auth: Auth, me: int, expected: Any) -> tuple[int, PairKeys]:
    """The acceptor's side: returns (the dialer's rank, keys); ProtocolError on refusal.

    ``expected(rank)`` says whether a connection from ``rank`` is awaited."""
    frame, n_d = await _recv(ep, auth, Kind.HELLO, NONCE_NBYTES)
    d = frame.src
    if frame.count != me:
        raise ProtocolError(f"rank {d} meant to reach rank {frame.count}, not rank {me}")
    if not expected(d):
        raise ProtocolError(f"unexpected HELLO from rank {d}")
    n_a = secrets.token_bytes(NONCE_NBYTES)
    rx = allocate_prefix()
    try:
        ours = _prefix_bytes(rx, auth.mask(b"to-acceptor", d, me, n_d, n_a))
        await _send(
            ep,
            auth.frame(Kind.HELLO_ACK, me, d, NONCE_NBYTES + PROOF_NBYTES + PREFIX_NBYTES),
            n_a + auth.proof(b"acceptor", d, me, n_d, n_a) + ours,
        )
        frame, body = await _recv(ep, auth, Kind.PROOF, PROOF_NBYTES + PREFIX_NBYTES)
        if frame.src != d:
            raise ProtocolError(f"PROOF from rank {frame.src} after rank {d}'s HELLO")
        if not hmac.compare_digest(body[:16], auth.proof(b"dialer", d, me, n_d, n_a)):
            raise ProtocolError(f"rank {d} could not prove membership ({auth.refusal_hint}?)")
    except BaseException:
        release_prefix(rx)
        raise
    tx = _unmask(body[16:], auth.mask(b"to-dialer", d, me, n_d, n_a))
    return d, PairKeys(auth.pair_key(d, me, n_d, n_a), tx, rx)


async def data_hello(ep: Any, auth: Auth, me: int, peer: int, keys: PairKeys) -> None:
    """Prove, on the data channel, that ``peer``'s worker holds the pair key: each side
    sends a keyed HELLO on its secret tag and checks the one it receives."""
    tag = structured_tag(0, PHASE_HELLO, 0, False)
    hello = np.frombuffer(auth.frame(Kind.HELLO, me, peer, 0).pack(keys.key), np.uint8).copy()
    buf = np.empty(FRAME_NBYTES, np.uint8)
    send = post_send(ep, hello, keys.tx ^ tag)
    await post_recv(ep, buf, keys.rx ^ tag)
    await send
    frame = Frame.unpack(buf, job=auth.job, key=keys.key)
    if frame.kind != Kind.HELLO or frame.src != peer or frame.count != me:
        raise ProtocolError(f"rank {peer} failed the data-channel membership check")


def hash_bytes(text: str | bytes) -> bytes:
    """A secret given as text or bytes, as the 32 bytes the proofs are keyed with."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    return hashlib.sha256(b"cgx-secret" + raw).digest()


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (a time.monotonic() value), at least 1 ms."""
    return max(deadline - time.monotonic(), 0.001)
