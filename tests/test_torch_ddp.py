"""DDP with cgx_hook against DDP on gloo, across spawned processes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from torch_helpers import join_cgx_with_gloo, run_torch_ranks

STEPS = 3


def _model() -> Any:
    import torch.nn as nn

    # conv (compressed at 4608 values), linear (compressed), 1-D biases and a small
    # linear (uncompressed): every kind of layer the layout distinguishes.
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 40),
        nn.ReLU(),
        nn.Linear(40, 10),
    )


def _grad_bound(grads: list[Any], world: int, bits: int, gloo: Any) -> float:
    """CGX bound for one averaged layer: world * R / (2^bits - 1), R = largest range.

    Phase 1 quantizes each peer's share (error <= unit/2 each, world - 1 shares), phase
    2 re-quantizes the reduced chunk (range <= world * R): (2*world - 1) * R / (2 *
    (2^bits - 1)) < world * R / (2^bits - 1).
    """
    import torch
    import torch.distributed as dist

    r = torch.tensor([max(float(g.max() - g.min()) for g in grads) / world])
    dist.all_reduce(r, op=dist.ReduceOp.MAX, group=gloo)
    return world * r.item() / (2**bits - 1) * 1.01 + 1e-7


def _same_on_all_ranks(model: Any, gloo: Any) -> bool:
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, flat, group=gloo)
    return all(torch.equal(rows[0], r) for r in rows[1:])


def _ddp_job(rank: int, world: int, store: Any) -> dict[str, Any]:
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx_ucx.torch import CGXState, cgx_hook

    gloo = join_cgx_with_gloo(rank, world, store)
    base = _model()
    ref = DDP(copy.deepcopy(base), process_group=gloo)  # PyTorch's default allreduce
    runs: dict[str, tuple[Any, Any, int]] = {}
    for name, bits, group, ef in (
        ("cgx32", 32, dist.group.WORLD, False),
        ("cgx8", 8, dist.group.WORLD, False),
        ("cgx4", 4, dist.group.WORLD, False),
        ("gloo+hook4", 4, gloo, False),  # hook on a non-cgx group: its own communicator
        ("cgx4ef", 4, dist.group.WORLD, True),
    ):
        model = DDP(copy.deepcopy(base), process_group=group)
        state = CGXState(
            group,
            layer_min_size=1024,
            compression_params={"bits": bits, "bucket_size": 512},
            error_feedback=ef,
        )
        model.register_comm_hook(state, cgx_hook)
        runs[name] = (model, state, bits)
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, (m, _, _) in runs.items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    lossy = {n: 0.0 for n in runs}
    for step in range(STEPS):
        x = torch.randn(8, 1, 8, 8, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        # Every model starts the step from the reference's parameters, so each step's
        # gradients are compared from the same point.
        for model, _, _ in runs.values():
            model.module.load_state_dict(ref.module.state_dict())
        F.cross_entropy(ref(x), y).backward()
        want = [p.grad for p in ref.parameters()]
        # Per-layer local gradients (divided as the hook does) for the bound.
        local_model = copy.deepcopy(ref.module)
        local_model.zero_grad()
        F.cross_entropy(local_model(x), y).backward()
        local = [p.grad for p in local_model.parameters()]
        for name, (model, _state, bits) in runs.items():
            opts[name].zero_grad()
            F.cross_entropy(model(x), y).backward()
            if step == 1:  # an unrelated all_reduce in between must not disturb the hook
                other = torch.randn(3000)
                dist.all_reduce(other)
            got = [p.grad for p in model.parameters()]
            for w, g, lg in zip(want, got, local, strict=True):
                if bits == 32:
                    assert torch.equal(w, g), (name, step, (w - g).abs().max())
                    continue
                err = (w - g).abs().max().item()
                lossy[name] = max(lossy[name], err)
                if name.endswith("ef"):
                    continue  # the residual of the last step is added: not this bound
                bound = _grad_bound([lg], world, bits, gloo)
                assert err <= bound, (name, step, tuple(w.shape), err, bound)
        ref_opt.step()
        ref_opt.zero_grad()
    for name, (model, state, bits) in runs.items():
        if bits < 32:
            assert lossy[name] > 0, f"{name}: compression was never applied"
        opts[name].step()  # one more update from the last compressed gradients
        assert _same_on_all_ranks(model.module, gloo), name
        assert state.steps == STEPS and state.bytes_per_step > 0
    # Error feedback: residuals exist for compressed layers and survive state_dict.
    ef_state = runs["cgx4ef"][1]
    sd = ef_state.state_dict()
    assert sd["residuals"] and sd["steps"] == STEPS
    assert any(float(t.abs().max()) > 0 for t in sd["residuals"].values())
    fresh = CGXState(dist.group.WORLD, error_feedback=True)
    fresh.load_state_dict(sd)
    sd2 = fresh.state_dict()
    assert sd2["steps"] == STEPS and sd2["residuals"].keys() == sd["residuals"].keys()
    assert all(torch.equal(sd["residuals"][k], sd2["residuals"][k]) for k in sd["residuals"])
    return {n: s.bytes_per_step for n, (_, s, _) in runs.items()}


@pytest.mark.timeout(200)
def test_ddp_cgx_hook_against_gloo() -> None:
    per_step = run_torch_ranks(_ddp_job, 2, timeout=180)[0]
    # 4 bits send far fewer bytes than 32 (about 6x on this model: biases stay fp32).
    assert per_step["cgx4"] * 4 < per_step["cgx32"], per_step
    assert per_step["cgx8"] < per_step["cgx32"]


def _ddp_peer_dies(rank: int, world: int, store: Any) -> str:
    import os

    import torch
    from harness import DEAD_EXIT
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx_ucx.torch import CGXState, cgx_hook

    join_cgx_with_gloo(rank, world, store)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)]
    model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10)), bucket_cap_mb=1)
    model.register_comm_hook(CGXState(None), cgx_hook)

    class DieInBackward(torch.autograd.Function):
        """Rank 1 dies half-way through backward: rank 0's later buckets are in flight."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            if rank == 1:
                os._exit(DEAD_EXIT)
            return g

    try:
        for step in range(5):
            x = torch.randn(4, 64)
            h = model.module[1](model.module[0](x))
            out = model(x) + (DieInBackward.apply(h).sum() * 0 if step == 2 else 0)
            out.square().mean().backward()
    except RuntimeError as exc:  # the typed error itself, or DDP's RuntimeError naming it
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_a_lost_peer_inside_the_ddp_hook_names_the_cgx_error() -> None:
    """A hook whose peer is lost fails DDP's backward with the typed error's message: the
    hook's future fails through a then(), because torch's Python Future.set_exception
    stores the error as the value (DDP would then say "Unable to cast ... to Tensor")."""
    text = run_torch_ranks(_ddp_peer_dies, 2, timeout=110, expect_dead=[1])[0]
    assert "PeerLostError" in text and "Unable to cast" not in text, text
