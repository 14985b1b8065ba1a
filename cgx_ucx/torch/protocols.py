"""The duck types the torch layer accepts: a communicator and a rendezvous store.

The engine's :class:`~cgx_ucx.engine.SyncCommunicator` is what
:func:`~cgx_ucx.torch.communicators.get_communicator` hands out and what ``communicator=`` of
:class:`~cgx_ucx.torch.hook.CGXState`, :class:`~cgx_ucx.torch.grad_sync.GradientSync`
and the ``cgx`` process group take; :class:`Communicator` names the part of it they use,
so that a wrapper (or a test double) with these members works too. It includes what
the policies' agreement needs of a communicator (:class:`cgx_ucx.agreement.PolicyComm`).

A store is anything with the part of ``torch.distributed.Store`` the rendezvous uses
(:class:`cgx_ucx.transport.rendezvous.Store`), re-exported here.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol

from ..transport.rendezvous import Store

__all__ = ["Communicator", "Store"]


class Communicator(Protocol):
    """A synchronous communicator: every collective returns a
    ``concurrent.futures.Future`` at once and works on its arrays in place (NumPy or
    CuPy, which must stay untouched until the future completes)."""

    @property
    def world_size(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def allreduce(
        self, x: Any, op: str = "sum", **kwargs: Any
    ) -> concurrent.futures.Future[Any]: ...

    def broadcast(self, x: Any, root: int = 0) -> concurrent.futures.Future[Any]: ...

    def allgather(
        self, x: Any, out: Any = None, reduce_op: str | None = None, root: int | None = None
    ) -> concurrent.futures.Future[Any]: ...

    def barrier(self) -> concurrent.futures.Future[Any]: ...

    def refuse(self, name: str, exc: Any) -> concurrent.futures.Future[Any]: ...

    def late_peers(self) -> concurrent.futures.Future[Any]: ...

    def alltoall(
        self, x: Any, out: Any, send_counts: Any = None, recv_counts: Any = None
    ) -> concurrent.futures.Future[Any]: ...

    def reduce_scatter(
        self, x: Any, out: Any, op: str = "sum", **kwargs: Any
    ) -> concurrent.futures.Future[Any]: ...

    def send(self, x: Any, dst: int, tag: int = 0) -> concurrent.futures.Future[Any]: ...

    def recv(
        self, x: Any, src: int | None = None, tag: int = 0
    ) -> concurrent.futures.Future[Any]: ...

    def close(self, timeout: float | None = None) -> None: ...
