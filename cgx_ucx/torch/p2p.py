"""Point-to-point for the ``cgx`` group: send, recv, recv from any source.

torch's ``isend``/``irecv``/``batch_isend_irecv`` call the group's ``send``/``recv``
one operation at a time (a Python group takes the non-coalescing path of
``batch_isend_irecv``); each returns a Work at once and the engine runs them
concurrently, so a ring exchange in one batch never deadlocks. Messages of one
(source, destination, tag) arrive in the order they were sent, as torch promises
(:mod:`cgx_ucx.collectives.p2p`: per-stream numbers and pair-keyed headers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CGXTimeoutError, ConfigError
from ._convert import as_array
from .futures import to_torch_future
from .ops import GroupView, Pending, staged
from .work import CGXWork

__all__ = ["RecvWork", "recv", "send"]


class RecvWork(CGXWork):
    """The Work of a receive; ``_source_rank()`` names the sender, as torch's
    ``recv(src=None)`` asks of the work of a receive from any source."""

    def __init__(self, what: str, timeout: float, source: Any = None) -> None:
        super().__init__(what, timeout)
        self._src = -1
        self._source = source  # the engine future of the receive

    def wait(self, timeout: Any = None) -> bool:
        """As :meth:`CGXWork.wait`; a receive whose wait times out is cancelled, and its
        stream (source, tag) fails from then on: left posted, it would take the next
        message and every later receive would get the one after."""
        try:
            return super().wait(timeout)
        except CGXTimeoutError:
            if self._source is not None:
                self._source.cancel()
            raise

    def set_source(self, src: int) -> None:
        self._src = src

    def _source_rank(self) -> int:
        self.wait()
        return self._src

    def source_rank(self) -> int:
        return self._source_rank()


def _one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ConfigError(f"cgx {what} takes exactly one tensor per call, got {len(tensors)}")
    return tensors[0]


def send(g: GroupView, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> Pending:
    """Send the one tensor of ``tensors`` to group rank ``dst`` on ``tag``."""
    t = _one(tensors, "send")
    src = t.contiguous()  # a copy only when t is strided; the send reads it later
    cf = g.comm.send(as_array(src.view(-1)), dst, tag)
    return Pending("send", cf, lambda _: list(tensors))


def recv(
    g: GroupView, tensors: Sequence[torch.Tensor], src: int | None, tag: int, timeout: float
) -> RecvWork:
    """Receive into the one tensor of ``tensors`` from ``src`` (None: any rank)."""
    t = _one(tensors, "recv")
    stage, back = staged(t)
    cf = g.comm.recv(as_array(stage.view(-1)), src, tag)
    what = "recv" if src is not None else "recv from any source"
    work = RecvWork(what, timeout, cf)

    def finish(sender: Any) -> list[torch.Tensor]:
        work.set_source(int(sender))
        back()
        return list(tensors)

    work.attach(to_torch_future(cf, finish, done=work.mark_done))
    return work
