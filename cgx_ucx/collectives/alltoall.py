"""All-to-all: rank r's i-th block goes to rank i, into its r-th block (exact, uncompressed).

Mixture-of-experts layers exchange tokens this way (torch's ``all_to_all_single`` with
split sizes), so blocks may be uneven: rank r sends ``send_counts[i]`` values to rank i
and receives ``recv_counts[i]`` from it. The counts of a pair must agree (r's
``send_counts[i]`` is i's ``recv_counts[r]``): only the two ranks of a pair know them,
so the signature exchanged by everyone carries the dtype only, and the size of each
block is checked by its receiver against the sender's header, before any byte of it is
written. A difference drains the block and fails the call with
:class:`~cgx_ucx.errors.CollectiveMismatchError` on the receiver (the ABORT it sends
fails the peers still in the call).

Blocks go straight from the caller's input to the peers and land in place in the
caller's output, in pieces of at most :data:`~.plan.PIECE_BYTES` (one message each).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError, ProtocolError
from ..transport.frames import Algo, Coll, Frame
from .broadcast import byte_pieces
from .call import PH_DATA, Call, gather_or_cancel, make_template
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
    # numel 0: the block sizes differ between ranks and are checked per block.
    template = make_template(Coll.ALLTOALL, flat, algorithm=Algo.DIRECT).with_(numel=0)
    return template, (flat, dst, sc, rc, _offsets(sc), _offsets(rc))


async def run_alltoall(
    call: Call, state: tuple[Any, Any, list[int], list[int], list[int], list[int]]
) -> Any:
    """Exchange the blocks; returns the output."""
    flat, dst, sc, rc, so, ro = state
    await call.exchange_signatures()
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
        for k, (a, b) in enumerate(pieces):
            frame = await call.recv_header(p, PH_DATA, k)
            if frame.count != len(pieces) or frame.payload != b - a:
                if k == 0:
                    await call.drain(p, frame, PH_DATA)
                    n = frame.payload // flat.dtype.itemsize
                    sent = f"{n}" if frame.count == 1 else f"about {n * frame.count}"
                    problems.append(
                        f"rank {p} sends rank {r} {sent} values, rank {r} expects {rc[p]}"
                    )
                    return
                raise ProtocolError(f"rank {p} changed its block size mid-way")
            await call.recv_payload(p, frame, block[a:b])

    peers = call.transport.peers
    await gather_or_cancel([*(s for p in peers for s in sends(p)), *(recv_from(p) for p in peers)])
    call.raise_mismatches(sorted(problems))
    return dst
