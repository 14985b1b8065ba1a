"""The ``cgx`` torch.distributed backend: its registration with torch.distributed.

After ``import cgx_ucx`` a torchrun script changes one line::

    dist.init_process_group("cgx")        # env:// or an explicit store, as with gloo

The group that call makes is a :class:`~cgx_ucx.torch.process_group.ProcessGroupCGX`
(its semantics are listed there), a ``torch.distributed.ProcessGroup`` subclass: that
is the Python extension point torch 2.13 supports (its own tests, test_c10d_pypg.py,
build DDP on one); ``_new_process_group_helper`` uses a returned ProcessGroup subclass
as the group itself. The C++ side (DDP's reducer) reaches the group's methods through
pybind11's trampoline, Python callers (``dist.all_reduce``) directly.

This module also re-exports the names a backend user needs.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from .communicators import close_communicators, get_communicator
from .group_order import GroupIdentity
from .options import CGXOptions
from .process_group import BACKEND_NAME, ProcessGroupCGX

__all__ = [
    "BACKEND_NAME",
    "CGXOptions",
    "ProcessGroupCGX",
    "close_communicators",
    "get_communicator",
    "register",
]


def _create(dist_opts: Any, pg_options: Any) -> ProcessGroupCGX:
    """The creator registered with torch (extended API: we get group options, and for a
    group other than the default one its name and global ranks)."""
    ranks = tuple(int(r) for r in dist_opts.global_ranks_in_group or ())
    return ProcessGroupCGX(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        pg_options,
        group=GroupIdentity(str(dist_opts.group_id), ranks) if ranks else None,
    )


_registered = False
_reg_lock = threading.Lock()


def register() -> None:
    """Register the ``cgx`` backend with torch.distributed (idempotent)."""
    global _registered
    with _reg_lock:
        if _registered or BACKEND_NAME in dist.Backend.backend_list:
            _registered = True
            return
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
        _registered = True
