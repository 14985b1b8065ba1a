"""Closing at interpreter exit the cgx groups a job did not shut down.

A job that ends without ``destroy_process_group`` would otherwise say BYE to nobody,
and every peer would log a WARNING that the others were gone.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Protocol

from ..errors import CGXError

__all__ = ["EXIT_CLOSE_TIMEOUT_S", "close_at_exit", "forget"]

log = logging.getLogger("cgx_ucx")

#: Seconds each group or communicator may take to close at exit: the peers may already
#: be gone, and exit must not wait out the full collective timeout.
EXIT_CLOSE_TIMEOUT_S = 5.0


class _Group(Protocol):
    def shutdown(self, timeout: float | None = None) -> None: ...


#: cgx groups not shut down yet.
_live_groups: set[_Group] = set()
_lock = threading.Lock()


def close_at_exit(group: _Group) -> None:
    """Shut ``group`` down at interpreter exit unless :func:`forget` is called first."""
    with _lock:
        if not _live_groups:
            atexit.register(_close_groups_at_exit)
        _live_groups.add(group)


def forget(group: _Group) -> None:
    """``group`` is shut down (or being shut down): exit need not close it."""
    _live_groups.discard(group)


def _close_groups_at_exit(timeout: float = EXIT_CLOSE_TIMEOUT_S) -> None:
    with _lock:
        groups = list(_live_groups)
        _live_groups.clear()
    for group in groups:
        try:
            group.shutdown(timeout)
        except CGXError as exc:
            log.info("closing a cgx process group at exit: %s", exc)
