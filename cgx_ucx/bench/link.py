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

Honesty checks; the command refuses to report (exit 3) when one fails:

- the raw TCP probe must not exceed the shaped rate (else traffic is not crossing the link);
- every uncompressed allreduce (gloo, cgx32) must take at least the time its minimal bytes
  need at the shaped rate (less the token bucket's burst), and its device must have sent
  them: with ``UCX_TLS`` unset, UCX can find shared memory across namespaces (one kernel)
  and ignore the shaping, which this catches;
- cgx32 must equal gloo (relative L2 error below 1e-5), and no result may be non-finite;
- FSDP2 (:func:`verify_fsdp`): held-out loss within ``FSDP_EXACT_LOSS`` of gloo's at 32 bits
  and ``FSDP_LOSS_TOLERANCE`` compressed; the reduce-scatters went through cgx; uncompressed
  runs sent what FSDP2 must send over the shaped device, and a compressed run sent less by
  at least ``FSDP_MIN_SAVING`` of what quantizing the reduce-scatter saves.

Delay is not emulated: ``netem`` is missing from the kernel this was written on (reported
in the JSON as ``netem_available``); links here have veth latency (tens of microseconds).

Output: a table (with a progress bar while running), ``link.json`` and ``link.png``
(speedup over gloo against link rate, one line per bit width) in the results directory
(``--out-dir``; see :mod:`cgx_ucx.bench.report`).

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
from ..errors import CGXError
from .link_worker import PROGRESS
from .netns import LinkEmulator, TcpMeasurement, format_rate, missing_prerequisites, parse_rate
from .report import (
    add_output_args,
    arg_error,
    bits_arg,
    check_rank_buffers,
    count_arg,
    format_table,
    nonnegative_number,
    positive_number,
    ranks_arg,
    results_dir,
    write_json,
)

__all__ = ["main"]

MIB = 1 << 20
#: Tolerance of the honesty checks: tbf's rate is exact to well under 1% (TCP payload is at
#: most 1448/1514 of the frame rate tbf counts); 5% leaves room for timers.
RATE_TOLERANCE = 1.05
#: cgx32 must match gloo's float32 sum: the same sum in another order differs by ~1e-7.
EXACT_REL_ERR = 1e-5
#: Buffers of an allreduce size each rank holds at once (:mod:`cgx_ucx.bench.link_worker`):
#: the input, the buffer reduced in place, gloo's result kept for the error check, the
#: float64 difference (2) and the communicator's staging (about 6 in all).
BUFFERS_PER_RANK = 6
#: The uncompressed check needs a transfer well beyond the bucket's burst to mean anything.
CHECK_MIN_BURSTS = 4


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


def parse_size(text: str) -> int:
    """Bytes of ``"64"`` (MiB), ``"64MiB"``, ``"512KiB"``; a multiple of 4 (float32)."""
    t = text.strip().lower()
    scale = MIB
    for suffix, s in (("kib", 1 << 10), ("mib", MIB), ("gib", 1 << 30), ("b", 1)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], s
            break
    try:
        size = int(float(t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"size must be e.g. 64 (MiB) or 512KiB: {text!r}"
        ) from None
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of 4 bytes: {text!r}")
    return size


def rate_arg(text: str) -> int:
    """An argparse ``type``: a link rate in bits per second (:func:`~cgx_ucx.bench.netns.
    parse_rate`: a number or tc's units, e.g. ``1gbit``)."""
    try:
        return parse_rate(text)
    except CGXError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def check_iters(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error unless ``--min-iters <= --max-iters`` (shared with ``bench nodes``)."""
    if args.max_iters < args.min_iters:
        arg_error(
            parser,
            "--max-iters",
            f"must be at least --min-iters ({args.min_iters}), got {args.max_iters}",
        )


def check_sizes(
    parser: argparse.ArgumentParser, option: str, sizes: Sequence[int], ranks: int
) -> None:
    """A usage error when ``ranks`` ranks of this machine cannot hold the largest of
    ``sizes`` (:data:`BUFFERS_PER_RANK` buffers each) in its physical memory."""
    largest = max(sizes)
    check_rank_buffers(parser, option, ranks, BUFFERS_PER_RANK, largest, size_label(largest))


def size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size % MIB == 0 else f"{size / 1024:g} KiB"


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


def _verify(
    rows: list[dict[str, Any]], link: LinkEmulator, probe: TcpMeasurement, world: int
) -> list[str]:
    """The honesty checks of the module doc; the list of violations (empty when honest)."""
    bad = []
    if probe.fraction_of_rate > RATE_TOLERANCE:
        bad.append(
            f"raw TCP {probe.bits_per_s / 1e9:.3f} Gbit/s exceeds the shaped "
            f"{format_rate(link.rate_bps)}: traffic is not crossing the link"
        )
    for row in rows:
        name = f"{row['method']} {size_label(row['size'])}"
        if "finite" in row and not row["finite"]:
            bad.append(f"{name}: non-finite values in the result")
        if row["method"] == "cgx32" and row.get("rel_l2_err", 0.0) > EXACT_REL_ERR:
            bad.append(f"{name}: differs from gloo (relative L2 error {row['rel_l2_err']:.3g})")
        if row["method"] not in ("gloo", "cgx32"):
            continue
        min_bytes = 2 * (world - 1) / world * row["size"]
        if min_bytes < CHECK_MIN_BURSTS * link.burst_bytes:
            continue
        floor_s = (min_bytes - link.burst_bytes) / (link.rate_bps / 8) / RATE_TOLERANCE
        if row["time_s"] < floor_s:
            bad.append(
                f"{name}: {row['time_s'] * 1e3:.1f} ms is faster than the shaped link allows "
                f"({floor_s * 1e3:.1f} ms): traffic is not crossing the link"
            )
        if row["tx_bytes"] is not None and row["tx_bytes"] < 0.9 * min_bytes:
            bad.append(
                f"{name}: the shaped device sent {row['tx_bytes'] / MIB:.1f} MiB of the "
                f"{min_bytes / MIB:.1f} MiB an allreduce must send: traffic went elsewhere"
            )
    return bad


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
            config["violations"] = _verify([], link, probe, world)
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
        config["violations"] = _verify(rows, link, probe, world)
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


#: cgx32 runs the same FSDP2 step as gloo, adding in another order: float rounding only.
FSDP_EXACT_LOSS = 1e-3
#: A compressed reduce-scatter may move the held-out loss by at most this (relative).
FSDP_LOSS_TOLERANCE = 0.02
#: The compressed run must save at least this share of the bytes the model says the
#: quantized reduce-scatter saves (framing, control messages and ACKs blur the rest).
FSDP_MIN_SAVING = 0.7


def fsdp_bytes_model(params: int, world: int, bits: int, gathers: float, bucket: int) -> float:
    """Bytes one rank sends per FSDP2 step: ``gathers`` exact all-gathers of its shard to
    each peer (forward, and again in backward with FSDP2's default reshard after forward),
    one reduce-scatter sending each peer its shard at ``bits``."""
    share = (world - 1) / world
    rs = 4 * params if bits == 32 else encoded_nbytes(params, bits, bucket)
    return share * (gathers * 4 * params + rs)


def verify_fsdp(rows: list[dict[str, Any]], world: int, bucket: int) -> list[str]:
    """The FSDP rows' honesty checks; the list of violations (empty when honest).

    - every rank ends with the same held-out loss (FSDP2 keeps one model, sharded);
    - cgx32's loss is gloo's within FSDP_EXACT_LOSS, compressed runs' within
      FSDP_LOSS_TOLERANCE;
    - every cgx run's reduce-scatters went through the cgx group;
    - with device counters: the uncompressed runs sent at least 90% of the bytes FSDP2 must
      send (else traffic did not cross the shaped link), and each compressed run saved at
      least FSDP_MIN_SAVING of what quantizing the reduce-scatter saves, against cgx32 when
      it ran (the same framing), else against gloo.
    """
    bad = []
    by = {r["method"]: r for r in rows}
    gloo = by["gloo"]
    cgx = [r for r in rows if r["backend"] == "cgx"]
    counts = cgx[0]["cgx_collectives_per_step"] if cgx else {}
    scatters = counts.get("reduce_scatter", 0.0)
    gathers = counts.get("allgather", 0.0) / scatters if scatters else 2.0
    for row in rows:
        name = f"fsdp {row['method']}"
        losses = row["eval_loss_per_rank"]
        if not all(math.isfinite(v) for v in losses) or max(losses) != min(losses):
            bad.append(f"{name}: ranks ended with different or non-finite losses {losses}")
        limit = FSDP_EXACT_LOSS if row["bits"] == 32 else FSDP_LOSS_TOLERANCE
        if abs(row["loss_vs_gloo"]) > limit:
            bad.append(
                f"{name}: held-out loss {row['eval_loss']:.5f} is {row['loss_vs_gloo']:+.2%} "
                f"from gloo's {gloo['eval_loss']:.5f} (tolerance {limit:.2%})"
            )
        if row["backend"] == "cgx" and not row["cgx_collectives_per_step"].get("reduce_scatter"):
            bad.append(f"{name}: no reduce_scatter went through the cgx group")
        row["tx_bytes_model"] = fsdp_bytes_model(row["params"], world, row["bits"], gathers, bucket)
    ref = by.get("cgx32", gloo)
    for row in rows:
        name = f"fsdp {row['method']}"
        if row["tx_bytes_per_step"] is None or ref["tx_bytes_per_step"] is None:
            continue
        if row["bits"] == 32 and row["tx_bytes_per_step"] < 0.9 * row["tx_bytes_model"]:
            bad.append(
                f"{name}: the shaped device sent {row['tx_bytes_per_step'] / MIB:.2f} MiB per "
                f"step of the {row['tx_bytes_model'] / MIB:.2f} MiB FSDP2 must send: traffic "
                "went elsewhere"
            )
        if row["bits"] == 32:
            continue
        saved = ref["tx_bytes_per_step"] - row["tx_bytes_per_step"]
        model = ref["tx_bytes_model"] - row["tx_bytes_model"]
        row["tx_saved_vs_" + ref["method"]] = saved
        if saved < FSDP_MIN_SAVING * model:
            bad.append(
                f"{name}: sent {saved / MIB:.2f} MiB per step less than {ref['method']}, not "
                f"the {model / MIB:.2f} MiB a {row['bits']}-bit reduce-scatter saves: the "
                "gradients were not compressed"
            )
    return bad


def _tables(configs: list[dict[str, Any]]) -> str:
    head = ["world", "link", "size", "method", "time ms", "algbw GB/s", "speedup"]
    head += ["wire MiB", "bound ms", "x bound", "rel err", "auto"]
    rows = []
    for c in configs:
        for r in c.get("allreduce", []):
            rows.append(
                [
                    c["world_size"],
                    c["link"]["rate"],
                    size_label(r["size"]),
                    r["method"],
                    r["time_s"] * 1e3,
                    r["algbw_GBps"],
                    r["speedup"] if r["speedup"] is not None else "-",
                    r["tx_bytes"] / MIB if r["tx_bytes"] is not None else "-",
                    r["bound_s"] * 1e3,
                    r["x_bound"] if r["x_bound"] is not None else "-",
                    r.get("rel_l2_err", "-") if r["method"] != "gloo" else "ref",
                    r.get("auto_bits") or "-",
                ]
            )
    text = format_table(head, rows)
    train_rows = []
    for c in configs:
        for t in c.get("train", []):
            train_rows.append(
                [
                    c["world_size"],
                    c["link"]["rate"],
                    t["backend"],
                    t["bits"],
                    t["step_s_mean"] * 1e3,
                    t["speedup"],
                    t["tx_bytes_per_step"] / MIB if t["tx_bytes_per_step"] else "-",
                    t["eval_loss"],
                    f"{100 * t['loss_vs_gloo']:+.2f}%",
                    "/".join(
                        f"{1e3 * t[k]:.0f}" if t.get(k) is not None else "-"
                        for k in ("forward_s_mean", "backward_s_mean", "optimizer_s_mean")
                    ),
                ]
            )
    if train_rows:
        thead = ["world", "link", "backend", "bits", "step ms", "speedup", "wire MiB/step"]
        thead += ["eval loss", "loss vs gloo", "fwd/bwd/opt ms"]
        text += (
            "\n\nDDP training (MLP, mean step time over the timed steps; bwd includes "
            "waiting for the last bucket)\n"
        )
        text += format_table(thead, train_rows)
    fsdp_rows = [
        [
            c["world_size"],
            c["link"]["rate"],
            f["method"],
            f["step_s_median"] * 1e3,
            f["speedup"],
            f["tx_bytes_per_step"] / MIB if f["tx_bytes_per_step"] is not None else "-",
            f["tx_bytes_model"] / MIB if "tx_bytes_model" in f else "-",
            f["cgx_bytes_sent_per_step"] / MIB if "cgx_bytes_sent_per_step" in f else "-",
            f["eval_loss"],
            f"{100 * f['loss_vs_gloo']:+.3f}%",
        ]
        for c in configs
        for f in c.get("fsdp", [])
    ]
    if fsdp_rows:
        fhead = ["world", "link", "method", "step ms", "speedup", "wire MiB/step"]
        fhead += ["model MiB", "cgx MiB/step", "eval loss", "loss vs gloo"]
        text += (
            "\n\nFSDP2 training (fully_shard per Linear, same MLP and data; median step time "
            "after warm-up; parameter all-gathers exact, gradient reduce-scatter at the "
            "method's bits)\n"
        )
        text += format_table(fhead, fsdp_rows)
    return text


#: Issue 5's targets: 64 MiB, 2 ranks, 1 Gbit/s, 4 bits at least 4x gloo and within 1.2x
#: of the lower bound; DDP training over 1 Gbit/s at least 3x gloo's step time, loss within 2%.
TARGET_SIZE, TARGET_BITS = 64 * MIB, 4
TARGET_SPEEDUP, TARGET_X_BOUND = 4.0, 1.2
TARGET_TRAIN_SPEEDUP, TARGET_LOSS = 3.0, 0.02


def _headline(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per link of the headline case and of training, against issue 5's targets."""
    lines = []
    for c in configs:
        where = f"{c['world_size']} ranks, {c['link']['rate']}"
        for r in c.get("allreduce", []):
            if r["size"] == TARGET_SIZE and r["method"] == f"cgx{TARGET_BITS}":
                lines.append(
                    {
                        "case": f"allreduce 64 MiB {TARGET_BITS} bits, {where}",
                        "speedup": r["speedup"],
                        "x_bound": r["x_bound"],
                        "text": f"{r['speedup']:.2f}x gloo (target >= {TARGET_SPEEDUP:g}x), "
                        + (
                            f"{r['x_bound']:.2f}x the lower bound (target <= {TARGET_X_BOUND}x)"
                            if r["x_bound"] is not None
                            else "no bound"
                        ),
                    }
                )
        for t in c.get("train", []):
            if t["backend"] == "cgx":
                lines.append(
                    {
                        "case": f"DDP training {t['bits']} bits, {where}",
                        "speedup": t["speedup"],
                        "loss_vs_gloo": t["loss_vs_gloo"],
                        "text": f"{t['speedup']:.2f}x gloo's step time (target >= "
                        f"{TARGET_TRAIN_SPEEDUP:g}x), held-out loss "
                        f"{100 * t['loss_vs_gloo']:+.2f}% (target within {100 * TARGET_LOSS:g}%)",
                    }
                )
        for f in c.get("fsdp", []):
            if f["backend"] == "cgx" and f["bits"] != 32:
                lines.append(
                    {
                        "case": f"FSDP2 training {f['bits']} bits, {where}",
                        "speedup": f["speedup"],
                        "loss_vs_gloo": f["loss_vs_gloo"],
                        "text": f"{f['speedup']:.2f}x gloo's median step time, held-out loss "
                        f"{100 * f['loss_vs_gloo']:+.3f}% (tolerance "
                        f"{100 * FSDP_LOSS_TOLERANCE:g}%), "
                        f"{f['tx_bytes_per_step'] / MIB:.1f} MiB sent per step and rank"
                        if f["tx_bytes_per_step"] is not None
                        else "no device counters",
                    }
                )
    return lines


#: Issue 10: a compressed allreduce is never slower than the uncompressed one by more than
#: this, at any size where the ``auto`` policy would compress.
MAX_COMPRESSED_SLOWDOWN = 1.10


def _compressed_vs_raw(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per link, size and bit width: cgx at those bits against cgx32, with the width the
    ``auto`` policy would pick and whether issue 10's rule holds there."""
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


def _print_versus(versus: list[dict[str, Any]]) -> None:
    if not versus:
        return
    print(
        f"\nCompressed against cgx32 (issue 10: at most {MAX_COMPRESSED_SLOWDOWN:g}x where "
        "the auto policy would compress; auto: the width its cost model picks here):"
    )
    for v in versus:
        print(
            f"  {v['world_size']} ranks, {v['rate']}, {size_label(v['size'])}, {v['method']}: "
            f"{v['time_vs_cgx32']:.2f}x cgx32's time, auto picks {v['auto_bits'] or '-'}: "
            + ("ok" if v["ok"] else "MISSED")
        )


def _plot(configs: list[dict[str, Any]], size: int, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot (pip install cgx_ucx[bench])", file=sys.stderr)
        return None
    worlds = sorted({c["world_size"] for c in configs})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        series: dict[str, list[tuple[float, float, float]]] = {}
        for c in configs:
            if c["world_size"] != world:
                continue
            rows = {r["method"]: r for r in c.get("allreduce", []) if r["size"] == size}
            if "gloo" not in rows:
                continue
            for method, r in rows.items():
                if method == "gloo":
                    continue
                best = rows["gloo"]["time_s"] / r["bound_s"] if r["bound_s"] > 0 else math.nan
                series.setdefault(method, []).append(
                    (c["link"]["rate_bps"] / 1e9, r["speedup"], best)
                )
        for method in sorted(series, key=lambda m: int(m[3:])):
            pts = sorted(series[method])
            (line,) = ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{method[3:]} bits"
            )
            ax.plot(
                [p[0] for p in pts], [p[2] for p in pts], ":", color=line.get_color(), alpha=0.6
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        rates = sorted({c["link"]["rate_bps"] / 1e9 for c in configs})
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("link rate per direction (Gbit/s)")
        ax.set_ylabel("speedup over gloo")
        ax.set_title(f"allreduce {size_label(size)}, {world} ranks (dotted: lower bound)")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The training run's options and the timeouts (shared with ``bench nodes``)."""
    p.add_argument("--steps", type=count_arg(1), default=20, help="timed training steps")
    p.add_argument("--warmup", type=count_arg(0), default=3, help="untimed steps first")
    p.add_argument("--batch", type=count_arg(1), default=8, help="per rank (see bench link's doc)")
    p.add_argument(
        "--hidden", type=count_arg(1), default=3072, help="MLP width (3072: ~22 M params)"
    )
    p.add_argument("--probe-seconds", type=positive_number, default=1.0)
    p.add_argument(
        "--timeout", type=positive_number, default=300.0, help="seconds any single wait may take"
    )


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
    print(_tables(configs))
    print(
        "\nwire MiB: bytes the busiest rank's shaped device sent per call (Ethernet headers "
        "in); bound: max(wire time at the measured TCP rate, codec time at the measured "
        "single-core codec rate / cores per rank); rel err: relative L2 error against gloo; "
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
    headline = _headline(configs)
    if headline:
        print("\nAgainst issue 5's targets (1 Gbit/s targets; other rates for the record):")
        for line in headline:
            print(f"  {line['case']}: {line['text']}")
    versus = _compressed_vs_raw(configs)
    _print_versus(versus)
    record = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "headline": headline,
        "compressed_vs_raw": versus,
        "configs": configs,
    }
    path = write_json("link", record, out_dir)
    print(f"\nJSON: {path}")
    try:
        plot_size = args.plot_size if args.plot_size in args.sizes else args.sizes[-1]
        png = _plot(configs, plot_size, Path(path).with_suffix(".png"))
    except Exception as exc:  # the numbers are out already; a plot failure must not hide them
        print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    else:
        if png:
            print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
