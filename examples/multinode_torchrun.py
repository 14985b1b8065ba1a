"""A multi-node job with torchrun: DDP with 4-bit compressed gradients across nodes.

On each of two nodes (``HOST0`` is any address of the first node that both can reach)::

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        examples/multinode_torchrun.py
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        examples/multinode_torchrun.py

(with the c10d rendezvous torchrun assigns the node ranks itself; ``--node-rank`` only
documents which line runs where). The script needs nothing but ``init_process_group("cgx")``:
torchrun's ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` tell cgx which ranks share a node, so
with more than one rank per node the allreduce is hierarchical (node-local reduce-scatter,
compressed exchange across nodes, node-local allgather), and ranks on different nodes
never use shared memory. ``CGX_COMPRESSION_QUANTIZATION_BITS`` or ``--bits`` sets the bits.

Each rank prints where it runs; rank 0 prints the loss every few steps and checks that all
ranks ended with the same weights.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx_ucx import CGXState, cgx_hook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("cgx", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    print(f"rank {rank}/{world} on node {node} ({socket.gethostname()}), local rank {local}")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DDP(model)
    state = CGXState(dist.group.WORLD, compression_params={"bits": args.bits, "bucket_size": 1024})
    ddp.register_comm_hook(state, cgx_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(world * 64, 64, generator=gen)
    y = (x[:, :10] * 3).argmax(1)  # a learnable labelling, the same on every rank
    mine = slice(rank * 64, (rank + 1) * 64)
    for step in range(args.steps):
        loss = F.cross_entropy(ddp(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(replicas, flat)
    identical = all(torch.equal(r, replicas[0]) for r in replicas)
    if rank == 0:
        print(f"final loss {loss.item():.4f}; replicas identical: {identical}", flush=True)
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
