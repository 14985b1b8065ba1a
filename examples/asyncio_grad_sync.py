"""An asyncio training loop with per-parameter gradient hooks: ``cgx_ucx.GradientSync``.

Run with torchrun::

    torchrun --nproc-per-node 2 examples/asyncio_grad_sync.py

No DDP: ``GradientSync`` puts a post-accumulate-grad hook on every parameter, so each
bucket of gradients starts its compressed (4-bit) allreduce while backward is still
running. The loop is a coroutine: ``await gs`` waits for the averaged gradients without
blocking the event loop, so another task (here a prefetcher that prepares the next
batch) keeps running meanwhile. Rank 0 prints the loss per epoch, the bytes one rank sent
per step, and whether every rank ended with bit-identical weights (they must: every rank
decodes the same compressed sums).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cgx_ucx


async def prefetch(batches: asyncio.Queue, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    """Produce the batches of this rank (a real loader would read and decode here)."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        idx = torch.randint(len(y), (32,), generator=gen)
        await batches.put((x[idx], y[idx]))
    await batches.put(None)


async def train(model: nn.Module, gs: cgx_ucx.GradientSync, steps: int) -> list[float]:
    torch.manual_seed(0)  # the same toy regression task on every rank
    x = torch.randn(2048, 32)
    y = x @ torch.randn(32, 1) + 0.1 * torch.randn(2048, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches: asyncio.Queue = asyncio.Queue(maxsize=2)
    producer = asyncio.create_task(prefetch(batches, x, y, steps))
    losses = []
    while (batch := await batches.get()) is not None:
        xb, yb = batch
        loss = F.mse_loss(model(xb), yb)
        loss.backward()  # buckets start their compressed allreduce from the hooks
        await gs  # averaged gradients are in param.grad; the loop ran meanwhile
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    await producer
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # several ranks share the machine's cores
    dist.init_process_group("cgx", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1))
    gs = cgx_ucx.GradientSync(
        model,
        compression_params={"bits": args.bits, "bucket_size": 1024},
        layer_min_size=1024,  # 1-D and small layers stay exact, as in the CGX paper
    )
    losses = asyncio.run(train(model, gs, args.steps))

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, flat)
    identical = all(torch.equal(r, replicas[0]) for r in replicas)
    if dist.get_rank() == 0:
        every = max(args.steps // 6, 1)
        for i in range(0, len(losses), every):
            print(f"step {i:3d} loss {sum(losses[i : i + every]) / len(losses[i : i + every]):.5f}")
        print(f"bytes sent per step (rank 0): {gs.bytes_per_step}")
        print(f"final loss {losses[-1]:.5f}")
        print(f"replicas identical: {identical}", flush=True)
    gs.remove()
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
