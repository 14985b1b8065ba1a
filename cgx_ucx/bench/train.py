"""``python -m cgx_ucx.bench train``: compression policies against uncompressed, in training.

The same model, data, seed and data order are trained with every policy, side by side in
one run (``--repeats`` times, 3), by ``--world`` ranks (2) on the cgx_ucx engine:

``none``
    every layer uncompressed (bits 32) through the same engine: the baseline;
``static``
    the CGX paper's 4 bits, buckets of 1024, 1-D and small layers uncompressed;
``kmeans`` / ``budget`` / ``auto``
    the adaptive policies of :mod:`cgx_ucx.compression.adaptive`.

Each step: the ranks agree on the assignment (:func:`~cgx_ucx.compression.adaptive.
agree_sync`; communication only on decision steps), compute forward and backward, let the
policy observe the local gradients, all-reduce the flat gradient buffer with the policy's
layout, and step the optimizer. All policies use this one loop (no DDP, no overlap of
backward and communication), so differences come from the policies alone.

Model and data: an MLP 64-H-H-H/2-10 (H = ``--hidden``, 512: about 430 k parameters in
four weight matrices of 2.5 k to 262 k values, so the layers differ in size as in real
networks) on scikit-learn's digits (1797 8x8 images, 30% held out; nothing downloaded).

Reported per policy: held-out accuracy, mean training loss of the last epoch, mean step
time (after the first 10% of steps: JIT compilation, probes, warm-up; the median over
the runs, made in rotating order), gradient bytes each rank really sent per step (the
communicator's counter around the gradient allreduces), the final per-layer assignment.
The ranks are checked to end with bit-identical parameters and identical assignments; a
difference fails the run.

``--link-rate 1gbit`` runs the ranks in network namespaces joined by a shaped link
(:mod:`cgx_ucx.bench.netns`, needs root and iproute2), the commodity-link setting where
compression pays; without it the ranks talk over loopback. The ranks use the engine
directly (:func:`~cgx_ucx.engine.connect_sync` on a TCPStore at ``MASTER_ADDR``).
Output: a progress bar (one step per policy run), a table and ``train.json``
(``train_<rate>.json`` with a link rate) in ``--out-dir`` (default: a new
``./cgx_bench_results/<timestamp>/``; ``--refresh-tracked``: the checkout's
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .link_args import rate_arg
from .netns import LinkEmulator, format_rate, missing_prerequisites
from .report import (
    HelpFormatter,
    Progress,
    add_output_args,
    arg_error,
    count_arg,
    format_table,
    positive_number,
    ranks_arg,
    results_dir,
    write_json,
)

__all__ = ["main"]

POLICY_NAMES = ("none", "static", "kmeans", "budget", "auto")
#: Held-out share of the 1797 digits (540 test images: one image is 0.19 points).
TEST_FRACTION = 0.3
#: Share of the first steps left out of the mean step time (JIT, probes, warm-up).
WARMUP_FRACTION = 0.1
#: The target ``bench train`` reports against: auto at most 5% slower than the better of
#: none and static.
AUTO_SLACK = 1.05
#: Marks the result line a rank prints on stdout.
RESULT_TAG = "CGX_TRAIN_RESULT "
#: Marks a rank's progress lines on stderr.
PROGRESS_TAG = "[train]"


# =======================================================================================
# driver


def _policies_arg(text: str) -> list[str]:
    """An argparse ``type``: a comma-separated, non-empty subset of POLICY_NAMES."""
    policies = [s.strip() for s in text.split(",") if s.strip()]
    valid = ", ".join(POLICY_NAMES)
    if not policies:
        raise argparse.ArgumentTypeError(f"at least one policy is needed, of {valid}")
    unknown = sorted(set(policies) - set(POLICY_NAMES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policies {unknown}; choose from {valid}")
    return policies


def _link_rate_arg(text: str) -> str:
    """An argparse ``type``: a link rate as ``bench link --rates`` takes it, written in
    tc's units (``1000mbit`` -> ``1gbit``: the name of the result file)."""
    return format_rate(rate_arg(text))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench train",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--world", type=ranks_arg(2), default=2, help="ranks (one has nothing to compress)"
    )
    p.add_argument(
        "--policies",
        type=_policies_arg,
        default=",".join(POLICY_NAMES),
        help=f"comma-separated subset of {','.join(POLICY_NAMES)}",
    )
    p.add_argument("--epochs", type=count_arg(1), default=15, help="epochs per run")
    p.add_argument("--batch-size", type=count_arg(1), default=32, help="per rank")
    p.add_argument("--lr", type=positive_number, default=0.1, help="peak of the one-cycle schedule")
    p.add_argument("--hidden", type=count_arg(1), default=512, help="MLP width H")
    p.add_argument("--seed", type=count_arg(0), default=0, help="model, data split and order")
    p.add_argument(
        "--repeats",
        type=count_arg(1),
        default=3,
        help="runs per policy, in rotating order (median)",
    )
    p.add_argument("--warmup", type=count_arg(0), default=20, help="kmeans/budget: first decision")
    p.add_argument(
        "--interval", type=count_arg(1), default=100, help="kmeans/budget: decision period"
    )
    p.add_argument(
        "--window", type=count_arg(1), default=10, help="kmeans/budget: statistics steps"
    )
    p.add_argument("--check-every", type=count_arg(1), default=50, help="auto: drift check period")
    p.add_argument(
        "--link-rate",
        type=_link_rate_arg,
        default=None,
        help="emulated link rate, e.g. 1gbit (root)",
    )
    p.add_argument(
        "--timeout", type=positive_number, default=900.0, help="seconds for the whole run"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_output_args(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    policies = args.policies
    if args.worker:
        return _worker(args, policies)
    if args.link_rate:
        missing = missing_prerequisites()
        if missing:
            arg_error(parser, "--link-rate", f"link emulation needs {', '.join(missing)}")

    out_dir = results_dir(args)
    forward = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    cmd = [sys.executable, "-m", "cgx_ucx.bench.train", "--worker", *forward]
    started = time.monotonic()
    bar = Progress(args.repeats * len(policies), "train", disable=args.quiet)
    on_line = functools.partial(_on_rank_line, bar)
    try:
        if args.link_rate:
            with LinkEmulator(args.world, args.link_rate) as em:
                runs = em.run_ranks(
                    cmd, timeout=args.timeout, env=_threads_env(args.world), progress=on_line
                )
                outs = [r.stdout for r in runs]
        else:
            outs = _run_local(cmd, args.world, args.timeout, on_line)
    except Exception as exc:  # report the failing ranks, exit non-zero
        bar.close()
        print(f"training benchmark failed: {exc}", file=sys.stderr)
        return 1
    bar.close()
    record = _parse(outs[0])
    record["wall_s"] = round(time.monotonic() - started, 1)
    record["link_rate"] = args.link_rate or "loopback"
    record["targets"] = _targets(record["results"])
    print(_headline(record))
    print(_table(record["results"]))
    for line in record["targets"]["lines"]:
        print(line)
    name = "train" if not args.link_rate else f"train_{args.link_rate}"
    path = write_json(name, record, out_dir)
    print(f"wrote {path}")
    return 0


def _on_rank_line(bar: Progress, rank: int, line: str) -> None:
    """Rank 0's ``[train] ... done`` lines advance the bar (other lines are its log)."""
    if rank == 0 and line.startswith(PROGRESS_TAG):
        text = line[len(PROGRESS_TAG) :].strip()
        if text.endswith(" done"):
            bar.update(note=text)


def _threads_env(world: int) -> dict[str, str]:
    """Numba threads per rank: the cores divided among the ranks (the codec runs on the
    engine's threads, so this must be set before Numba starts, by variable)."""
    per_rank = max(1, (os.cpu_count() or 1) // world)
    return {"NUMBA_NUM_THREADS": os.environ.get("NUMBA_NUM_THREADS", str(per_rank))}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_local(
    cmd: list[str],
    world: int,
    timeout: float,
    on_line: Callable[[int, str], None] | None = None,
) -> list[str]:
    """One process per rank on loopback, one shared deadline; their stdouts.

    ``on_line(0, line)`` sees rank 0's stderr lines while it runs (progress).

    A rank that fails or the deadline passing kills the others and raises with the
    stderr tails (the children's tracebacks).
    """
    port = _free_port()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="cgx-train-") as tmp:
        procs, files = [], []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            env.update(_threads_env(world))
            out = open(Path(tmp) / f"{rank}.out", "w+")  # noqa: SIM115 - closed below
            err = open(Path(tmp) / f"{rank}.err", "w+")  # noqa: SIM115 - closed below
            files.append((out, err))
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True))
        failed = timed_out = False
        seen = 0  # bytes of rank 0's stderr already passed to on_line
        try:
            while any(p.poll() is None for p in procs):
                if on_line is not None:
                    seen = _follow(files[0][1], seen, on_line)
                if any(p.returncode not in (None, 0) for p in procs):
                    failed = True
                    time.sleep(2.0)  # let the others report their side
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
        texts = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if timed_out or failed or bad:
        tails = "\n".join(
            f"--- rank {r} (exit {procs[r].returncode}) ---\n" + "\n".join(e.splitlines()[-25:])
            for r, (_, e) in enumerate(texts)
        )
        why = f"deadline of {timeout:g} s passed" if timed_out else f"rank(s) {bad} failed"
        raise RuntimeError(f"{why}\n{tails}")
    return [o for o, _ in texts]


def _follow(f: Any, seen: int, on_line: Callable[[int, str], None]) -> int:
    """Pass the complete lines written to ``f`` past byte ``seen`` to ``on_line(0, .)``;
    returns the new position."""
    with open(f.name, "rb") as g:
        g.seek(seen)
        chunk = g.read()
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].decode(errors="replace").splitlines():
        on_line(0, line)
    return seen + end


def _parse(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise RuntimeError("rank 0 printed no result")


def _targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, evaluated on this run (reported, never hidden)."""
    by = {r["policy"]: r for r in results}
    out: dict[str, Any] = {"lines": []}
    if "static" in by:
        st = by["static"]
        for name in ("kmeans", "budget"):
            if name in by:
                r = by[name]
                fewer = r["bytes_per_step"] < st["bytes_per_step"]
                acc_ok = r["accuracy"] >= st["accuracy"]
                out[f"{name}_fewer_bytes_than_static"] = fewer
                out[f"{name}_accuracy_at_least_static"] = acc_ok
                out["lines"].append(
                    f"{name}: {r['bytes_per_step'] / max(st['bytes_per_step'], 1):.2f}x static's "
                    f"bytes, accuracy {r['accuracy'] - st['accuracy']:+.2f} points"
                )
    if "auto" in by and "none" in by and "static" in by:
        best = min(by["none"]["step_ms"], by["static"]["step_ms"])
        ratio = by["auto"]["step_ms"] / best
        out["auto_over_best"] = round(ratio, 3)
        out["auto_within_5pct"] = ratio <= AUTO_SLACK
        out["lines"].append(
            f"auto: {ratio:.3f}x the step time of the better of none/static "
            f"({'within' if ratio <= AUTO_SLACK else 'OVER'} the 5% target)"
        )
    return out


def _headline(record: dict[str, Any]) -> str:
    c = record["config"]
    return (
        f"MLP 64-{c['hidden']}-{c['hidden']}-{c['hidden'] // 2}-10 on digits, "
        f"{c['world']} ranks, link {record['link_rate']}, {c['epochs']} epochs x "
        f"{c['steps_per_epoch']} steps, batch {c['batch_size']}/rank, seed {c['seed']}"
    )


def _table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["policy"] == "none"), results[0])
    rows = [
        [
            r["policy"],
            round(r["accuracy"], 2),
            round(r["final_loss"], 4),
            round(r["step_ms"], 2),
            r["bytes_per_step"],
            round(base["bytes_per_step"] / max(r["bytes_per_step"], 1), 2),
            " ".join(str(b) for b in r["bits"]),
        ]
        for r in results
    ]
    headers = ["policy", "accuracy %", "loss", "step ms", "bytes/step/rank", "x less", "bits"]
    return format_table(headers, rows)


# =======================================================================================
# ranks


def _worker(args: argparse.Namespace, policies: list[str]) -> int:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    from ..config import CommConfig
    from ..engine import connect_sync

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != args.world:
        raise RuntimeError(f"launched {world} ranks, --world is {args.world}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share cores
    # The engine straight on a TCPStore at MASTER_ADDR: peers then dial the address that
    # routes to it (the veth of an emulated link), not the host name's.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    cfg = CommConfig(timeout=args.timeout, connect_timeout=min(args.timeout, 120.0))
    comm = connect_sync(store, rank, world, config=cfg)
    try:
        # compile the codec before anything is timed
        warm = np.ones(4096, np.float32)
        comm.allreduce(warm, op="sum", bits=4).result(args.timeout)
        data = _load_data(args.seed)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
        for r in range(args.repeats):
            # rotate the order: on a shared host a policy's place in the run can change its
            # step time more than the policies differ (caches, other processes)
            k = r % len(policies)
            for name in policies[k:] + policies[:k]:
                print(
                    f"{PROGRESS_TAG} rank {rank}: {name} run {r + 1}", file=sys.stderr, flush=True
                )
                runs[name].append(_train_one(name, comm, data, args))
                step_ms = runs[name][-1]["step_ms"]
                print(
                    f"{PROGRESS_TAG} {name} run {r + 1}: {step_ms:.2f} ms/step done",
                    file=sys.stderr,
                    flush=True,
                )
        results = [_combine(runs[name]) for name in policies]
        steps_per_epoch = (len(data[1]) // world) // args.batch_size
        record = {
            "config": {
                "world": world,
                "epochs": args.epochs,
                "steps_per_epoch": steps_per_epoch,
                "batch_size": args.batch_size,
                "lr": args.lr,
                "hidden": args.hidden,
                "seed": args.seed,
                "repeats": args.repeats,
                "schedule": {
                    "warmup": args.warmup,
                    "interval": args.interval,
                    "window": args.window,
                    "check_every": args.check_every,
                },
            },
            "results": results,
        }
        if rank == 0:
            print(RESULT_TAG + json.dumps(record), flush=True)
        comm.barrier().result(args.timeout)  # rank 0's store outlives the others' use
    finally:
        comm.close()
    return 0


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's runs: step time is the median of the runs' means; the rest is run 1's.

    Same seed and data: every policy but auto must give the same accuracy, bits and bytes
    in every run (checked). Auto decides from measurements, which differ between runs;
    its per-run accuracy, bytes and bits are kept.
    """
    import numpy as np

    first = dict(runs[0])
    if first["policy"] == "auto":
        for key in ("accuracy", "bits", "bytes_per_step"):
            first[f"{key}_runs"] = [r[key] for r in runs]
    else:
        for other in runs[1:]:
            for key in ("accuracy", "bits", "bytes_per_step"):
                if other[key] != first[key]:
                    raise RuntimeError(f"{first['policy']}: {key} differs between runs")
    first["step_ms_runs"] = [r["step_ms"] for r in runs]
    first["step_ms"] = float(np.median(first["step_ms_runs"]))
    first["step_ms_median"] = float(np.median([r["step_ms_median"] for r in runs]))
    return first


def _load_data(seed: int) -> tuple[Any, Any, Any, Any]:
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def _make_policy(name: str, params: list[tuple[str, Any]], comm: Any, args: argparse.Namespace):
    from cgx_ucx.agreement import make_link_probe
    from cgx_ucx.compression.policies import Schedule, layers_from_parameters, make_policy

    layers = layers_from_parameters(params)
    sched = Schedule(args.warmup, args.interval, args.window)
    if name == "none":
        return None
    if name == "static":
        return make_policy("static", layers)
    if name in ("kmeans", "budget"):
        return make_policy(name, layers, schedule=sched)
    return make_policy(
        "auto",
        layers,
        world_size=comm.world_size,
        link_probe=make_link_probe(comm, timeout=args.timeout),
        check_every=args.check_every,
    )


def _train_one(name: str, comm: Any, data: Any, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from cgx_ucx.agreement import agree_sync
    from cgx_ucx.compression.policies import AutoPolicy
    from cgx_ucx.layout import Layout

    xtr, ytr, xte, yte = data
    rank, world = comm.rank, comm.world_size
    torch.manual_seed(args.seed)
    h = args.hidden
    model = nn.Sequential(
        nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
        nn.Linear(h, h // 2), nn.ReLU(), nn.Linear(h // 2, 10),
    )  # fmt: skip
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    offsets = np.cumsum([0] + [p.numel() for p in params]).tolist()
    flat = torch.zeros(offsets[-1], dtype=torch.float32)
    flat_np = flat.numpy()
    views = [flat_np[offsets[i] : offsets[i + 1]] for i in range(len(params))]
    policy = _make_policy(name, named, comm, args)
    uncompressed = Layout.uniform(offsets[-1])
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    per_rank = len(ytr) // world
    steps_per_epoch = per_rank // args.batch_size
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total)
    times, sent, last_losses = [], 0, []
    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(args.seed + epoch))
        mine = order[rank * per_rank : (rank + 1) * per_rank]
        for s in range(steps_per_epoch):
            idx = mine[s * args.batch_size : (s + 1) * args.batch_size]
            t0 = time.perf_counter()
            if policy is not None:
                agree_sync(policy, comm, step, timeout=args.timeout)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            for p, v in zip(params, views, strict=True):
                v[:] = p.grad.reshape(-1).numpy()
            if policy is not None:
                policy.observe(step, views)
            flat.div_(world)
            layout = policy.layout() if policy is not None else uncompressed
            before = comm.stats.bytes_sent
            comm.allreduce(flat_np, op="sum", layout=layout).result(args.timeout)
            sent += comm.stats.bytes_sent - before
            for p, i in zip(params, range(len(params)), strict=True):
                p.grad.copy_(flat[offsets[i] : offsets[i + 1]].view_as(p))
            opt.step()
            sched.step()
            dt = time.perf_counter() - t0
            times.append(dt)
            if isinstance(policy, AutoPolicy):
                policy.record_step_time(dt)
            if epoch == args.epochs - 1:
                last_losses.append(float(loss.item()))
            step += 1
    model.eval()
    with torch.no_grad():
        accuracy = float((model(xte).argmax(1) == yte).float().mean().item() * 100.0)
    _check_replicas(comm, params, policy, args.timeout)
    skip = int(len(times) * WARMUP_FRACTION)
    bits = list(policy.current.bits) if policy is not None else [32] * len(params)
    buckets = list(policy.current.bucket_sizes) if policy is not None else [0] * len(params)
    return {
        "policy": name,
        "accuracy": accuracy,
        "final_loss": float(np.mean(last_losses)) if last_losses else float("nan"),
        "step_ms": 1000.0 * float(np.mean(times[skip:])),
        "step_ms_median": 1000.0 * float(np.median(times[skip:])),
        "bytes_per_step": int(sent / max(len(times), 1)),
        "steps": len(times),
        "layers": [n for n, _ in named],
        "numel": [p.numel() for p in params],
        "bits": bits,
        "bucket_sizes": buckets,
        "decisions": policy.decisions if policy is not None else 0,
        "link_bandwidth": getattr(policy, "link_bandwidth", None),
        "codec": (
            None
            if getattr(policy, "codec", None) is None
            else [policy.codec.encode_bps, policy.codec.decode_bps, policy.codec.overhead_s]
        ),
    }


def _check_replicas(comm: Any, params: list[Any], policy: Any, timeout: float) -> None:
    """Every rank must end with rank 0's parameters, bit for bit, and its assignment."""
    import numpy as np

    mine = np.concatenate([p.detach().reshape(-1).numpy() for p in params])
    ref = mine.copy()
    comm.broadcast(ref, root=0).result(timeout)
    if ref.tobytes() != mine.tobytes():
        raise RuntimeError(f"rank {comm.rank}: parameters differ from rank 0's")
    if policy is not None:
        enc = policy.current.encode()
        ref_a = enc.copy()
        comm.broadcast(ref_a, root=0).result(timeout)
        if not np.array_equal(ref_a, enc):
            raise RuntimeError(f"rank {comm.rank}: assignment differs from rank 0's")


if __name__ == "__main__":
    sys.exit(main())
