"""What :func:`~.communicator.connect` does between the connected mesh and the first
collective: the host codec's threads shared out between the ranks of a host, and the
store counter the ranks meet at.

Connect compiles no codec kernel: each kernel signature is compiled on a background thread
once calls need it, and calls run the NumPy reference codec (the same bytes) until then
(:mod:`cgx_ucx.compression.kernels`), so no compile runs inside a peer's deadline and a
job compiles only what it uses (a GPU-only job no host kernel).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..transport.progress import usable_cores

__all__ = ["all_counted", "compile_codec_in_background", "share_codec_threads"]

log = logging.getLogger("cgx_ucx")


def compile_codec_in_background() -> None:
    """Switch the host codec to compiling in the background (see the module's docstring):
    a compile holds the GIL for most of its time, and inside a connect or a collective it
    would delay this rank's steps and failure detection past their deadlines."""
    from ..compression import kernels

    kernels.compile_in_background()


async def all_counted(store: Any, key: str, n: int, end: float, pause: float = 0.002) -> bool:
    """Count this rank in the store counter ``key`` and wait until all ``n`` ranks are,
    asking every ``pause`` seconds (False when the monotonic deadline ``end`` passes)."""
    count = int(store.add(key, 1))
    while count < n:
        if time.monotonic() > end:
            return False
        await asyncio.sleep(pause)
        count = int(store.add(key, 0))
    return True


def share_codec_threads(local_ranks: int) -> None:
    """Give the CPU codec ``cores // local ranks`` threads, unless the user chose a count
    (:func:`~cgx_ucx.compression.cpu_threads.set_num_threads`). Shared again at every
    connect: a process group re-formed with more ranks on this host (torchft's replica
    groups after a quorum change) gets its smaller share, not the first job's.

    A parallel host codec call waits for its slowest thread; with several ranks per host
    each running all-core kernels, the threads oversubscribe the cores and wait for time
    slices: a large 4-bit allreduce then runs several times slower than with the cores
    shared out between the ranks.
    """
    from ..compression import cpu_threads as cpu  # no Numba import: a GPU job needs none

    if cpu.threads_chosen():
        return
    cores = usable_cores()
    threads = max(1, cores // max(local_ranks, 1))
    if threads != cpu.num_threads():
        log.info(
            "codec threads per rank: %d (%d cores, %d ranks here)", threads, cores, local_ranks
        )
    cpu.share_threads(threads)
