"""FSDP2 (``fully_shard``) on CPU with the cgx backend: a small MLP, a few steps, the loss.

Run with torchrun::

    torchrun --nproc-per-node 2 examples/fsdp2_cgx.py              # cgx
    torchrun --nproc-per-node 2 examples/fsdp2_cgx.py --backend gloo  # the same on gloo
    torchrun --nproc-per-node 2 examples/fsdp2_cgx.py --bits 4        # compressed gradients

The only cgx-specific line is the backend name: FSDP2 shards the parameters over a CPU
device mesh built on the default process group, gathers them with all_gather before each
layer runs, and reduce-scatters the gradients after backward; all of it goes through the
cgx backend. Every rank trains on its own slice of the same seeded data, so the two runs
print the same losses (within float rounding: the backends add in different orders).
With ``--bits 4`` (or ``CGX_COMPRESSION_QUANTIZATION_BITS=4``) the gradient reduce-scatter
is quantized (about 8x fewer bytes) while the parameter all-gather stays exact; the losses
then follow the exact run closely rather than equal it.
Rank 0 prints one line per step (the loss averaged over ranks) and ``final loss``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import cgx_ucx  # registers the "cgx" backend


class MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cgx", choices=["cgx", "gloo"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bits", type=int, help="cgx: quantize gradient traffic (1..8)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # several ranks share the machine's cores
    options = None
    if args.backend == "cgx" and args.bits is not None:
        options = cgx_ucx.CGXOptions(compression=cgx_ucx.CompressionConfig(bits=args.bits))
    dist.init_process_group(
        args.backend, timeout=datetime.timedelta(seconds=120), pg_options=options
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(0)  # every rank builds the same model, then keeps its shard
    model = MLP()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)  # each layer is gathered just before it runs
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    # One fixed batch, the same on every rank; each rank trains on its slice of it.
    x = torch.randn(world * args.batch_size, 64, generator=torch.Generator().manual_seed(1))
    y = x[:, :1].sin()
    mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    for step in range(args.steps):
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()  # gradients are reduce-scattered to their shards here
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step} loss {mean.item():.6f}", flush=True)
    if rank == 0:
        print(f"final loss {mean.item():.6f} ({args.backend}, {world} ranks)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
