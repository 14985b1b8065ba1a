"""``python -m cgx_ucx.bench link``: cgx_ucx against gloo on emulated commodity links.

CGX's claim (Markov et al., Middleware 2022) is speed on slow links. This command builds such
links on one machine (:mod:`cgx_ucx.bench.netns`: one network namespace per rank, veth,
``tc tbf`` at the asked rate; needs root and iproute2) and measures, side by side on the
same links in one run:

1. allreduce, float32, 1-256 MiB: cgx_ucx at each bit width against torch.distributed gloo
   in the same processes: median time, algorithm bandwidth (bytes / time), speedup over
   gloo, the bytes each rank's device really sent, and the error against gloo's result;
2. with ``--train``: DDP training of an MLP (about 22 M parameters) on gloo against DDP +
   ``cgx_hook`` on the ``cgx`` backend: mean step time, wire bytes per step, the loss curve
   and the loss of the trained model on a held-out batch. The per-rank batch is 8: a CPU
   core computes this MLP far slower than a GPU, so small batches keep the ratio of
   compute to communication near that of a GPU, the setting CGX is about;
3. with ``--fsdp``: FSDP2 (``fully_shard`` per Linear on a CPU device mesh of the world
   group) on the same MLP and data, gloo against the ``cgx`` backend at each
   ``--fsdp-bits``: the parameter all-gathers stay exact, the gradient reduce-scatter is
   quantized (DeepSpeed ZeRO++ qgZ's idea). Median step time after warm-up, the bytes each
   rank's device sent per step next to the model's, cgx's own count, the held-out loss;
4. the lower bound of each case: ``max(wire bytes / link rate, codec time)``. Wire bytes are
   the bandwidth-optimal ``2 (N-1)/N`` times the encoded buffer per rank less the token
   bucket's burst (which passes at line speed), the rate is the
   TCP payload rate measured across the same link in the same run, and the codec time is
   what the quantize / dequantize work of one rank takes at the single-core throughput
   measured in the same run, divided by the cores each rank has while all encode at once.
   ``x bound`` = measured time / lower bound: 1.0 would be perfect overlap of codec and wire.

Honesty checks (:mod:`cgx_ucx.bench.link_checks`); the command refuses to report (exit 3)
when one fails:

- the raw TCP probe must not exceed the shaped rate (else traffic is not crossing the link);
- every uncompressed allreduce (gloo, cgx32) must take at least the time its minimal bytes
  need at the shaped rate (less the token bucket's burst), and its device must have sent
  them: with ``UCX_TLS`` unset, UCX can find shared memory across namespaces (one kernel)
  and ignore the shaping, which this catches;
- cgx32 must equal gloo (relative L2 error below 1e-5), and no result may be non-finite;
- FSDP2 (:func:`~cgx_ucx.bench.link_checks.verify_fsdp`): held-out loss within
  ``FSDP_EXACT_LOSS`` of gloo's at 32 bits and ``FSDP_LOSS_TOLERANCE`` compressed; the
  reduce-scatters went through cgx; uncompressed runs sent what FSDP2 must send over the
  shaped device, and a compressed run sent less by at least ``FSDP_MIN_SAVING`` of what
  quantizing the reduce-scatter saves.

Delay is not emulated: ``netem`` is not in every kernel (the JSON reports
``netem_available``); links here have veth latency (tens of microseconds).

Output: a table (with a progress bar while running), ``link.json`` and ``link.png``
(speedup over gloo against link rate, one line per bit width; :mod:`cgx_ucx.bench.link_tables`)
in the results directory (``--out-dir``; see :mod:`cgx_ucx.bench.report`).

Several ranks per node (one namespace per node, shared memory inside it, the shaped link
between nodes; flat against hierarchical cgx_ucx): ``python -m cgx_ucx.bench nodes``
(:mod:`cgx_ucx.bench.nodes`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ..compression import encoded_nbytes
from .link_args import (
    MIB,
    add_training_args,
    check_iters,
    check_sizes,
    parse_size,
    rate_arg,
    size_label,
)
from .link_checks import MAX_COMPRESSED_SLOWDOWN, RATE_TOLERANCE, verify_allreduce, verify_fsdp
from .link_tables import headline, plot, print_versus, tables
from .link_worker import PROGRESS
from .netns import LinkEmulator, TcpMeasurement, format_rate, missing_prerequisites
from .report import (
    add_output_args,
    bits_arg,
    count_arg,
    nonnegative_number,
    ranks_arg,
    results_dir,
    write_json,
)

__all__ = ["main"]


class Progress:
    """A one-line progress bar on a terminal, one line per step elsewhere (logs, CI)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self.context = ""

    def note(self, text: str, advance: int = 0) -> None:
        with self._lock:
            self.done = min(self.total, self.done + advance)
            elapsed = time.monotonic() - self.start
            width = 28
            filled = int(width * self.done / self.total)
            bar = "#" * filled + "-" * (width - filled)
            line = f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {self.context} {text}"
            if self.tty:
                self.stream.write("\r" + line[:150].ljust(150))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] + s[(n - 1) // 2]) / 2 if n else math.nan


def _merge_ranks(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (size, method): the slowest rank per iteration, the busiest device's bytes."""
    merged = []
    for i, first in enumerate(records[0]["results"]):
        per_rank = [r["results"][i] for r in records]
        iters = min(len(p["times"]) for p in per_rank)
        times = [max(p["times"][k] for p in per_rank) for k in range(iters)]
        tx = [max(p["tx_bytes"][k] for p in per_rank) for k in range(iters)]
        row = {"size": first["size"], "method": first["method"], "times": times}
        row["time_s"] = median(times)
        row["tx_bytes"] = median(tx) if tx and min(tx) >= 0 else None
        for key in ("max_abs_err", "rel_l2_err"):
            if key in first:
                row[key] = max(p[key] for p in per_rank)
        if "finite" in first:
            row["finite"] = all(p["finite"] for p in per_rank)
        if all(p.get("cpu_s") for p in per_rank):  # all ranks, or no figure
            row["cpu_s_per_rank"] = [median(p["cpu_s"]) for p in per_rank]
        if all(p.get("wakeups") for p in per_rank):
            row["wakeups_per_rank"] = [median(p["wakeups"]) for p in per_rank]
        merged.append(row)
    return merged


def _bounds(
    row: dict[str, Any],
    world: int,
    probe: TcpMeasurement,
    burst: int,
    codec: dict[str, dict[str, float]],
    bucket: int,
    cores: int,
) -> None:
    """Add the wire, codec and lower-bound times of ``row`` (see the module doc, item 4).

    The first ``burst`` bytes pass the token bucket at line speed (a small allreduce that
    fits in the bucket finishes faster than the rate allows), so they are left out of the
    wire time.
    """
    numel = row["size"] // 4
    bits = 32 if row["method"] == "gloo" else int(row["method"][3:])
    share = 2 * (world - 1) / world
    wire_bytes = share * (row["size"] if bits == 32 else encoded_nbytes(numel, bits, bucket))
    wire_s = max(wire_bytes - burst, 0) / (probe.bits_per_s / 8)
    codec_s = 0.0
    rates = codec.get(str(bits))
    if rates:
        # Per rank (scatter-reduce-allgather): encode every value once (the peers' chunks and
        # its reduced chunk), decode-add (N-1)/N of them, decode all of them (allgather plus
        # its own re-quantized chunk).
        single_core = (
            numel / rates["encode"]
            + (world - 1) / world * numel / rates["decode_add"]
            + numel / rates["decode"]
        )
        codec_s = single_core / max(cores / world, 1e-9)
    row["wire_bytes_model"] = wire_bytes
    row["wire_s"] = wire_s
    row["codec_s"] = codec_s
    row["bound_s"] = max(wire_s, codec_s)
    # No bound when the whole transfer fits in the token bucket's burst (and no codec).
    row["x_bound"] = row["time_s"] / row["bound_s"] if row["bound_s"] > 0 else None


def _auto_costs(records: list[dict[str, Any]]) -> dict[str, tuple[float, Any]]:
    """Per compressed width: the link bandwidth and codec cost the ``auto`` policy decides
    with, the ranks' link-probe results averaged as the policy averages them."""
    from ..compression.policies.auto import probed_codec

    out: dict[str, tuple[float, Any]] = {}
    for bits in records[0].get("auto_probe", {}) if records else {}:
        values = [r["auto_probe"][bits] for r in records if bits in r.get("auto_probe", {})]
        bw, enc, dec, over = (math.fsum(v[i] for v in values) / len(values) for i in range(4))
        cost = probed_codec(enc, dec, over)
        if cost is not None and math.isfinite(bw) and bw > 0:
            out[bits] = (bw, cost)
    return out


def _auto_bits(
    row: dict[str, Any], world: int, auto: dict[str, tuple[float, Any]], bucket: int
) -> int | None:
    """The width the ``auto`` policy would give a layer of this row's size on this link,
    from its own link probe run in the same job (:func:`_auto_costs`): the row's bits when
    compressing pays, else 32; None for gloo and 32-bit rows, or without a probe."""
    from ..compression.policies.auto import compress_pays

    method = row["method"]
    if not method.startswith("cgx") or method[3:] not in auto:
        return None
    bw, cost = auto[method[3:]]
    bits = int(method[3:])
    return bits if compress_pays(row["size"] // 4, bits, bucket, world, bw, cost) else 32


def thread_env(world: int) -> dict[str, str]:
    """Each rank gets its share of the cores, as torchrun's OMP_NUM_THREADS does.

    The ranks of one machine share its cores; Numba's parallel kernels otherwise start one
    thread per core in every rank, and the oversubscribed threads wait on each other
    (small allreduces slow down by an order of magnitude). The workers also give torch
    the same share (torch.set_num_threads).
    """
    return {"NUMBA_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}


def worker_argv(job: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "cgx_ucx.bench.link_worker", job, *args]


def read_ranks(prefix: str, world: int) -> list[dict[str, Any]]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world)]


def _forward_progress(bar: Progress, verbose: bool) -> Any:
    def on_line(rank: int, line: str) -> None:
        if line.startswith(PROGRESS):
            try:
                info = json.loads(line[len(PROGRESS) :])
            except ValueError:
                return
            phase = info.get("phase")
            if phase == "allreduce":
                med = info.get("median")
                ms = f"{med * 1e3:.1f} ms" if med else "-"
                bar.note(f"{size_label(info['size'])} {info['method']}: {ms}", advance=1)
            elif phase == "train":
                bar.note(f"train {info['backend']} step {info['step']}/{info['of']}", advance=1)
            elif phase == "fsdp":
                name = f"cgx{info['bits']}" if info["backend"] == "cgx" else "gloo"
                bar.note(f"fsdp {name} step {info['step']}/{info['of']}", advance=1)
            else:
                bar.note(str(phase))
        elif verbose:
            sys.stderr.write(f"[rank {rank}] {line}")

    return on_line


def _estimate_timeout(args: argparse.Namespace, rate_bps: int, world: int, job: str) -> float:
    """A generous deadline for one job: 3x what the slowest (uncompressed) path needs."""
    rate = rate_bps / 8 * 0.9
    share = 2 * (world - 1) / world
    if job == "allreduce":
        methods = len(args.bits) + 1
        per = sum(
            (args.max_iters + 1) * min(share * s / rate, 1.0) + args.budget + 2 * share * s / rate
            for s in args.sizes
        )
        return 3 * methods * per + 180
    grad_bytes = 4 * 22_000_000 * (args.hidden / 3072) ** 2
    if job == "fsdp":  # two all-gathers and one reduce-scatter per step, each (N-1)/N
        share = 3 * (world - 1) / world
    return 3 * (args.warmup + args.steps) * (share * grad_bytes / rate + 3.0) + 180


def _run_job(
    link: LinkEmulator,
    job: str,
    job_args: list[str],
    prefix: str,
    args: argparse.Namespace,
    rate_bps: int,
    world: int,
    bar: Progress,
) -> list[dict[str, Any]]:
    """Run the worker's ``job`` on every rank of ``link`` (each with its share of the
    cores, under the job's deadline) and return the records each rank wrote at ``prefix``
    (``job_args`` must pass it as ``--out``)."""
    link.run_ranks(
        worker_argv(job, *job_args),
        timeout=_estimate_timeout(args, rate_bps, world, job),
        env=thread_env(world),
        progress=_forward_progress(bar, args.verbose),
    )
    return read_ranks(prefix, world)


def _run_config(
    args: argparse.Namespace, world: int, rate_bps: int, bar: Progress, tmp: Path
) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    with LinkEmulator(world, rate_bps) as link:
        bar.context = f"w{world} {format_rate(rate_bps)}"
        bar.note("probing the link")
        probe = link.measure_tcp(0, 1, seconds=args.probe_seconds)
        bar.note(f"TCP {probe.bits_per_s / 1e9:.3f} Gbit/s", advance=1)
        config: dict[str, Any] = {
            "world_size": world,
            "link": link.describe(),
            "tcp_probe": {
                "bits_per_s": probe.bits_per_s,
                "fraction_of_rate": probe.fraction_of_rate,
                "bytes": probe.bytes,
                "seconds": probe.seconds,
            },
        }
        if probe.fraction_of_rate > RATE_TOLERANCE:
            config["violations"] = verify_allreduce([], link, probe, world)
            return config
        prefix = str(tmp / f"ar-w{world}-{rate_bps}")
        ar_args = ["--sizes", *map(str, args.sizes), "--bits", *map(str, args.bits)]
        ar_args += ["--bucket-size", str(args.bucket_size), "--out", prefix]
        ar_args += ["--min-iters", str(args.min_iters), "--max-iters", str(args.max_iters)]
        ar_args += ["--budget", str(args.budget), "--timeout", str(args.timeout)]
        records = _run_job(link, "allreduce", ar_args, prefix, args, rate_bps, world, bar)
        codec = records[0].get("codec_rates", {})
        rows = _merge_ranks(records)
        auto = _auto_costs(records)
        config["auto_probe"] = {b: [bw, c.encode_bps, c.decode_bps, c.overhead_s]
                                for b, (bw, c) in auto.items()}  # fmt: skip
        gloo = {r["size"]: r["time_s"] for r in rows if r["method"] == "gloo"}
        for row in rows:
            _bounds(row, world, probe, link.burst_bytes, codec, args.bucket_size, cores)
            row["algbw_GBps"] = row["size"] / row["time_s"] / 1e9
            row["speedup"] = gloo[row["size"]] / row["time_s"] if row["size"] in gloo else None
            row["auto_bits"] = _auto_bits(row, world, auto, args.bucket_size)
        config["codec_rates_values_per_s_single_core"] = codec
        config["allreduce"] = rows
        config["violations"] = verify_allreduce(rows, link, probe, world)
        if args.train and not config["violations"]:
            config["train"] = _train(args, link, world, rate_bps, bar, tmp)
        if args.fsdp and not config["violations"]:
            config["fsdp"] = _fsdp(args, link, world, rate_bps, bar, tmp)
            config["violations"] = verify_fsdp(config["fsdp"], world, args.bucket_size)
    return config


def _train(
    args: argparse.Namespace,
    link: LinkEmulator,
    world: int,
    rate_bps: int,
    bar: Progress,
    tmp: Path,
) -> list[dict[str, Any]]:
    out = []
    for backend in ("gloo", "cgx"):
        prefix = str(tmp / f"train-{backend}-w{world}-{rate_bps}")
        tr_args = ["--backend", backend, "--bits", str(args.train_bits), "--out", prefix]
        tr_args += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        tr_args += ["--batch", str(args.batch), "--hidden", str(args.hidden)]
        tr_args += ["--bucket-size", str(args.bucket_size), "--timeout", str(args.timeout)]
        ranks = _run_job(link, "train", tr_args, prefix, args, rate_bps, world, bar)
        steps = min(len(r["step_times"]) for r in ranks)
        times = [max(r["step_times"][k] for r in ranks) for k in range(steps)]
        tx = [r["tx_bytes_per_step"] for r in ranks]
        out.append(
            {
                "backend": backend,
                "bits": ranks[0]["bits"],
                "params": ranks[0]["params"],
                "steps": steps,
                "step_s_mean": sum(times) / len(times),
                "step_s_median": median(times),
                "tx_bytes_per_step": max(tx) if None not in tx else None,
                "eval_loss": ranks[0]["eval_loss"],
                # Rank 0's mean phase times: backward includes waiting for the last bucket.
                "forward_s_mean": ranks[0].get("forward_s_mean"),
                "backward_s_mean": ranks[0].get("backward_s_mean"),
                "optimizer_s_mean": ranks[0].get("optimizer_s_mean"),
                "loss_curve_rank0": ranks[0]["losses"],
                "replicas_identical": len({r["param_digest"] for r in ranks}) == 1,
            }
        )
    base = out[0]
    for row in out:
        row["speedup"] = base["step_s_mean"] / row["step_s_mean"]
        row["loss_vs_gloo"] = row["eval_loss"] / base["eval_loss"] - 1
    return out


def _fsdp(
    args: argparse.Namespace,
    link: LinkEmulator,
    world: int,
    rate_bps: int,
    bar: Progress,
    tmp: Path,
) -> list[dict[str, Any]]:
    """FSDP2 training on gloo, then on cgx at each ``--fsdp-bits``; one row each (the
    slowest rank per step, the busiest rank's bytes)."""
    out = []
    for backend, bits in [("gloo", 32)] + [("cgx", b) for b in args.fsdp_bits]:
        prefix = str(tmp / f"fsdp-{backend}{bits}-w{world}-{rate_bps}")
        fs_args = ["--backend", backend, "--bits", str(bits), "--out", prefix]
        fs_args += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        fs_args += ["--batch", str(args.batch), "--hidden", str(args.hidden)]
        fs_args += ["--bucket-size", str(args.bucket_size), "--timeout", str(args.timeout)]
        ranks = _run_job(link, "fsdp", fs_args, prefix, args, rate_bps, world, bar)
        steps = min(len(r["step_times"]) for r in ranks)
        times = [max(r["step_times"][k] for r in ranks) for k in range(steps)]
        tx = [r["tx_bytes_per_step"] for r in ranks]
        row = {
            "method": "gloo" if backend == "gloo" else f"cgx{bits}",
            "backend": backend,
            "bits": ranks[0]["bits"],
            "params": ranks[0]["params"],
            "steps": steps,
            "step_s_median": median(times),
            "step_s_mean": sum(times) / len(times),
            "step_times": times,
            "tx_bytes_per_step": max(tx) if None not in tx else None,
            "eval_loss": ranks[0]["eval_loss"],
            "eval_loss_per_rank": [r["eval_loss"] for r in ranks],
            "loss_curve_rank0": ranks[0]["losses"],
        }
        if backend == "cgx":
            row["cgx_bytes_sent_per_step"] = max(r["cgx_bytes_sent_per_step"] for r in ranks)
            row["cgx_collectives_per_step"] = ranks[0]["cgx_collectives_per_step"]
        out.append(row)
    base = out[0]
    for row in out:
        row["speedup"] = base["step_s_median"] / row["step_s_median"]
        row["loss_vs_gloo"] = row["eval_loss"] / base["eval_loss"] - 1
    return out


def _compressed_vs_raw(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per link, size and bit width: cgx at those bits against cgx32, with the width the
    ``auto`` policy would pick and whether :data:`MAX_COMPRESSED_SLOWDOWN` holds there."""
    out = []
    for c in configs:
        rows = c.get("allreduce", [])
        raw = {r["size"]: r["time_s"] for r in rows if r["method"] == "cgx32"}
        for r in rows:
            if not r["method"].startswith("cgx") or r["method"] == "cgx32":
                continue
            if r["size"] not in raw:
                continue
            ratio = r["time_s"] / raw[r["size"]]
            picked = r.get("auto_bits")
            slow = ratio > MAX_COMPRESSED_SLOWDOWN
            out.append(
                {
                    "world_size": c["world_size"],
                    "rate": c["link"]["rate"],
                    "size": r["size"],
                    "method": r["method"],
                    "time_vs_cgx32": ratio,
                    "auto_bits": picked,
                    "ok": not slow or picked == 32,
                }
            )
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench link",
        description="cgx_ucx vs gloo on emulated links (network namespaces + tc tbf; root)",
    )
    p.add_argument("--rates", nargs="+", type=rate_arg, default=[10**9, 10 * 10**9],
                   help="link rates per direction, e.g. 1gbit 10gbit (default)")  # fmt: skip
    p.add_argument(
        "--world", nargs="+", type=ranks_arg(2), default=[2, 4], help="ranks (default 2 4)"
    )
    p.add_argument("--sizes", nargs="+", type=parse_size,
                   default=[s * MIB for s in (1, 4, 16, 64, 256)],
                   help="allreduce sizes, MiB or with a unit (default 1 4 16 64 256)")  # fmt: skip
    p.add_argument("--bits", nargs="+", type=bits_arg, default=[2, 4, 8, 32])
    p.add_argument("--bucket-size", type=count_arg(1), default=1024)
    p.add_argument("--min-iters", type=count_arg(1), default=3, help="timed iterations at least")
    p.add_argument("--max-iters", type=count_arg(1), default=10, help="timed iterations at most")
    p.add_argument(
        "--budget", type=nonnegative_number, default=2.0, help="seconds per (size, method)"
    )
    p.add_argument("--train", action="store_true", help="also DDP training, gloo vs cgx")
    p.add_argument("--train-bits", type=bits_arg, default=4)
    p.add_argument(
        "--fsdp", action="store_true", help="also FSDP2 training, gloo vs cgx at --fsdp-bits"
    )
    p.add_argument(
        "--fsdp-bits",
        nargs="+",
        type=bits_arg,
        default=[4, 32],
        help="bits of cgx's gradient reduce-scatter under FSDP2 (default 4 32)",
    )
    add_training_args(p)
    p.add_argument(
        "--plot-size", type=parse_size, default=64 * MIB, help="size plotted (else the largest)"
    )
    add_output_args(p)
    p.add_argument("--verbose", action="store_true", help="show the ranks' stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 2 without root/iproute2, 3 when a check refused."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_iters(parser, args)
    check_sizes(parser, "--sizes", args.sizes, max(args.world))
    check_sizes(parser, "--plot-size", [args.plot_size], max(args.world))
    missing = missing_prerequisites()
    if missing:
        print("link emulation needs " + ", ".join(missing), file=sys.stderr)
        return 2
    args.sizes = sorted(set(args.sizes))
    out_dir = results_dir(args)
    steps_per = 1 + len(args.sizes) * (len(args.bits) + 1)
    if args.train:
        steps_per += 2 * (args.steps + args.warmup)
    if args.fsdp:
        steps_per += (1 + len(args.fsdp_bits)) * (args.steps + args.warmup)
    configs = []
    bar = Progress(steps_per * len(args.world) * len(args.rates))
    try:
        with tempfile.TemporaryDirectory(prefix="cgx-link-") as tmp:
            for world in args.world:
                for rate in args.rates:
                    config = _run_config(args, world, rate, bar, Path(tmp))
                    configs.append(config)
                    if config["violations"]:
                        bar.close()
                        print(
                            f"REFUSED to report ({world} ranks, {format_rate(rate)}):\n  "
                            + "\n  ".join(config["violations"]),
                            file=sys.stderr,
                        )
                        return 3
    except KeyboardInterrupt:
        bar.close()
        print("interrupted; the emulated links were removed", file=sys.stderr)
        return 130
    bar.close()
    netem = configs[0]["link"]["netem_available"] if configs else None
    print(tables(configs))
    print(
        "\nwire MiB: bytes the busiest rank's shaped device sent per call (Ethernet headers "
        "in); bound: max(wire time at the measured TCP rate, codec time at the measured "
        "single-core codec rate / cores per rank); CPU ms/rank: the process CPU time (all "
        "threads) per call, median, least and most busy rank; rel err: relative L2 error "
        "against gloo; "
        "auto: the width the auto policy's cost model picks for a layer of that size."
    )
    if any(c.get("fsdp") for c in configs):
        print(
            "FSDP2 model MiB: what one rank must send per step at best, (N-1)/N of the "
            "parameters per all-gather (forward, and backward after resharding) plus (N-1)/N "
            "of the gradients at the method's bits; cgx MiB: cgx's own count (frame headers in)."
        )
    if not netem:
        print("No delay emulation: the netem qdisc is not in this kernel.")
    head = headline(configs)
    if head:
        print("\nAgainst the 1 Gbit/s targets (other rates for the record):")
        for line in head:
            print(f"  {line['case']}: {line['text']}")
    versus = _compressed_vs_raw(configs)
    print_versus(versus)
    record = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "headline": head,
        "compressed_vs_raw": versus,
        "configs": configs,
    }
    path = write_json("link", record, out_dir)
    print(f"\nJSON: {path}")
    try:
        plot_size = args.plot_size if args.plot_size in args.sizes else args.sizes[-1]
        png = plot(configs, plot_size, Path(path).with_suffix(".png"))
    except Exception as exc:  # the numbers are out already; a plot failure must not hide them
        print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    else:
        if png:
            print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
