"""The link benchmark's output: its tables, the lines against its targets, its plot."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from .link_args import MIB, size_label
from .link_checks import FSDP_LOSS_TOLERANCE, MAX_COMPRESSED_SLOWDOWN
from .report import format_table

__all__ = ["TARGET_BITS", "TARGET_SIZE", "headline", "plot", "print_versus", "tables"]

#: The targets ``bench link`` reports against: 64 MiB, 2 ranks, 1 Gbit/s, 4 bits at least 4x
#: gloo and within 1.2x of the lower bound; DDP training over 1 Gbit/s at least 3x gloo's step
#: time, held-out loss within 2%.
TARGET_SIZE, TARGET_BITS = 64 * MIB, 4
TARGET_SPEEDUP, TARGET_X_BOUND = 4.0, 1.2
TARGET_TRAIN_SPEEDUP, TARGET_LOSS = 3.0, 0.02


def _cpu_range(cpu_s: list[float] | None) -> str:
    """A row's CPU milliseconds per call, the least and the most busy rank."""
    if not cpu_s:
        return "-"
    lo, hi = 1e3 * min(cpu_s), 1e3 * max(cpu_s)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


def tables(configs: list[dict[str, Any]]) -> str:
    head = ["world", "link", "size", "method", "time ms", "algbw GB/s", "speedup"]
    head += ["wire MiB", "bound ms", "x bound", "CPU ms/rank", "rel err", "auto"]
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
                    _cpu_range(r.get("cpu_s_per_rank")),
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


def headline(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per link of the headline case and of training, against the targets above."""
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


def print_versus(versus: list[dict[str, Any]]) -> None:
    if not versus:
        return
    print(
        f"\nCompressed against cgx32 (at most {MAX_COMPRESSED_SLOWDOWN:g}x where "
        "the auto policy would compress; auto: the width its cost model picks here):"
    )
    for v in versus:
        print(
            f"  {v['world_size']} ranks, {v['rate']}, {size_label(v['size'])}, {v['method']}: "
            f"{v['time_vs_cgx32']:.2f}x cgx32's time, auto picks {v['auto_bits'] or '-'}: "
            + ("ok" if v["ok"] else "MISSED")
        )


def plot(configs: list[dict[str, Any]], size: int, path: Path) -> Path | None:
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
