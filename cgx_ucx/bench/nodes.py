"""``python -m cgx_ucx.bench nodes``: several emulated nodes of several ranks each.

The setting of a cluster: ranks inside a node share memory, nodes share a slow network. The
command builds ``--nodes`` network namespaces of ``--ranks-per-node`` ranks each
(:class:`~cgx_ucx.bench.netns.LinkEmulator` with ``nodes=``; ``tc tbf`` at each
``--rates`` on every node's link; needs root and iproute2) and starts the ranks as torchrun
would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK; no UCX variables), so
cgx_ucx learns the topology as it would on real hosts. Side by side on the same links in
one run:

1. allreduce, float32, 16/64/256 MiB: torch.distributed gloo, flat cgx_ucx
   (``algorithm="sra"``) and hierarchical cgx_ucx (``algorithm="hierarchical"``) at each
   bit width: median time of the slowest rank, speedup over gloo (and of hierarchical over
   flat), the error against gloo's result, and the bytes each node really sent over its
   shaped link: its devices' kernel counters read around each method's timed loop (after
   barriers on both sides) divided by the timed iterations, next to the formula below;
2. unless ``--no-train``: a DDP step of the 22 M-parameter MLP of ``bench link``
   (:mod:`cgx_ucx.bench.link_worker`) on gloo, on cgx with every bucket flat and on cgx
   with every bucket on two levels: mean step time, link bytes per step and node, the
   held-out loss.

Cross-node bytes per node and allreduce (N ranks, M nodes of L ranks, S the buffer's
bytes, C its encoded size at the bit width, C = S at 32 bits):

- gloo (ring allreduce, its default: each rank sends 2(N-1)/N x S to its ring successor;
  with consecutive ranks per node one ring edge leaves each node):
  ``2 (N-1)/N x S``;
- flat cgx (scatter-reduce-allgather: each rank sends C/N to each of its N-1 peers in each
  of two rounds, 2(N-1)/N x C per rank, of which the N-L peers on other nodes take
  2(N-L)/N x C): ``L x 2 (N-L)/N x C`` (2 x 2: 2 C);
- hierarchical cgx (node-local reduce-scatter in shared memory, then each local rank runs
  the same algorithm on its 1/L shard among the M ranks of its local index, then a
  node-local allgather): ``L x 2 (M-1)/M x C/L = 2 (M-1)/M x C`` (2 nodes: C).

The counters include Ethernet/IP/TCP headers and the ACKs of what the node received, so
measured bytes run a few percent above the formula.

Honesty checks; the command refuses to report (exit 3) when one fails:

- the raw TCP probe between two nodes must not exceed the shaped rate;
- every uncompressed allreduce (gloo, flat32, hier32) must take at least the time its
  minimal cross-node bytes (2 (M-1)/M x S per node, what any allreduce must move) need at
  the shaped rate, and every node's shaped device must have sent them: otherwise traffic
  did not cross the link (gloo beating the link is the plainest sign);
- 32-bit cgx must equal gloo (relative L2 error below 1e-5), no result may be non-finite;
- the ranks must have seen a two-level topology (else "hierarchical" silently runs flat);
- the bytes counted per method cannot exceed what the driver's own snapshot of every
  interface (:meth:`LinkEmulator.interface_counters`) counted around the whole job.

The load average (1, 5, 15 min) is recorded before and after every link rate: these are
wall-time measurements on CPU cores that the ranks share, so compare runs made on a quiet
machine only.

Output: tables (a progress bar while running), ``nodes.json`` and ``nodes.png`` (speedup
over gloo against size, and measured against formula cross-node bytes) in the results
directory (``--out-dir``; see :mod:`cgx_ucx.bench.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..compression import encoded_nbytes
from .link import Progress, median, read_ranks, thread_env, worker_argv
from .link_args import (
    MIB,
    add_training_args,
    check_iters,
    check_sizes,
    parse_size,
    rate_arg,
    size_label,
)
from .link_checks import CHECK_MIN_BURSTS, EXACT_REL_ERR, RATE_TOLERANCE
from .link_worker import PROGRESS
from .netns import LinkEmulator, TcpMeasurement, format_rate, missing_prerequisites
from .report import (
    MAX_LOCAL_RANKS,
    add_output_args,
    arg_error,
    bits_arg,
    count_arg,
    format_table,
    nonnegative_number,
    results_dir,
    write_json,
)

__all__ = ["formula_bytes_per_node", "main"]

#: cgx algorithm per scheme, and the scheme's short name in the tables.
SCHEMES = {"flat": "sra", "hier": "hierarchical"}
#: The targets ``bench nodes`` reports against: 2 nodes x 2 ranks, 1 Gbit/s, 64 MiB, 4 bits.
TARGET_SIZE, TARGET_BITS, TARGET_RATE = 64 * MIB, 4, 10**9
TARGET_OVER_FLAT, TARGET_OVER_GLOO, TARGET_BYTES_TOL = 1.7, 10.0, 0.10
#: Slack of the counter cross-check: what a node sends outside the timed loops is positive,
#: so only a per-method count above the whole job's (beyond rounding) is inconsistent.
COUNTER_SLACK_BYTES = 64 * 1024


def formula_bytes_per_node(
    scheme: str, size: int, bits: int, node_sizes: list[int], bucket: int = 1024
) -> list[float]:
    """Cross-node bytes each node sends per allreduce under ``scheme`` (module doc)."""
    n, m = sum(node_sizes), len(node_sizes)
    c = size if bits == 32 else encoded_nbytes(size // 4, bits, bucket)
    if scheme == "gloo":
        return [2 * (n - 1) / n * size for _ in node_sizes]
    if scheme == "flat":
        return [local * 2 * (n - local) / n * c for local in node_sizes]
    if scheme == "hier":
        return [2 * (m - 1) / m * c for _ in node_sizes]
    raise ValueError(f"unknown scheme {scheme!r}")


def _method_name(worker_method: str) -> tuple[str, str, int]:
    """``"cgx4-sra" -> ("flat4", "flat", 4)``; ``"gloo" -> ("gloo", "gloo", 32)``."""
    if worker_method == "gloo":
        return "gloo", "gloo", 32
    bits, _, alg = worker_method[3:].partition("-")
    scheme = {v: k for k, v in SCHEMES.items()}[alg]
    return f"{scheme}{bits}", scheme, int(bits)


def _node_reader(records: list[dict[str, Any]], nodes: int) -> list[dict[str, Any]]:
    """Per node, the record of its local rank 0 (it read the node's counters)."""
    readers = {r["group_rank"]: r for r in records if r.get("local_rank", 0) == 0}
    return [readers[n] for n in range(nodes)]


def _merge(records: list[dict[str, Any]], link: LinkEmulator, bucket: int) -> list[dict[str, Any]]:
    """Per (size, method): the slowest rank per iteration; per node its counters."""
    readers = _node_reader(records, link.nodes)
    rows = []
    for i, first in enumerate(records[0]["results"]):
        per_rank = [r["results"][i] for r in records]
        iters = min(len(p["times"]) for p in per_rank)
        times = [max(p["times"][k] for p in per_rank) for k in range(iters)]
        name, scheme, bits = _method_name(first["method"])
        row: dict[str, Any] = {
            "size": first["size"],
            "method": name,
            "scheme": scheme,
            "bits": bits,
            "iters": iters,
            "times": times,
            "time_s": median(times),
        }
        link_tx, lo_tx = [], []
        for n, reader in enumerate(readers):
            res = reader["results"][i]
            counted = res.get("iface_bytes", {})
            timed = max(len(res["times"]), 1)
            link_tx.append(counted.get(link.node_devices[n], [0, 0])[0] / timed)
            lo_tx.append(counted.get("lo", [0, 0])[0] / timed)
        row["link_tx_per_node"] = link_tx
        row["lo_tx_per_node"] = lo_tx
        row["formula_per_node"] = formula_bytes_per_node(
            scheme, row["size"], bits, link.node_sizes, bucket
        )
        row["bytes_vs_formula"] = max(
            m / f for m, f in zip(link_tx, row["formula_per_node"], strict=True)
        )
        # Each rank's own CPU time per call (median): on a host with fewer cores than
        # ranks, their sum over the cores is a floor under the call's time.
        cpu_counted = all(p.get("cpu_s") for p in per_rank)  # all ranks, or no figure
        row["cpu_s_per_rank"] = [median(p["cpu_s"]) for p in per_rank] if cpu_counted else []
        for key in ("max_abs_err", "rel_l2_err"):
            if key in first:
                row[key] = max(p[key] for p in per_rank)
        if "finite" in first:
            row["finite"] = all(p["finite"] for p in per_rank)
        rows.append(row)
    by = {(r["size"], r["method"]): r for r in rows}
    for row in rows:
        gloo = by.get((row["size"], "gloo"))
        flat = by.get((row["size"], f"flat{row['bits']}"))
        row["algbw_GBps"] = row["size"] / row["time_s"] / 1e9
        row["speedup"] = gloo["time_s"] / row["time_s"] if gloo else None
        row["over_flat"] = (
            flat["time_s"] / row["time_s"] if flat and row["scheme"] == "hier" else None
        )
    return rows


def _verify(
    rows: list[dict[str, Any]],
    link: LinkEmulator,
    probe: TcpMeasurement,
    records: list[dict[str, Any]],
    job_tx: list[int],
) -> list[str]:
    """The honesty checks of the module doc; the list of violations (empty when honest)."""
    bad = []
    if probe.fraction_of_rate > RATE_TOLERANCE:
        bad.append(
            f"raw TCP {probe.bits_per_s / 1e9:.3f} Gbit/s between nodes exceeds the shaped "
            f"{format_rate(link.rate_bps)}: traffic is not crossing the link"
        )
    plans = {r.get("plan") for r in records}
    if any(r["scheme"] == "hier" for r in rows) and plans != {"sharded"}:
        bad.append(
            f"the ranks saw topology {records[0].get('topology')!r} (plans "
            f"{sorted(map(str, plans))}): 'hierarchical' would have run flat"
        )
    m = link.nodes
    for row in rows:
        name = f"{row['method']} {size_label(row['size'])}"
        if "finite" in row and not row["finite"]:
            bad.append(f"{name}: non-finite values in the result")
        exact = row["bits"] == 32 and row["scheme"] != "gloo"
        if exact and row.get("rel_l2_err", 0.0) > EXACT_REL_ERR:
            bad.append(f"{name}: differs from gloo (relative L2 {row['rel_l2_err']:.3g})")
        if row["bits"] != 32:
            continue
        need = 2 * (m - 1) / m * row["size"]
        if need < CHECK_MIN_BURSTS * link.burst_bytes:
            continue
        floor_s = (need - link.burst_bytes) / (link.rate_bps / 8) / RATE_TOLERANCE
        if row["time_s"] < floor_s:
            bad.append(
                f"{name}: {row['time_s'] * 1e3:.1f} ms is faster than the shaped link allows "
                f"({floor_s * 1e3:.1f} ms for {need / MIB:.1f} MiB per node): traffic is not "
                "crossing the link"
            )
        if min(row["link_tx_per_node"]) < 0.9 * need:
            bad.append(
                f"{name}: a node's shaped device sent {min(row['link_tx_per_node']) / MIB:.1f} "
                f"MiB of the {need / MIB:.1f} MiB an allreduce must send: traffic went elsewhere"
            )
    for n, total in enumerate(job_tx):
        counted = sum(r["link_tx_per_node"][n] * r["iters"] for r in rows)
        if counted > total + COUNTER_SLACK_BYTES:
            bad.append(
                f"node {n}: the timed loops counted {counted / MIB:.1f} MiB on the link, more "
                f"than the {total / MIB:.1f} MiB of the whole job: the counters are not the link's"
            )
    return bad


def _forward_progress(bar: Progress, verbose: bool) -> Any:
    def on_line(rank: int, line: str) -> None:
        if not line.startswith(PROGRESS):
            if verbose:
                sys.stderr.write(f"[rank {rank}] {line}")
            return
        try:
            info = json.loads(line[len(PROGRESS) :])
        except ValueError:
            return
        phase = info.get("phase")
        if phase == "allreduce":
            med = info.get("median")
            ms = f"{med * 1e3:.1f} ms" if med else "-"
            name = _method_name(info["method"])[0]
            bar.note(f"allreduce {size_label(info['size'])} {name}: {ms}", advance=1)
        elif phase == "train":
            what = info["backend"] if info["backend"] == "gloo" else f"cgx {info['algorithm']}"
            bar.note(f"train {what} step {info['step']}/{info['of']}", advance=1)
        else:
            bar.note(str(phase))

    return on_line


def _timeout(args: argparse.Namespace, rate_bps: int, job: str) -> float:
    """A generous deadline for one job: 3x what its slowest path (2 S per node) needs."""
    rate = rate_bps / 8 * 0.9
    if job == "allreduce":
        methods = 1 + 2 * len(args.bits)
        per = sum(
            (args.max_iters + 2) * 2 * s / rate + args.budget + 2 * s / rate for s in args.sizes
        )
        return 3 * methods * per + 180
    grad_bytes = 4 * 22_000_000 * (args.hidden / 3072) ** 2
    return 3 * (args.warmup + args.steps) * (2 * grad_bytes / rate + 3.0) + 180


def _run_job(
    link: LinkEmulator,
    job: str,
    job_args: list[str],
    args: argparse.Namespace,
    bar: Progress,
) -> list[dict[str, Any]]:
    """``job`` of the link worker on every rank; the records they wrote (``--out`` last)."""
    link.run_ranks(
        worker_argv(job, *job_args),
        timeout=_timeout(args, link.rate_bps, job),
        env=thread_env(link.world_size),
        progress=_forward_progress(bar, args.verbose),
    )
    return read_ranks(job_args[-1], link.world_size)


def _run_config(args: argparse.Namespace, rate_bps: int, bar: Progress, tmp: Path) -> dict:
    world = args.nodes * args.ranks_per_node
    with LinkEmulator(world, rate_bps, nodes=args.nodes) as link:
        bar.context = f"{args.nodes}x{args.ranks_per_node} {format_rate(rate_bps)}"
        config: dict[str, Any] = {
            "nodes": list(link.node_sizes),
            "world_size": world,
            "link": link.describe(),
            "loadavg_before": list(os.getloadavg()),
        }
        bar.note("probing the link between nodes")
        probe = link.measure_tcp(0, args.ranks_per_node, seconds=args.probe_seconds)
        bar.note(f"raw TCP {probe.bits_per_s / 1e9:.3f} Gbit/s", advance=1)
        config["probe"] = {
            "bits_per_s": probe.bits_per_s,
            "fraction_of_rate": probe.fraction_of_rate,
            "bytes": probe.bytes,
            "seconds": probe.seconds,
        }
        if probe.fraction_of_rate > RATE_TOLERANCE:
            config["violations"] = _verify([], link, probe, [], [])
            return config
        ar_args = ["--sizes", *map(str, args.sizes), "--bits", *map(str, args.bits)]
        ar_args += ["--algorithms", *SCHEMES.values(), "--iface-counters", "--codec-numel", "0"]
        ar_args += ["--bucket-size", str(args.bucket_size), "--timeout", str(args.timeout)]
        ar_args += ["--min-iters", str(args.min_iters), "--max-iters", str(args.max_iters)]
        ar_args += ["--budget", str(args.budget), "--out", str(tmp / f"ar-{rate_bps}")]
        c0 = link.interface_counters()
        records = _run_job(link, "allreduce", ar_args, args, bar)
        whole = link.interface_counters().delta(c0)
        job_tx = [whole.link_tx(n) for n in range(link.nodes)]
        rows = _merge(records, link, args.bucket_size)
        config["topology"] = records[0].get("topology")
        config["plan"] = records[0].get("plan")
        config["levels"] = records[0].get("levels")
        config["job_link_tx_per_node"] = job_tx
        config["job_lo_tx_per_node"] = [whole.loopback_tx(n) for n in range(link.nodes)]
        config["allreduce"] = rows
        config["violations"] = _verify(rows, link, probe, records, job_tx)
        if args.train and not config["violations"]:
            config["train"] = _train(args, link, bar, tmp)
        config["loadavg_after"] = list(os.getloadavg())
    return config


def _train(
    args: argparse.Namespace, link: LinkEmulator, bar: Progress, tmp: Path
) -> list[dict[str, Any]]:
    out = []
    for backend, scheme in (("gloo", None), ("cgx", "flat"), ("cgx", "hierarchical")):
        prefix = str(tmp / f"train-{scheme or backend}-{link.rate_bps}")
        tr_args = ["--backend", backend, "--bits", str(args.train_bits)]
        tr_args += ["--algorithm", scheme or "auto", "--steps", str(args.steps)]
        tr_args += ["--warmup", str(args.warmup), "--batch", str(args.batch)]
        tr_args += ["--hidden", str(args.hidden), "--bucket-size", str(args.bucket_size)]
        tr_args += ["--timeout", str(args.timeout), "--out", prefix]
        ranks = _run_job(link, "train", tr_args, args, bar)
        steps = min(len(r["step_times"]) for r in ranks)
        times = [max(r["step_times"][k] for r in ranks) for k in range(steps)]
        readers = _node_reader(ranks, link.nodes)
        per_step = [
            r["iface_bytes_per_step"].get(link.node_devices[n], [0, 0])[0]
            for n, r in enumerate(readers)
        ]
        bits = ranks[0]["bits"]
        out.append(
            {
                "method": "gloo" if scheme is None else f"{scheme[:4]}{bits}",
                "backend": backend,
                "algorithm": scheme,
                "bits": bits,
                "params": ranks[0]["params"],
                "steps": steps,
                "step_s_mean": sum(times) / len(times),
                "step_s_median": median(times),
                "link_tx_per_step_per_node": per_step,
                "eval_loss": ranks[0]["eval_loss"],
                "loss_curve_rank0": ranks[0]["losses"],
                "replicas_identical": len({r["param_digest"] for r in ranks}) == 1,
            }
        )
    base = out[0]
    flat = out[1]
    for row in out:
        row["speedup"] = base["step_s_mean"] / row["step_s_mean"]
        row["over_flat"] = flat["step_s_mean"] / row["step_s_mean"]
        row["loss_vs_gloo"] = row["eval_loss"] / base["eval_loss"] - 1
    return out


def _fmt(v: float | None, scale: float = 1.0) -> Any:
    return "-" if v is None else v * scale


def _times(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _tables(configs: list[dict[str, Any]]) -> str:
    head = ["link", "size", "method", "time ms", "x gloo", "x flat", "link MiB/node"]
    head += ["formula MiB", "meas/form", "lo MiB/node", "rel err"]
    rows = []
    for c in configs:
        for r in c.get("allreduce", []):
            rows.append(
                [
                    c["link"]["rate"],
                    size_label(r["size"]),
                    r["method"],
                    r["time_s"] * 1e3,
                    _fmt(r["speedup"]),
                    _fmt(r["over_flat"]),
                    "/".join(f"{b / MIB:.2f}" for b in r["link_tx_per_node"]),
                    r["formula_per_node"][0] / MIB,
                    r["bytes_vs_formula"],
                    "/".join(f"{b / MIB:.2f}" for b in r["lo_tx_per_node"]),
                    r.get("rel_l2_err", "-") if r["method"] != "gloo" else "ref",
                ]
            )
    nodes = configs[0]["nodes"] if configs else []
    text = f"allreduce on {len(nodes)} nodes x {nodes[0] if nodes else 0} ranks\n"
    text += format_table(head, rows)
    train_rows = []
    for c in configs:
        for t in c.get("train", []):
            train_rows.append(
                [
                    c["link"]["rate"],
                    t["method"],
                    t["step_s_mean"] * 1e3,
                    t["speedup"],
                    t["over_flat"] if t["algorithm"] == "hierarchical" else "-",
                    "/".join(f"{b / MIB:.1f}" for b in t["link_tx_per_step_per_node"]),
                    t["eval_loss"],
                    f"{100 * t['loss_vs_gloo']:+.2f}%",
                    "yes" if t["replicas_identical"] else "NO",
                ]
            )
    if train_rows:
        thead = ["link", "method", "step ms", "x gloo", "x flat", "link MiB/step/node"]
        thead += ["eval loss", "loss vs gloo", "replicas equal"]
        text += "\n\nDDP training step (MLP, mean over the timed steps)\n"
        text += format_table(thead, train_rows)
    return text


def _headline(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The headline case per link rate, and the training rows, against the targets."""
    lines = []
    for c in configs:
        where = f"{len(c['nodes'])}x{c['nodes'][0]}, {c['link']['rate']}"
        binding = c["link"]["rate_bps"] == TARGET_RATE and c["nodes"] == [2, 2]
        for r in c.get("allreduce", []):
            if r["size"] != TARGET_SIZE or r["method"] != f"hier{TARGET_BITS}":
                continue
            ok = (
                (r["over_flat"] or 0) >= TARGET_OVER_FLAT
                and (r["speedup"] or 0) >= TARGET_OVER_GLOO
                and abs(r["bytes_vs_formula"] - 1) <= TARGET_BYTES_TOL
            )
            lines.append(
                {
                    "case": f"allreduce 64 MiB {TARGET_BITS} bits, {where}",
                    "over_flat": r["over_flat"],
                    "over_gloo": r["speedup"],
                    "bytes_vs_formula": r["bytes_vs_formula"],
                    "target": binding,
                    "met": ok if binding else None,
                    "text": f"hierarchical {_times(r['over_flat'])} flat (target >= "
                    f"{TARGET_OVER_FLAT:g}x), {_times(r['speedup'])} gloo (target >= "
                    f"{TARGET_OVER_GLOO:g}x), link bytes {r['bytes_vs_formula']:.3f}x the "
                    f"formula (target within {100 * TARGET_BYTES_TOL:g}%)"
                    + ("" if not binding else (": met" if ok else ": MISSED")),
                }
            )
        for t in c.get("train", []):
            if t["algorithm"] == "hierarchical":
                lines.append(
                    {
                        "case": f"DDP step {t['bits']} bits, {where}",
                        "over_flat": t["over_flat"],
                        "over_gloo": t["speedup"],
                        "loss_vs_gloo": t["loss_vs_gloo"],
                        "text": f"hierarchical {t['over_flat']:.2f}x flat, {t['speedup']:.2f}x "
                        f"gloo's step time, held-out loss {100 * t['loss_vs_gloo']:+.2f}% vs gloo",
                    }
                )
    return lines


def _plot(configs: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot (pip install cgx_ucx[bench])", file=sys.stderr)
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = ["-", "--", ":", "-."]
    colors: dict[str, Any] = {}
    for i, c in enumerate(configs):
        rows = [r for r in c.get("allreduce", []) if r["scheme"] != "gloo"]
        for method in sorted({r["method"] for r in rows}):
            pts = sorted((r["size"] / MIB, r["speedup"]) for r in rows if r["method"] == method)
            (line,) = left.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                styles[i % len(styles)],
                marker="o",
                color=colors.get(method),
                label=f"{method} {c['link']['rate']}",
            )
            colors.setdefault(method, line.get_color())
        for r in c.get("allreduce", []):
            right.scatter(
                [f / MIB for f in r["formula_per_node"]],
                [m / MIB for m in r["link_tx_per_node"]],
                color=colors.get(r["method"], "grey"),
                marker="o" if i == 0 else "s",
                s=18,
            )
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_xscale("log", base=2)
    left.set_xlabel("allreduce size (MiB)")
    left.set_ylabel("speedup over gloo")
    nodes = configs[0]["nodes"] if configs else []
    left.set_title(f"{len(nodes)} nodes x {nodes[0] if nodes else 0} ranks")
    left.legend(fontsize=7)
    left.grid(True, which="both", alpha=0.3)
    lo, hi = right.get_xlim()
    right.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("formula: cross-node MiB per node")
    right.set_ylabel("measured: shaped-link MiB per node")
    right.set_title("cross-node bytes per allreduce (circles: first rate)")
    right.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench nodes",
        description="gloo vs flat vs hierarchical cgx_ucx on emulated nodes (netns + tc; root)",
    )
    # Two levels need at least 2 of each; all nodes x ranks per node run on this machine.
    why = f"the other is at least 2, and at most {MAX_LOCAL_RANKS} ranks run on this machine"
    most = count_arg(2, MAX_LOCAL_RANKS // 2, why)
    p.add_argument("--nodes", type=most, default=2, help="emulated nodes (hosts)")
    p.add_argument("--ranks-per-node", type=most, default=2, help="ranks in each node")
    p.add_argument("--rates", nargs="+", type=rate_arg, default=[10**9, 10 * 10**9],
                   help="rates between nodes, per direction (default 1gbit 10gbit)")  # fmt: skip
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[s * MIB for s in (16, 64, 256)],
                   help="allreduce sizes, MiB or with a unit (default 16 64 256)")  # fmt: skip
    p.add_argument("--bits", nargs="+", type=bits_arg, default=[32, 4])
    p.add_argument("--bucket-size", type=count_arg(1), default=1024)
    # One slow call of three moved a median by a third: as many as --max-iters by default.
    p.add_argument("--min-iters", type=count_arg(1), default=None,
                   help="timed iterations at least (default: --max-iters)")  # fmt: skip
    p.add_argument("--max-iters", type=count_arg(1), default=10, help="timed iterations at most")
    p.add_argument(
        "--budget", type=nonnegative_number, default=2.0, help="seconds per (size, method)"
    )
    p.add_argument("--no-train", dest="train", action="store_false", help="allreduce only")
    p.add_argument("--train-bits", type=bits_arg, default=4)
    add_training_args(p)
    add_output_args(p)
    p.add_argument("--verbose", action="store_true", help="show the ranks' stderr")
    return p


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for what the option types alone cannot see."""
    if args.min_iters is None:
        args.min_iters = args.max_iters
    check_iters(parser, args)
    ranks = args.nodes * args.ranks_per_node
    if ranks > MAX_LOCAL_RANKS:
        arg_error(
            parser,
            "--ranks-per-node",
            f"{args.nodes} nodes x {args.ranks_per_node} ranks per node = {ranks} ranks, "
            f"at most {MAX_LOCAL_RANKS} (ranks started on this one machine)",
        )
    check_sizes(parser, "--sizes", args.sizes, ranks)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 2 on bad arguments or without root/iproute2, 3 when
    a check refused."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    missing = missing_prerequisites()
    if missing:
        print("link emulation needs " + ", ".join(missing), file=sys.stderr)
        return 2
    args.sizes = sorted(set(args.sizes))
    args.bits = sorted(set(args.bits), reverse=True)
    out_dir = results_dir(args)
    load_start = list(os.getloadavg())
    cpus = os.cpu_count() or 1
    if load_start[0] > 0.5 * cpus:
        print(
            f"note: load average {load_start[0]:.2f} on {cpus} cores: the machine is busy, "
            "times measured now are not for the record",
            file=sys.stderr,
        )
    steps_per = 1 + len(args.sizes) * (1 + 2 * len(args.bits))
    if args.train:
        steps_per += 3 * (args.steps + args.warmup)
    configs = []
    bar = Progress(steps_per * len(args.rates))
    try:
        with tempfile.TemporaryDirectory(prefix="cgx-nodes-") as tmp:
            for rate in args.rates:
                config = _run_config(args, rate, bar, Path(tmp))
                configs.append(config)
                if config["violations"]:
                    bar.close()
                    print(
                        f"REFUSED to report ({args.nodes}x{args.ranks_per_node}, "
                        f"{format_rate(rate)}):\n  " + "\n  ".join(config["violations"]),
                        file=sys.stderr,
                    )
                    return 3
    except KeyboardInterrupt:
        bar.close()
        print("interrupted; the emulated links were removed", file=sys.stderr)
        return 130
    bar.close()
    load_end = list(os.getloadavg())
    print(_tables(configs))
    print(
        "\nlink MiB/node: bytes each node's shaped device sent per call (node 0/node 1/...; "
        "Ethernet headers and ACKs in); formula: the module doc's; lo: node-local TCP "
        "(shared memory is not seen); rel err: relative L2 error against gloo."
    )
    for c in configs:
        for r in c.get("allreduce", []):
            if r.get("cpu_s_per_rank"):
                cpu = r["cpu_s_per_rank"]
                print(
                    f"CPU per call, {c['link']['rate']} {size_label(r['size'])} {r['method']}: "
                    + " ".join(f"{v * 1e3:.1f}" for v in cpu)
                    + f" ms a rank, {sum(cpu) / cpus * 1e3:.1f} ms of the {cpus} cores"
                )
    first = configs[0]
    print(
        f"topology seen by the ranks: {first.get('topology')}, auto plan: "
        f"{first.get('plan')}, transports per level: {first.get('levels')}"
    )
    print(
        f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in load_start)} at start, "
        f"{' '.join(f'{x:.2f}' for x in load_end)} at end ({cpus} cores)"
    )
    headline = _headline(configs)
    if headline:
        print("\nAgainst the targets (2x2 at 1 Gbit/s binding; the rest for the record):")
        for line in headline:
            print(f"  {line['case']}: {line['text']}")
    record = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpus": cpus,
        "loadavg_start": load_start,
        "loadavg_end": load_end,
        "headline": headline,
        "configs": configs,
    }
    path = write_json("nodes", record, out_dir)
    print(f"\nJSON: {path}")
    try:
        png = _plot(configs, Path(path).with_suffix(".png"))
    except Exception as exc:  # the numbers are out already; a plot failure must not hide them
        print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    else:
        if png:
            print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
