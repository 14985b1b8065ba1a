"""The cgx_ucx communicator serving a torch.distributed group: :func:`get_communicator`,
and :func:`close_communicators` for those made for groups of other backends.
"""

from __future__ import annotations

import atexit
import logging
import threading

import torch.distributed as dist

from ..config import CommConfig, resolve_comm
from ..errors import CGXError, ConfigError
from .at_exit import EXIT_CLOSE_TIMEOUT_S
from .process_group import ProcessGroupCGX
from .protocols import Communicator
from .startup import connect

__all__ = ["close_communicators", "get_communicator"]

log = logging.getLogger("cgx_ucx")

_comms: dict[str, Communicator] = {}
_generations: dict[str, int] = {}
_comms_lock = threading.Lock()


def get_communicator(
    group: dist.ProcessGroup | None = None, *, config: CommConfig | None = None
) -> Communicator:
    """The cgx_ucx synchronous communicator serving ``group`` (default: WORLD).

    A ``cgx`` group has its own. For a group of another backend (DDP on gloo with
    cgx_hook), a cgx_ucx communicator over the same ranks is made on first use,
    through that group's store, and kept for the life of the process: this is a
    collective call, all ranks of the group must make it (CGXState and GradientSync
    do, at construction).
    """
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise ConfigError("torch.distributed is not initialized: call init_process_group first")
    if isinstance(group, ProcessGroupCGX):
        return group.communicator
    name = group.group_name
    with _comms_lock:
        comm = _comms.get(name)
        if comm is not None and not comm.closed:
            return comm
        store = group.get_group_store()
        if store is None:
            raise ConfigError(f"process group {name!r} has no store to rendezvous through")
        cfg = config if config is not None else resolve_comm()
        # A fresh prefix per communicator made for this group, so that a second one
        # (after the first was closed) never reads the first one's store keys.
        gen = _generations.get(name, 0)
        _generations[name] = gen + 1
        comm = connect(store, group.rank(), group.size(), cfg, f"cgx_ucx_hook/{gen}")
        if not _comms:
            atexit.register(close_communicators)
        _comms[name] = comm
        return comm


def close_communicators(timeout: float = EXIT_CLOSE_TIMEOUT_S) -> None:
    """Close the communicators :func:`get_communicator` made for non-cgx groups.

    Runs at interpreter exit; call it earlier to release UCX resources (a later
    get_communicator makes a new one, collectively).
    """
    with _comms_lock:
        comms = list(_comms.items())
        _comms.clear()
    for name, comm in comms:
        try:
            comm.close(timeout)
        except CGXError as exc:
            log.warning("closing the cgx communicator of group %r: %s", name, exc)
