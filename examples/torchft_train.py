"""Fault-tolerant training with torchft on cgx: 4-bit all-reduce, replica groups that
die and come back.

One process is one replica group (add torchrun for several ranks per group). Start a
Lighthouse, then any number of groups, at any time; kill and restart them freely::

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 &
    TORCHFT_LIGHTHOUSE=http://localhost:29510 python examples/torchft_train.py --replica-id 0 &
    TORCHFT_LIGHTHOUSE=http://localhost:29510 python examples/torchft_train.py --replica-id 1

``--diloco`` trains with DiLoCo instead, its pseudo-gradients at 2 bits with error
feedback; give its Lighthouse a join timeout longer than the groups' spread at an outer
sync (``--join_timeout_ms 30000``), or a late group is left out and must heal every sync.
``--demo`` runs the whole story on this host: a Lighthouse, two groups, one of them
SIGKILLed mid-run and restarted; both end at the same step with bit-identical parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torchft import Manager
from torchft.local_sgd import DiLoCo
from torchft.optim import OptimizerWrapper

from cgx_ucx.torchft import DistributedDataParallel, ProcessGroupCGX, PseudoGradientFeedback


def train(replica_id: int, steps: int, diloco: bool) -> str:
    """Train one replica group; returns a digest of its final parameters."""
    torch.manual_seed(0)  # every group starts from the same model
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # 4-bit all-reduce for per-step DDP; DiLoCo's pseudo-gradients go at 2 bits.
    pg = ProcessGroupCGX(timeout=timedelta(seconds=30), bits=2 if diloco else 4)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"example{replica_id}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        use_async_quorum=not diloco,
        init_sync=False,
        timeout=timedelta(seconds=30),
    )
    loss_fn = nn.CrossEntropyLoss()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 100 + replica_id)
        x = torch.randn(64, 32, generator=g)
        return x, (x[:, :10] * 3).argmax(dim=1)

    try:
        if diloco:
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            with DiLoCo(manager, [model], inner, outer, sync_every=10) as local_sgd:
                # Each sync's 2-bit quantization error goes into the next sync.
                PseudoGradientFeedback(local_sgd, pg)
                local = 0
                while manager.current_step() < steps:
                    x, y = batch(local)
                    inner.zero_grad()
                    loss_fn(model(x), y).backward()
                    inner.step()  # every 10th step runs the 2-bit outer sync
                    local += 1
        else:
            net = DistributedDataParallel(manager, model)
            opt = OptimizerWrapper(manager, inner)
            while manager.current_step() < steps:
                x, y = batch(manager.current_step())
                opt.zero_grad()  # starts the step's quorum
                loss_fn(net(x), y).backward()  # 4-bit all-reduce in the comm hook
                opt.step()  # commits only if every group's step succeeded
                if manager.current_step() % 10 == 0:
                    print(f"group {replica_id}: step {manager.current_step()}", flush=True)
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        return digest.hexdigest()[:16]
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()


def demo() -> None:
    """A Lighthouse and two groups here; group 1 is SIGKILLed at step 10 and restarted."""
    from cgx_ucx.bench.ft_jobs import FtJob, Lighthouse, read_reports

    lighthouse = Lighthouse(min_replicas=1)
    out = tempfile.mkdtemp(prefix="torchft-cgx-demo-")
    args = ["--hidden", "128", "--bits", "4", "--steps", "40", "--end-with", "2"]
    job = FtJob(lighthouse.address, out, [*args, "--step-delay", "0.05"])
    try:
        job.start(0)
        job.start(1)
        job.wait_for(lambda: job.steps(1) >= 10, 120, "group 1 at step 10")
        killed = job.kill(1)
        print(f"killed group 1 at step {job.steps(1)}; group 0 goes on alone")
        job.start(1)
        job.wait(300)
        for r in (0, 1):
            final = [row for row in read_reports(out, r) if row.get("final")][-1]
            print(f"group {r}: step {final['step']}, parameters {final['digest'][:16]}")
        print(f"both groups finished {time.time() - killed:.0f} s after the kill")
    finally:
        job.stop()
        lighthouse.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replica-id", type=int, default=0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--diloco", action="store_true")
    p.add_argument("--demo", action="store_true")
    args = p.parse_args()
    if args.demo:
        demo()
        return
    os.environ.setdefault("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    digest = train(args.replica_id, args.steps, args.diloco)
    print(f"group {args.replica_id}: done, parameters {digest}")


if __name__ == "__main__":
    main()
