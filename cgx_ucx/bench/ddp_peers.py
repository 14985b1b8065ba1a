"""``python -m cgx_ucx.bench.ddp_peers``: a DDP step over an emulated slow link, cgx_ucx
next to the gradient compression that ships with PyTorch.

Two ranks, each in its own network namespace, joined by a shaped veth link
(:mod:`cgx_ucx.bench.netns`; needs root and iproute2), train the link benchmark's MLP
(about 22 M parameters at ``--hidden 3072``) with DDP: on CUDA tensors when torch sees a
GPU (both ranks share GPU 0), else on the CPU. One job per method, one after the other
on the same link, with the same model, data and seeds:

- ``gloo``: DDP on gloo, float32, no hook;
- ``fp16``: gloo with ``fp16_compress_hook``;
- ``powersgd1``, ``powersgd4``: gloo with ``powerSGD_hook`` at rank 1 and 4 (error
  feedback and warm start, PyTorch's defaults; compression from the second step on, so
  every timed step is compressed; on CUDA one bucket at a time, see
  :func:`_one_bucket_at_a_time`);
- ``cgx-backend``: DDP on the ``cgx`` backend, every bucket quantized at ``--bits``
  (through the ``CGX_COMPRESSION_*`` variables, as a user of the backend sets them);
- ``cgx-hook``: DDP on ``cgx`` with ``cgx_hook`` at ``--bits`` (layers under 1024
  values, the biases, go uncompressed).

Per method: the median step time after ``--warmup`` untimed steps and the compiles of the
codec kernels they queued (forward, backward and optimizer, the device synchronized), the
bytes each rank's shaped device sent per step, the loss of the trained model on a held-out
batch, and whether the two replicas ended bit-identical (a SHA-256 of every parameter's
bytes, compared across ranks).

On CUDA every rank gets ``UCX_TLS=tcp,cuda_copy``: TCP over the shaped device, device
memory staged through the host. Without it UCX would join the two processes of one GPU
with cuda_ipc and the bytes would never cross the link. gloo's bytes per step are checked
against the ``4 N`` bytes of a two-rank ring allreduce of N float32 values: a run whose
gloo traffic did not cross the link is reported as such, not as a result.

Target: each cgx variant's median step faster than every other method's, its held-out
loss within 1% of gloo's, and the replicas bit-identical for every method.

Prints a table and the line against the target and writes ``ddp_peers.json`` to
``--out-dir`` (see :mod:`cgx_ucx.bench.report`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import CGXError
from .link_worker import end_warmup
from .report import (
    HelpFormatter,
    add_output_args,
    bits_arg,
    count_arg,
    format_table,
    positive_number,
    results_dir,
    write_json,
)

__all__ = ["METHODS", "main", "summarize"]

#: The methods, in the order they run: the baseline first, the cgx variants last.
METHODS = ("gloo", "fp16", "powersgd1", "powersgd4", "cgx-backend", "cgx-hook")
#: The cgx methods the target is about; every other method is a peer they must beat.
CGX_METHODS = ("cgx-backend", "cgx-hook")
#: Held-out loss of a cgx method, relative to gloo's: within this.
LOSS_TOLERANCE = 0.01
#: gloo's bytes per step on the shaped device, as a share of a two-rank ring allreduce's
#: ``4 N``: below this the traffic did not cross the link (Ethernet and TCP headers only
#: add to it).
MIN_GLOO_WIRE_SHARE = 0.9
#: PowerSGD compresses from this iteration on; PyTorch requires more than 1 with error
#: feedback (the first step's plain allreduce seeds the error buffers' shapes).
POWERSGD_START_ITER = 2
#: Layers with fewer values go uncompressed under ``cgx-hook`` (the biases here).
LAYER_MIN_SIZE = 1024
#: What ``cgx-backend`` and ``cgx-hook`` get on CUDA (see the module doc).
CUDA_UCX_TLS = "tcp,cuda_copy"


# ----------------------------------------------------------------------------- one rank


def _tx_bytes() -> int:
    """Bytes this rank's shaped device has sent (the kernel's counter, headers in); -1
    outside the emulator."""
    dev = os.environ.get("CGX_BENCH_LINK_DEVICE", "")
    try:
        return int((Path("/sys/class/net") / dev / "statistics" / "tx_bytes").read_text())
    except (OSError, ValueError):
        return -1


def _digest(params: Any) -> str:
    """SHA-256 of every parameter's bytes, in order (equal on two ranks: identical replicas)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _one_bucket_at_a_time(hook: Any) -> Any:
    """``hook``, with each bucket's collectives started only after the previous bucket's
    have finished. PowerSGD issues its second allreduce from the first one's callback;
    gloo completes CUDA work on its own threads, so with several buckets in flight the
    two ranks issued the collectives of different buckets in different orders (gloo
    aborted: "Received data size doesn't match expected size"). One bucket at a time
    keeps the order the same on every rank; PowerSGD's traffic is a few hundred KiB per
    step, so it loses little overlap."""
    last: list[Any] = [None]

    @functools.wraps(hook)  # DDP checks the hook's signature (GradBucket -> Future)
    def serialized(state: Any, bucket: Any) -> Any:
        if last[0] is not None:
            last[0].wait()
        last[0] = hook(state, bucket)
        return last[0]

    return serialized


def _register_hook(ddp: Any, method: str, args: argparse.Namespace, cuda: bool) -> Any:
    """Register ``method``'s comm hook on ``ddp``; returns its state (None: no hook)."""
    if method == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if method.startswith("powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(method.removeprefix("powersgd")),
            start_powerSGD_iter=POWERSGD_START_ITER,
        )
        hook = powerSGD_hook.powerSGD_hook
        if cuda:
            hook = _one_bucket_at_a_time(hook)
        ddp.register_comm_hook(state, hook)
        return state
    if method == "cgx-hook":
        from .. import torch as cgx_torch

        state = cgx_torch.CGXState(
            None,
            layer_min_size=LAYER_MIN_SIZE,
            compression_params={"bits": args.bits, "bucket_size": args.bucket_size},
        )
        ddp.register_comm_hook(state, cgx_torch.cgx_hook)
        return state
    return None


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One rank's training job for ``args.worker`` (the method); its record."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .link_worker import _mlp_and_data

    method = args.worker
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "cgx" if method in CGX_METHODS else "gloo"
    if method == "cgx-backend":
        os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = str(args.bits)
        os.environ["CGX_COMPRESSION_BUCKET_SIZE"] = str(args.bucket_size)
    if backend == "cgx":
        from .. import torch as _cgx_torch  # noqa: F401  (registers the "cgx" backend)
    dist.init_process_group(
        backend, init_method="env://", timeout=datetime.timedelta(seconds=args.timeout)
    )
    model, loss_fn, data, (xe, ye) = _mlp_and_data(args, rank)
    model = model.to(dev)
    data = [(x.to(dev), y.to(dev)) for x, y in data]
    ddp = DDP(model, device_ids=[0] if cuda else None)
    _register_hook(ddp, method, args, cuda)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    times: list[float] = []
    losses: list[float] = []
    tx_start = 0
    for step, (x, y) in enumerate(data):
        if step == args.warmup:
            sync()
            end_warmup(args.timeout)
            tx_start = _tx_bytes()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()  # DDP waits here for the last bucket's allreduce
        opt.step()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    tx_end = _tx_bytes()
    with torch.no_grad():
        eval_loss = float(loss_fn(model(xe.to(dev)), ye.to(dev)))
    digest = _digest(model.parameters())
    dist.destroy_process_group()
    return {
        "rank": rank,
        "method": method,
        "backend": backend,
        "device": str(dev),
        "params": sum(p.numel() for p in model.parameters()),
        "step_times": times,
        "losses": losses,
        "eval_loss": eval_loss,
        "param_sha256": digest,
        "tx_bytes_per_step": (tx_end - tx_start) / args.steps if tx_start >= 0 else None,
    }


# ----------------------------------------------------------------------------- summary


def _method_row(method: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's figures from its ranks' records: the slowest rank's median step."""
    per_rank = [statistics.median(r["step_times"]) for r in ranks if r["step_times"]]
    tx = [r["tx_bytes_per_step"] for r in ranks]
    return {
        "method": method,
        "params": ranks[0]["params"],
        "step_s": max(per_rank) if per_rank else None,
        "step_s_per_rank": per_rank,
        "tx_bytes_per_step": tx if all(t is not None for t in tx) else None,
        "eval_loss": ranks[0]["eval_loss"],
        "eval_loss_per_rank": [r["eval_loss"] for r in ranks],
        "final_train_loss": ranks[0]["losses"][-1] if ranks[0]["losses"] else None,
        "replicas_equal": len({r["param_sha256"] for r in ranks}) == 1,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speedups over gloo and the verdict against the target (see the module doc).

    ``rows`` are :func:`_method_row` records, or ``{"method", "error"}`` for a method that
    failed. Adds ``speedup`` (gloo's step time / the method's) and ``loss_vs_gloo`` to
    each row in place and returns ``{"met", "text", "checks"}``."""
    done = {r["method"]: r for r in rows if r.get("step_s")}
    gloo = done.get("gloo")
    for r in done.values():
        r["speedup"] = gloo["step_s"] / r["step_s"] if gloo else None
        r["loss_vs_gloo"] = r["eval_loss"] / gloo["eval_loss"] - 1 if gloo else None
    checks: dict[str, bool] = {}
    notes = []
    failed = [r["method"] for r in rows if r["method"] not in done]
    if failed:
        notes.append("failed: " + ", ".join(failed))
    checks["all methods ran"] = not failed
    if gloo is None:
        return {"met": False, "text": "no gloo baseline; " + "; ".join(notes), "checks": checks}
    tx = gloo["tx_bytes_per_step"]
    wire = min(tx) / (4 * gloo["params"]) if tx else None
    checks["gloo crossed the link"] = wire is not None and wire >= MIN_GLOO_WIRE_SHARE
    if not checks["gloo crossed the link"]:
        notes.append(
            "gloo sent " + ("no counted bytes" if wire is None else f"{wire:.2f}x 4N bytes")
            + " over the shaped device: the link was bypassed"
        )  # fmt: skip
    checks["replicas equal"] = all(r["replicas_equal"] for r in done.values())
    if not checks["replicas equal"]:
        notes.append(
            "replicas differ: " + ", ".join(m for m, r in done.items() if not r["replicas_equal"])
        )
    peers = {m: r for m, r in done.items() if m not in CGX_METHODS}
    best_peer = min(peers.values(), key=lambda r: r["step_s"])
    parts = []
    for m in CGX_METHODS:
        r = done.get(m)
        if r is None:
            checks[f"{m} ran"] = False
            continue
        beaten = all(r["step_s"] < p["step_s"] for p in peers.values())
        checks[f"{m} faster than every peer"] = beaten
        checks[f"{m} loss within {100 * LOSS_TOLERANCE:g}%"] = (
            abs(r["loss_vs_gloo"]) <= LOSS_TOLERANCE
        )
        parts.append(
            f"{m} {1e3 * r['step_s']:.1f} ms ({r['speedup']:.2f}x gloo, "
            f"loss {100 * r['loss_vs_gloo']:+.2f}%)"
        )
    met = all(checks.values())
    text = (
        ", ".join(parts)
        + f"; best peer {best_peer['method']} {1e3 * best_peer['step_s']:.1f} ms, "
        + f"gloo {1e3 * gloo['step_s']:.1f} ms"
        + (f"; {'; '.join(notes)}" if notes else "")
        + (": met" if met else ": MISSED")
    )
    return {"met": met, "text": text, "checks": checks}


def _table(rows: list[dict[str, Any]]) -> str:
    headers = ["method", "step ms", "x gloo", "MiB/step/rank", "eval loss", "vs gloo", "replicas"]
    out = []
    for r in rows:
        if not r.get("step_s"):
            out.append([r["method"], "failed", "-", "-", "-", "-", "-"])
            continue
        tx = r["tx_bytes_per_step"]
        out.append(
            [
                r["method"],
                1e3 * r["step_s"],
                r["speedup"] if r.get("speedup") is not None else "-",
                "/".join(f"{t / (1 << 20):.2f}" for t in tx) if tx else "-",
                r["eval_loss"],
                f"{100 * r['loss_vs_gloo']:+.2f}%" if r.get("loss_vs_gloo") is not None else "-",
                "equal" if r["replicas_equal"] else "DIFFER",
            ]
        )
    return format_table(headers, out)


# ----------------------------------------------------------------------------- driver


def _methods_arg(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {bad or text!r}: choose from {','.join(METHODS)}"
        )
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench.ddp_peers",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--rate", default="1gbit", help="link rate per direction, e.g. 1gbit")
    p.add_argument(
        "--methods", type=_methods_arg, default=list(METHODS), help="comma-separated subset"
    )
    p.add_argument(
        "--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if seen"
    )
    p.add_argument("--bits", type=bits_arg, default=4, help="cgx methods' bits")
    p.add_argument("--bucket-size", type=count_arg(), default=1024)
    p.add_argument("--steps", type=count_arg(), default=10, help="timed steps")
    p.add_argument(
        "--warmup",
        type=count_arg(POWERSGD_START_ITER),
        default=3,
        help=f"untimed steps first (at least {POWERSGD_START_ITER}: PowerSGD's plain steps)",
    )
    p.add_argument("--batch", type=count_arg(), default=32, help="per rank")
    p.add_argument("--input", type=count_arg(), default=1024, help="MLP input width")
    p.add_argument("--hidden", type=count_arg(), default=3072, help="MLP width (3072: ~22 M)")
    p.add_argument("--layers", type=count_arg(), default=3, help="hidden layers")
    p.add_argument("--classes", type=count_arg(2), default=10)
    p.add_argument("--lr", type=positive_number, default=0.02)
    p.add_argument("--probe-seconds", type=positive_number, default=1.0)
    p.add_argument("--timeout", type=positive_number, default=300.0, help="seconds per job")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    add_output_args(p)
    return p


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_method(
    link: Any, method: str, args: argparse.Namespace, device: str, tmp: Path
) -> dict[str, Any]:
    """One method's job on both ranks; its row, or ``{"method", "error"}``."""
    prefix = tmp / method
    argv = [sys.executable, "-m", "cgx_ucx.bench.ddp_peers", "--worker", method]
    argv += ["--device", device, "--worker-out", str(prefix)]
    for name in ("bits", "bucket_size", "steps", "warmup", "batch", "input", "hidden"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("layers", "classes", "lr", "timeout"):
        argv += [f"--{name}", str(getattr(args, name))]
    env = {"NUMBA_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    if device == "cuda":
        env["UCX_TLS"] = CUDA_UCX_TLS
    try:
        link.run_ranks(argv, timeout=args.timeout, env=env)
        ranks = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(2)]
    except (CGXError, OSError, ValueError) as exc:
        return {"method": method, "error": str(exc)}
    return _method_row(method, ranks)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        record = _worker(args)
        path = Path(f"{args.worker_out}.rank{record['rank']}.json")
        path.write_text(json.dumps(record))
        return 0
    from .netns import LinkEmulator, missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        print("link emulation needs " + ", ".join(missing), file=sys.stderr)
        return 2
    device = _device(args.device)
    out_dir = results_dir(args)
    settings = {k: v for k, v in vars(args).items() if not k.startswith("worker")}
    rows: list[dict[str, Any]] = []

    def save(link: Any, probe: Any) -> tuple[Path, dict[str, Any]]:
        # Written after every method: a run stopped from outside keeps what it measured.
        verdict = summarize(rows)
        if len(rows) < len(args.methods):
            verdict["met"] = False
            verdict["text"] += f" (only {len(rows)} of {len(args.methods)} methods ran)"
        record = {
            "settings": settings,
            "device": device,
            "link": link.describe(),
            "tcp_probe": {"bits_per_s": probe.bits_per_s, "fraction": probe.fraction_of_rate},
            "rows": rows,
            "headline": [{"case": f"DDP step, 2 ranks, {args.rate}, {device}", **verdict}],
        }
        return write_json("ddp_peers", record, out_dir), verdict

    with tempfile.TemporaryDirectory(prefix="cgx-ddp-") as tmp, LinkEmulator(2, args.rate) as link:
        probe = link.measure_tcp(0, 1, seconds=args.probe_seconds)
        print(f"link {args.rate}: raw TCP {probe.bits_per_s / 1e9:.3f} Gbit/s; device {device}")
        for method in args.methods:
            start = time.monotonic()
            row = _run_method(link, method, args, device, Path(tmp))
            took = time.monotonic() - start
            shown = f"{1e3 * row['step_s']:.1f} ms/step" if row.get("step_s") else "FAILED"
            print(f"  {method}: {shown} ({took:.0f} s)", flush=True)
            if "error" in row:
                print(row["error"], file=sys.stderr)
            rows.append(row)
            path, verdict = save(link, probe)
    print(_table(rows))
    print(f"\nAgainst the target: {verdict['text']}")
    print(f"JSON: {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
