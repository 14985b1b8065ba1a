"""The comm hook of cgx_ucx.torchft.DistributedDataParallel on stand-ins of torchft's
managed work (no processes): it returns each bucket's future without waiting, runs the
Manager's callbacks once, and finishes a bucket whose all-reduce failed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchft")


def test_ddp_hook_finishes_a_bucket_whose_all_reduce_failed():
    """torchft's managed work records a failed all-reduce and returns False from wait()
    without ever setting up its future, which then never completes: DDP's backward would
    wait on it forever. The hook hands the bucket back, finished."""
    import weakref

    from torchft.manager import _ManagedFuture

    from cgx_ucx.torchft import DistributedDataParallel

    class FailedWork:
        def wait(self, timeout=None):
            return False  # what _ManagedWork.wait returns once it reported the error

        def get_future(self):
            return _ManagedFuture(weakref.ref(self))  # never completed

    class Manager:
        def allreduce(self, tensor):
            return FailedWork()

    class Bucket:
        def __init__(self):
            self.data = torch.arange(4, dtype=torch.float32)

        def buffer(self):
            return self.data

    bucket = Bucket()
    fut = DistributedDataParallel._comm_hook(Manager(), bucket)
    assert fut.done() and torch.equal(fut.wait(), torch.arange(4, dtype=torch.float32))


class _Manager:
    """Manager.wrap_future as torchft has it: an error is reported, the default returned."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def wrap_future(self, fut, default, timeout=None):
        def swallow(done):
            try:
                return done.value()
            except Exception as exc:  # what torchft's does
                self.errors.append(exc)
                return default

        return fut.then(swallow)


def _managed(manager: _Manager, tensor: torch.Tensor):
    """torchft's managed work around a process group's pending future, with the
    Manager's average registered on it (in place, as Manager.allreduce does)."""
    from torchft.manager import _ManagedWork

    class PendingWork:
        def __init__(self) -> None:
            self.fut: torch.futures.Future = torch.futures.Future()

        def get_future(self):
            return self.fut

        def wait(self, timeout=None):
            self.fut.wait()
            return True

    inner = PendingWork()
    work = _ManagedWork(manager, inner, tensor)
    work.get_future().then(lambda f: f.value().div_(2))
    return work, inner


@pytest.mark.parametrize("fails", [False, True])
def test_ddp_hook_returns_before_the_all_reduce_and_runs_the_managers_callbacks_once(fails):
    from cgx_ucx.torchft import DistributedDataParallel

    manager = _Manager()
    tensor = torch.full((4,), 6.0)
    work, inner = _managed(manager, tensor)

    class State:
        def allreduce(self, t):
            assert t is tensor
            return work

    class Bucket:
        def buffer(self):
            return tensor

    fut = DistributedDataParallel._comm_hook(State(), Bucket())
    assert not fut.done()  # backward goes on while the bucket is reduced
    if fails:
        inner.fut.set_exception(RuntimeError("lost"))
        assert torch.equal(fut.wait(), torch.full((4,), 6.0)) and len(manager.errors) == 1
    else:
        inner.fut.set_result([tensor])
        assert torch.equal(fut.wait(), torch.full((4,), 3.0)) and not manager.errors
        assert work.wait() is True  # a later wait: the same chain, the average not redone
        assert torch.equal(tensor, torch.full((4,), 3.0))
