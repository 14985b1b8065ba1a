"""The ``cgx`` backend and the DDP hook on CUDA tensors, two processes sharing one GPU.

Marked ``gpu``: skipped without a usable GPU; with ``CGX_UCX_REQUIRE_GPU=1``
(``benchmarks/gpu_check.sh``) a missing GPU, or a torch without CUDA, is a failure.
Both ranks use device 0 (the check machine has one GPU), so UCX moves the buffers between
the processes with cuda_ipc / cuda_copy; the results are checked against exact sums and the
codec's bound, and the replicas bit for bit.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from torch_helpers import join_cgx_with_gloo, run_torch_ranks

pytestmark = pytest.mark.gpu

N_LARGE = 3_000_017  # odd: the last bucket and the last chunk are partial


def _inputs(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(n).astype(np.float32)


def _identical_everywhere(t: Any, gloo: Any) -> bool:
    import torch
    import torch.distributed as dist

    host = t.detach().reshape(-1).cpu()
    rows = [torch.empty_like(host) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, host, group=gloo)
    return all(torch.equal(rows[0], r) for r in rows[1:])


def _model() -> Any:
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def _job(rank: int, world: int, store: Any, device: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx_ucx.torch import CGXState, cgx_hook

    if device == "cuda":
        assert torch.cuda.is_available(), "torch has no CUDA device"
        torch.cuda.set_device(0)
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    gloo = join_cgx_with_gloo(rank, world, store)
    out: dict[str, Any] = {}

    # 32 bits: exact on integer-valued floats, results stay on the device.
    for n in (1, 1001, 1 << 20):
        base = (torch.arange(n, device=dev) % 97).float()
        t = base * (rank + 1)
        dist.all_reduce(t)
        assert t.device == dev and torch.equal(t, base * (world * (world + 1) // 2)), n

    # 4 bits through the environment knobs, on a buffer far over the minimal size.
    os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = "4"
    os.environ["CGX_COMPRESSION_BUCKET_SIZE"] = "512"
    x = torch.from_numpy(_inputs(rank, N_LARGE)).to(dev)
    dist.all_reduce(x)
    exact = sum(_inputs(r, N_LARGE).astype(np.float64) for r in range(world))
    r_max = max(float(np.ptp(_inputs(r, N_LARGE))) for r in range(world))
    err = float(np.abs(x.cpu().numpy().astype(np.float64) - exact).max())
    # Two quantization stages, each at most one step of the largest range it saw:
    # a share of one rank's input (range <= R), then the sum (range <= world * R).
    bound = (2 * world - 1) * r_max / (2**4 - 1)
    assert 0 < err <= bound, (err, bound)
    assert _identical_everywhere(x, gloo), "4-bit replicas differ"
    out["err4"], out["bound4"] = err, bound
    os.environ.pop("CGX_COMPRESSION_QUANTIZATION_BITS")

    # broadcast and all_gather on device tensors.
    b = (
        torch.arange(5000, device=dev, dtype=torch.float32)
        if rank == 0
        else torch.zeros(5000, device=dev)
    )
    dist.broadcast(b, src=0)
    assert torch.equal(b.cpu(), torch.arange(5000, dtype=torch.float32))
    rows = [torch.empty(7, device=dev) for _ in range(world)]
    dist.all_gather(rows, torch.full((7,), float(rank), device=dev))
    assert all(torch.equal(r.cpu(), torch.full((7,), float(i))) for i, r in enumerate(rows))

    # DDP on the device with the hook at 32 and 4 bits, against gloo DDP on the host.
    base_model = _model()
    ref = DDP(copy.deepcopy(base_model), process_group=gloo)
    runs = {}
    for bits in (32, 4):
        ids = [0] if device == "cuda" else None
        model = DDP(copy.deepcopy(base_model).to(dev), device_ids=ids)
        params = {"bits": bits, "bucket_size": 512}
        state = CGXState(dist.group.WORLD, layer_min_size=1024, compression_params=params)
        model.register_comm_hook(state, cgx_hook)
        runs[bits] = model
    gen = torch.Generator().manual_seed(7 + rank)
    worst = {32: 0.0, 4: 0.0}
    for _step in range(3):
        xb = torch.randn(16, 1, 8, 8, generator=gen)
        yb = torch.randint(0, 10, (16,), generator=gen)
        for model in runs.values():
            model.module.load_state_dict(ref.module.state_dict())
        ref.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        for bits, model in runs.items():
            model.zero_grad()
            F.cross_entropy(model(xb.to(dev)), yb.to(dev)).backward()
            for w, p in zip(ref.parameters(), model.parameters(), strict=True):
                assert p.grad.device == dev
                g = p.grad.cpu()
                err = (w.grad - g).abs().max().item()
                worst[bits] = max(worst[bits], err)
                scale = w.grad.abs().max().item()
                if bits == 32:  # device vs host kernels: float rounding only
                    assert err <= 1e-5 * max(1.0, scale) + 1e-6, (bits, err)
                else:  # the averaged gradient's range is at most 2 * max|g|
                    assert err <= (2 * world - 1) * 2 * scale / 15 * 1.01 + 1e-5, (bits, err)
            assert _identical_everywhere(
                torch.cat([p.grad.reshape(-1) for p in model.parameters()]), gloo
            ), f"cgx{bits} DDP gradients differ between ranks"
    assert worst[4] > worst[32], worst  # compression was applied
    out["ddp_worst"] = worst
    return out


@pytest.mark.timeout(300)
def test_cgx_backend_and_ddp_hook_on_cuda_tensors() -> None:
    results = run_torch_ranks(_job, 2, args=("cuda",), timeout=280)
    for r in results:
        assert r["err4"] <= r["bound4"]
