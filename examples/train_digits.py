"""Train a small CNN on scikit-learn's digits with 4-bit compressed gradients, and without.

Run with torchrun (scripts/train.sh does)::

    torchrun --nproc-per-node 2 examples/train_digits.py

The job joins the ``cgx`` backend (one line changes from a gloo script) and trains the
same model, from the same seed on the same data order, twice:

1. ``cgx 4-bit``: DDP on the cgx group with ``cgx_hook`` (4 bits, buckets of 1024
   values; 1-D and small layers uncompressed, as in the CGX paper);
2. ``gloo fp32``: DDP on a gloo group with PyTorch's default allreduce.

Rank 0 prints an epoch line while it trains (loss, step time, bytes sent per step),
then final test accuracy, median step time and the gradient bytes each rank sent per step,
and writes ``train_digits.json`` and ``train_digits.png`` (loss and bytes against step,
cgx and gloo) to ``--out-dir`` (default: a new ``./cgx_bench_results/<timestamp>/``).
``--quiet`` keeps only the table. The data (1797 8x8 images) ships with scikit-learn:
nothing is downloaded.

``--policy kmeans|budget|auto`` lets an adaptive policy choose each layer's bits in
the cgx run (``CGXState(..., policy=..., model=ddp)``; "static" is the paper's
setting) and prints its final per-layer assignment.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx_ucx.torch as cgx_torch
from cgx_ucx.layout import Layout
from cgx_ucx.torch import CGXState, cgx_hook, wire_bytes

#: Held-out share of the 1797 images (30%: 540 test images, so one image is 0.19
#: accuracy points).
TEST_FRACTION = 0.3


@dataclass
class Result:
    mode: str
    accuracy: float  # percent, on the held-out images
    step_ms: float  # median wall time of a training step (forward, backward, sync, update)
    step_ms_mean: float  # their mean: one-time costs in (the codec's kernel load, ~0.5 s)
    bytes_per_step: int  # gradient bytes this rank sent per step
    bytes_measured: bool  # True: the communicator's counter; False: computed (gloo)
    steps: int
    final_loss: float
    layers: str = ""  # the policy's per-layer table (cgx runs)
    losses: list[float] = field(default_factory=list)  # training loss of every step (this rank)
    step_bytes: list[int] = field(default_factory=list)  # bytes sent at every step (cgx only)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers (about 38k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits scaled to [0, 1], split train/test with a fixed permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def train(
    mode: str,
    group: dist.ProcessGroup,
    *,
    bits: int = 4,
    epochs: int = 15,
    batch_size: int = 32,
    lr: float = 0.1,
    seed: int = 0,
    policy: str = "static",
    report: Callable[[str], None] | None = None,
) -> Result:
    """Train from ``seed`` on ``group``; ``mode`` is "cgx" (cgx_hook with ``policy``) or
    "plain" (DDP's default allreduce). ``report`` receives one line per epoch."""
    rank, world = group.rank(), group.size()
    xtr, ytr, xte, yte = load_data(seed)
    torch.manual_seed(seed)
    model = DigitsCNN()
    ddp = DDP(model, process_group=group)
    state = None
    if mode == "cgx":
        state = CGXState(
            group,
            compression_params={"bits": bits, "bucket_size": 1024},
            policy=policy,
            model=ddp,
        )
        ddp.register_comm_hook(state, cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    per_rank = len(ytr) // world
    steps_per_epoch = per_rank // batch_size
    # One-cycle schedule: the run ends converged, so the final accuracy is a stable
    # measure (with a constant rate it varies by more than a point between seeds).
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=lr, total_steps=epochs * steps_per_epoch
    )
    times: list[float] = []
    losses: list[float] = []
    step_bytes: list[int] = []
    loss = torch.zeros(())
    sent0 = state.communicator.stats.bytes_sent if state is not None else 0
    label = _name(mode, bits, policy)
    started = time.perf_counter()
    for epoch in range(epochs):
        # Same shuffle on every rank; each takes its own contiguous share.
        order = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[rank * per_rank : (rank + 1) * per_rank]
        for s in range(steps_per_epoch):
            idx = mine[s * batch_size : (s + 1) * batch_size]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            sched.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.item()))
            if state is not None:
                sent = state.communicator.stats.bytes_sent
                step_bytes.append(sent - sent0 - sum(step_bytes))
        if report is not None:
            epoch_losses = losses[-steps_per_epoch:]
            epoch_ms = 1000.0 * float(np.mean(times[-steps_per_epoch:]))
            sent_text = (
                f"{np.mean(step_bytes[-steps_per_epoch:]) / 1e3:.1f} kB/step sent"
                if (step_bytes)
                else "bytes: computed at the end"
            )
            report(
                f"[{label}] epoch {epoch + 1}/{epochs}  loss {np.mean(epoch_losses):.4f}  "
                f"step {epoch_ms:.2f} ms  {sent_text}  ({time.perf_counter() - started:.0f} s)"
            )
    model.eval()
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item() * 100.0
    # The first steps include DDP's bucket rebuild. Later ones of the cgx run include the
    # one-time load of the host codec's Numba kernels (about half a second of CPU a rank,
    # on a thread of its own, while the NumPy codec runs): the median is the step time of
    # a longer job, the mean says what this short one paid.
    warm = times[len(times) // 10 :]
    if state is not None:
        # Measured: everything the communicator sent (payload and frame headers).
        sent = state.communicator.stats.bytes_sent - sent0
        nbytes, measured = sent / len(times), True
    else:
        # gloo has no byte counters: the same formula the hook's layouts use, at fp32.
        grads = [p for p in model.parameters() if p.requires_grad]
        layout = Layout.uniform(sum(p.numel() for p in grads))
        nbytes, measured = wire_bytes(layout, 4, world), False
    return Result(
        mode=label,
        accuracy=accuracy,
        step_ms=1000.0 * float(np.median(warm)),
        step_ms_mean=1000.0 * float(np.mean(warm)),
        bytes_per_step=int(nbytes),
        bytes_measured=measured,
        steps=len(times),
        final_loss=float(loss.item()),
        layers=state.stats_table() if state is not None else "",
        losses=losses,
        step_bytes=step_bytes,
    )


def _name(mode: str, bits: int, policy: str) -> str:
    if mode != "cgx":
        return "gloo fp32"
    return f"cgx {bits}-bit" if policy == "static" else f"cgx {policy}"


def plot(results: list[Result], path: Path) -> Path:
    """Loss against step and bytes sent per step, one line per run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = np.arange(1, len(r.losses) + 1)
        ax_loss.plot(steps, r.losses, label=r.mode, linewidth=0.8)
        per_step = r.step_bytes if r.step_bytes else [r.bytes_per_step] * len(r.losses)
        kind = "measured" if r.step_bytes else "computed"
        ax_bytes.plot(steps, per_step, label=f"{r.mode} ({kind})", linewidth=0.8)
    ax_loss.set(xlabel="step", ylabel="training loss (rank 0)", yscale="log")
    ax_loss.set_title("loss")
    ax_bytes.set(xlabel="step", ylabel="bytes sent per step (one rank)", yscale="log")
    ax_bytes.set_title("gradient bytes per step")
    for ax in (ax_loss, ax_bytes):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(results: list[Result]) -> str:
    from cgx_ucx.bench.report import format_table

    rows = [
        [
            r.mode,
            round(r.accuracy, 2),
            round(r.step_ms, 2),
            round(r.step_ms_mean, 2),
            r.bytes_per_step,
            "measured" if r.bytes_measured else "computed",
            round(results[-1].bytes_per_step / max(r.bytes_per_step, 1), 2),
            r.steps,
        ]
        for r in results
    ]
    headers = [
        "run",
        "accuracy %",
        "median step ms",
        "mean",
        "bytes/step/rank",
        "bytes",
        "x less",
        "steps",
    ]
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1, help="peak of the one-cycle schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policy",
        default="static",
        choices=list(cgx_torch.POLICY_NAMES),
        help="who picks each layer's bits in the cgx run (static: the paper's 4-bit rule)",
    )
    parser.add_argument(
        "--out-dir",
        help="directory for train_digits.json and .png (unset: a new "
        "./cgx_bench_results/<timestamp>/)",
    )
    parser.add_argument("--json", help="the JSON file (the PNG goes next to it)")
    parser.add_argument("--quiet", action="store_true", help="no epoch lines (CI)")
    args = parser.parse_args(argv)
    if not (1 <= args.bits <= 8 or args.bits == 32):
        parser.error(f"--bits must be 1..8 or 32 (uncompressed), got {args.bits}")
    if args.epochs < 1 or args.batch_size < 1 or not args.lr > 0:
        parser.error("--epochs and --batch-size must be at least 1 and --lr greater than 0")

    torch.set_num_threads(1)  # two ranks share two cores here
    assert cgx_torch.BACKEND_NAME in dist.Backend.backend_list  # registered at import
    dist.init_process_group("cgx", timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    kw: dict[str, Any] = dict(
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed
    )
    if dist.get_rank() == 0 and not args.quiet:
        print(f"joined {dist.get_world_size()} ranks on the cgx backend; training", flush=True)
        kw["report"] = lambda line: print(line, flush=True)
    results = [
        train("cgx", dist.group.WORLD, bits=args.bits, policy=args.policy, **kw),
        train("plain", gloo, **kw),
    ]
    if dist.get_rank() == 0:
        print(
            f"digits CNN, {dist.get_world_size()} ranks, {args.epochs} epochs, "
            f"batch {args.batch_size}/rank, seed {args.seed}"
        )
        print(_table(results))
        print(
            "bytes/step/rank: what one rank sends per step; cgx: the communicator's byte\n"
            "counter (payload + frame headers); gloo: 2(W-1)/W x the fp32 gradient bytes\n"
            "(reduce-scatter + allgather), as gloo keeps no counters."
        )
        print(f"\n{results[0].mode}: final per-layer assignment\n{results[0].layers}")
        _write(results, args)
        sys.stdout.flush()
    dist.destroy_process_group()
    return 0


def _write(results: list[Result], args: argparse.Namespace) -> None:
    from cgx_ucx.bench.report import default_results_dir

    if args.json:
        path = Path(args.json)
    else:
        path = (Path(args.out_dir) if args.out_dir else default_results_dir()) / "train_digits.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    print(f"\nJSON: {path}")
    try:
        png = plot(results, path.with_suffix(".png"))
    except ImportError as exc:  # matplotlib is in the bench extra
        print(f"no plot ({exc}); pip install matplotlib", file=sys.stderr)
    else:
        print(f"plot: {png}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
