"""What making a group runs once: the engine's connect and a warm-up of this layer.

The engine (and with it UCX) is imported only when a group or a communicator is made,
so that ``import cgx_ucx`` stays cheap.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from ..config import CommConfig
from ._convert import as_array
from .protocols import Communicator, Store
from .work import CGXWork

__all__ = ["connect", "warm_torch_path"]


def connect(
    store: Store | None, rank: int, size: int, config: CommConfig, prefix: str
) -> Communicator:
    """The engine's synchronous communicator over ``store``, its keys under ``prefix``."""
    from ..engine import connect_sync  # the engine imports UCX: only when a group is made

    return connect_sync(store, rank, size, config=config, prefix=prefix)


def warm_torch_path() -> None:
    """Run this layer's per-call steps once, locally: a tensor's array view, and a Work
    made from a finished future and waited on.

    ``connect`` warms the engine (codec, one collective); this pays the first runs of
    the pybind and torch future set-up here, so that the first user call does not.
    """
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    done.set_result(None)
    z = torch.zeros(8)
    as_array(z.view(-1))
    CGXWork.from_future("warm-up", 1.0, done, lambda _: [z]).wait()
