"""A dial that timed out leaves nothing of UCX behind: once the failed connect has
returned its error, the dialing process's descriptors and UCX context are back to what
they were before it, within seconds and without the process exiting."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time

import pytest
from harness import run_ranks
from test_connect_blame import black_hole, publish_instead

from cgx_ucx.collectives import connect
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import CGXError

CONNECT_TIMEOUT = 1.5
#: How long the dialer may take, after its connect failed, to be back to its baseline.
RELEASE_WITHIN_S = 3.0


def _fds() -> list[str]:
    out = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        with contextlib.suppress(OSError):  # closed meanwhile
            out.append(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
    return out


def _ucx_context() -> bool:
    ucxx = sys.modules.get("ucxx")
    return getattr(getattr(ucxx, "core", None), "_ctx", None) is not None


async def dial_black_hole(ctx, host):
    """Rank 0 publishes ``host`` (nobody answers there); rank 1 dials it and times out.
    Rank 1 returns (error type, seconds to fail, descriptors before, at the failure and
    at the end, UCX context at the failure and at the end, seconds until released). No
    garbage collection is forced: what a reference cycle holds counts as held."""
    import ucxx  # noqa: F401 - its import opens what stays open (libraries), not counted

    if ctx.rank == 0:
        publish_instead(*host)
    await asyncio.sleep(0)
    before = _fds()
    cfg = CommConfig(timeout=10.0, connect_timeout=CONNECT_TIMEOUT)
    start = time.monotonic()
    try:
        await (await connect(ctx.store, ctx.rank, ctx.world_size, config=cfg)).close()
        kind = "connected"
    except CGXError as exc:
        kind = type(exc).__name__
    failed_s = time.monotonic() - start
    if ctx.rank == 0:
        return kind, failed_s
    at_failure, ctx_at_failure = _fds(), _ucx_context()
    end = time.monotonic() + RELEASE_WITHIN_S
    released_s = None
    while time.monotonic() < end:
        if len(_fds()) <= len(before) and not _ucx_context():
            released_s = time.monotonic() - start - failed_s
            break
        await asyncio.sleep(0.05)
    return kind, failed_s, before, at_failure, _fds(), ctx_at_failure, _ucx_context(), released_s


@pytest.mark.timeout(60)
def test_a_dial_that_timed_out_releases_ucx_without_exiting():
    with black_hole() as host:
        results = run_ranks(dial_black_hole, 2, args=(host,), timeout=40)
    kind, failed_s, before, at_failure, end, ctx_failure, ctx_end, released_s = results[1]
    print(
        f"dialer: {kind} after {failed_s:.2f} s; descriptors {len(before)} before, "
        f"{len(at_failure)} at the failure, {len(end)} at the end; UCX context "
        f"{ctx_failure} then {ctx_end}; released {released_s} s after the failure"
    )
    assert kind in ("RendezvousError", "PeerFailedError"), results
    assert failed_s < CONNECT_TIMEOUT + 2.0, failed_s
    assert not ctx_end, "the UCX context outlived the failed connect"
    assert released_s is not None, sorted(set(end) - set(before))
    assert len(end) <= len(before), sorted(set(end) - set(before))
