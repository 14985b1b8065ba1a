"""``python -m cgx_ucx.bench ft``: fault-tolerant training with torchft, gloo against cgx.

A torchft Lighthouse and ``--groups`` replica groups (one process each,
:mod:`.ft_worker`) on this host, each group in its own network namespace, the groups
joined by shaped links (:class:`~cgx_ucx.bench.netns.LinkEmulator`; the Lighthouse has a
namespace of its own). The model is the 22 M-parameter MLP of ``bench train``
(``--hidden 3840``).

1. Per-step fault tolerance (torchft DistributedDataParallel + OptimizerWrapper) across
   ``--ddp-rate`` links, side by side: torchft+gloo, torchft+cgx 32-bit, torchft+cgx
   4-bit. In each run the last group is SIGKILLed at step ``--kill-at`` and restarted at
   once; it heals from a survivor and rejoins. Reported: the survivors' longest stall
   after the kill (the longest gap between two of their steps) and the steps they lost
   (steps that did not commit), the time from the restart to the restarted group's first
   step in the full quorum, the median step time in the full quorum, bytes per step on
   the link, the batches trained by step ``--steps`` and the evaluation loss there, and
   whether every group ended at the same step with bit-identical parameters.
   Uninterrupted runs of torchft+gloo and torchft+cgx 4-bit compare the loss of
   compression at equal batches (:data:`REFERENCE_RUNS`). A run of the same steps with
   no process group, every group at once (``ft_worker --mode local``), gives the compute
   floor under any process group's step on this host. With ``--trials N`` the
   torchft+cgx 4-bit run is repeated N times: how many finished with every group at one
   step and bit-identical, and the spread of the
   stall, the steps lost and the rejoin time.
2. DiLoCo (torchft.local_sgd) across ``--diloco-rate`` links: fp32 pseudo-gradients over
   gloo, 4-bit and 2-bit over cgx, and 2-bit with error feedback. Reported: bytes per
   outer sync, the sync time (per sync, as the last group to arrive saw it, and of it the
   communication and torchft's outer step; not the wait for slower groups, which replica
   0's median "wall" time includes), how many syncs held every group, final loss.

Prints two tables and the targets, writes ``ft.json`` and ``ft.png``. Without root (or
with ``--no-netns``) the groups run unshaped on loopback: a dry run of the procedure, not
a measurement of the links. Default runtime: about 7 minutes on 2 cores (each run about
1 min, the gloo ones the longest).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .ft_jobs import FtJob, Lighthouse, read_reports
from .link_args import rate_arg
from .report import (
    MAX_LOCAL_RANKS,
    add_output_args,
    arg_error,
    count_arg,
    format_table,
    positive_number,
    results_dir,
    threads_arg,
    write_json,
)

__all__ = ["main"]

#: (label, backend, bits) of the per-step runs; the DiLoCo runs add whether their
#: pseudo-gradients get error feedback (cgx_ucx.torchft.PseudoGradientFeedback).
DDP_RUNS = (
    ("torchft+gloo", "gloo", 32),
    ("torchft+cgx 32-bit", "cgx", 32),
    ("torchft+cgx 4-bit", "cgx", 4),
)
#: ``--methods`` names of the per-step runs (DDP_RUNS and REFERENCE_RUNS by backend and bits).
METHODS = {"gloo": ("gloo", 32), "cgx32": ("cgx", 32), "cgx4": ("cgx", 4)}
#: Uninterrupted runs: the eval loss of compression at equal batches. In a kill run the
#: survivors go on without the killed group until it rejoins, so the batches trained by
#: ``--steps`` depend on how many steps ran meanwhile: more for a run with faster steps,
#: not because of its numbers (torchft+cgx 4-bit, 40 steps: 1.527-1.546 across trials).
REFERENCE_RUNS = (
    ("reference (gloo, no kill)", "gloo", 32),
    ("reference (cgx 4-bit, no kill)", "cgx", 4),
)
DILOCO_RUNS = (
    ("DiLoCo fp32 (gloo)", "gloo", 32, False),
    ("DiLoCo cgx 4-bit", "cgx", 4, False),
    ("DiLoCo cgx 2-bit", "cgx", 2, False),
    ("DiLoCo cgx 2-bit + EF", "cgx", 2, True),
)
#: The Lighthouse's port inside its namespace.
LIGHTHOUSE_PORT = 29400
#: Seconds a whole run may take before it is stopped and reported as hung.
RUN_TIMEOUT_S = 600.0
#: The Lighthouse's join timeout (how long a quorum waits for a group of the previous one
#: that is alive but late). Per-step runs: 1 s, so a slow group does not hold the others.
#: DiLoCo: groups reach an outer sync seconds apart (20 inner steps of three processes
#: sharing two cores), and a group left out of a quorum must then heal, downloading the
#: whole state over the slow link while the others go on without it; with 1 s at
#: 100 Mbit/s, a 4-bit run fell into that and never again synced all three groups
#: (each sync 32 s, 248 MB of healing). A dead group is dropped on its heartbeat
#: timeout whatever this is.
DDP_JOIN_TIMEOUT_MS, DILOCO_JOIN_TIMEOUT_MS = 1000, 30000


def _rate(text: str) -> str:
    """An argparse ``type``: a link rate as tc writes it (``1gbit``), checked, kept as text."""
    rate_arg(text)
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench ft", description=__doc__.split("\n")[0]
    )
    groups = count_arg(2, MAX_LOCAL_RANKS - 1, "groups started on this one machine")
    p.add_argument("--groups", type=groups, default=3, help="replica groups")
    p.add_argument(
        "--hidden", type=count_arg(1), default=3840, help="MLP width (3840: 22 M parameters)"
    )
    p.add_argument("--batch", type=count_arg(1), default=64)
    p.add_argument("--steps", type=count_arg(2), default=40, help="DDP steps per run")
    p.add_argument(
        "--kill-at", type=count_arg(1), default=10, help="step at which the last group dies"
    )
    p.add_argument(
        "--diloco-steps", type=count_arg(1), default=5, help="DiLoCo outer syncs per run"
    )
    p.add_argument(
        "--sync-every", type=count_arg(1), default=20, help="DiLoCo inner steps per sync"
    )
    p.add_argument("--ddp-rate", type=_rate, default="1gbit", help="link rate of the per-step runs")
    p.add_argument(
        "--diloco-rate", type=_rate, default="100mbit", help="link rate of the DiLoCo runs"
    )
    p.add_argument("--timeout", type=positive_number, default=60.0, help="collective timeout (s)")
    p.add_argument(
        "--trials",
        type=count_arg(1),
        default=1,
        help="kill-and-rejoin runs of torchft+cgx 4-bit (the table shows the first; every "
        "one counts toward the trials line and its target)",
    )
    p.add_argument("--only", choices=("ddp", "diloco"), default=None)
    p.add_argument(
        "--methods",
        nargs="+",
        choices=tuple(METHODS),
        default=list(METHODS),
        help="per-step runs to make (each with its uninterrupted reference, where it has one)",
    )
    p.add_argument("--no-netns", action="store_true", help="loopback, unshaped (a dry run)")
    p.add_argument("--threads", type=threads_arg, default=max(1, (os.cpu_count() or 2) // 4))
    add_output_args(p)
    return p


# -- where the groups run --------------------------------------------------------------------
class _Place:
    """The groups' namespaces (or loopback): commands, addresses and link byte counters."""

    def __init__(
        self, groups: int, rate: str, netns: bool, workdir: Path, join_timeout_ms: int
    ) -> None:
        self.groups = groups
        self.join_timeout_ms = join_timeout_ms
        self.rate = rate
        self.netns = netns
        self.workdir = workdir
        self.emu: Any = None
        self.lighthouse: Any = None
        self.address = ""

    @contextlib.contextmanager
    def up(self) -> Iterator[_Place]:
        if not self.netns:
            lighthouse = Lighthouse(min_replicas=1, join_timeout_ms=self.join_timeout_ms)
            self.address = lighthouse.address
            try:
                yield self
            finally:
                lighthouse.shutdown()
            return
        from .netns import LinkEmulator

        with LinkEmulator(self.groups + 1, self.rate) as emu:
            self.emu = emu
            serve = [sys.executable, "-m", "cgx_ucx.bench.ft_jobs", "--port", str(LIGHTHOUSE_PORT)]
            serve += ["--join-timeout-ms", str(self.join_timeout_ms)]
            proc = emu.popen(
                self.groups,
                serve,
                stdout=open(self.workdir / "lighthouse.log", "w"),  # noqa: SIM115
                stderr=open(self.workdir / "lighthouse.err", "w"),  # noqa: SIM115
            )
            end = time.monotonic() + 60
            while "ready" not in (self.workdir / "lighthouse.log").read_text():
                if proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError("the Lighthouse did not start: see lighthouse.err")
                time.sleep(0.1)
            self.address = f"http://{emu.addresses[self.groups]}:{LIGHTHOUSE_PORT}"
            try:
                yield self
            finally:
                proc.kill()
                proc.wait()

    def job(self, out: Path, args: list[str]) -> FtJob:
        emu = self.emu
        if emu is None:
            return FtJob(self.address, out, args)
        return FtJob(
            self.address,
            out,
            args,
            env=lambda r: emu.rank_env(r),
            prefix=lambda r: ["ip", "netns", "exec", emu.namespaces[r]],
            host=lambda r: emu.addresses[r],
        )

    def egress(self) -> list[int] | None:
        if self.emu is None:
            return None
        return [self.emu.egress_bytes(r) for r in range(self.groups)]


# -- one run ----------------------------------------------------------------------------------
def _worker_args(
    args: argparse.Namespace, backend: str, bits: int, mode: str, error_feedback: bool = False
) -> list[str]:
    steps = args.diloco_steps if mode == "diloco" else args.steps
    return (["--error-feedback"] if error_feedback else []) + [
        "--backend", backend, "--bits", str(bits), "--mode", mode,
        "--steps", str(steps), "--sync-every", str(args.sync_every),
        "--hidden", str(args.hidden), "--batch", str(args.batch),
        "--timeout", str(args.timeout), "--threads", str(args.threads),
        "--end-with", str(args.groups),
    ]  # fmt: skip


def _run(place: _Place, out: Path, worker_args: list[str], kill_at: int | None) -> dict[str, Any]:
    """One job; with ``kill_at`` the last group is SIGKILLed there and restarted."""
    out.mkdir(parents=True, exist_ok=True)
    job = place.job(out, worker_args)
    victim = place.groups - 1
    before = place.egress()
    started = time.time()
    killed = restarted = None
    try:
        die = {victim: kill_at} if kill_at is not None else {}
        job.start_together(range(place.groups), RUN_TIMEOUT_S, die)
        if kill_at is not None:
            dead: list[float] = []

            def gone() -> bool:
                t = job.died(victim) if victim in job.procs else None
                if t is not None:
                    dead.append(t)
                return bool(dead)

            job.wait_for(gone, RUN_TIMEOUT_S, "the victim's death")
            killed = dead[0]
            restarted = time.time()
            job.start(victim)
        codes = job.wait(RUN_TIMEOUT_S)
    finally:
        job.stop()
    after = place.egress()
    reports = {r: read_reports(out, r) for r in range(place.groups)}
    return {
        "codes": codes,
        "wall_s": time.time() - started,
        "killed_at": killed,
        "restarted_at": restarted,
        "link_bytes": None
        if before is None
        else [a - b for a, b in zip(after, before, strict=True)],
        "reports": reports,
    }


def _finals(reports: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any] | None]:
    return [next((r for r in reversed(rows) if r.get("final")), None) for rows in reports.values()]


def _batches(steps: list[dict[str, Any]], until: int | None) -> int:
    """The batches the model trained on by step ``until``: one per participant of each
    committed step (a step that did not commit is tried again under the same number;
    its last try counts)."""
    last: dict[int, int] = {}
    for x in steps:
        if until is None or x["step"] <= until:
            last[x["step"]] = x["participants"]
    return sum(last.values())


def _ddp_metrics(run: dict[str, Any], groups: int) -> dict[str, Any]:
    reports, killed = run["reports"], run["killed_at"]
    victim = groups - 1
    steps = {r: [x for x in rows if x.get("event") == "step"] for r, rows in reports.items()}
    full = [x["dt"] for r in range(victim) for x in steps[r] if x["participants"] == groups]
    metrics: dict[str, Any] = {"step_s": statistics.median(full) if full else None}
    sent = [x["sent"] for x in steps[0] if x.get("sent") and x["participants"] == groups]
    metrics["cgx_bytes_per_step"] = statistics.median(sent) if sent else None
    if run["link_bytes"] is not None:
        total_steps = max(len(steps[0]), 1)
        metrics["link_bytes_per_step"] = run["link_bytes"][0] / total_steps
    if killed is not None:
        stalls, lost = [], 0
        for r in range(victim):
            times = [killed] + [x["t"] for x in steps[r] if x["t"] > killed]
            stalls.append(max((b - a for a, b in itertools.pairwise(times)), default=None))
            after = [x for x in steps[r] if x["t"] > killed]
            lost += sum(1 for a, b in itertools.pairwise(after) if b["step"] == a["step"])
        metrics["stall_s"] = max((s for s in stalls if s is not None), default=None)
        metrics["steps_lost"] = lost
        back = [
            x for x in steps[victim] if x["t"] > run["restarted_at"] and x["participants"] == groups
        ]
        metrics["rejoin_s"] = back[0]["t"] - run["restarted_at"] if back else None
    finals = _finals(reports)
    metrics["final_loss"] = finals[0]["eval_loss"] if finals[0] else None
    # The loss at --steps: a run whose groups waited longer for the restarted one ends
    # later, and compares with the uninterrupted run at the same step.
    at_steps = [x for x in reports[0] if x.get("event") == "eval"]
    metrics["loss_at_steps"] = at_steps[0]["eval_loss"] if at_steps else metrics["final_loss"]
    metrics["batches"] = _batches(steps[0], at_steps[0]["step"] if at_steps else None)
    metrics["same_step"] = (
        all(f is not None for f in finals) and len({f["step"] for f in finals}) == 1
    )
    metrics["bit_identical"] = metrics["same_step"] and len({f["digest"] for f in finals}) == 1
    metrics["ok"] = all(c == 0 for c in run["codes"].values())
    return metrics


#: The phases of an outer sync that are communication: the quorum, handing the
#: pseudo-gradients to the group, the wait for their all-reduce and the commit vote. The
#: rest of a sync ("outer": torchft's outer optimizer step, the merge and its parameter
#: copies) is local compute, the same whatever the process group.
COMM_PHASES = ("quorum", "prepare", "wait", "commit")


#: Steps of a floor run left out of its median (the first ones warm caches and allocators).
FLOOR_WARMUP_STEPS = 3


def _floor_metrics(run: dict[str, Any]) -> dict[str, Any]:
    """The compute floor: the median step of every group of a ``--mode local`` run (the
    DDP step's compute with nothing to communicate, every group at once)."""
    dts = [
        x["dt"]
        for rows in run["reports"].values()
        for x in rows
        if x.get("event") == "step" and x["step"] >= FLOOR_WARMUP_STEPS
    ]
    return {"step_s": statistics.median(dts) if dts else None, "steps": len(dts)}


def _last_arrivals(reports: dict[int, list[dict[str, Any]]], groups: int) -> list[dict[str, Any]]:
    """Per outer sync that every group committed together (after the first, which also
    forms the first quorum): the record of the group that arrived last. The others' times
    also hold their wait for it, which is the groups' compute skew, not the sync."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for rows in reports.values():
        for x in rows:
            if x.get("event") == "sync" and x.get("committed") and x["participants"] == groups:
                by_step.setdefault(x["step"], []).append(x)
    steps = sorted(s for s, xs in by_step.items() if len(xs) == groups)
    return [min(by_step[s], key=lambda x: x["sync_s"]) for s in steps[1:]]


def _sync_costs(reports: dict[int, list[dict[str, Any]]], groups: int) -> list[float]:
    """The sync time of the last-arriving group, per sync (see :func:`_last_arrivals`)."""
    return [x["sync_s"] for x in _last_arrivals(reports, groups)]


def _phase_medians(syncs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median seconds per phase of ``syncs`` and of their communication (COMM_PHASES);
    empty when the workers did not time phases."""
    timed = [x["phases"] for x in syncs if x.get("phases")]
    if not timed:
        return {}
    names = sorted({k for p in timed for k in p})
    phases = {k: statistics.median(p.get(k, 0.0) for p in timed) for k in names}
    comm = statistics.median(sum(p.get(k, 0.0) for k in COMM_PHASES) for p in timed)
    return {"comm_s": comm, "outer_s": phases.get("outer"), "phases_s": phases}


def _diloco_metrics(run: dict[str, Any], groups: int) -> dict[str, Any]:
    syncs = [x for x in run["reports"][0] if x.get("event") == "sync"]
    later = syncs[1:] or syncs  # the first sync also forms the first quorum
    sent = [x["sent"] for x in later if x.get("sent")]
    finals = _finals(run["reports"])
    bytes_per_sync = statistics.median(sent) if sent else None
    if run["link_bytes"] is not None and syncs:
        bytes_per_sync = run["link_bytes"][0] / len(syncs)
    last = _last_arrivals(run["reports"], groups)
    return {
        "sync_s": statistics.median(x["sync_s"] for x in last) if last else None,
        **_phase_medians(last),
        "sync_wall_s": statistics.median(x["sync_s"] for x in later) if later else None,
        "syncs": len(syncs),
        "syncs_all_groups": sum(1 for x in syncs if x["participants"] == groups),
        "bytes_per_sync": bytes_per_sync,
        "cgx_bytes_per_sync": statistics.median(sent) if sent else None,
        "final_loss": finals[0]["eval_loss"] if finals[0] else None,
        "bit_identical": all(f is not None for f in finals)
        and len({f["digest"] for f in finals}) == 1,
        "ok": all(c == 0 for c in run["codes"].values()),
    }


def _trials(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Kill-and-rejoin trials of one method: how many ended right, and the spreads."""

    def spread(key: str) -> list[float] | None:
        xs = sorted(m[key] for m in runs if m.get(key) is not None)
        return [xs[0], statistics.median(xs), xs[-1]] if xs else None

    return {
        "trials": len(runs),
        "finished": sum(1 for m in runs if m.get("ok") and m.get("same_step")),
        "bit_identical": sum(1 for m in runs if m.get("ok") and m.get("bit_identical")),
        "stall_s": spread("stall_s"),
        "rejoin_s": spread("rejoin_s"),
        "steps_lost": sum(m.get("steps_lost") or 0 for m in runs),
    }


# -- targets ----------------------------------------------------------------------------------
def targets(
    ddp: dict[str, dict[str, Any]],
    diloco: dict[str, dict[str, Any]],
    trials: dict[str, Any] | None = None,
    floor: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """This command's targets, evaluated on this run (reported, never hidden)."""
    out = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        out.append({"target": name, "met": ok, "detail": detail})

    gloo, c32, c4 = (ddp.get(label) for label, _, _ in DDP_RUNS)
    if c4 is not None:
        check(
            "cgx 4-bit: kill and rejoin end bit-identical at one step", c4.get("bit_identical"), ""
        )
    if trials and trials["trials"] > 1:
        n, good = trials["trials"], trials["bit_identical"]
        check(
            f"cgx 4-bit: {n} of {n} kill-and-rejoin trials end bit-identical at one step",
            good == n,
            f"{good}/{n}",
        )
    stall = (trials or {}).get("stall_s") or [None, None, c4.get("stall_s") if c4 else None]
    if gloo and stall[2] is not None and gloo.get("stall_s") is not None:
        d = stall[2] - gloo["stall_s"]
        check(
            "cgx 4-bit stall within 1 s of gloo's",
            d <= 1.0,
            f"{stall[2]:.2f} s (longest of the trials) vs {gloo['stall_s']:.2f} s",
        )
    if gloo and c4 and gloo.get("step_s") and c4.get("step_s"):
        x = gloo["step_s"] / c4["step_s"]
        detail = f"{x:.2f}x"
        if floor and floor.get("step_s"):
            detail += (
                f" (the compute floor, {floor['step_s']:.2f} s a step: gloo's step "
                f"{gloo['step_s'] / floor['step_s']:.2f}x it, cgx 4-bit's "
                f"{c4['step_s'] / floor['step_s']:.2f}x)"
            )
        check("cgx 4-bit step >= 3x faster than gloo", x >= 3.0, detail)
    ref, ref4 = (ddp.get(label) for label, _, _ in REFERENCE_RUNS)
    if ref and ref4 and ref.get("loss_at_steps") and ref4.get("loss_at_steps"):
        rel = abs(ref4["loss_at_steps"] - ref["loss_at_steps"]) / ref["loss_at_steps"]
        detail = f"{rel * 100:.2f}% uninterrupted, {ref4.get('batches')} batches each"
        if gloo and c4 and gloo.get("loss_at_steps") and c4.get("loss_at_steps"):
            killed = abs(c4["loss_at_steps"] - gloo["loss_at_steps"]) / gloo["loss_at_steps"]
            detail += (
                f"; with the kill {killed * 100:.2f}% ({c4.get('batches')} batches against "
                f"{gloo.get('batches')}: the restarted group missed the steps run without it)"
            )
        check("cgx 4-bit eval loss within 1% of gloo (equal batches)", rel <= 0.01, detail)
    fp32, d4 = diloco.get(DILOCO_RUNS[0][0]), diloco.get(DILOCO_RUNS[1][0])
    if fp32 and d4 and fp32.get("sync_s") and d4.get("sync_s"):
        whole = fp32["sync_s"] / d4["sync_s"]
        if fp32.get("comm_s") and d4.get("comm_s"):
            x = fp32["comm_s"] / d4["comm_s"]
            check(
                "DiLoCo 4-bit outer sync (quorum, all-reduce, commit) >= 6x faster than fp32 gloo",
                x >= 6.0,
                f"{x:.2f}x; {whole:.2f}x with torchft's outer step and copies "
                f"({d4.get('outer_s') or 0:.2f} s / {fp32.get('outer_s') or 0:.2f} s "
                "of local compute)",
            )
        else:
            check(
                "DiLoCo 4-bit outer sync >= 6x faster than fp32 gloo", whole >= 6.0, f"{whole:.2f}x"
            )
    if fp32 and d4 and fp32.get("final_loss") and d4.get("final_loss"):
        rel = abs(d4["final_loss"] - fp32["final_loss"]) / fp32["final_loss"]
        check("DiLoCo 4-bit eval loss within 1% of fp32", rel <= 0.01, f"{rel * 100:.2f}%")
    del c32
    return out


def _fmt(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v / scale:.{digits}f}"


def _plot(ddp: dict[str, dict[str, Any]], diloco: dict[str, dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    labels = [k for k in ddp if ddp[k].get("step_s")]
    axes[0].bar(labels, [ddp[k]["step_s"] for k in labels])
    axes[0].set_ylabel("step time (s)")
    labels_k = [k for k in ddp if ddp[k].get("stall_s") is not None]
    axes[1].bar(labels_k, [ddp[k]["stall_s"] for k in labels_k], color="tab:red")
    axes[1].set_ylabel("survivors' longest stall (s)")
    labels_d = [k for k in diloco if diloco[k].get("sync_s")]
    axes[2].bar(labels_d, [diloco[k]["sync_s"] for k in labels_d], color="tab:green")
    axes[2].set_ylabel("DiLoCo outer sync (s)")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def trials_line(trials: dict[str, Any]) -> str:
    """One line on the kill-and-rejoin trials (the terminal and the benchmarks page)."""

    def spread(xs: list[float] | None) -> str:
        return "-" if not xs else f"{xs[0]:.2f} / {xs[1]:.2f} / {xs[2]:.2f} s"

    n = trials["trials"]
    return (
        f"torchft+cgx 4-bit, {n} kill-and-rejoin trials: {trials['finished']}/{n} finished "
        f"with every group at one step, {trials['bit_identical']}/{n} bit-identical; "
        f"stall (least / median / most) {spread(trials['stall_s'])}, rejoin "
        f"{spread(trials['rejoin_s'])}, {trials['steps_lost']} steps lost in all"
    )


def floor_line(floor: dict[str, Any], groups: Any) -> str:
    """The sentence on the compute floor (tables and docs)."""
    return (
        f"Compute floor: the same steps with no process group, {groups} groups at once on "
        f"this host: {_fmt(floor.get('step_s'))} s a step (median of {floor.get('steps')})"
    )


def _print_tables(
    args: argparse.Namespace,
    netns: bool,
    ddp: dict[str, dict[str, Any]],
    diloco: dict[str, dict[str, Any]],
    trials: dict[str, Any] | None = None,
    floor: dict[str, Any] | None = None,
) -> None:
    if ddp:
        link = args.ddp_rate if netns else "loopback"
        print(f"\nper-step DDP, {args.groups} replica groups, links {link}")
        headers = ["run", "step s", "MB/step", "stall s", "lost", "rejoin s", "batches",
                   "loss@steps", "same"]  # fmt: skip
        rows = []
        for k, m in ddp.items():
            per_step = m.get("link_bytes_per_step") or m.get("cgx_bytes_per_step")
            rows.append(
                [k, _fmt(m.get("step_s")), _fmt(per_step, 1e6), _fmt(m.get("stall_s")),
                 m.get("steps_lost", "-"), _fmt(m.get("rejoin_s")), m.get("batches", "-"),
                 _fmt(m.get("loss_at_steps"), 1, 4), m.get("bit_identical")]
            )  # fmt: skip
        print(format_table(headers, rows))
        if trials and trials["trials"] > 1:
            print(trials_line(trials))
        if floor:
            print(floor_line(floor, args.groups))
    if diloco:
        link = args.diloco_rate if netns else "loopback"
        print(f"\nDiLoCo, an outer sync every {args.sync_every} steps, links {link}")
        rows = [
            [k, _fmt(m.get("bytes_per_sync"), 1e6), _fmt(m.get("sync_s")), _fmt(m.get("comm_s")),
             _fmt(m.get("outer_s")), _fmt(m.get("sync_wall_s")),
             f"{m.get('syncs_all_groups', '-')}/{m.get('syncs', '-')}",
             _fmt(m.get("final_loss"), 1, 4), m.get("bit_identical")]
            for k, m in diloco.items()
        ]  # fmt: skip
        headers = ["run", "MB/sync", "sync s", "comm s", "outer s", "wall s", "all groups",
                   "eval loss", "same"]  # fmt: skip
        print(format_table(headers, rows))
        print(
            "sync s: per sync, the time of the group that arrived last, median; of it, comm s: "
            "quorum, all-reduce and commit, outer s: torchft's outer step, merge and parameter "
            "copies (local compute); wall s: replica 0's, waits for slower groups included; "
            "all groups: syncs whose quorum held every group"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.kill_at >= args.steps:
        arg_error(parser, "--kill-at", f"must be below --steps ({args.steps}), got {args.kill_at}")
    out_dir = results_dir(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The runs' logs (each group's and the Lighthouse's): next to the results, or in a
    # folder of their own where the results are the tracked ones (which hold results only).
    logs = Path(tempfile.mkdtemp(prefix="cgx-ft-")) if args.refresh_tracked else out_dir
    work = logs / "ft_runs"
    print(f"run logs: {work}")
    netns = not args.no_netns
    if netns:
        from .netns import missing_prerequisites

        missing = missing_prerequisites()
        if missing:
            print(f"network namespaces unavailable ({', '.join(missing)}): loopback, unshaped")
            netns = False
    ddp: dict[str, dict[str, Any]] = {}
    diloco: dict[str, dict[str, Any]] = {}
    trials: dict[str, Any] | None = None
    floor: dict[str, Any] | None = None
    if args.only in (None, "ddp"):
        with _Place(args.groups, args.ddp_rate, netns, logs, DDP_JOIN_TIMEOUT_MS).up() as place:
            print("ft: compute floor (no process group) ...", flush=True)
            floor = _floor_metrics(
                _run(place, work / "compute_floor", _worker_args(args, "gloo", 32, "local"), None)
            )
            chosen = {METHODS[m] for m in args.methods}
            runs = [(label, b, bits, args.kill_at) for label, b, bits in DDP_RUNS]
            runs += [(label, b, bits, None) for label, b, bits in REFERENCE_RUNS]
            runs = [run for run in runs if run[1:3] in chosen]
            for label, backend, bits, kill in runs:
                print(f"ft: {label} ...", flush=True)
                run = _run(
                    place,
                    work / label.replace(" ", "_"),
                    _worker_args(args, backend, bits, "ddp"),
                    kill,
                )
                ddp[label] = {"backend": backend, "bits": bits, **_ddp_metrics(run, args.groups)}
                if label == DDP_RUNS[2][0]:
                    runs4 = [ddp[label]]
                    for i in range(1, args.trials):
                        print(f"ft: {label}, trial {i + 1} of {args.trials} ...", flush=True)
                        more = _run(
                            place,
                            work / f"{label.replace(' ', '_')}_trial{i + 1}",
                            _worker_args(args, backend, bits, "ddp"),
                            kill,
                        )
                        runs4.append(_ddp_metrics(more, args.groups))
                    trials = _trials(runs4)
    if args.only in (None, "diloco"):
        place = _Place(args.groups, args.diloco_rate, netns, logs, DILOCO_JOIN_TIMEOUT_MS)
        with place.up():
            for label, backend, bits, feedback in DILOCO_RUNS:
                print(f"ft: {label} ...", flush=True)
                run = _run(
                    place,
                    work / label.replace(" + ", "_").replace(" ", "_"),
                    _worker_args(args, backend, bits, "diloco", feedback),
                    None,
                )
                metrics = _diloco_metrics(run, args.groups)
                diloco[label] = {
                    "backend": backend,
                    "bits": bits,
                    "error_feedback": feedback,
                    **metrics,
                }
    _print_tables(args, netns, ddp, diloco, trials, floor)
    checks = targets(ddp, diloco, trials, floor)
    print("\nAgainst the targets:" + ("" if netns else " (loopback: not a measurement of links)"))
    for c in checks:
        mark = "MET " if c["met"] else "MISS"
        print(f"  [{mark}] {c['target']} {c['detail']}")
    config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "refresh_tracked")}
    record = {"config": {**config, "netns": netns}, "ddp": ddp, "diloco": diloco}
    record.update({"ddp_trials": trials, "ddp_floor": floor, "targets": checks})
    path = write_json("ft", record, out_dir)
    print(f"wrote {path}")
    if _plot(ddp, diloco, out_dir / "ft.png"):
        print(f"wrote {out_dir / 'ft.png'}")
    ok = all(m.get("ok") for m in [*ddp.values(), *diloco.values()])
    ok = ok and (trials is None or trials["finished"] == trials["trials"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
