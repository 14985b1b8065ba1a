"""One rank of the link benchmark; started by :mod:`cgx_ucx.bench.link` inside a namespace.

Not a command for users: it expects the environment :meth:`LinkEmulator.rank_env` sets
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, CGX_BENCH_LINK_DEVICE, UCX_TLS=tcp, ...).

``allreduce``: for every size, gloo's all_reduce and cgx_ucx's allreduce at every bit width
on the same buffers in the same processes, one after the other, each iteration started by a
barrier (the ranks agree on the number of iterations). Per iteration the rank records its
wall time and the bytes its shaped device sent (``/sys/class/net/<dev>/statistics/
tx_bytes``: what really went on the wire). The first
iteration of each (size, method) is a warm-up, kept out of the timing and used to check the
numbers: gloo's result is the reference; cgx_ucx's error against it is recorded. The
warm-up ends when the codec kernels it queued are compiled: timed calls measure the steady
state, not the NumPy reference that runs meanwhile (``bench latency --cold`` measures
first calls).

``train``: DDP on an MLP of tens of millions of parameters, either on gloo or on the ``cgx``
backend with ``cgx_hook``; step times, wire bytes per step, the loss curve and the loss of
the trained model on a fixed held-out batch.

``fsdp``: FSDP2 (``fully_shard`` per Linear on a CPU device mesh) on the same MLP and data,
on gloo or on ``cgx`` with the gradient reduce-scatter at ``--bits``; step times, wire bytes
per step (and on cgx the communicator's bytes and collectives per step), the held-out loss.

For the nodes layout (:mod:`cgx_ucx.bench.nodes`): ``allreduce --algorithms sra
hierarchical`` runs cgx_ucx once per algorithm at every bit width (methods
``cgx<bits>-<algorithm>``), and ``--iface-counters`` records, around each method's timed
loop (after barriers on both sides), the byte counters of every interface of the rank's
namespace: in the nodes layout that namespace is the rank's node, so the shaped device's
counter is the node's cross-node traffic and ``lo`` its node-local TCP. ``train
--algorithm flat|hierarchical`` routes DDP's buckets through that scheme.

Every rank writes ``<out>.rank<r>.json``; the driver merges them (max over ranks per
iteration). Rank 0 prints ``@progress <json>`` lines on stderr for the driver's progress bar.
Only ``codec`` (in-process, on rank 0 while the others wait) needs no network.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: Prefix of the lines the driver's progress bar reads.
PROGRESS = "@progress "


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        sys.exit(f"link_worker: {name} must be set to an integer (run by cgx_ucx.bench.link)")


def end_warmup(timeout: float) -> None:
    """End a training benchmark's warm-up on every rank of the default group: wait until
    the codec kernels its steps queued are compiled (timed steps then run them, not the
    NumPy reference), then a barrier, so that no rank's first timed step waits for
    another's compile."""
    import torch.distributed as dist

    from ..compression.kernels import settle

    settle(timeout)
    dist.barrier()


def _tx_bytes() -> int:
    """Bytes this rank's shaped device has sent (the kernel's counter, Ethernet headers in)."""
    dev = os.environ.get("CGX_BENCH_LINK_DEVICE", "")
    path = Path("/sys/class/net") / dev / "statistics" / "tx_bytes"
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1  # outside the emulator: the driver then has no wire-byte check to offer


def _iface_bytes() -> dict[str, list[int]]:
    """``{ifname: [tx_bytes, rx_bytes]}`` of every interface this process's namespace sees."""
    out: dict[str, list[int]] = {}
    root = Path("/sys/class/net")
    for dev in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            tx = int((dev / "statistics" / "tx_bytes").read_text())
            rx = int((dev / "statistics" / "rx_bytes").read_text())
        except (OSError, ValueError):
            continue
        out[dev.name] = [tx, rx]
    return out


def _iface_delta(after: dict[str, list[int]], before: dict[str, list[int]]) -> dict[str, list]:
    return {
        dev: [tx - before.get(dev, [0, 0])[0], rx - before.get(dev, [0, 0])[1]]
        for dev, (tx, rx) in after.items()
    }


def _wakeups() -> int:
    """Runs of this loop's UCX progress driver so far (0 before one exists)."""
    from ..transport.progress import driver

    drv = driver(asyncio.get_running_loop())
    return drv.wakeups if drv is not None else 0


def _progress(rank: int, **fields: Any) -> None:
    if rank == 0:
        print(PROGRESS + json.dumps(fields), file=sys.stderr, flush=True)


def _store(rank: int, world: int, timeout: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT"),
        world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _write(out: str, rank: int, record: dict[str, Any]) -> None:
    path = Path(f"{out}.rank{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


# ----------------------------------------------------------------------------- codec


def _codec_rates(bits_list: list[int], bucket: int, numel: int) -> dict[str, dict[str, float]]:
    """Single-core codec throughput (values/s) per bit width: encode, decode, decode_add.

    One Numba thread, so the driver can scale it by the cores each rank really has while
    all ranks run their codecs at once on the cores they share.
    """
    import numba

    from ..compression import decode, decode_add, encode, encoded_nbytes

    saved = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        x = np.random.default_rng(7).standard_normal(numel, dtype=np.float32)
        acc = np.zeros_like(x)
        rates: dict[str, dict[str, float]] = {}
        for bits in bits_list:
            if bits == 32:
                continue
            buf = np.empty(encoded_nbytes(numel, bits, bucket), dtype=np.uint8)
            enc = encode(x, bits, bucket, out=buf)  # warm-up: compiles
            decode(enc, out=acc)
            decode_add(enc, acc)
            best = {"encode": np.inf, "decode": np.inf, "decode_add": np.inf}
            for _ in range(3):
                t0 = time.perf_counter()
                enc = encode(x, bits, bucket, out=buf)
                t1 = time.perf_counter()
                decode(enc, out=acc)
                t2 = time.perf_counter()
                decode_add(enc, acc)
                t3 = time.perf_counter()
                best["encode"] = min(best["encode"], t1 - t0)
                best["decode"] = min(best["decode"], t2 - t1)
                best["decode_add"] = min(best["decode_add"], t3 - t2)
            rates[str(bits)] = {k: numel / v for k, v in best.items()}
        return rates
    finally:
        numba.set_num_threads(saved)


# ----------------------------------------------------------------------------- allreduce


async def _auto_probe(comm: Any, bits_list: list[int], args: argparse.Namespace) -> dict:
    """What the ``auto`` policy's link probe measures on this link, per compressed width
    (``[bandwidth, encode_bps, decode_bps, overhead_s]``, this rank's view): the driver
    averages the ranks', as the policy does, to say which width it would pick per size."""
    from ..agreement import make_link_probe

    out = {}
    for bits in bits_list:
        if bits != 32:
            _progress(comm.rank, phase=f"auto-policy probe, {bits} bits")
            probe = make_link_probe(
                comm, bits=bits, bucket_size=args.bucket_size, timeout=args.timeout
            )
            out[str(bits)] = [float(v) for v in await probe()]
    return out


async def _allreduce_job(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ..compression.kernels import settle as settle_kernels

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = _store(rank, world, args.timeout)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("gloo", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    comm = None
    cgx_bits = [b for b in args.bits]
    if cgx_bits:
        from ..collectives import connect

        # The TCPStore itself (its keys live under "cgx/"): the engine finds the address
        # peers dial from the store's host, i.e. this rank's veth address.
        comm = await asyncio.wait_for(connect(store, rank, world), args.timeout)

    async def barrier() -> None:
        await asyncio.wait_for(asyncio.to_thread(dist.barrier), args.timeout)

    async def agree(want: bool) -> bool:
        """A barrier that also agrees on going on: one more iteration if any rank wants it.

        The budget is wall time, which ranks see differently; deciding alone, one rank
        would wait in an iteration its peers never start.
        """
        flag = torch.tensor([int(want)], dtype=torch.int32)
        await asyncio.wait_for(
            asyncio.to_thread(dist.all_reduce, flag, op=dist.ReduceOp.MAX), args.timeout
        )
        return bool(flag.item())

    record: dict[str, Any] = {"rank": rank, "world_size": world, "results": []}
    record["local_rank"] = int(os.environ.get("LOCAL_RANK", "0"))
    record["group_rank"] = int(os.environ.get("GROUP_RANK", str(rank)))
    if comm is not None:
        record.update(_topology_record(comm))
    if rank == 0 and cgx_bits and args.codec_numel > 0:
        _progress(rank, phase="codec")
        record["codec_rates"] = _codec_rates(cgx_bits, args.bucket_size, args.codec_numel)
    if comm is not None:
        record["auto_probe"] = await _auto_probe(comm, cgx_bits, args)
    await barrier()
    methods = ["gloo"] if not args.no_gloo else []
    if args.algorithms:
        methods += [f"cgx{b}-{alg}" for b in cgx_bits for alg in args.algorithms]
    else:
        methods += [f"cgx{b}" for b in cgx_bits]
    rng = np.random.default_rng(1000 + rank)
    try:
        for size in args.sizes:
            numel = size // 4
            x0 = rng.standard_normal(numel, dtype=np.float32)
            buf = np.empty_like(x0)
            tbuf = torch.from_numpy(buf)
            ref: np.ndarray | None = None
            for method in methods:
                times: list[float] = []
                cpu: list[float] = []  # this process's CPU seconds (all threads) per call
                wakes: list[int] = []  # the UCX progress driver's runs per call
                wire: list[int] = []
                err: dict[str, Any] = {}
                iface0: dict[str, list[int]] | None = None
                start = time.monotonic()
                it = 0
                while await agree(
                    it <= args.min_iters
                    or (it <= args.max_iters and time.monotonic() - start < args.budget)
                ):
                    buf[:] = x0
                    if it == 1 and args.iface_counters:
                        # Every rank is done with the warm-up: nothing of it is in flight.
                        await barrier()
                        iface0 = _iface_bytes()
                    await barrier()
                    tx0 = _tx_bytes()
                    w0 = _wakeups()
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    if method == "gloo":
                        await asyncio.wait_for(
                            asyncio.to_thread(dist.all_reduce, tbuf), args.timeout
                        )
                    else:
                        bits, _, alg = method[3:].partition("-")
                        await asyncio.wait_for(
                            comm.allreduce(
                                buf,
                                op="sum",
                                bits=int(bits),
                                bucket_size=args.bucket_size,
                                algorithm=alg or "auto",
                            ),
                            args.timeout,
                        )
                    dt = time.perf_counter() - t0
                    dc = time.process_time() - c0
                    tx = _tx_bytes() - tx0
                    if it == 0:  # warm-up: check the numbers instead of timing
                        if method == "gloo":
                            ref = buf.copy()
                        else:
                            if ref is not None:
                                err = _error(buf, ref)
                            await asyncio.to_thread(settle_kernels, args.timeout)
                    else:
                        times.append(dt)
                        cpu.append(dc)
                        wire.append(tx)
                        wakes.append(_wakeups() - w0)
                    it += 1
                if iface0 is not None:
                    # agree() ended the loop: every rank has finished its last call.
                    err["iface_bytes"] = _iface_delta(_iface_bytes(), iface0)
                record["results"].append(
                    {
                        "size": size,
                        "method": method,
                        "times": times,
                        "cpu_s": cpu,
                        "wakeups": wakes,
                        "tx_bytes": wire,
                        **err,
                    }
                )
                _progress(rank, phase="allreduce", size=size, method=method, median=_median(times))
            del x0, buf, tbuf, ref
    finally:
        if comm is not None:
            await asyncio.wait_for(_maybe_await(comm.close()), args.timeout)
        dist.destroy_process_group()
    return record


def _topology_record(comm: Any) -> dict[str, Any]:
    """What the communicator learned: its topology, the scheme "auto" runs on it, and the
    transport of each level (so a report can show that two levels really ran)."""
    transport = comm.transport
    topology = getattr(transport, "topology", None)
    hierarchy = getattr(transport, "hierarchy", None)
    stats = getattr(transport, "stats", None)
    out: dict[str, Any] = {}
    if topology is not None:
        out["topology"] = topology.describe()
        if hierarchy is not None:
            out["plan"] = hierarchy.plan(topology)
    if stats is not None:
        out["levels"] = dict(getattr(stats, "levels", {}) or {})
    return out


async def _maybe_await(x: Any) -> Any:
    return await x if asyncio.iscoroutine(x) or isinstance(x, asyncio.Future) else x


def _median(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def _error(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    diff = got.astype(np.float64) - ref
    norm = float(np.linalg.norm(ref)) or 1.0
    return {
        "max_abs_err": float(np.max(np.abs(diff))) if diff.size else 0.0,
        "rel_l2_err": float(np.linalg.norm(diff)) / norm,
        "finite": bool(np.isfinite(got).all()),
    }


# ----------------------------------------------------------------------------- training


class _SchemeCommunicator:
    """The synchronous communicator with DDP's buckets pinned to one scheme.

    ``algorithm`` is what each bucket's allreduce asks for ("sra": flat, "hierarchical":
    two levels). Buckets small enough for the one-round path keep "auto"'s choice (flat
    either way), as they do without the pin, so flat and hierarchical differ only where
    the schemes do. Everything else is the wrapped communicator's.
    """

    def __init__(self, comm: Any, algorithm: str, world: int) -> None:
        from ..collectives.allreduce import oneshot_max_bytes

        self.comm = comm
        self.algorithm = algorithm
        self.one_round_bytes = oneshot_max_bytes(world)

    def allreduce(self, x: Any, op: str = "sum", **kwargs: Any) -> Any:
        if "algorithm" not in kwargs and getattr(x, "nbytes", 0) > self.one_round_bytes:
            kwargs["algorithm"] = self.algorithm
        return self.comm.allreduce(x, op, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)


def _init_group(args: argparse.Namespace) -> None:
    """The default group on ``args.backend`` (``cgx`` registered first), bounded by the
    job's timeout."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.timeout)
    if args.backend == "cgx":
        from .. import torch as _cgx_torch  # noqa: F401  (registers the "cgx" backend)

    dist.init_process_group(args.backend, init_method="env://", timeout=timeout)


def _mlp_and_data(args: argparse.Namespace, rank: int) -> tuple[Any, Any, list, tuple]:
    """The benchmark's MLP (same seed on every rank), its loss, each step's batch of this
    rank (a teacher network labels random inputs) and the held-out batch.

    DDP and FSDP jobs build the very same model and data, so their losses compare.
    """
    import torch
    from torch import nn

    def mlp(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = args.input
        for _ in range(args.layers):
            layers += [nn.Linear(width, args.hidden), nn.ReLU()]
            width = args.hidden
        layers.append(nn.Linear(width, args.classes))
        return nn.Sequential(*layers)

    model = mlp(0)
    with torch.no_grad():
        teacher = nn.Sequential(nn.Linear(args.input, 256), nn.Tanh(), nn.Linear(256, args.classes))
        torch.manual_seed(1)
        for p in teacher.parameters():
            p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)

    def batch(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, args.input, generator=g)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        return x, y

    data = [batch(10_000 * (rank + 1) + s, args.batch) for s in range(args.warmup + args.steps)]
    return model, nn.CrossEntropyLoss(), data, batch(999_999, 2048)


def _train_job(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _init_group(args)
    model, loss_fn, data, (xe, ye) = _mlp_and_data(args, rank)
    ddp = DDP(model)
    if args.backend == "cgx":
        from .. import torch as cgx_torch

        communicator = None
        if args.algorithm != "auto":
            pinned = {"flat": "sra", "hierarchical": "hierarchical"}[args.algorithm]
            communicator = _SchemeCommunicator(cgx_torch.get_communicator(), pinned, world)
        state = cgx_torch.CGXState(
            None,
            layer_min_size=1024,
            compression_params={"bits": args.bits, "bucket_size": args.bucket_size},
            communicator=communicator,
        )
        ddp.register_comm_hook(state, cgx_torch.cgx_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    nparams = sum(p.numel() for p in model.parameters())
    times: list[float] = []
    phases: list[tuple[float, float, float]] = []  # forward, backward (+ waiting), optimizer
    losses: list[float] = []
    tx_start = 0
    iface_start: dict[str, list[int]] = {}
    for step, (x, y) in enumerate(data):
        if step == args.warmup:
            end_warmup(args.timeout)
            tx_start = _tx_bytes()
            iface_start = _iface_bytes()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()  # DDP waits here for the last bucket's allreduce
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        losses.append(float(loss))
        if step >= args.warmup:
            times.append(t3 - t0)
            phases.append((t1 - t0, t2 - t1, t3 - t2))
        _progress(
            rank,
            phase="train",
            backend=args.backend,
            algorithm=args.algorithm,
            step=step + 1,
            of=len(data),
        )
    tx = _tx_bytes() - tx_start if tx_start >= 0 else -1
    iface = _iface_delta(_iface_bytes(), iface_start)
    with torch.no_grad():
        eval_loss = float(loss_fn(model(xe), ye))
        digest = float(sum(p.double().sum() for p in model.parameters()))
    dist.destroy_process_group()
    return {
        "rank": rank,
        "world_size": world,
        "backend": args.backend,
        "algorithm": args.algorithm if args.backend == "cgx" else None,
        "bits": args.bits if args.backend == "cgx" else 32,
        "params": nparams,
        "step_times": times,
        "forward_s_mean": float(np.mean([p[0] for p in phases])) if phases else None,
        "backward_s_mean": float(np.mean([p[1] for p in phases])) if phases else None,
        "optimizer_s_mean": float(np.mean([p[2] for p in phases])) if phases else None,
        "losses": losses,
        "eval_loss": eval_loss,
        "param_digest": digest,
        "tx_bytes_per_step": tx / args.steps if tx >= 0 else None,
        "iface_bytes_per_step": {d: [v / args.steps for v in tr] for d, tr in iface.items()},
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "group_rank": int(os.environ.get("GROUP_RANK", str(rank))),
    }


def _fsdp_job(args: argparse.Namespace) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on a CPU device mesh of the world group) on the DDP job's MLP
    and data: per step, the parameters are all-gathered (exact on either backend) and the
    gradients reduce-scattered (on cgx with compression on, quantized at ``--bits``).

    Each Linear is its own FSDP unit, gathered just before it runs, as FSDP2 is used.
    Records the step times, rank 0's loss curve, the held-out loss of the trained model,
    the shaped device's bytes per timed step and, on cgx, the communicator's own
    bytes and collectives per timed step.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.backend == "cgx":
        # Through the environment, read when each collective starts: it reaches whatever
        # group the device mesh uses (a cgx group made for the mesh gets no pg_options).
        os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = str(args.bits)
        os.environ["CGX_COMPRESSION_BUCKET_SIZE"] = str(args.bucket_size)
    _init_group(args)
    model, loss_fn, data, (xe, ye) = _mlp_and_data(args, rank)
    nparams = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    comm = None
    if args.backend == "cgx":
        from .. import torch as cgx_torch

        comm = cgx_torch.get_communicator(mesh.get_group())
    times: list[float] = []
    losses: list[float] = []
    tx_start = 0
    stats_start = None
    for step, (x, y) in enumerate(data):
        if step == args.warmup:
            end_warmup(args.timeout)
            tx_start = _tx_bytes()
            stats_start = comm.stats if comm is not None else None
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # the gradients' reduce-scatter completes here
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        _progress(rank, phase="fsdp", backend=args.backend, bits=args.bits, step=step + 1,
                  of=len(data))  # fmt: skip
    tx = _tx_bytes() - tx_start if tx_start >= 0 else -1
    record: dict[str, Any] = {}
    if comm is not None and stats_start is not None:
        end = comm.stats
        record["cgx_bytes_sent_per_step"] = (end.bytes_sent - stats_start.bytes_sent) / args.steps
        record["cgx_collectives_per_step"] = {
            name: (n - stats_start.by_collective.get(name, 0)) / args.steps
            for name, n in end.by_collective.items()
            if n != stats_start.by_collective.get(name, 0)
        }
    with torch.no_grad():  # every rank evaluates (FSDP gathers the parameters)
        eval_loss = float(loss_fn(model(xe), ye))
    dist.destroy_process_group()
    return {
        "rank": rank,
        "world_size": world,
        "backend": args.backend,
        "bits": args.bits if args.backend == "cgx" else 32,
        "params": nparams,
        "step_times": times[args.warmup :],
        "losses": losses,
        "eval_loss": eval_loss,
        "tx_bytes_per_step": tx / args.steps if tx >= 0 else None,
        **record,
    }


# ----------------------------------------------------------------------------- main


#: Options of the training jobs (DDP and FSDP train the same model on the same data).
_MODEL_ARGS: list[tuple[str, int | float]] = [
    ("--bucket-size", 1024),
    ("--steps", 20),
    ("--warmup", 3),
    ("--batch", 8),
    ("--input", 1024),
    ("--hidden", 3072),
    ("--layers", 3),
    ("--classes", 10),
    ("--lr", 0.02),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgx_ucx.bench.link_worker")
    sub = parser.add_subparsers(dest="job", required=True)
    ar = sub.add_parser("allreduce")
    ar.add_argument("--sizes", type=int, nargs="+", required=True, help="bytes")
    ar.add_argument("--bits", type=int, nargs="*", default=[])
    ar.add_argument("--no-gloo", action="store_true")
    ar.add_argument("--algorithms", nargs="*", default=[], help="cgx algorithms, e.g. sra")
    ar.add_argument("--iface-counters", action="store_true", help="counters per timed loop")
    ar.add_argument("--bucket-size", type=int, default=1024)
    ar.add_argument("--min-iters", type=int, default=3)
    ar.add_argument("--max-iters", type=int, default=20)
    ar.add_argument("--budget", type=float, default=3.0, help="seconds per (size, method)")
    ar.add_argument("--codec-numel", type=int, default=1 << 22, help="0: no codec rates")
    tr = sub.add_parser("train")
    tr.add_argument("--backend", choices=["gloo", "cgx"], required=True)
    tr.add_argument("--bits", type=int, default=4)
    tr.add_argument("--algorithm", choices=["auto", "flat", "hierarchical"], default="auto")
    for name, default in _MODEL_ARGS:
        tr.add_argument(name, type=type(default), default=default)
    fs = sub.add_parser("fsdp")
    fs.add_argument("--backend", choices=["gloo", "cgx"], required=True)
    fs.add_argument("--bits", type=int, default=4, help="cgx: the reduce-scatter's bits")
    for name, default in _MODEL_ARGS:
        fs.add_argument(name, type=type(default), default=default)
    for p in (ar, tr, fs):
        p.add_argument("--out", required=True, help="path prefix of the per-rank JSON")
        p.add_argument("--timeout", type=float, default=300.0, help="seconds any wait may take")
    args = parser.parse_args(argv)
    rank = _env_int("RANK")
    if args.job == "allreduce":
        record = asyncio.run(_allreduce_job(args))
    elif args.job == "fsdp":
        record = _fsdp_job(args)
    else:
        record = _train_job(args)
    _write(args.out, rank, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
