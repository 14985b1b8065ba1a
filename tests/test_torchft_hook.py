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


@pytest.mark.parametrize(
    ("participants", "participating", "dtype", "group_op", "manager_op"),
    [
        (2, True, torch.float32, "AVG", "SUM"),  # all participate: the group averages
        (1, True, torch.float32, "SUM", "AVG"),  # a replica recovering: the Manager divides
        (2, False, torch.float32, "SUM", "AVG"),  # this replica recovering
        (2, True, torch.int64, "SUM", "AVG"),  # not a float bucket: the Manager's path
    ],
)
def test_ddp_hook_lets_the_cgx_group_average_where_the_whole_quorum_participates(
    monkeypatch, participants, participating, dtype, group_op, manager_op
):
    """Manager.allreduce asks its group for a SUM and divides every bucket afterwards;
    on a ProcessGroupCGX whose quorum is all participating, the hook asks for the SUM
    inside summing_as_average(), so the group runs an AVG and the Manager divides
    nothing. The group's size is the quorum's (the fake one here: 2)."""
    from torch.distributed import AllreduceOptions, ReduceOp

    from cgx_ucx import torchft as ft

    def name(op) -> str:
        return next(n for n in ("SUM", "AVG") if op == getattr(ReduceOp, n))

    seen: dict[str, str] = {}

    class Group:  # the connected cgx group of the quorum
        def size(self):
            return 2

        def allreduce(self, tensors, opts):
            seen["group"] = name(opts.reduceOp)
            return _finished_work(tensors[0])

    pg = ft.ProcessGroupCGX()
    pg._pg = Group()
    monkeypatch.setattr(ft.ProcessGroupCGX, "group", property(lambda self: self._pg))

    class Manager:
        _pg = pg

        def errored(self):
            return None

        def wait_quorum(self):
            seen["quorum"] = "waited"

        def is_participating(self):
            return participating

        def num_participants(self):
            return participants

        def allreduce(self, tensor, reduce_op=ReduceOp.AVG):
            seen["manager"] = name(reduce_op)
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM  # what torchft asks of its group for AVG or SUM
            return pg.allreduce([tensor], opts)

    class Bucket:
        def buffer(self):
            return torch.ones(4, dtype=dtype)

    ft.DistributedDataParallel._comm_hook(Manager(), Bucket())
    assert (seen["group"], seen["manager"]) == (group_op, manager_op)
    # The participants are read after the step's quorum, as Manager.allreduce reads them.
    assert ("quorum" in seen) == dtype.is_floating_point
    assert not getattr(pg._local, "average", False)  # the flag ends with the call


def _finished_work(tensor: torch.Tensor):
    class Work:
        def wait(self, timeout=None):
            return True

        def get_future(self):
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result([tensor])
            return fut

    return Work()


def test_summing_as_average_turns_only_a_sum_into_an_average():
    import datetime

    from torch.distributed import AllreduceOptions, ReduceOp

    from cgx_ucx.torchft import _as_average

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    opts.timeout = datetime.timedelta(seconds=7)
    avg = _as_average(opts)
    assert avg.reduceOp == ReduceOp.AVG and avg.timeout == opts.timeout
    opts.reduceOp = ReduceOp.MAX
    assert _as_average(opts) is opts
    assert _as_average(ReduceOp.SUM) == ReduceOp.AVG
    assert _as_average(ReduceOp.MIN) == ReduceOp.MIN


@pytest.mark.parametrize("as_view", [None, False])
def test_ddp_gradients_are_views_of_the_reduced_buckets_unless_asked_otherwise(as_view):
    """By default each .grad is a view of its bucket: the all-reduced values are the
    gradients, with no copy back. The Manager here halves each bucket (an average over
    2 replicas), which the gradients then hold either way."""
    from cgx_ucx.torchft import DistributedDataParallel

    class Manager(_Manager):
        def errored(self):
            return None

        def allreduce(self, tensor):
            work, inner = _managed(self, tensor)
            inner.fut.set_result([tensor])
            return work

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    reference = [p.detach().clone() for p in model.parameters()]
    kwargs = {} if as_view is None else {"gradient_as_bucket_view": as_view}
    net = DistributedDataParallel(Manager(), model, **kwargs)
    x = torch.randn(4, 8)
    net(x).square().sum().backward()

    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p, r in zip(plain.parameters(), reference, strict=True):
            p.copy_(r)
    plain(x).square().sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad / 2)  # the Manager's average reached .grad
        assert p.grad._is_view() is (as_view is None)
