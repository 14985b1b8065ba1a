"""GradientSync (per-parameter gradient hooks) against DDP, across spawned processes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from torch_helpers import join_cgx_with_gloo, run_torch_ranks


class _Net:
    """Built lazily in the children (torch is imported there)."""

    @staticmethod
    def make() -> Any:
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = nn.Sequential(nn.Linear(30, 64), nn.Tanh(), nn.Linear(64, 64))
                self.head = nn.Linear(64, 5)
                self.unused = nn.Linear(4, 4)  # never in the graph: counts as zero

            def forward(self, x: Any) -> Any:
                return self.head(self.body(x).relu())

        return Net()


def _sync_job(rank: int, world: int, store: Any) -> None:
    import asyncio
    import copy

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx_ucx.errors import ConfigError
    from cgx_ucx.torch import GradientSync

    gloo = join_cgx_with_gloo(rank, world, store)
    base = _Net.make()
    ddp = DDP(copy.deepcopy(base), process_group=gloo, find_unused_parameters=True)
    exact_model = copy.deepcopy(base)
    # A tiny bucket cap: several buckets, started in order while backward runs.
    exact = GradientSync(exact_model, compression_params={"bits": 32}, bucket_cap_mb=0.01)
    assert len(exact.buckets) > 2
    lossy_model = copy.deepcopy(base)
    lossy = GradientSync(
        lossy_model, compression_params={"bits": 4, "bucket_size": 256}, layer_min_size=512
    )
    gen = torch.Generator().manual_seed(7 + rank)
    max_err = 0.0
    for step in range(4):
        x = torch.randn(16, 30, generator=gen)
        y = torch.randint(0, 5, (16,), generator=gen)
        ddp.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        for model in (exact_model, lossy_model):
            model.load_state_dict(ddp.module.state_dict())
            model.zero_grad(set_to_none=step % 2 == 0)
            F.cross_entropy(model(x), y).backward()
        exact.synchronize() if step % 2 == 0 else asyncio.run(_await(exact))
        lossy.synchronize()
        for (name, p), q, r in zip(
            ddp.module.named_parameters(),
            exact_model.parameters(),
            lossy_model.parameters(),
            strict=True,
        ):
            if name.startswith("unused"):
                # DDP leaves it without grad; GradientSync averages zeros.
                assert p.grad is None and torch.equal(q.grad, torch.zeros_like(q))
                continue
            assert torch.equal(p.grad, q.grad), (name, step, (p.grad - q.grad).abs().max())
            max_err = max(max_err, (p.grad - r.grad).abs().max().item())
    assert 0 < max_err < 0.05, max_err  # 4 bits: lossy, and close
    assert exact.steps == 4 and lossy.bytes_per_step * 4 < exact.bytes_per_step

    # Overlap: with every parameter used, all buckets start during backward.
    body = GradientSync(exact_model.body, compression_params={"bits": 32}, bucket_cap_mb=0.01)
    exact.remove()
    exact_model.zero_grad()
    exact_model(torch.randn(4, 30, generator=gen)).sum().backward()
    assert body.buckets_started == len(body.buckets) > 1
    body.synchronize()
    assert body.buckets_started == 0
    body.remove()
    exact = GradientSync(exact_model, compression_params={"bits": 32}, bucket_cap_mb=0.01)

    # Accumulation: no_sync for the first backward, averaged once at the end.
    ddp.zero_grad()
    exact_model.zero_grad()
    xs = [torch.randn(8, 30, generator=gen) for _ in range(2)]
    with ddp.no_sync():
        ddp(xs[0]).sum().backward()
    ddp(xs[1]).sum().backward()
    with exact.no_sync():
        exact_model(xs[0]).sum().backward()
    exact_model(xs[1]).sum().backward()
    exact.synchronize()
    for (name, p), q in zip(ddp.module.named_parameters(), exact_model.parameters(), strict=True):
        if not name.startswith("unused"):
            assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7), name
    # Two backward passes without synchronize() in between: an error, not a double count.
    exact_model(xs[0]).sum().backward()
    try:
        exact_model(xs[1]).sum().backward()
    except ConfigError:
        pass
    else:
        raise AssertionError("a second backward before synchronize() must be refused")


async def _await(sync: Any) -> None:
    await sync


@pytest.mark.timeout(150)
def test_gradient_sync_matches_ddp() -> None:
    run_torch_ranks(_sync_job, 2, timeout=140)


def _accumulation_job(rank: int, world: int, store: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from cgx_ucx.errors import ConfigError
    from cgx_ucx.torch import GradientSync

    gloo = join_cgx_with_gloo(rank, world, store)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    sync = GradientSync(model, compression_params={"bits": 32})
    out: dict[str, Any] = {}

    def backward(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()

    def exact_mean() -> list[torch.Tensor]:
        grads = [p.grad.clone() for p in model.parameters()]
        for t in grads:
            dist.all_reduce(t, group=gloo)
            t.div_(world)
        return grads

    # Every micro-batch under no_sync(), then synchronize: the accumulated gradients are
    # averaged, not zeroed.
    with sync.no_sync():
        backward(10 + rank)
        backward(20 + rank)
    expected = exact_mean()
    sync.synchronize()
    out["no_sync_only"] = max(
        float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected, strict=True)
    )
    # A second synchronize without a backward leaves the averages as they are.
    before = [p.grad.clone() for p in model.parameters()]
    sync.synchronize()
    out["twice"] = max(
        float((p.grad - b).abs().max()) for p, b in zip(model.parameters(), before, strict=True)
    )
    model.zero_grad()
    # A layer frozen after construction keeps grad None (AdamW must not move it).
    model[0].weight.requires_grad_(False)
    backward(30 + rank)
    sync.synchronize()
    out["frozen_grad"] = model[0].weight.grad
    model.zero_grad()
    model[0].weight.requires_grad_(True)
    # A layer replaced after construction: refused, not silently left un-averaged.
    model[2] = torch.nn.Linear(16, 3)
    backward(40 + rank)
    try:
        sync.synchronize()
        out["replaced"] = "no error"
    except ConfigError as exc:
        out["replaced"] = str(exc)
    return out


@pytest.mark.timeout(150)
def test_accumulation_repeats_frozen_and_replaced_layers() -> None:
    """synchronize() averages the gradients even when no hook delivered one since the
    last call (all micro-batches under no_sync(), or a second call); a layer frozen after
    construction keeps no gradient (so weight decay leaves it alone), and a replaced layer
    that is not synchronized is an error, never silently left un-averaged."""
    for res in run_torch_ranks(_accumulation_job, 2, timeout=140):
        assert res["no_sync_only"] < 1e-6, res
        assert res["twice"] < 1e-6, res
        assert res["frozen_grad"] is None, res
        assert "'2.weight' has a gradient but is not synchronized" in res["replaced"], res


def _unused_job(rank: int, world: int, store: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx_ucx.torch import GradientSync

    gloo = join_cgx_with_gloo(rank, world, store)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: Any, use: str) -> Any:
            y = self.a(x)
            for name in use:
                y = y + getattr(self, name)(x)
            return y.square().sum()

    torch.manual_seed(0)
    base = Net()
    ddp = DDP(Net(), process_group=gloo, find_unused_parameters=True)
    ddp.module.load_state_dict(base.state_dict())
    ours = Net()
    ours.load_state_dict(base.state_dict())
    sync = GradientSync(
        ours, compression_params={"bits": 32}, bucket_cap_mb=0.001, find_unused_parameters=True
    )
    gen = torch.Generator().manual_seed(3 + rank)
    # Per step, what each rank uses besides `a`: b on one rank only, then on none, then c
    # on both; grads set to None, kept as zeros, None again.
    steps = [("b" if rank == 0 else "", True), ("", False), ("c", True)]
    for step, (use, to_none) in enumerate(steps):
        x = torch.randn(4, 8, generator=gen)
        for model in (ddp, ours):
            model.zero_grad(set_to_none=to_none)
        ddp(x, use).backward()
        ours(x, use).backward()
        sync.synchronize()
        for (name, p), q in zip(ddp.module.named_parameters(), ours.parameters(), strict=True):
            if p.grad is None:  # DDP leaves a parameter no rank used untouched
                assert q.grad is None, (step, name)
            else:
                assert torch.equal(p.grad, q.grad), (step, name)
        if step == 0:
            assert ours.c.weight.grad is None and ours.b.weight.grad is not None
    assert sync.bytes_per_step > 0

    # Used only under no_sync() on rank 0, in no rank's last backward: its accumulated
    # gradient counts as used, and every rank gets the same average.
    ours.zero_grad(set_to_none=True)
    with sync.no_sync():
        ours(torch.randn(4, 8, generator=gen), "c" if rank == 0 else "").backward()
    ours(torch.randn(4, 8, generator=gen), "").backward()
    sync.synchronize()
    got = ours.c.weight.grad
    assert got is not None and got.abs().sum() > 0
    both = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(both, got, group=gloo)
    assert torch.equal(both[0], both[1])


@pytest.mark.timeout(120)
def test_find_unused_parameters_leaves_unused_gradients_as_ddp_does() -> None:
    run_torch_ranks(_unused_job, 2, timeout=110)


def _unused_feedback_job(rank: int, world: int, store: Any) -> dict[str, Any]:
    import torch
    import torch.nn as nn

    from cgx_ucx.torch import GradientSync

    join_cgx_with_gloo(rank, world, store)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x: Any, use_b: bool) -> Any:
            y = self.a(x)
            return (y + self.b(x) if use_b else y).square().sum()

    torch.manual_seed(0)
    model = Net()
    sync = GradientSync(
        model,
        compression_params={"bits": 4, "bucket_size": 64},
        layer_min_size=256,  # both weights compressed, the biases exact
        error_feedback=True,
        find_unused_parameters=True,
    )
    names = {}
    for bi, params in enumerate(sync.buckets):
        for slot, p in enumerate(params):
            names[id(p)] = f"{bi}.{slot}"
    a_key, b_key = names[id(model.a.weight)], names[id(model.b.weight)]
    gen = torch.Generator().manual_seed(5 + rank)
    residuals, b_grads = [], []
    for use_b in (True, False, True):  # b: used by both ranks, by none, by both
        model.zero_grad(set_to_none=False)
        model(torch.randn(8, 32, generator=gen), use_b).backward()
        sync.synchronize()
        res = sync.state_dict()["residuals"]
        residuals.append({k: res[k].clone() for k in (a_key, b_key) if k in res})
        b_grads.append(model.b.weight.grad.clone())
    return {"keys": (a_key, b_key), "residuals": residuals, "b_grads": b_grads}


@pytest.mark.timeout(120)
def test_error_feedback_of_a_parameter_no_rank_used_is_kept() -> None:
    """find_unused_parameters with error feedback: a compressed parameter no rank used in
    a step keeps its gradient (DDP's rule) and its residual: what error feedback added
    to it was sent, but the average was discarded, so the residual is the one before
    that step, and the next step that uses it re-sends the error (before, the residual
    was replaced by the error of quantizing the residual itself)."""
    import torch

    for res in run_torch_ranks(_unused_feedback_job, 2, timeout=110):
        a_key, b_key = res["keys"]
        first, skipped, last = res["residuals"]
        assert b_key in first and first[b_key].abs().sum() > 0  # a real residual
        assert torch.equal(skipped[b_key], first[b_key])
        assert not torch.equal(skipped[a_key], first[a_key])  # a was used: it moved on
        assert not torch.equal(last[b_key], first[b_key])  # b used again: consumed
        g0, g1, _ = res["b_grads"]
        assert g0.abs().sum() > 0
        assert torch.equal(g1, torch.zeros_like(g1))  # as zero_grad() left it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("find_unused", [False, True])
def test_a_synchronize_repeated_after_an_error_still_averages(find_unused: bool) -> None:
    """A failed synchronize() (here a mismatch of its first bucket) repeated without a new
    backward averages the gradients, with find_unused_parameters too: the used-parameter
    flags survive the error for the retry."""
    import concurrent.futures

    import torch

    from cgx_ucx.errors import CollectiveMismatchError
    from cgx_ucx.torch import GradientSync

    class Peer:
        """World 2, in process: the peer adds zeros to the buckets (the average is half
        this rank's gradient) and used the same parameters (the flags double)."""

        world_size = 2
        closed = False
        fail_next = 0

        def allreduce(self, x: Any, op: str = "sum", **kwargs: Any) -> Any:
            done: concurrent.futures.Future = concurrent.futures.Future()
            if self.fail_next:
                self.fail_next -= 1
                done.set_exception(CollectiveMismatchError("rank 1 called another collective"))
                return done
            if "layout" not in kwargs:  # the used flags
                x *= 2
            done.set_result(x)
            return done

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    peer = Peer()
    sync = GradientSync(
        model,
        communicator=peer,
        compression_params={"bits": 32},
        timeout=5,
        find_unused_parameters=find_unused,
    )
    peer.fail_next = 1
    model(torch.ones(2, 3)).sum().backward()
    local = model.weight.grad.clone()
    with pytest.raises(CollectiveMismatchError):
        sync.synchronize()
    sync.synchronize()
    assert torch.equal(model.weight.grad, local / 2)
    assert sync.find_unused_parameters is find_unused


class _FlakyPeer:
    """World 2, in process: the peer adds zeros (each average is half this rank's value);
    the calls numbered in ``fail`` fail, in their future or, with ``raise_now``, at once."""

    world_size = 2
    closed = False

    def __init__(self, fail: tuple[int, ...] = (), raise_now: bool = False) -> None:
        self.calls = 0
        self.fail = fail
        self.raise_now = raise_now

    def allreduce(self, x: Any, op: str = "sum", **kwargs: Any) -> Any:
        import concurrent.futures

        from cgx_ucx.errors import CollectiveMismatchError

        number, self.calls = self.calls, self.calls + 1
        done: concurrent.futures.Future = concurrent.futures.Future()
        if number in self.fail:
            error = CollectiveMismatchError(f"rank 1 called another collective at #{number}")
            if self.raise_now:
                raise error
            done.set_exception(error)
            return done
        done.set_result(x)
        return done


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raise_now", [False, True])
def test_a_synchronize_repeated_after_an_error_adds_each_residual_once(raise_now: bool) -> None:
    """With error feedback, a synchronize() that failed (a bucket's collective failed, or
    refused to start) and is repeated leaves the gradients and residuals bit-identical
    to a run where it never failed: the residuals the failed attempt consumed are put
    back, not applied a second time."""
    import torch

    from cgx_ucx.errors import CollectiveMismatchError
    from cgx_ucx.torch import GradientSync

    def run(fail: tuple[int, ...]) -> tuple[list[Any], dict[str, Any], int]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 48), torch.nn.Linear(48, 40))
        peer = _FlakyPeer(fail, raise_now)
        sync = GradientSync(
            model,
            communicator=peer,
            compression_params={"bits": 3, "bucket_size": 64},
            layer_min_size=16,
            bucket_cap_mb=0.005,  # one bucket per parameter, started as backward goes
            error_feedback=True,
            timeout=5,
        )
        assert len(sync.buckets) == 4
        failures = 0
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            model.zero_grad()
            x = torch.randn(8, 40, generator=gen)
            if raise_now:  # every bucket starts in synchronize()
                with sync.no_sync():
                    model(x).square().sum().backward()
            else:
                model(x).square().sum().backward()
            try:
                sync.synchronize()
            except CollectiveMismatchError:
                failures += 1
                sync.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        return grads, sync.state_dict()["residuals"], failures

    grads, residuals, failures = run(())
    assert failures == 0 and len(residuals) >= 2
    buckets = 4  # one per parameter: calls 4..7 are the second step's
    failed_grads, failed_residuals, failures = run((buckets + 1,))
    assert failures == 1
    for got, want in zip(failed_grads, grads, strict=True):
        assert torch.equal(got, want)
    assert failed_residuals.keys() == residuals.keys()
    for key, want in residuals.items():
        assert torch.equal(failed_residuals[key], want), key
