"""Collectives issued from two threads on one cgx process group, with the interleaving
injected in one process (no peers, no race left to chance)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("torch")


class _Comm:
    """The asyncio communicator under the engine's SyncCommunicator, in process: world 2,
    the peer adds zeros; records the calls refused."""

    rank = 0
    world_size = 2
    mailbox = None

    def __init__(self) -> None:
        self.refused: list[str] = []

    async def allreduce(self, x: Any, op: str = "sum", **kwargs: Any) -> Any:
        return x

    async def refuse(self, name: str, exc: Any) -> None:
        self.refused.append(name)

    async def close(self) -> None:
        return None


@pytest.mark.timeout(30)
def test_an_error_before_submission_is_refused_while_another_thread_submits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collective that fails before it is submitted refuses its call to the peers even
    when another thread submits a collective on the same group between the call's start
    and its failure: the other thread's submission is not this call's."""
    import torch

    from cgx_ucx.engine import Engine, SyncCommunicator
    from cgx_ucx.errors import ConfigError
    from cgx_ucx.torch import process_group
    from cgx_ucx.torch.process_group import ProcessGroupCGX

    comm = _Comm()
    sync = SyncCommunicator(Engine.get(retain=True), comm)  # type: ignore[arg-type]
    group = ProcessGroupCGX(None, 0, 2, communicator=sync)
    failing = threading.current_thread()
    real_single = process_group.single
    other: list[Any] = []

    def single(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
        if threading.current_thread() is not failing:
            return real_single(tensors, what)
        # Inside this thread's call, before its submission: the other thread's
        # all_reduce goes out, then this call fails its argument check.
        thread = threading.Thread(target=lambda: other.append(group.allreduce([torch.ones(4)])))
        thread.start()
        thread.join()
        raise ConfigError("allreduce takes one tensor")

    monkeypatch.setattr(process_group, "single", single)
    try:
        with pytest.raises(ConfigError):
            group.allreduce([torch.ones(4)])
        assert len(other) == 1
        other[0].wait()
        assert sync.submitted == 2  # the other thread's call and this one's refusal
        # The refusal runs on the engine loop: submitted, not necessarily run yet.
        end = time.monotonic() + 10.0
        while not comm.refused and time.monotonic() < end:
            time.sleep(0.005)
        assert comm.refused == ["allreduce"]
    finally:
        group.shutdown(5.0)
