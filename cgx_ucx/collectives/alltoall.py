"""All-to-all: rank r's i-th block goes to rank i, into its r-th block (exact, uncompressed).

Mixture-of-experts layers exchange tokens this way (torch's ``all_to_all_single`` with
split sizes), so blocks may be uneven: rank r sends ``send_counts[i]`` values to rank i
and receives ``recv_counts[i]`` from it. The counts of a pair must agree (r's
``send_counts[i]`` is i's ``recv_counts[r]``), and only the two ranks of a pair know
them, so each rank signs its call to each peer apart: the SIG frame rank r sends rank i
is the call's signature (collective, dtype, algorithm; ``numel`` and ``digest`` 0 in the
template that every data frame carries) with

* ``numel``  = ``send_counts[i]``: the values r sends i,
* ``digest`` = ``recv_counts[i]``: the values r expects from i.

On i's SIG each rank checks both directions of the pair (i's ``numel`` against its own
receive count from i, i's ``digest`` against its own send count to i) before any byte
of data moves, so BOTH ranks of a pair that disagrees raise
:class:`~cgx_ucx.errors.CollectiveMismatchError` naming the two ranks and the counts,
in the same words on both ("rank p sends rank r 6 values, rank r expects 9"; a rank
still waiting for a third rank's SIG when its partner's ABORT comes raises that ABORT,
"rank p aborted collective #n: ...", which quotes them too). They then send no block
at all; every other rank waits for a block from each of them and so fails as well,
with CollectiveMismatchError from their ABORT (as soon as it arrives; the ABORT is best
effort, as everywhere, the timeout bounds the wait otherwise): an all-to-all with a bad
pair completes on no rank. A peer in another collective, or in an all-to-all of
another dtype, is a mismatch as for every collective (its SIG stream drained first).

The size of each block is still checked by its receiver against the sender's header
before any byte of it is written (defence in depth: counts that agreed in the
signatures cannot differ there unless a peer breaks the protocol); a difference drains
the block and fails the call with CollectiveMismatchError on the receiver (the ABORT it
sends fails the peers still in the call).

All-to-all never goes through the node-local mailboxes (:mod:`.local`): it has no
mailbox steps, so on one host too it runs over messages and the checks above hold.

Blocks go straight from the caller's input to the peers and land in place in the
caller's output, in pieces of at most :data:`~.plan.PIECE_BYTES` (one message each).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError, ProtocolError
from ..transport.frames import Algo, Coll, Frame, Kind
from .broadcast import byte_pieces
from .call import PH_DATA, PH_SIG, Call, gather_or_cancel, make_template
from .staging import as_flat, byte_view, synchronize

__all__ = ["prepare_alltoall", "run_alltoall"]


def _counts(counts: Sequence[int] | None, total: int, world_size: int, what: str) -> list[int]:
    """Per-rank value counts: given, or ``total`` split evenly (ConfigError otherwise)."""
    if counts is None:
        if total % world_size:
            raise ConfigError(
                f"{what}: {total} values do not split evenly over {world_size} ranks; "
                "give the split sizes"
            )
        return [total // world_size] * world_size
    out = [int(c) for c in counts]
    if len(out) != world_size or any(c < 0 for c in out):
        raise ConfigError(f"{what}: need {world_size} counts >= 0, got {list(counts)}")
    if sum(out) != total:
        raise ConfigError(f"{what}: counts {out} sum to {sum(out)}, the buffer holds {total}")
    return out


def _offsets(counts: list[int]) -> list[int]:
    return [int(v) for v in np.concatenate([[0], np.cumsum(counts)])]


def prepare_alltoall(
    x: Any,
    out: Any,
    rank: int,
    world_size: int,
    send_counts: Sequence[int] | None = None,
    recv_counts: Sequence[int] | None = None,
) -> tuple[Frame, tuple[Any, Any, list[int], list[int], list[int], list[int]]]:
    """The signature of an all-to-all of flat ``x`` into flat ``out`` and its blocks."""
    flat = as_flat(x)
    dst = as_flat(out, "out", writable=True)
    if dst.dtype != flat.dtype:
        raise ConfigError(f"out must have dtype {flat.dtype}, got {dst.dtype}")
    sc = _counts(send_counts, flat.size, world_size, "send counts")
    rc = _counts(recv_counts, dst.size, world_size, "receive counts")
    if sc[rank] != rc[rank]:
        raise ConfigError(
            f"rank {rank} sends itself {sc[rank]} values but receives {rc[rank]} from itself"
        )
    # numel and digest 0: the block sizes differ per pair; each SIG frame carries its
    # pair's counts instead (see exchange_counts), and each data frame the template.
    template = make_template(Coll.ALLTOALL, flat, algorithm=Algo.DIRECT).with_(numel=0)
    return template, (flat, dst, sc, rc, _offsets(sc), _offsets(rc))


def pair_problems(me: int, peer: int, sig: Frame, sc: list[int], rc: list[int]) -> list[str]:
    """What ``peer``'s all-to-all SIG frame ``sig`` to rank ``me`` says that ``me`` (with
    ``sc`` / ``rc``) disagrees with, one line per direction of the pair; [] when the pair
    agrees. Both ranks of a pair word a difference the same way."""
    out = []
    if sig.numel != rc[peer]:
        out.append(f"rank {peer} sends rank {me} {sig.numel} values, rank {me} expects {rc[peer]}")
    if sig.digest != sc[peer]:
        out.append(
            f"rank {me} sends rank {peer} {sc[peer]} values, rank {peer} expects {sig.digest}"
        )
    return out


async def exchange_counts(call: Call, sc: list[int], rc: list[int]) -> None:
    """Phase 1 of an all-to-all: a SIG frame to each peer carrying the pair's counts
    (``numel``: what this rank sends it, ``digest``: what this rank expects from it), and
    each peer's checked against ours in both directions (module docstring). Raises
    CollectiveMismatchError naming every difference; nothing else has moved then."""
    assert call.template is not None
    peers = list(call.transport.peers)
    base = call.frame(PH_SIG, 0, 0, 1, Kind.SIG)
    sends = [
        call.transport.send_frame(p, base.with_(numel=sc[p], digest=rc[p]), None, call.extra)
        for p in peers
    ]
    recvs = [call.recv_header(p, PH_SIG, 0, first=True) for p in peers]
    frames = (await gather_or_cancel([*sends, *recvs]))[len(sends) :]
    problems: list[str] = []
    for p, frame in zip(peers, frames, strict=True):
        # The template signs numel and digest 0: the rest of the signature must be ours.
        if frame.with_(numel=0, digest=0).signature == call.template.signature:
            problems += pair_problems(call.rank, p, frame, sc, rc)
            continue
        # Another collective, or another dtype: drain what the peer announced, as
        # Call.check_first does for every collective.
        await call.drain(p, frame, PH_SIG)
        problems.append(call.mismatch(p, frame))
    call.raise_mismatches(sorted(problems))


async def run_alltoall(
    call: Call, state: tuple[Any, Any, list[int], list[int], list[int], list[int]]
) -> Any:
    """Exchange the blocks; returns the output."""
    flat, dst, sc, rc, so, ro = state
    await exchange_counts(call, sc, rc)
    r = call.rank
    dst[ro[r] : ro[r] + rc[r]] = flat[so[r] : so[r] + sc[r]]
    synchronize(flat)
    problems: list[str] = []

    def sends(p: int) -> list[Any]:
        data = byte_view(flat[so[p] : so[p] + sc[p]])
        pieces = byte_pieces(data.size)
        return [call.send(p, PH_DATA, k, data[a:b], len(pieces)) for k, (a, b) in enumerate(pieces)]

    async def recv_from(p: int) -> None:
        block = byte_view(dst[ro[p] : ro[p] + rc[p]])
        pieces = byte_pieces(block.size)
        (a, b), *rest = pieces
        frame = await call.recv_header(p, PH_DATA, 0)
        if frame.count != len(pieces) or frame.payload != b - a:
            await call.drain(p, frame, PH_DATA)
            n = frame.payload // flat.dtype.itemsize
            sent = f"{n}" if frame.count == 1 else f"about {n * frame.count}"
            problems.append(f"rank {p} sends rank {r} {sent} values, rank {r} expects {rc[p]}")
            return
        await call.recv_payload(p, frame, block[a:b])
        # The block's size was checked on its first piece: the rest land in place.
        for k, (a, b) in enumerate(rest, 1):
            frame = await call.recv_piece(p, PH_DATA, k, block[a:b])
            if frame.count != len(pieces):
                raise ProtocolError(f"rank {p} changed its block size mid-way")

    peers = call.transport.peers
    await gather_or_cancel([*(s for p in peers for s in sends(p)), *(recv_from(p) for p in peers)])
    call.raise_mismatches(sorted(problems))
    return dst
